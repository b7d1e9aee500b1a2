"""Nothing lost (issue 28): every check that CI ran before the suite was split into fast and slow tests is still
collected. ``tests/assets/ci-checks.txt`` lists the node ids of ``tests/unit`` as they were collected on
2026-11-26 before the split (1245 tests, 105 of them planted-fault twins by name: ``fault``, ``twin`` or
``planted``; 4 renamed on purpose since, docs/ci-history.md); a test that disappears from collection (deleted, renamed, or its file no longer imports) fails here,
named. New tests are welcome and need no entry. A deliberate rename or removal updates the manifest in the same
change (``python tests/unit/test_ci_manifest.py --write`` rewrites it from the current collection; the diff shows
what went). ``make test`` runs selections (``-m "not e2e"`` under xdist, then ``-m e2e``) that together take
every test exactly once (test_make_test_runs_every_test_once), so what is collected
is what CI runs.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "tests" / "assets" / "ci-checks.txt"
TWIN = re.compile(r"fault|twin|planted", re.IGNORECASE)
HEADER = """\
# The checks CI runs: every test node id of tests/unit (`make test` runs them all: `-m "not slow"`, then
# `-m "slow and not e2e"` under xdist, then `-m e2e`). tests/unit/test_ci_manifest.py fails when one of these is no longer collected. New tests need
# no entry; a deliberate rename/removal rewrites this file: python tests/unit/test_ci_manifest.py --write
"""


@functools.lru_cache(maxsize=4)  # one collection for this file's tests (xdist's loadfile keeps them in one process)
def collected(paths: tuple[str, ...] = ("tests/unit",)) -> tuple[list[str], str]:
    """(node ids, pytest's output) of a collect-only run, in a fresh process (this session may run a subset)."""
    r = subprocess.run([sys.executable, "-m", "pytest", *paths, "--collect-only", "-q", "-p", "no:cacheprovider"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(("ERROR", "FAILED"))]
    return ids, r.stdout + r.stderr


def read_manifest(path: Path = MANIFEST) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def missing(manifest: list[str], now: list[str]) -> list[str]:
    have = set(now)
    return [i for i in manifest if i not in have]


@pytest.mark.slow  # 10-26 s on 2 cores: out of the developer loop (make test-fast < 5 min, issue 28)
def test_every_manifest_check_is_still_collected():
    listed = read_manifest()
    now, out = collected()
    gone = missing(listed, now)
    twins = [i for i in gone if TWIN.search(i)]
    assert not gone, (f"{len(gone)} of the {len(listed)} checks in {MANIFEST.relative_to(REPO)} are no longer collected "
                      f"({len(twins)} planted-fault twins among them): {gone[:40]}\n--- pytest --collect-only:\n"
                      f"{out[-3000:]}")
    assert sum(bool(TWIN.search(i)) for i in now) >= sum(bool(TWIN.search(i)) for i in listed)


def make_test_selections() -> list[str]:
    """The ``-m`` expressions of the pytest commands that ``make test`` runs (from ``make -n``: printed, not run;
    an out-of-date setup's commands are printed too, and have no pytest ``-m``)."""
    r = subprocess.run(["make", "-n", "-s", "test"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    found = [re.findall(r' -m (?:"([^"]+)"|(\w+))', lanes_taken(line).replace("-m pytest", ""))
             for line in r.stdout.splitlines() if "-m pytest" in line]
    return [quoted or bare for per_line in found for quoted, bare in per_line]


def lanes_taken(line: str) -> str:
    """A line of ``make -n test`` with the e2e phase's ``if [ "$(E2E_LANES)" = 2 ] ... else ... fi`` (printed
    whole) reduced to the branch that runs, its echo dropped, and its two lanes counted as one selection: lane 1
    is every test of the selection that lane 2 is not (tests/conftest.py ``e2e_lane``), so the two together take
    the selection once; both lanes must be there."""
    m = re.search(r'if \[ "(\d+)" = 2 \]; then (.*?); else (.*?); fi', line)
    if not m:
        return line
    branch = m.group(2) if m.group(1) == "2" else m.group(3)
    branch = re.sub(r'echo "[^"]*"', "echo", branch)
    if "--e2e-lane" in branch:
        lanes = re.findall(r"--e2e-lane (\d)/2", branch)
        assert sorted(lanes) == ["1", "2"], f"the e2e phase runs lanes {lanes} of 2: {branch}"
        branch = re.sub(r' -m (?:"[^"]+"|\w+)( --e2e-lane 2/2)', r"\1", branch)
    return line[: m.start()] + branch + line[m.end():]


def once_each(selections: list[str], markers: tuple[str, ...] = ("slow", "e2e")) -> list[str]:
    """Marker combinations (e2e implies slow, tests/conftest.py) that the selections take never or twice."""
    from _pytest.mark.expression import Expression

    combos = [set(), {"slow"}, {"slow", "e2e"}] + [{m} for m in markers if m not in ("slow", "e2e")]
    bad = []
    for marks in combos:
        n = sum(bool(Expression.compile(e).evaluate(lambda name, _m=marks, **kw: name in _m)) for e in selections)
        if n != 1:
            bad.append(f"{sorted(marks) or 'unmarked'}: selected {n} times by {selections}")
    return bad


def test_make_test_runs_every_test_once():
    sel = make_test_selections()
    assert len(sel) >= 2, sel
    assert once_each(sel) == [], sel


def test_twin_selections_that_drop_or_repeat_tests_are_named():
    assert once_each(["not slow", "e2e"]) == ["['slow']: selected 0 times by ['not slow', 'e2e']"]
    assert once_each(["not e2e", "slow"]) == ["['slow']: selected 2 times by ['not e2e', 'slow']"]
    assert once_each(["not e2e", "e2e"]) == [] and once_each(["not slow", "slow and not e2e", "e2e"]) == []


def test_twin_a_dropped_check_is_named():
    """The comparison sees a missing id (a renamed twin), and new ids alone are no loss."""
    listed = ["tests/unit/test_a.py::test_ok", "tests/unit/test_a.py::test_planted_fault[x]"]
    assert missing(listed, ["tests/unit/test_a.py::test_ok", "tests/unit/test_a.py::test_new"]) == [listed[1]]
    assert missing(listed, [*listed, "tests/unit/test_b.py::test_new"]) == []


def test_twin_a_file_that_stops_importing_loses_its_checks(tmp_path):
    """A test file that no longer imports collects nothing: its ids are missing, not silently passed over."""
    (tmp_path / "conftest.py").write_text("")
    (tmp_path / "test_ok.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "test_broken.py").write_text("import no_such_module_here\n\ndef test_two():\n    pass\n")
    ids, _ = collected((str(tmp_path / "test_ok.py"), str(tmp_path / "test_broken.py")))
    names = [i.split("::")[-1] for i in ids]
    assert names == ["test_one"], ids


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit/test_ci_manifest.py --write   (rewrites tests/assets/ci-checks.txt)")
    ids, out = collected()
    if not ids:
        sys.exit(f"nothing collected:\n{out[-3000:]}")
    from dsv3_rl.fs import write_text_atomic

    write_text_atomic(MANIFEST, HEADER + "".join(f"{i}\n" for i in ids))
    print(f"wrote {MANIFEST.relative_to(REPO)}: {len(ids)} checks, {sum(bool(TWIN.search(i)) for i in ids)} twins by name")


# ------------------------------------------------------------------ the editable trees' bytecode (scripts/setup.sh)

def bytecode_sample() -> list[Path]:
    """One module of each editable tree that every GRPO process imports (backend trees as backends.lock names them),
    and two of site-packages (pip installs with --no-compile; setup compiles them)."""
    import importlib.util

    from dsv3_rl.backends import load_lock

    lock = load_lock()
    site = [Path(importlib.util.find_spec(m).origin) for m in ("torch", "transformers")]  # pip installs them uncompiled
    return [lock["megatron-core"].path() / "megatron/core/parallel_state.py", lock["verl"].path() / "verl/protocol.py",
            REPO / "dsv3_rl/errors.py", *site]


def missing_bytecode(files) -> list[Path]:
    """FILES with no compiled bytecode beside them (``__pycache__``), or that do not exist."""
    import importlib.util

    return [f for f in files if not f.is_file() or not Path(importlib.util.cache_from_source(str(f))).is_file()]


def test_setup_compiled_the_editable_trees():
    """`make setup` compiles site-packages, backends/* and dsv3_rl (compileall on every core): pip installs without
    compiling and never compiles an editable tree, and where PYTHONDONTWRITEBYTECODE is set (CI) no process would, so
    each one compiled them again (docs/ci.md)."""
    assert missing_bytecode(bytecode_sample()) == [], "run `make setup` (scripts/setup.sh compiles them)"


def test_twin_a_tree_without_bytecode_is_named(tmp_path):
    (tmp_path / "pkg").mkdir()
    mod, gone = tmp_path / "pkg" / "mod.py", tmp_path / "pkg" / "gone.py"
    mod.write_text("x = 1\n")
    assert missing_bytecode([mod, gone]) == [mod, gone]
    import compileall

    compileall.compile_dir(str(tmp_path / "pkg"), quiet=1)
    assert missing_bytecode([mod]) == []


def files_not_in_suite(names, suite: Path = REPO / "tests" / "unit") -> list[str]:
    return [n for n in names if not (suite / n).is_file()]


def test_longest_files_first_names_files_that_exist():
    """tests/conftest.py LONGEST_FILES orders `make test`'s xdist phase; a renamed file would silently lose its rank."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from conftest import LONGEST_FILES
    finally:
        sys.path.pop(0)
    assert files_not_in_suite(LONGEST_FILES) == []
    assert files_not_in_suite(["test_convert.py", "test_renamed_away.py"]) == ["test_renamed_away.py"]  # twin


def _lanes():
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from conftest import E2E_LANE_2, e2e_lane
    finally:
        sys.path.pop(0)
    return E2E_LANE_2, e2e_lane


@pytest.mark.slow  # the whole suite's collection (~17 s on 2 cores), as the test above: out of make test-fast
def test_e2e_lanes_split_the_e2e_tests_and_name_tests_that_exist():
    """`make test` runs the e2e tests in two lanes side by side (tests/conftest.py): lane 2 is what E2E_LANE_2
    names, lane 1 everything else. Each name must match a collected test (else lane 2 shrinks unseen and lane 1
    runs alone for longer); a test no name matches runs in lane 1, never in neither (twin below)."""
    lane_2, e2e_lane = _lanes()
    now, out = collected()
    assert [p for p in lane_2 if not any(i.startswith(p) for i in now)] == [], out[-3000:]
    assert e2e_lane("tests/unit/test_algorithm_demos.py::test_algorithm_demo_learns[tiny_cpu_one_step_off_gspo]") == 2
    assert e2e_lane("tests/unit/test_algorithm_demos.py::test_killed_engine_restarts_the_one_step_off_run") == 2
    # the fault chain with the resume test, and the DAPO run at PP2 with its R3 test, each stay in one lane with the
    # tests that share their fixtures (else both lanes would launch them)
    assert e2e_lane("tests/unit/test_launch_faults.py::test_killed_worker_and_truncated_checkpoint_end_passed") == 1
    assert e2e_lane("tests/unit/test_grpo_learning.py::test_interrupted_run_resumes_and_matches_an_uninterrupted_one") == 1
    assert e2e_lane("tests/unit/test_grpo_learning.py::test_sound_short_run_passes") == 1
    assert e2e_lane("tests/unit/test_algorithm_demos.py::test_algorithm_demo_learns[tiny_cpu_dapo_pp2]") == 2
    assert e2e_lane("tests/unit/test_algorithm_demos.py::test_r3_router_replay_at_pp2") == 2


def test_twin_an_unnamed_e2e_test_runs_in_lane_1_and_a_lone_lane_is_named():
    _, e2e_lane = _lanes()
    assert e2e_lane("tests/unit/test_new_grpo_run.py::test_it_learns") == 1  # not dropped: lane 1 takes it
    one_lane = ('if [ "2" = 2 ]; then echo "x"; .venv/bin/python -m pytest tests/unit -m e2e --e2e-lane 2/2 > l & p=$!; '
                'wait $p; else .venv/bin/python -m pytest tests/unit -m e2e; fi')
    try:
        lanes_taken(one_lane)
    except AssertionError as e:
        assert "lanes ['2'] of 2" in str(e)
    else:
        raise AssertionError("a make test that runs lane 2/2 alone was not named")
    both = one_lane.replace("wait $p;", ".venv/bin/python -m pytest tests/unit -m e2e --e2e-lane 1/2; wait $p;")
    assert once_each(["not e2e", *re.findall(r" -m (\w+)", lanes_taken(both).replace("-m pytest", ""))]) == []
    # twin: the two lanes read as two selections take the e2e tests twice
    assert once_each(["not e2e", *re.findall(r" -m (\w+)", both.replace("-m pytest", ""))]) != []
