"""``dsv3-prep-data``: convert math datasets to verl's RL parquet schema, or check such a file.

    dsv3-prep-data math-lighteval --input-dir DIR --out OUT [options]
    dsv3-prep-data gsm8k          --input-dir DIR --out OUT [options]
    dsv3-prep-data synthetic --out OUT                 # the learning demo's synthetic task (MATH layout)
    dsv3-prep-data validate FILE.parquet [...]

``dsv3-prep-data math-lighteval -h`` lists the options (sampling, seed, tokenizer length
filter, chat template, thresholds). Exit status: 0 ok, 2 bad input or options.
"""

from __future__ import annotations

import argparse
import sys

from dsv3_rl.data import gsm8k, math_lighteval, synthetic
from dsv3_rl.data.common import DataPrepError, add_arguments, run, validate_rl_parquet
from dsv3_rl.errors import cli_main

#: subcommand -> (dataset module, old spellings still accepted)
DATASETS = {"math-lighteval": (math_lighteval, ["math_lighteval", "math"]), "gsm8k": (gsm8k, [])}
#: every command name, as an unknown one's error lists them (the seed's spelling first)
COMMANDS = ("math_lighteval", "math-lighteval", "math", "gsm8k", "synthetic", "validate")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv3-prep-data", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (mod, aliases) in DATASETS.items():
        s = sub.add_parser(name, aliases=aliases, help=f"{mod.SPEC.name} -> verl RL parquet",
                           description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(s, mod.SPEC)
        s.set_defaults(spec=mod.SPEC)
    s = sub.add_parser("synthetic", help="write the synthetic identity-arithmetic task (MATH layout)",
                       description=synthetic.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    synthetic.add_arguments(s)
    s = sub.add_parser("validate", help="check RL parquet files against verl's schema")
    s.add_argument("files", nargs="+", metavar="FILE.parquet")
    return ap


@cli_main(interrupted="the previous outputs are as they were; rerun the same command")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        raise DataPrepError(f"unknown command {argv[0]!r}; allowed: {', '.join(COMMANDS)}")
    args = build_parser().parse_args(argv)
    if args.cmd == "synthetic":
        return synthetic.run(args)
    if args.cmd == "validate":
        for p in args.files:
            print(f"{p}: {validate_rl_parquet(p)} rows ok")
        return 0
    run(args.spec, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
