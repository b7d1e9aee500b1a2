""".ci/run's deadline (CI_DEADLINE_S): a CI run past the CI's hard limit lands nothing, so every stage runs with the
time left before the deadline and one still running then is stopped, failing the run with exit 124 and one line
that says so; the stage table still closes the run. Checked on a copy of .ci/run with a stand-in ``make`` on PATH
(each stage a sleep), so no real stage runs. Twin: the same script without the guard on its first stage runs that
stage to its end, past the deadline."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_MAKE = """#!/usr/bin/env bash
# stand-in for make: the stage named in SLOW_STAGE sleeps SLOW_S seconds, every other one succeeds at once
[ "$1" = "$SLOW_STAGE" ] && sleep "$SLOW_S"
[ "$1" = "${FAIL_STAGE:-}" ] && exit 3
exit 0
"""


def _ci_copy(tmp_path: Path, unguard_first_stage: bool = False, fatal_backends: bool = False) -> Path:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    text = (REPO / ".ci" / "run").read_text()
    if fatal_backends:
        assert "guard make test-backends || backends_rc=$?" in text
        text = text.replace("guard make test-backends || backends_rc=$?", "guard make test-backends")
    if unguard_first_stage:
        assert "guard make setup" in text
        text = text.replace("guard make setup", "make setup")
    (repo / ".ci" / "run").write_text(text)
    (repo / ".ci" / "run").chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(FAKE_MAKE)
    (bin_dir / "make").chmod(0o755)
    return repo


def _run(repo: Path, deadline_s: int, slow_stage: str, slow_s: int, fail_stage: str = "") -> tuple[int, float, str]:
    env = dict(os.environ, PATH=f"{repo.parent / 'bin'}:{os.environ['PATH']}", CI_DEADLINE_S=str(deadline_s),
               SLOW_STAGE=slow_stage, SLOW_S=str(slow_s), FAIL_STAGE=fail_stage)
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, time.monotonic() - t0, r.stdout + r.stderr


def _assert_stopped_at_deadline(rc: int, wall: float, out: str, stage: str) -> None:
    assert rc == 124, out
    assert wall < 5, f"ran {wall:.0f} s with a 2-s deadline\n{out}"
    assert f"reached: stopped make {stage}" in out, out
    assert f"make {stage} (FAILED, exit 124)" in out and "total" in out, out  # the stage table still closes it


def test_a_stage_running_at_the_deadline_is_stopped_and_fails_the_run(tmp_path):
    assert shutil.which("timeout"), "GNU timeout (coreutils) is what .ci/run's guard uses"
    repo = _ci_copy(tmp_path)
    rc, wall, out = _run(repo, deadline_s=2, slow_stage="setup", slow_s=60)
    _assert_stopped_at_deadline(rc, wall, out, "setup")
    # a later stage too (make test, after the demo): the earlier stages ran, the rest are not started
    rc, wall, out = _run(repo, deadline_s=2, slow_stage="test", slow_s=60)
    _assert_stopped_at_deadline(rc, wall, out, "test")
    assert "make test-backends" not in out.split("reached: stopped make test")[1].split("stage times")[0], out


def test_a_run_within_the_deadline_passes(tmp_path):
    rc, wall, out = _run(_ci_copy(tmp_path), deadline_s=600, slow_stage="test", slow_s=1)
    assert rc == 0 and "deadline" not in out.split("stage times")[1], out
    assert all(f"make {s}" in out for s in ("setup", "demo", "test", "test-backends")), out


def test_failed_backend_tests_still_run_make_test_and_fail_the_run(tmp_path):
    """make test-backends runs before make test (a run stopped at the deadline loses the e2e lanes' end, not the
    backends' tests); its failure does not stop make test, and the run fails at the end naming it."""
    _assert_backends_failure_ran_make_test(*_run(_ci_copy(tmp_path), 600, "none", 0, fail_stage="test-backends"))


def _assert_backends_failure_ran_make_test(rc: int, wall: float, out: str) -> None:
    assert rc == 3, out
    assert "make test-backends (FAILED, exit 3)" in out and "=== [ci] make test (" in out, out
    assert out.index("=== [ci] make test-backends (") < out.index("=== [ci] make test ("), out
    assert "make test-backends failed (exit 3)" in out, out


def test_planted_fault_fatal_backend_tests_skip_make_test(tmp_path):
    """Twin: a test-backends failure that ends the script (set -e) leaves make test unrun: the check above fails."""
    r = _run(_ci_copy(tmp_path, fatal_backends=True), 600, "none", 0, fail_stage="test-backends")
    with pytest.raises(AssertionError):
        _assert_backends_failure_ran_make_test(*r)


def test_planted_fault_unguarded_stage_runs_past_the_deadline(tmp_path):
    """Twin: the first stage without its guard sleeps its full 6 s past a 2-s deadline: the check above fails."""
    repo = _ci_copy(tmp_path, unguard_first_stage=True)
    rc, wall, out = _run(repo, deadline_s=2, slow_stage="setup", slow_s=6)
    with pytest.raises(AssertionError):
        _assert_stopped_at_deadline(rc, wall, out, "setup")
    assert wall >= 6, out
