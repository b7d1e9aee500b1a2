"""HF DeepSeek-V3 checkpoints for tests and benchmarks.

The project's writer of preset checkpoints is ``dsv3_rl.models.mini_model.write_mini_model``
(tests and the bench use it). :func:`write_random_hf` adds what it does not write: a BF16 HF
checkpoint *with* MTP layers (hub names ``model.layers.{num_hidden_layers + i}.*``, whose
``embed_tokens``/``shared_head.head`` equal the main ones, as in DeepSeek's release), any config,
tensor by tensor, and norms that are not all ones (so a swapped norm shows).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from .names import build_plan
from .st_io import shard_names, write_shard


def _config_dict(preset: str, overrides: dict | None) -> dict:
    from dsv3_rl.models.presets import hf_config

    cfg = hf_config(preset, overrides)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def _tokenizer(out: Path) -> None:
    import shutil

    from dsv3_rl.models.tokenizer import tokenizer_dir

    src = Path(tokenizer_dir())
    for p in src.iterdir():
        if p.is_file() and p.name != "build_info.json":
            shutil.copy2(p, out / p.name)


def write_random_hf(config: Any, out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    shard_gb: float = 2.0, keep_mtp: bool = True) -> Path:
    """Seeded random tensors under every HF name of ``config`` (a preset name or a config), written
    shard by shard (memory: one tensor). MTP layers are written when the config has them."""
    if isinstance(config, str):
        config = _config_dict(config, None)
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    cfg.setdefault("architectures", ["DeepseekV3ForCausalLM"])
    full = build_plan(cfg, keep_mtp=True, spec="local")
    dropped = set() if keep_mtp else set(build_plan(cfg, keep_mtp=False, spec="local").hf_ignored)
    shapes = dict(full.hf_shapes)
    names = [n for n in shapes if n not in dropped]
    nbytes = {n: math.prod(shapes[n]) * dtype.itemsize for n in names}
    shards: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if shards[-1] and acc + nbytes[n] > shard_gb * (1 << 30):
            shards.append([])
            acc = 0
        shards[-1].append(n)
        acc += nbytes[n]
    out.mkdir(parents=True, exist_ok=True)
    files = list(shard_names(len(shards)))
    dups = full.mtp_duplicates

    def produce(n: str) -> torch.Tensor:
        src = dups.get(n, n)  # MTP embed/head copies equal the main ones, as in DeepSeek's release
        g = torch.Generator().manual_seed(seed * 1_000_003 + int.from_bytes(src.encode()[-8:], "little") % 1_000_000_007)
        shape = shapes[n]
        if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
            return (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        return (0.02 * torch.randn(shape, generator=g)).to(dtype)

    weight_map = {}
    for f, names_f in zip(files, shards):
        write_shard(out / f, [(n, dtype, shapes[n]) for n in names_f], produce)
        weight_map.update({n: f for n in names_f})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    _tokenizer(out)
    return out
