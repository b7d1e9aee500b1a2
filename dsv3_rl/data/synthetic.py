"""A synthetic MATH-format task the tiny DeepSeek-V3 can learn: identity arithmetic on one digit.

    dsv3-prep-data synthetic --out OUT_DIR     # OUT_DIR/data/{train,test}-00000-of-00001.parquet
    python -m dsv3_rl.data.synthetic OUT_DIR   # the same (OUT_DIR may be positional)

Each problem is one of eight phrasings of "the value of a single digit d" (``What is $7$ plus
zero?``, ``Evaluate $|7|$.``, ...), d in 1..9; the answer goes in ``\\boxed{}`` and is graded by our
math reward like any MATH problem. The files have MATH-lighteval's layout (problem, level, solution,
type), so ``dsv3_rl.data.math_lighteval`` prepares them into verl's parquet like the real dataset.

The test split holds out whole (phrasing, digit) pairs: two per digit, so every answer is 1/9 of the
validation set and no constant answer scores more than 11.2% (the learning demo's guard: its reward can
rise only by answering each prompt). The 2M-parameter tiny model learns to read the digit out of an
unseen phrasing after a few hundred supervised steps (``dsv3_rl.minimodel.warm_start``); the warm start it
ships is then pushed towards a wrong habit so that GRPO has something to fix.
Deterministic: the same seed writes the same rows.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

from dsv3_rl.cliargs import add_out, one_path
from dsv3_rl.data.common import DataPrepError, commit_staged, make_staging
from dsv3_rl.errors import cli_main

TEMPLATES = (
    "What is ${d}$ plus zero?",
    "What is ${d}$ times one?",
    "If $x = {d}$, what is $x$?",
    "Evaluate $|{d}|$.",
    "What is ${d}$ minus zero?",
    "Simplify $({d})$.",
    "What number is ${d}$?",
    "What is ${d}$ divided by one?",
)
DIGITS = tuple(range(1, 10))
HELD_OUT_PER_DIGIT = 2
TYPE = "Identity arithmetic (synthetic)"
#: what one run writes into OUT_DIR/data (all of it is replaced at once)
FILES = tuple(f"{split}-00000-of-00001.parquet" for split in ("train", "test"))


def rows(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test) rows in MATH-lighteval's columns; test holds out HELD_OUT_PER_DIGIT phrasings per digit."""
    rng = random.Random(seed)
    pairs = [(t, d) for t in range(len(TEMPLATES)) for d in DIGITS]
    rng.shuffle(pairs)
    held: dict[int, int] = {}
    test, train = [], []
    for t, d in pairs:
        if held.get(d, 0) < HELD_OUT_PER_DIGIT:
            held[d] = held.get(d, 0) + 1
            test.append((t, d))
        else:
            train.append((t, d))

    def row(t: int, d: int) -> dict:
        problem = TEMPLATES[t].replace("{d}", str(d))
        return {"problem": problem, "level": "Level 1", "type": TYPE,
                "solution": f"The expression equals ${d}$, so the answer is $\\boxed{{{d}}}$."}

    return [row(*p) for p in train], [row(*p) for p in test]


def write(out_dir: str | Path, seed: int = 0) -> Path:
    """Write OUT_DIR/data/{train,test}-00000-of-00001.parquet (MATH-lighteval layout). Both files are written
    into a staging directory beside OUT_DIR/data and swapped in at once (``commit_staged``, the rule of every
    data tool): a failure or an interrupt leaves the previous output as it was, never a new train beside an
    old test; other files in OUT_DIR/data are kept."""

    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    data = out_dir / "data"
    for p in (out_dir, data):
        if p.exists() and not p.is_dir():
            raise DataPrepError(f"--out {out_dir}: {p} exists and is not a directory")
    staging = make_staging(data)
    try:
        for name, rs in zip(FILES, rows(seed), strict=True):
            pq.write_table(pa.Table.from_pylist(rs), staging / name)
        commit_staged(staging, data, FILES)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("out_dir", nargs="?", help="same as --out")
    add_out(ap, metavar="DIR", help="directory to write (MATH-lighteval layout: OUT/data/*.parquet)")
    ap.add_argument("--seed", type=int, default=0)


@cli_main(interrupted='the previous outputs are as they were; rerun the same command')
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-prep-data synthetic", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    out = write(one_path("OUT_DIR", args.out_dir, "--out", args.out), args.seed)
    train, test = rows(args.seed)
    print(f"[synthetic] {len(train)} train / {len(test)} test problems -> {out}/data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
