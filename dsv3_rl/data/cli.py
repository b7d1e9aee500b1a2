"""``dsv3-prep-data``: convert math datasets to verl's RL parquet schema, or check such a file.

    dsv3-prep-data math_lighteval --input_dir DIR --local_dir OUT [options]
    dsv3-prep-data gsm8k          --input_dir DIR --local_dir OUT [options]
    dsv3-prep-data validate FILE.parquet [...]

``dsv3-prep-data math_lighteval -h`` lists the options (sampling, seed, tokenizer length
filter, chat template, thresholds). Exit status: 0 ok, 2 bad input or options.
"""

from __future__ import annotations

import sys

from dsv3_rl.data import gsm8k, math_lighteval
from dsv3_rl.data.common import DataPrepError, validate_rl_parquet
from dsv3_rl.errors import cli_main

COMMANDS = {"math_lighteval": math_lighteval.main, "math": math_lighteval.main, "gsm8k": gsm8k.main}


def _validate(paths: list[str]) -> int:
    if not paths:
        print("usage: dsv3-prep-data validate FILE.parquet [...]", file=sys.stderr)
        return 2
    for p in paths:
        n = validate_rl_parquet(p)
        print(f"{p}: {n} rows ok")
    return 0


@cli_main(interrupted="the previous outputs are as they were; rerun the same command")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "validate":
        return _validate(rest)
    if cmd not in COMMANDS:
        raise DataPrepError(f"unknown command {cmd!r}; allowed: {', '.join([*COMMANDS, 'validate'])}")
    return COMMANDS[cmd].__wrapped__(rest)  # this main's wrapper maps errors; not twice


if __name__ == "__main__":
    sys.exit(main())
