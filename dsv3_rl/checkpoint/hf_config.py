"""Make a HF DeepSeek-V3 config.json acceptable to Megatron (via verl) and vLLM; report each change.

Fix-ups (each reported as ``key: old -> new (why)``):

* ``quantization_config`` removed once the weights are BF16 (verl's converter asserts it is absent;
  vLLM would otherwise try to load BF16 tensors as FP8).
* ``num_nextn_predict_layers`` -> 0 unless the MTP layer is kept (verl asserts 0).
* ``topk_method: noaux_tc`` kept/inserted where the checkpoint has ``mlp.gate.e_score_correction_bias``
  (all DeepSeek-V3-family models do). transformers 5 does not write ``topk_method``; without it vLLM
  creates no bias parameter and fails with ``KeyError: 'layers.1.mlp.gate.e_score_correction_bias'``.
* ``scoring_func: sigmoid`` inserted when missing (vLLM's default is softmax: silently wrong routing).
* ``auto_map`` removed: it points at remote code written for transformers 4.x; transformers >= 4.51
  has DeepseekV3 built in (``--keep-auto-map`` keeps it).

Configs that are not DeepSeek-V3-family (model_type deepseek_v3 / kimi_k2, architecture
DeepseekV3ForCausalLM) are refused with the values found and the ones allowed.

CLI::

    dsv3-fix-config CKPT_DIR_OR_CONFIG [--out OUT] [--keep-mtp] [--check] [--dry-run]   # or python -m dsv3_rl.checkpoint.hf_config
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Collection
from typing import Any
from dsv3_rl.cliargs import add_out
from dsv3_rl.errors import cli_main
from dsv3_rl.fs import JsonFileError, read_json, write_json_atomic
from dsv3_rl.models.hf_config_rules import ConfigError, check_family

BIAS_SUFFIX = "mlp.gate.e_score_correction_bias"
_REMOVED = "(removed)"
_ABSENT = "(absent)"


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    why: str

    def __str__(self) -> str:
        def fmt(v):
            return v if v in (_REMOVED, _ABSENT) else json.dumps(v, ensure_ascii=False)

        return f"{self.key}: {fmt(self.old)} -> {fmt(self.new)} ({self.why})"


# Tensor dtypes (safetensors spelling) the architecture allows: floating weights; FP8 only for the linear
# weights DeepSeek ships in FP8, each with a float ``_scale_inv``.
FLOAT_DTYPES = ("BF16", "F16", "F32")
FP8_DTYPES = ("F8_E4M3",)
FP8_WEIGHT_RE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$"
)
SCALE_SUFFIX = "_scale_inv"


def check_tensor_dtypes(dtypes: dict[str, str], where: str, scaled: Collection[str] = ()) -> None:
    """Raise ConfigError naming the first tensor whose dtype (safetensors spelling: BF16, F8_E4M3, I16, ...)
    the architecture does not allow: floats everywhere; F8_E4M3 for a weight that has its ``<name>_scale_inv``
    (SCALED: the names that have one; DeepSeek's ``fp8_cast_bf16.py`` dequantizes every such weight, whatever
    its name: an ``eh_proj`` of the MTP layer as well as the linear weights of the release); a ``_scale_inv``
    is a float."""
    for name, dt in dtypes.items():
        allowed = FLOAT_DTYPES + FP8_DTYPES if name in scaled else FLOAT_DTYPES
        if dt in FP8_DTYPES and name not in scaled:
            raise ConfigError(f"{where}: FP8 tensor {name!r} has no scale: {name + SCALE_SUFFIX!r} is missing from the "
                              f"checkpoint (dtype {dt} needs its scale; allowed without one: {', '.join(FLOAT_DTYPES)})")
        if dt not in allowed:
            raise ConfigError(f"{where}: tensor {name!r} has dtype {dt}; allowed for it: {', '.join(allowed)}")


def load_config(path: str | os.PathLike, *, family: bool = True) -> dict:
    """The ``config.json`` of a checkpoint directory (or the file PATH itself), parsed. Raises ConfigError
    naming the file when it is missing, not JSON or not an object; FAMILY: also :func:`check_family`
    (a DeepSeek-V3-family config whose sizes pass :func:`validate_config`)."""
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    try:
        cfg = read_json(cfg_path, what="HF config")
    except JsonFileError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path}: JSON {type(cfg).__name__}, expected an object (an HF config)")
    if family:
        check_family(cfg, str(cfg_path))
    return cfg


def fix_config(cfg: dict, *, keep_mtp: bool = False, has_score_bias: bool | None = None,
               keep_auto_map: bool = False, where: str = "config.json") -> tuple[dict, list[Change]]:
    """Return (fixed copy of CFG, changes). HAS_SCORE_BIAS: whether the weights carry
    ``*.mlp.gate.e_score_correction_bias`` (None = unknown: assume yes, as for every DeepSeek-V3)."""
    check_family(cfg, where)
    out = json.loads(json.dumps(cfg))
    changes: list[Change] = []

    def put(key, value, why):
        old = out.get(key, _ABSENT)
        if old != value:
            out[key] = value
            changes.append(Change(key, old, value, why))

    def drop(key, why):
        if key in out:
            changes.append(Change(key, out.pop(key), _REMOVED, why))

    drop("quantization_config", "weights are BF16; verl asserts no quantization_config")
    if not keep_mtp and out.get("num_nextn_predict_layers", 0) != 0:
        put("num_nextn_predict_layers", 0, "MTP layer not loaded; verl asserts 0")
    if has_score_bias is not False:
        put("topk_method", "noaux_tc",
            "checkpoint has e_score_correction_bias; without noaux_tc vLLM fails with "
            "KeyError: 'layers.N.mlp.gate.e_score_correction_bias'")
    if "scoring_func" not in out:
        put("scoring_func", "sigmoid", "vLLM defaults to softmax routing")
    if not keep_auto_map:
        drop("auto_map", "remote code targets transformers 4.x; transformers has DeepseekV3 built in")
    return out, changes


def weight_names(ckpt_dir: Path) -> list[str] | None:
    """Tensor names of a checkpoint dir (index or shard headers), None if it has no weights."""
    from .safetensors_io import read_header

    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(read_json(index, what="safetensors index")["weight_map"])
        except (KeyError, TypeError) as e:
            raise ConfigError(f"{index}: not a safetensors index (no weight_map: {e!r})") from None
    shards = sorted(ckpt_dir.glob("*.safetensors"))
    if not shards:
        return None
    return [n for s in shards for n in read_header(s).tensors]


def fix_checkpoint_config(path: str | os.PathLike, out: str | os.PathLike | None = None, *, keep_mtp: bool = False,
                          keep_auto_map: bool = False, dry_run: bool = False) -> list[Change]:
    """Fix PATH (a checkpoint dir or a config.json) in place, or write the result to OUT."""
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    cfg = load_config(cfg_path, family=False)  # fix_config checks the family
    names = weight_names(cfg_path.parent)
    has_bias = None
    if names is not None:
        fp8 = [n for n in names if n.endswith("_scale_inv")]
        if fp8:
            raise ConfigError(
                f"{cfg_path.parent}: weights are still FP8 ({len(fp8)} *_scale_inv tensors, e.g. {fp8[0]}); "
                f"removing quantization_config would make them unloadable. Run the cast instead: "
                f"python -m dsv3_rl.checkpoint.fp8 cast {cfg_path.parent} OUT_DIR"
            )
        has_bias = any(n.endswith(BIAS_SUFFIX) for n in names)
    fixed, changes = fix_config(cfg, keep_mtp=keep_mtp, has_score_bias=has_bias, keep_auto_map=keep_auto_map,
                                where=str(cfg_path))
    if not dry_run and (changes or out is not None):
        dst = Path(out) if out is not None else cfg_path
        if dst.is_dir():
            dst = dst / "config.json"
        write_json_atomic(dst, fixed)
    return changes


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv3-fix-config",
                                description="Make a DeepSeek-V3 config.json acceptable to Megatron/verl and vLLM.")
    p.add_argument("path", help="checkpoint directory or config.json (fixed in place unless --out)")
    add_out(p, dest="output", help="write the fixed config here (file or directory) instead")
    p.add_argument("--keep-mtp", action="store_true", help="keep num_nextn_predict_layers (MTP layer kept)")
    p.add_argument("--keep-auto-map", action="store_true", help="keep auto_map (remote code)")
    p.add_argument("--dry-run", action="store_true", help="report the changes, write nothing")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if any change is needed")
    args = p.parse_args(argv)
    changes = fix_checkpoint_config(args.path, args.output, keep_mtp=args.keep_mtp,
                                    keep_auto_map=args.keep_auto_map, dry_run=args.dry_run or args.check)
    for c in changes:
        print(f"config: {c}")
    verb = "would change" if (args.dry_run or args.check) else "changed"
    print(f"config: {verb} {len(changes)} key(s)" if changes else "config: already acceptable, nothing to change")
    return 1 if (args.check and changes) else 0


if __name__ == "__main__":
    sys.exit(main())
