"""Scripts launched under torchrun must not have a long flag that is a prefix of one of torchrun's own: on the GPU
box (Python 3.12) torchrun's argparse read bench_grpo_update.py's ``--n 8`` as an ambiguous abbreviation of its
``--nnodes``/``--nproc-per-node``/... and exited before the script ran (2026-11-26, every row of the bench)."""

import re
from pathlib import Path

from torch.distributed.run import get_args_parser

REPO = Path(__file__).resolve().parents[2]
# what gpu_session.sh / grpo_update_vs_planner.sh / the docs start with torchrun
UNDER_TORCHRUN = ["bench/bench_grpo_update.py", "bench/bench_train_step.py", "dsv3_rl/consistency/replay_check.py"]


def torchrun_flags() -> set[str]:
    return {s for a in get_args_parser()._actions for s in a.option_strings if s.startswith("--")}


def clashes(flags, theirs) -> list[tuple[str, str]]:
    """(our flag, their flag) where ours is a strict prefix of theirs: argparse's abbreviation matching takes it."""
    return sorted((f, t) for f in flags for t in theirs if t != f and t.startswith(f))


def script_flags(path: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[A-Za-z0-9-]+)\"", path.read_text()))


def test_scripts_under_torchrun_have_no_flag_torchrun_would_take():
    theirs = torchrun_flags()
    for rel in UNDER_TORCHRUN:
        flags = script_flags(REPO / rel)
        assert flags, f"{rel}: no flags found (the pattern no longer matches the script)"
        assert not clashes(flags, theirs), f"{rel}: {clashes(flags, theirs)}"


def test_the_flag_that_broke_the_bench_is_caught():
    assert ("--n", "--nnodes") in clashes({"--n", "--rollout-n"}, torchrun_flags())
