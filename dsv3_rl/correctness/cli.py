"""Command line of the correctness suite.

    python -m dsv3_rl.correctness run [--hf-model-path DIR] [--layouts tp1,tp2_sp,...|ci] [--dtype fp32|bf16]
        [--batch-size 4] [--seq-length 32] [--micro-batch-size 1] [--plant-fault NAME] [--reference hf|mcore]
        [--json OUT.json] [--work DIR] [--keep-work] [--debug]
    python -m dsv3_rl.correctness check-faults [--faults a,b] [same options]   # clean run + every planted fault
    python -m dsv3_rl.correctness layouts      # the named layouts
    python -m dsv3_rl.correctness faults       # the planted faults

Without ``--hf-model-path`` a random mini model of ``--preset`` (default tiny) is written first.
Exit status: ``run``: 0 overall PASS, 1 FAIL (a planted fault must give 1), 2 usage error;
``check-faults``: 0 when the clean run PASSes and every planted fault FAILs, else 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from dsv3_rl.errors import cli_main

if TYPE_CHECKING:
    from dsv3_rl.correctness.runner import Options

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def add_run_args(ap: argparse.ArgumentParser) -> None:
    from dsv3_rl.correctness import faults, layouts

    ap.add_argument("--hf-model-path", help="HF DeepSeek-V3 checkpoint dir (default: build a random mini model)")
    ap.add_argument("--preset", default="tiny", help="mini model preset when no --hf-model-path (tiny, proxy, ...)")
    ap.add_argument("--set", dest="preset_set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset key of the mini model (JSON value), e.g. --set num_hidden_layers=2")
    ap.add_argument("--layouts", default=None,
                    help=f"comma list of layouts, or 'ci' ({','.join(layouts.CI_LAYOUTS)}, the default of `run`); "
                         f"`check-faults` plants each fault at the first one (default tp1; TP faults at tp2_sp)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="candidate dtype (reference is fp32)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences in the global batch")
    ap.add_argument("--seq-length", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plant-fault", choices=list(faults.FAULTS), help="plant a fault; the result must be FAIL")
    ap.add_argument("--reference", default="hf", choices=["hf", "mcore"],
                    help="hf: transformers (default); mcore: the single-process megatron model, random weights")
    ap.add_argument("--weights", help="already converted megatron dist checkpoint of --hf-model-path")
    ap.add_argument("--calibrate", action="store_true", help="also report transformers-bf16 vs fp32 (bf16 error floor)")
    ap.add_argument("--json", dest="json_out", help="write the report as JSON too")
    ap.add_argument("--work", help="work directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--keep-work", action="store_true")
    ap.add_argument("--debug", action="store_true", help="per-tensor gradient lines and worker logs")


def options_from(args: argparse.Namespace, layouts_list: list) -> Options:
    from dsv3_rl.correctness.runner import Options

    return Options(hf_model_path=args.hf_model_path, layouts=layouts_list, dtype=args.dtype, batch_size=args.batch_size,
                   seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, seed=args.seed,
                   fault=args.plant_fault, reference=args.reference, work=args.work, keep_work=args.keep_work,
                   debug=args.debug, json_out=args.json_out, weights=args.weights, preset=args.preset,
                   preset_overrides=_parse_set(args.preset_set), calibrate=args.calibrate)


def _parse_set(items: list[str]) -> dict:
    import json

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def quiet() -> None:
    """Keep the report readable: upstream deprecation chatter and download bars are not results."""
    import warnings

    for mod in ("megatron", "torch.distributed", "transformers", "torch.utils"):
        warnings.filterwarnings("ignore", module=rf"{mod}(\..*)?$")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


@cli_main
def main(argv: list[str] | None = None) -> int:
    from dsv3_rl.correctness import faults, layouts

    quiet()

    ap = argparse.ArgumentParser(prog="python -m dsv3_rl.correctness", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_run_args(sub.add_parser("run", help="run the suite"))
    chk = sub.add_parser("check-faults", help="clean run + every planted fault; each fault must FAIL")
    add_run_args(chk)
    chk.add_argument("--faults", help=f"comma list (default: all: {','.join(faults.FAULTS)})")
    sub.add_parser("layouts", help="list the named layouts")
    sub.add_parser("faults", help="list the planted faults")
    args = ap.parse_args(argv)
    if args.cmd == "layouts":
        for lay in layouts.LAYOUTS.values():
            print(f"{lay.describe():<78} {lay.note}")
        return 0
    if args.cmd == "faults":
        for f in faults.FAULTS.values():
            print(f"{f.name:<33} {f.description}\n{'':<33} fails: {f.catches}")
        return 0
    default_layouts = "tp1" if args.cmd == "check-faults" else "ci"
    if args.layouts is None:
        args.layouts = default_layouts
    names = layouts.CI_LAYOUTS if args.layouts == "ci" else [n.strip() for n in args.layouts.split(",") if n.strip()]
    try:
        lays = [layouts.get(n) for n in names]
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    from dsv3_rl.correctness.runner import run_fault_matrix, run_suite

    say = lambda s: print(s, flush=True)  # noqa: E731
    try:
        if args.cmd == "check-faults":
            fnames = [n.strip() for n in args.faults.split(",")] if args.faults else None
            for n in fnames or []:
                faults.get(n)
            return run_fault_matrix(options_from(args, lays), fnames, out=say)
        return run_suite(options_from(args, lays), out=say)
    except (ValueError, KeyError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
