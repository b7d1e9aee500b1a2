"""scripts/soak.py's kill schedule (issue 41, the soak): seeded, every kind at least once when there are enough
kills, distinct steps inside the run, a kill during a save only on a step that is checkpointed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", REPO / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_once_on_distinct_steps_inside_the_run(soak, seed):
    plan = soak.schedule(seed, 12, 4)
    assert sorted(k for _, k in plan) == sorted(soak.KINDS), plan
    steps = [s for s, _ in plan]
    assert steps == sorted(steps) and len(set(steps)) == 4 and all(2 <= s <= 11 for s in steps), plan
    assert all(s % soak.SAVE_FREQ == 0 for s, k in plan if k == "save"), plan


def test_the_seed_decides(soak):
    assert soak.schedule(1, 12, 4) == soak.schedule(1, 12, 4)
    assert len({tuple(soak.schedule(s, 12, 4)) for s in range(10)}) > 5  # twin: not one fixed plan


def test_more_kills_than_steps_is_refused(soak):
    with pytest.raises(SystemExit, match="no free step"):
        soak.schedule(1, 6, 6)
