"""Write DeepSeek-V3-architecture HF checkpoints for tests, the demo and benchmarks.

``write_mini_model(preset, out_dir, seed=0, dtype="bf16", fmt="hf", shards=None)`` writes
config.json, generation_config.json, the offline tokenizer (padded with placeholders to the config's vocab_size,
e.g. the proxies' 129280: verl's rollout never samples ids >= len(tokenizer)) and the weights, deterministically:

* ``fmt="hf"``: BF16 (or FP32) weights in the *hub* layout (one tensor per expert,
  ``model.layers.N.mlp.experts.E.gate_proj.weight``; not transformers-5's fused in-memory
  ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], which transformers builds on load),
  ``model.safetensors`` or N shards + index; config.json as transformers 5 writes it (``rope_parameters``).
* ``fmt="fp8-release"``: DeepSeek's FP8 release layout: the linear weights in ``float8_e4m3fn`` with
  ``<name>_scale_inv`` (128x128 blocks, float32), embeddings/norms/router/``eh_proj`` in BF16,
  ``e_score_correction_bias`` in FP32, the MTP layer ``model.layers.<num_hidden_layers>.*``,
  shards named ``model-00001-of-00000N.safetensors`` + index, and a hub-style config.json
  (``rope_scaling`` + ``rope_theta``, ``quantization_config``). The FP8 cast is tested on this.

Weights: normal(0, 0.02) for matrices, 1 for norms, small random nonzero ``e_score_correction_bias``
(so routing tests see it); each tensor from its own generator seeded by (seed, name), so values do
not depend on sharding or format. The "deepseek-v3" preset (671B) writes the config only.

``write_random_hf(config, out_dir, ...)`` (the converter's tests) writes any config in BF16 *with* its
MTP layers, norms that are not all ones, MTP embed/head equal to the main ones, through the same shard
writer.

CLI::

    dsv3-mini-model --model PRESET --out OUT_DIR [--format hf|fp8-release] [--dtype bf16|fp32]
        [--shards N] [--seed S] [--set key=value ...] [--force]
    dsv3-mini-model PRESET OUT_DIR [...]     # the same, positionally
    dsv3-mini-model --list

(``python -m dsv3_rl.minimodel.mini_model`` is the same.)
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv3_rl.models import presets
from dsv3_rl.models.tokenizer import copy_tokenizer_files

from dsv3_rl.cliargs import UsageError, add_force, add_out, one_path, parse_set, usage_errors
from dsv3_rl.errors import cli_main
from dsv3_rl.fs import replace_dir

FORMATS = ("hf", "fp8-release")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INIT_STD = 0.02
BIAS_STD = 0.02
SHARD_TARGET_BYTES = 4 << 30
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # linear (FP8 in the release) | embed | head | norm | router | bias | eh_proj


def tensor_specs(cfg: dict[str, Any], mtp_layers: int = 0) -> list[TensorSpec]:
    """Hub-layout tensor names and shapes of a DeepseekV3 config (dict of config kwargs), in
    checkpoint order: embeddings, layers 0..L-1, final norm, lm_head, then MTP layers L..L+mtp-1."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    n_layers = cfg["num_hidden_layers"]
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), "embed")]

    def lin(name, out_f, in_f):
        specs.append(TensorSpec(name, (out_f, in_f), "linear"))

    def mlp(prefix, inter):
        lin(f"{prefix}.gate_proj.weight", inter, h)
        lin(f"{prefix}.up_proj.weight", inter, h)
        lin(f"{prefix}.down_proj.weight", h, inter)

    def layer(i):
        p = f"model.layers.{i}"
        if i >= n_layers:  # MTP module: its own embedding, norms and projection, then a decoder layer
            specs.extend([TensorSpec(f"{p}.embed_tokens.weight", (v, h), "embed"),
                          TensorSpec(f"{p}.enorm.weight", (h,), "norm"),
                          TensorSpec(f"{p}.hnorm.weight", (h,), "norm"),
                          TensorSpec(f"{p}.eh_proj.weight", (h, 2 * h), "eh_proj")])
        specs.append(TensorSpec(f"{p}.input_layernorm.weight", (h,), "norm"))
        a = f"{p}.self_attn"
        if cfg.get("q_lora_rank"):
            lin(f"{a}.q_a_proj.weight", cfg["q_lora_rank"], h)
            specs.append(TensorSpec(f"{a}.q_a_layernorm.weight", (cfg["q_lora_rank"],), "norm"))
            lin(f"{a}.q_b_proj.weight", nh * qk_head, cfg["q_lora_rank"])
        else:
            lin(f"{a}.q_proj.weight", nh * qk_head, h)
        lin(f"{a}.kv_a_proj_with_mqa.weight", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h)
        specs.append(TensorSpec(f"{a}.kv_a_layernorm.weight", (cfg["kv_lora_rank"],), "norm"))
        lin(f"{a}.kv_b_proj.weight", nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
        lin(f"{a}.o_proj.weight", h, nh * cfg["v_head_dim"])
        specs.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "norm"))
        if i < cfg["first_k_dense_replace"]:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
        else:
            e = cfg["n_routed_experts"]
            specs.append(TensorSpec(f"{p}.mlp.gate.weight", (e, h), "router"))
            specs.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (e,), "bias"))
            for j in range(e):
                mlp(f"{p}.mlp.experts.{j}", cfg["moe_intermediate_size"])
            mlp(f"{p}.mlp.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        if i >= n_layers:
            specs.extend([TensorSpec(f"{p}.shared_head.norm.weight", (h,), "norm"),
                          TensorSpec(f"{p}.shared_head.head.weight", (v, h), "head")])

    for i in range(n_layers):
        layer(i)
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    specs.append(TensorSpec("lm_head.weight", (v, h), "head"))
    for i in range(n_layers, n_layers + mtp_layers):
        layer(i)
    return specs


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def init_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 value of SPEC for SEED (independent of every other tensor)."""
    if spec.kind == "norm":
        return torch.ones(spec.shape)
    g = _generator(seed, spec.name)
    std = BIAS_STD if spec.kind == "bias" else INIT_STD
    return torch.randn(spec.shape, generator=g) * std


def fuse_experts(hub: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Hub-layout state dict -> transformers-5 DeepseekV3ForCausalLM state dict (what from_pretrained
    does through its conversion mapping): per-expert gate/up/down become ``mlp.experts.gate_up_proj``
    [E, 2I, H] (gate rows then up rows) and ``mlp.experts.down_proj`` [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    e = cfg["n_routed_experts"]
    for name, t in hub.items():
        if ".mlp.experts." not in name:
            out[name] = t
    layers = sorted({int(n.split(".")[2]) for n in hub if ".mlp.experts." in n})
    for i in layers:
        p = f"model.layers.{i}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([hub[f"{p}.{j}.gate_proj.weight"], hub[f"{p}.{j}.up_proj.weight"]], dim=0) for j in range(e)])
        out[f"{p}.down_proj"] = torch.stack([hub[f"{p}.{j}.down_proj.weight"] for j in range(e)])
    return out


def _hub_style_config(kwargs: dict[str, Any], mtp_layers: int) -> dict[str, Any]:
    """The kwargs as DeepSeek's hub config.json spells them (rope_scaling + rope_theta, torch_dtype)."""
    cfg = dict(kwargs)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rtype = rope.pop("rope_type")
    if rtype != "default":
        cfg["rope_scaling"] = {**rope, "type": rtype}
    cfg.update({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_nextn_predict_layers": mtp_layers,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "pretraining_tp": 1,
        "attention_dropout": 0.0,
    })
    return dict(sorted(cfg.items()))


def _split(units: list[tuple[list[str], int]], n: int) -> list[list[str]]:
    """Split consecutive units (names, bytes) into N contiguous, non-empty groups of similar size."""
    if not 1 <= n <= len(units):
        raise ValueError(f"cannot split {len(units)} tensors into {n} shards")
    cum = [0]
    for _, b in units:
        cum.append(cum[-1] + b)
    bounds = [0]
    for g in range(1, n):
        k = bisect.bisect_left(cum, cum[-1] * g / n)
        bounds.append(min(max(k, bounds[-1] + 1), len(units) - (n - g)))
    bounds.append(len(units))
    return [[name for names, _ in units[b0:b1] for name in names] for b0, b1 in zip(bounds, bounds[1:])]


def write_mini_model(preset: str, out_dir: str | os.PathLike, seed: int = 0, dtype: str = "bf16", fmt: str = "hf",
                     shards: int | None = None, overrides: dict[str, Any] | None = None,
                     overwrite: bool = False) -> Path:
    """Write a DeepSeek-V3-architecture checkpoint of PRESET to OUT_DIR (see module doc); returns OUT_DIR.
    Built in a temporary sibling directory and renamed into place when complete."""
    name = presets.resolve(preset)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (allowed: {', '.join(FORMATS)})")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
    if fmt == "fp8-release" and dtype != "bf16":
        raise ValueError("the fp8-release format stores its non-FP8 tensors in bf16; use --dtype bf16")
    kwargs = presets.preset_kwargs(name, overrides)
    return _build_dir(Path(out_dir), overwrite, lambda tmp: _write(name, kwargs, tmp, seed, dtype, fmt, shards))


def write_random_hf(config: Any, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    shard_gb: float = 2.0, keep_mtp: bool = True, overwrite: bool = False) -> Path:
    """A BF16 HF checkpoint of any config (a preset name, a dict or a transformers config) *with* its MTP
    layers (hub names ``model.layers.{num_hidden_layers + i}.*``, whose ``embed_tokens``/``shared_head.head``
    equal the main ones, as in DeepSeek's release; KEEP_MTP=False leaves them out), every tensor in DTYPE,
    norms that are not all ones (so a swapped norm shows), in shards of about SHARD_GB + index. For the
    converter's tests; written like :func:`write_mini_model` (the same shard writer, atomically)."""
    if isinstance(config, str):
        config = presets.hf_config(config, None)
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    n_layers, mtp = cfg["num_hidden_layers"], (cfg.get("num_nextn_predict_layers") or 0) if keep_mtp else 0
    specs = tensor_specs(cfg, mtp)
    same = {f"model.layers.{i}.{k}": main for i in range(n_layers, n_layers + mtp)
            for k, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                            ("shared_head.head.weight", "lm_head.weight"))}

    def value(spec: TensorSpec) -> torch.Tensor:
        src = same.get(spec.name, spec.name)  # MTP embed/head copies equal the main ones
        g = torch.Generator().manual_seed(seed * 1_000_003 + int.from_bytes(src.encode()[-8:], "little") % 1_000_000_007)
        if spec.kind == "norm":
            return (1.0 + 0.1 * torch.randn(spec.shape, generator=g)).to(dtype)
        return torch.randn(spec.shape, generator=g).mul_(0.02).to(dtype)  # in place: no second fp32 copy

    def fill(tmp: Path) -> None:
        from dsv3_rl.checkpoint.safetensors_io import shard_names, st_dtype

        copy_tokenizer_files(tmp, cfg["vocab_size"])  # first: a vocab_size below the tokenizer's fails at once
        units = [(s, [(s.name, st_dtype(dtype), s.shape)]) for s in specs]
        total = sum(math.prod(s.shape) * dtype.itemsize for s in specs)
        n = min(len(units), max(1, math.ceil(total / max(1, int(shard_gb * (1 << 30))))))
        _write_shards(tmp, units, lambda w, s: w.write(s.name, value(s)), list(shard_names(n)), index=True)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")

    return _build_dir(Path(out_dir), overwrite, fill)


def _build_dir(out: Path, overwrite: bool, fill: Callable[[Path], None]) -> Path:
    """FILL a temporary sibling of OUT, then swap it into OUT's place (OUT is replaced only once complete)."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force)")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out)
    return out


def _write_shards(out: Path, units: list[tuple[TensorSpec, list[tuple[str, str, tuple[int, ...]]]]],
                  write: Callable[[Any, TensorSpec], None], files: list[str], index: bool = False) -> None:
    """The synthetic checkpoints' shard writer: UNITS (a tensor and the entries it writes: name, safetensors
    dtype, shape; an FP8 weight also writes its scale) split into len(FILES) contiguous shards of similar
    size, each written by a ShardWriter (WRITE(writer, spec) writes one unit), and
    ``model.safetensors.index.json`` when there is more than one file (or INDEX)."""
    from dsv3_rl.checkpoint.safetensors_io import ShardWriter, itemsize

    sizes = [sum(math.prod(sh) * itemsize(dt) for _, dt, sh in ents) for _, ents in units]
    groups = _split([([e[0] for e in ents], b) for (_, ents), b in zip(units, sizes)], len(files))
    entry_of = {e[0]: e for _, ents in units for e in ents}
    spec_of = {ents[0][0]: spec for spec, ents in units}
    weight_map = {}
    for fname, group in zip(files, groups):
        with ShardWriter(out / fname, [entry_of[g] for g in group]) as w:
            for tname in group:  # logical order; the writer places each tensor at its offset
                if tname in spec_of:  # the first entry of a unit (a scale is written with its weight)
                    write(w, spec_of[tname])
            w.close(fsync=False, digest=False)
        weight_map.update({g: fname for g in group})
    if len(files) > 1 or index:
        index_doc = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")


def _write(name: str, kwargs: dict[str, Any], tmp: Path, seed: int, dtype: str, fmt: str, shards: int | None) -> None:
    from dsv3_rl.checkpoint import fp8_kernels as K
    from dsv3_rl.checkpoint.safetensors_io import itemsize, st_dtype

    mtp = max(1, kwargs.get("num_nextn_predict_layers", 0)) if fmt == "fp8-release" else 0
    if fmt == "hf":
        from transformers import DeepseekV3Config

        kwargs["num_nextn_predict_layers"] = 0
        DeepseekV3Config(
            **{k: v for k, v in kwargs.items() if k != "quantization_config"},
            architectures=["DeepseekV3ForCausalLM"],
            dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
        ).save_pretrained(tmp)
    else:
        cfg = _hub_style_config({k: v for k, v in kwargs.items() if k != "quantization_config"}, mtp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    copy_tokenizer_files(tmp, kwargs["vocab_size"])  # len(tokenizer) == vocab_size (verl's rollout masks the rest)

    if name not in presets.CONFIG_ONLY:
        specs = tensor_specs(kwargs, mtp)
        wdt = st_dtype(DTYPES[dtype])

        def entries_of(s: TensorSpec) -> list[tuple[str, str, tuple[int, ...]]]:
            if s.kind == "bias":
                return [(s.name, "F32", s.shape)]
            if fmt == "fp8-release" and s.kind == "linear":
                return [(s.name, "F8_E4M3", s.shape), (s.name + "_scale_inv", "F32", K.scale_shape(s.shape))]
            return [(s.name, wdt, s.shape)]

        units = [(s, entries_of(s)) for s in specs]
        total = sum(math.prod(sh) * itemsize(dt) for _, ents in units for _, dt, sh in ents)
        n = shards or max(4 if fmt == "fp8-release" else 1, math.ceil(total / SHARD_TARGET_BYTES))
        if fmt == "hf" and n == 1:
            files = ["model.safetensors"]
        else:
            width = 6 if fmt == "fp8-release" else 5  # DeepSeek: model-00001-of-000163.safetensors
            files = [f"model-{i + 1:05d}-of-{n:0{width}d}.safetensors" for i in range(n)]

        def write(w, spec: TensorSpec) -> None:
            x = init_tensor(spec, seed)
            if spec.kind == "bias":
                w.write(spec.name, x)
            elif fmt == "fp8-release" and spec.kind == "linear":
                q, s = K.quantize(x, "amax")
                w.write(spec.name, q)
                w.write(spec.name + "_scale_inv", s)
            else:
                w.write(spec.name, x.to(DTYPES[dtype]))

        _write_shards(tmp, units, write, files)


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv3-mini-model",
                                description="Write a DeepSeek-V3-architecture HF checkpoint from a preset.")
    p.add_argument("preset", nargs="?", help="same as --model")
    p.add_argument("out_dir", nargs="?", help="same as --out")
    p.add_argument("--model", help=f"model preset: one of {', '.join(presets.list_presets())} (alias 671b)")
    add_out(p, metavar="DIR", help="HF checkpoint directory to write")
    p.add_argument("--format", dest="fmt", default="hf", choices=FORMATS)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--shards", type=int, help="number of safetensors shards (default: by size; fp8-release >= 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset key (JSON value), e.g. --set num_hidden_layers=2")
    add_force(p, "--overwrite", help="replace OUT_DIR if it is not empty")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    args = p.parse_args(argv)
    if args.list:
        for name in presets.list_presets():
            k = presets.PRESETS[name]
            extra = " (config only)" if name in presets.CONFIG_ONLY else ""
            print(f"{name:12s} layers={k['num_hidden_layers']} hidden={k['hidden_size']} "
                  f"experts={k['n_routed_experts']} vocab={k['vocab_size']}{extra}")
        return 0
    preset = one_path("PRESET", args.preset, "--model", args.model) if (args.preset or args.model) else None
    out_dir = one_path("OUT_DIR", args.out_dir, "--out", args.out) if (args.out_dir or args.out) else None
    if not preset or not out_dir:
        raise UsageError("--model PRESET and --out OUT_DIR are required (or --list)")
    with usage_errors(KeyError, ValueError, FileExistsError):
        out = write_mini_model(preset, out_dir, seed=args.seed, dtype=args.dtype, fmt=args.fmt,
                               shards=args.shards, overrides=parse_set(args.set), overwrite=args.force)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    kind = "FP8 e4m3 blocks + fp32 scale_inv, rest bf16" if args.fmt == "fp8-release" else args.dtype
    print(f"wrote {presets.resolve(preset)} ({args.fmt}: {kind}) to {out}: {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
