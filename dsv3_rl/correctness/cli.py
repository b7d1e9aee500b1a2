"""Command line of the correctness suite.

    dsv3-correctness run [--hf-model-path DIR] [--layout tp1 --layout tp=2,ep=2 ...|--layout ci|two|four]
        [--dtype fp32|bf16] [--spec auto|te|local]
        [--batch-size 4] [--seq-length 32] [--micro-batch-size 1] [--plant-fault NAME] [--reference hf|mcore]
        [--json OUT.json] [--work DIR] [--keep-work] [--debug]
    dsv3-correctness check-faults [--faults a,b] [--each-layout] [same options]   # clean run + every planted fault
    dsv3-correctness layouts      # the named layouts
    dsv3-correctness faults       # the planted faults

(``python -m dsv3_rl.correctness`` is the same.) ``--layout`` repeats; each value is a named layout, a comma
list of names (``tp1,tp2_sp``), ``ci``, or one ``tp=..,pp=..,ep=..`` spec.
Without ``--hf-model-path`` a random mini model of ``--model`` (default tiny) is written first.
Layouts documented as known failures (``layouts.Layout.known_fail``) are reported XFAIL when they fail and
XPASS when they pass. Exit status: ``run``: 0 overall PASS (XFAILs included, and said), 1 FAIL or XPASS (a
planted fault must give 1), 2 usage error (``--spec te`` without a usable Transformer Engine, one line);
``check-faults``: 0 when the clean run PASSes and every planted fault FAILs, else 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from dsv3_rl.cliargs import parse_set, usage_errors
from dsv3_rl.errors import cli_main

if TYPE_CHECKING:
    from dsv3_rl.correctness.runner import Options

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def add_run_args(ap: argparse.ArgumentParser) -> None:
    from dsv3_rl.correctness import faults, layouts

    ap.add_argument("--hf-model-path", help="HF DeepSeek-V3 checkpoint dir (default: build a random mini model)")
    ap.add_argument("--model", dest="preset", default="tiny",
                    help="model preset of the random mini model when no --hf-model-path (tiny, proxy, ...)")
    ap.add_argument("--set", dest="preset_set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset key of the mini model (JSON value), e.g. --set num_hidden_layers=2")
    ap.add_argument("--layout", dest="layouts", action="append", default=None, metavar="NAME|tp=..,pp=..",
                    help=f"repeatable: a named layout (`layouts` lists them), a comma list of names, a "
                         f"tp=..,pp=..,ep=.. spec, 'two' / 'four' (every 2- / 4-process layout) or 'ci' "
                         f"({','.join(layouts.CI_LAYOUTS)}, the default of `run`); "
                         f"`check-faults` plants each fault at the first one (default tp1; TP faults at tp2_sp)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                    help="candidate dtype (reference is fp32); fp32 turns TF32 off (NVIDIA_TF32_OVERRIDE=0 too)")
    ap.add_argument("--spec", default="auto", choices=["auto", "te", "local"],
                    help="megatron layer spec of the candidate: te (Transformer Engine), local, or auto "
                         "(te where Transformer Engine imports, as the model builder decides)")
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
                   preset_overrides=parse_set(args.preset_set), calibrate=args.calibrate, spec=args.spec)


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

    ap = argparse.ArgumentParser(prog="dsv3-correctness", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_run_args(sub.add_parser("run", help="run the suite"))
    chk = sub.add_parser("check-faults", help="clean run + every planted fault; each fault must FAIL")
    add_run_args(chk)
    chk.add_argument("--faults", help=f"comma list (default: all: {','.join(faults.FAULTS)})")
    chk.add_argument("--each-layout", action="store_true",
                     help="plant every fault at every --layout (TP faults at those with TP > 1), each with its "
                          "clean twin, instead of at the first layout only")
    sub.add_parser("layouts", help="list the named layouts")
    sub.add_parser("faults", help="list the planted faults")
    args = ap.parse_args(argv)
    if args.cmd == "layouts":
        for lay in layouts.LAYOUTS.values():
            known = f" [KNOWN FAIL, {'/'.join(lay.known_fail_specs)} spec: {lay.known_fail}]" if lay.known_fail else ""
            print(f"{lay.describe():<78} {lay.note}{known}")
        return 0
    if args.cmd == "faults":
        for f in faults.FAULTS.values():
            print(f"{f.name:<33} {f.description}\n{'':<33} fails: {f.catches}")
        return 0
    lays = [_layout(n) for n in layout_names(args.layouts or ["tp1" if args.cmd == "check-faults" else "ci"])]
    from dsv3_rl.correctness.runner import resolve_spec, run_fault_matrix, run_suite

    say = lambda s: print(s, flush=True)  # noqa: E731
    if args.dtype == "fp32":  # before anything can load Transformer Engine or CUDA here (runner.tf32_off says it)
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    with usage_errors():
        resolve_spec(args.spec)  # --spec te without a usable Transformer Engine: one line, exit 2, before any work
        if args.cmd == "check-faults":
            fnames = [n.strip() for n in args.faults.split(",")] if args.faults else None
            for n in fnames or []:
                faults.get(n)
            return run_fault_matrix(options_from(args, lays), fnames, out=say, each_layout=args.each_layout)
        return run_suite(options_from(args, lays), out=say)


def layout_names(values: list[str]) -> list[str]:
    """``--layout`` values -> layout names/specs: ``ci`` is the CI set, ``two`` / ``four`` every 2- / 4-process
    layout (known failures included, reported XFAIL), ``a,b`` (no ``=``) a list of names (groups too),
    anything with ``=`` one ``tp=..,pp=..`` spec."""
    from dsv3_rl.correctness import layouts

    out: list[str] = []
    for v in values:
        if v in layouts.GROUPS:
            out += layouts.GROUPS[v]
        elif "=" in v:
            out.append(v)
        else:
            for n in (n.strip() for n in v.split(",") if n.strip()):
                out += layouts.GROUPS.get(n, [n])
    return out


def _layout(name: str):
    from dsv3_rl.correctness import layouts

    with usage_errors():
        return layouts.get(name)


if __name__ == "__main__":
    sys.exit(main())
