"""``dsv3-convert`` (``python -m dsv3_rl.convert``): DeepSeek-V3 HF <-> megatron-core checkpoint conversion.

    dsv3-convert hf-to-mcore --hf-dir HF --out MCORE [--keep-mtp] [--spec both|local|te] [--force]
    dsv3-convert mcore-to-hf --mcore-dir MCORE --out HF2 [--hf-dir HF] [--force]
    dsv3-convert compare-hf HF HF2          # tensor-by-tensor, bytes; exit 1 on a difference
    dsv3-convert verify --mcore-dir MCORE --hf-dir HF --out DIR [--layout tp=2,ep=2]   # logits vs HF
    dsv3-convert plan --hf-dir HF           # validate the config, print the mapping (dry run)
    dsv3-convert mcore-config --hf-dir HF   # the MLATransformerConfig kwargs (JSON)
    torchrun --nproc-per-node 2 -m dsv3_rl.convert verify --mcore-dir MCORE --hf-dir HF --layout tp=2 --out DIR

Run the conversions under ``torchrun`` (any number of processes/nodes on a shared filesystem) to
spread the I/O. Every run ends with one summary line (tensors, GB, GB/s, ranks, peak RSS).
"""

from __future__ import annotations

import argparse
import math
import os
import json
import sys
from pathlib import Path

from dsv3_rl.convert import verify
from dsv3_rl.errors import cli_main


def _check_model_size(cfg_dir: Path, model_size: str | None) -> None:
    """Pai's MODEL_SIZE (``A37B``) must name the model the config describes; ``auto`` skips the check."""
    from .weights import ConvertError, load_hf_config, size_tag

    if not model_size or model_size == "auto":
        return
    tag = size_tag(load_hf_config(cfg_dir))
    if model_size != tag:
        raise ConvertError(f"MODEL_SIZE={model_size}, but {cfg_dir / 'config.json'} describes {tag} "
                           f"(DeepSeek-V3 671B is A37B); pass auto to take the config as it is")


def _plan(args) -> int:
    from .names import build_plan
    from .weights import load_hf_config, size_tag

    _check_model_size(args.hf_dir, args.model_size)
    cfg = load_hf_config(args.hf_dir)
    plan = build_plan(cfg, keep_mtp=args.keep_mtp, spec=args.spec)
    total = sum(math.prod(s) for s in plan.hf_shapes.values())
    if args.verbose:
        for it in plan.items:
            src = it.sources[0] if len(it.sources) == 1 else f"{it.sources[0]} .. ({len(it.sources)} HF tensors)"
            print(f"{it.key:<70} {str(list(it.shape)):<22} {it.kind:<12} <- {src}"
                  + (f"  (also {', '.join(it.aliases)})" if it.aliases else ""))
    print(f"[convert] plan: {size_tag(cfg)}, {len(plan.items)} megatron tensors from {len(plan.hf_shapes)} HF tensors "
          f"({total / 1e9:.3f} B params), {len(plan.extra_states)} _extra_state entries, "
          f"{len(plan.hf_ignored)} HF tensors dropped (MTP), spec={args.spec}")
    return 0


def _mcore_config(args) -> int:
    from dsv3_rl.models.config_map import RouterSettings, hf_to_mcore_kwargs
    from .weights import load_hf_config

    cfg = load_hf_config(args.hf_dir)
    kw = hf_to_mcore_kwargs(cfg, router=RouterSettings(), keep_mtp=args.keep_mtp)
    print(json.dumps({k: (v.__name__ if callable(v) else str(v) if not isinstance(v, (int, float, bool, list, type(None), str)) else v)
                      for k, v in kw.items()}, indent=2))
    return 0


@cli_main(interrupted="hf-to-mcore restarts, mcore-to-hf keeps finished shards; rerun the same command to resume")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron torch_dist checkpoint (loads at any layout)")
    s.add_argument("--hf-dir", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True, help="megatron checkpoint dir to write")
    s.add_argument("--keep-mtp", action="store_true", help="convert the MTP layer(s) too (default: drop them)")
    s.add_argument("--spec", default="both", choices=["both", "local", "te"],
                   help="norm names to write: both (loads under the TE and the local spec; default), local, te")
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast the weights (the router expert bias stays fp32; default: keep the HF dtype)")
    s.add_argument("--chunk-mb", type=int, default=512, help="split larger tensors into row chunks of this size")
    s.add_argument("--file-gb", type=float, default=1.0, help="size of each .distcp file (bounds memory per rank)")
    s.add_argument("--force", action="store_true", help="replace a complete output")
    s.add_argument("--model-size", default=None, help="A37B or auto: check the config describes that model")
    s.add_argument("--no-progress", action="store_true")

    s = sub.add_parser("mcore-to-hf", help="megatron torch_dist checkpoint (any layout) -> HF safetensors")
    s.add_argument("--mcore-dir", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True, help="HF checkpoint dir to write")
    s.add_argument("--hf-dir", type=Path, default=None,
                   help="HF model dir for config/tokenizer (default: the copy our hf-to-mcore stored in the checkpoint)")
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast the weights (the router expert bias stays fp32; default: keep the checkpoint dtype)")
    s.add_argument("--shard-gb", type=float, default=4.0)
    s.add_argument("--read-batch-mb", type=int, default=1024)
    s.add_argument("--force", action="store_true", help="replace a complete output")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--model-size", default=None, help="A37B or auto: check the config describes that model")

    s = sub.add_parser("compare-hf", help="compare two HF checkpoints tensor by tensor (bytes)")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)

    s = sub.add_parser("verify", help="load a megatron checkpoint at a layout (torchrun) and compare its logits with HF")
    verify.add_arguments(s)
    s.set_defaults(fn=verify.run)

    for name, fn in (("plan", _plan), ("mcore-config", _mcore_config)):
        s = sub.add_parser(name)
        s.add_argument("--hf-dir", type=Path, required=True)
        s.add_argument("--keep-mtp", action="store_true")
        s.add_argument("--spec", default="both", choices=["both", "local", "te"])
        s.add_argument("-v", "--verbose", action="store_true")
        s.add_argument("--model-size", default=None)
        s.set_defaults(fn=fn)

    args = ap.parse_args(argv)
    from .weights import compare_hf, hf_to_mcore, mcore_to_hf

    if args.cmd == "hf-to-mcore":
        _check_model_size(args.hf_dir, args.model_size)
        s = hf_to_mcore(args.hf_dir, args.out, keep_mtp=args.keep_mtp, spec=args.spec, dtype=args.dtype,
                        chunk_mb=args.chunk_mb, file_gb=args.file_gb, force=args.force, progress=not args.no_progress)
        if s.ranks == 1 or os.environ.get("RANK", "0") == "0":
            print(s.line(), flush=True)
    elif args.cmd == "mcore-to-hf":
        _check_model_size(args.hf_dir or args.mcore_dir / "hf_meta", args.model_size)
        s = mcore_to_hf(args.mcore_dir, args.out, hf_dir=args.hf_dir, dtype=args.dtype, shard_gb=args.shard_gb,
                        read_batch_mb=args.read_batch_mb, force=args.force, progress=not args.no_progress)
        if s.ranks == 1 or os.environ.get("RANK", "0") == "0":
            print(s.line(), flush=True)
    elif args.cmd == "compare-hf":
        diffs = compare_hf(args.a, args.b)
        for line in diffs[:50]:
            print(line)
        print(f"[convert] compare-hf: {'identical' if not diffs else f'{len(diffs)} difference(s)'}: {args.a} vs {args.b}")
        return 1 if diffs else 0
    else:
        return args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
