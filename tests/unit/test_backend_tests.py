"""dsv3_rl.backend_tests: which upstream test files need Ray, and the runner that groups the others.

The split decides which files share one pytest-xdist process (no Ray) and which get a process of their
own, after which its own Ray is stopped (Ray). Each property is a ``_check_*`` run against the real code (must pass)
and against a planted-fault twin (must fail). References are independent of the AST classifier: a
regex over the file's text for verl's tree, hand-written expectations for the synthetic sources, and
hand-written test ids for the runner (the ids a one-file-per-process pytest run gives, i.e. the
baseline's form).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsv3_rl import backend_tests as bt
from dsv3_rl.backends import BackendError, load_lock
from dsv3_rl.procs import processes_with


def _fails(check, *args) -> None:
    """The planted-fault twin: CHECK must reject it."""
    with pytest.raises(AssertionError):
        check(*args)


# --------------------------------------------------------------------------- the classifier

STARTS_RAY = {
    "import ray\n": "imports ray",
    "import ray.util.collective as col\n": "imports ray.util.collective",
    "from ray.util import ActorPool\n": "imports ray.util",
    "from verl.single_controller.ray.base import RayWorkerGroup\n": "imports verl.single_controller.ray.base",
    "from verl.single_controller import ray as vray\n": "imports verl.single_controller.ray",
    # hidden from an import scan: only the call shows it
    "import importlib\nray = importlib.import_module('ray')\n\ndef test_x():\n    ray.init(num_cpus=1)\n":
        "calls ray.init",
    "def test_x(ray_init_shutdown):\n    pass\n": "test_x() takes the fixture ray_init_shutdown",
    "def test_x(tmp_path, init_ray):\n    pass\n": "test_x() takes the fixture init_ray",
    "import pytest\n\n@pytest.mark.usefixtures('ray_start_regular')\ndef test_x():\n    pass\n":
        "uses the fixture ray_start_regular",
    "def test_x(:\n    pass\n": "does not parse: invalid syntax, line 1",
}
NO_RAY = [
    "import numpy as np\n\ndef test_array(tray):\n    assert np.array_equal([1], [1])\n",
    # verl's ray_trainer / constants_ppo import Ray's package but start no cluster
    "from verl.trainer.ppo.ray_trainer import compute_spec_decode_metrics\n",
    "from verl.trainer.constants_ppo import get_ppo_ray_runtime_env\n\ndef test_env():\n"
    "    get_ppo_ray_runtime_env({})\n",
    '"""Checked without Ray (which would need ray.init and workers)."""\n# import ray\n\ndef test_x():\n    pass\n',
    "from verl.utils.array_utils import x\n",
]


def _check_classifies(classify) -> None:
    for src, why in STARTS_RAY.items():
        assert classify(src) == why, src
    for src in NO_RAY:
        assert classify(src) is None, src


def _twin_imports_only(src: str) -> str | None:  # sees `import ray` lines only
    return "imports ray" if re.search(r"^\s*(import|from) ray\b", src, re.M) else None


def _twin_substring(src: str) -> str | None:  # any "ray" in the text (ray_trainer, np.array)
    return "mentions ray" if "ray" in src else None


def test_needs_ray_sees_every_way_a_file_starts_ray():
    _check_classifies(bt.needs_ray)
    _fails(_check_classifies, _twin_imports_only)
    _fails(_check_classifies, _twin_substring)


VERL = load_lock()["verl"].path()
# independent of the AST: the statements that bring Ray into a test file, as text
_RAY_TEXT = re.compile(r"^\s*(import ray\b|from ray\b)|\bray\.init\(|single_controller\.ray\b", re.M)


def _check_verl_split(classify, monkeypatch) -> None:
    files = sorted((VERL / "tests").rglob(bt.PATTERN))
    assert len(files) >= 20, f"{VERL}/tests has {len(files)} {bt.PATTERN} files"
    expected_alone = {f for f in files if _RAY_TEXT.search(f.read_text())}
    with monkeypatch.context() as m:
        m.setattr(bt, "needs_ray", classify)
        together, alone = bt.split_files(VERL, files)
    assert {f for f, _, ray in alone if ray} == expected_alone
    assert {f for f, _, ray in alone if not ray} == {VERL / r for r in bt.RUN_ALONE} - expected_alone
    assert set(together) == set(files) - {f for f, *_ in alone}
    assert len(together) >= len(files) // 2  # the point of the split: most files share a process
    assert [f for f, *_ in alone] == sorted(f for f, *_ in alone) and together == sorted(together)


def test_verl_files_that_start_ray_run_alone(monkeypatch):
    _check_verl_split(bt.needs_ray, monkeypatch)
    _fails(_check_verl_split, lambda src: None, monkeypatch)  # a ray.init file put into the shared process
    _fails(_check_verl_split, _twin_substring, monkeypatch)  # every file alone: no speed-up


# --------------------------------------------------------------------------- the runner

FILES = {
    "tests/__init__.py": "",
    "tests/sub/__init__.py": "",
    "tests/a_on_cpu.py": "def test_a1():\n    pass\n\ndef test_a2():\n    pass\n\n"
                         "def test_a3():\n    assert False, 'planted failure'\n",
    "tests/sub/b_on_cpu.py": "import pytest\n\nclass TestB:\n    def test_b(self):\n        pass\n\n"
                             "    @pytest.mark.parametrize('n', [1, 2])\n    def test_p(self, n):\n        pass\n",
    # a file that cannot be imported must not stop the other files of its process
    "tests/broken_on_cpu.py": "raise ImportError('planted collection error')\n",
    # named as a Ray file (its fixture) but starts none: runs alone, its Ray stopped after it
    "tests/sub/c_on_cpu.py": "import pytest\n\n@pytest.fixture\ndef ray_init_shutdown():\n    yield\n\n"
                             "def test_c(ray_init_shutdown):\n    pass\n",
    # in RUN_ALONE (the test sets it): alone, no Ray stop after it
    "tests/sub/d_on_cpu.py": "def test_d():\n    pass\n",
    "tests/not_a_cpu_test.py": "def test_never_collected():\n    pass\n",
}
PASSED = {"tests.a_on_cpu::test_a1", "tests.a_on_cpu::test_a2", "tests.sub.b_on_cpu.TestB::test_b",
          "tests.sub.b_on_cpu.TestB::test_p[1]", "tests.sub.b_on_cpu.TestB::test_p[2]", "tests.sub.c_on_cpu::test_c",
          "tests.sub.d_on_cpu::test_d"}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _run(tmp_path: Path, files: dict[str, str], monkeypatch) -> tuple[set[str], set[str], list[str]]:
    stops = []
    monkeypatch.setattr(bt, "_ray_stop", lambda ray_tmp: stops.append(ray_tmp))  # a fake Ray file starts none
    monkeypatch.setattr(bt, "RUN_ALONE", {"tests/sub/d_on_cpu.py": "planted reason"})
    src = _tree(tmp_path / "src", files)
    (tmp_path / "jobs").mkdir()
    passed, failed = bt.run_suite(src, src, tmp_path / "jobs")
    return passed, failed, stops


def test_runner_groups_files_and_keeps_one_process_ids(tmp_path, monkeypatch, capsys):
    passed, failed, stops = _run(tmp_path, FILES, monkeypatch)
    out = capsys.readouterr().out
    assert passed == PASSED
    assert failed == {"tests.a_on_cpu::test_a3", "::tests.broken_on_cpu"}  # the latter: its collection error
    assert len(stops) == 1, "Ray stopped after the one Ray file only (not after the group, not after d)"
    assert "3 files without Ray: 5 passed, 2 failed" in out, out
    for line in ("tests/a_on_cpu.py: 2 passed, 1 failed", "tests/broken_on_cpu.py: 0 passed, 1 failed",
                 "tests/sub/b_on_cpu.py: 3 passed, 0 failed"):
        assert f"[backend-tests]   {line}\n" in out, out
    assert re.search(r"1/2 alone \(test_c\(\) takes the fixture ray_init_shutdown\) tests/sub/c_on_cpu.py: "
                     r"1 passed, 0 failed", out), out
    assert re.search(r"2/2 alone \(planted reason\) tests/sub/d_on_cpu.py: 1 passed, 0 failed", out), out
    assert re.search(r"5 files in \d+s \(3 in one xdist session, 2 alone: 1 with Ray", out), out


def test_runner_fails_when_a_file_run_without_ray_starts_ray(tmp_path, monkeypatch):
    # planted: a file whose source hides that it starts Ray; it leaves a session where Ray would
    sneaky = ("import os, pathlib\n\ndef test_s():\n    d = os.environ.get('RAY_TMPDIR')\n"
              "    assert d, 'the shared process runs without a private RAY_TMPDIR'\n"
              "    (pathlib.Path(d) / 'ray' / 'session_2026-11-26_00-00-00_000000_1').mkdir(parents=True)\n")
    assert bt.needs_ray(sneaky) is None
    with pytest.raises(BackendError, match=r"a test file run without Ray started a Ray session .*session_2026"):
        _run(tmp_path, {**FILES, "tests/sneaky_on_cpu.py": sneaky}, monkeypatch)


def test_ray_itself_puts_its_session_where_the_guard_looks(tmp_path, monkeypatch):
    """The guard relies on Ray honouring RAY_TMPDIR: start a real (one-CPU) Ray from a hidden import
    (10 s on the 2-core box)."""
    sneaky = ("import importlib\n\ndef test_s():\n    r = importlib.import_module('ra' + 'y')\n"
              "    r.init(num_cpus=1, include_dashboard=False)\n    r.shutdown()\n")
    assert bt.needs_ray(sneaky) is None
    with pytest.raises(BackendError, match="started a Ray session"):
        _run(tmp_path, {"tests/__init__.py": "", "tests/sneaky_on_cpu.py": sneaky}, monkeypatch)


def test_a_ray_file_s_leftover_ray_is_stopped_and_no_other(tmp_path):
    """A Ray file that dies without ray.shutdown() leaves processes behind: the runner kills every process
    carrying that file's private RAY_TMPDIR, and nothing else: a process of another Ray (another RAY_TMPDIR: a GRPO
    run or another file beside it) lives on (twin; `ray stop --force` stopped it). A real one-CPU Ray, ~10 s."""
    # Ray's own leftovers die within ~2 s of their driver here; the detached sleeper stands for one that does not
    dying = ("import os\nimport subprocess\nimport sys\nimport ray\n\ndef test_dies_with_ray_up():\n"
             "    ray.init(num_cpus=1, include_dashboard=False)\n"
             "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
             "    os._exit(0)\n")
    src = _tree(tmp_path / "src", {"tests/__init__.py": "", "tests/dying_on_cpu.py": dying})
    jobs = Path(tempfile.mkdtemp(prefix="bt-", dir="/tmp"))  # short, as main()'s: Ray's socket paths live under it
    other = tmp_path / "other-ray"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 env={**os.environ, "RAY_TMPDIR": str(other)})
    try:
        # the file died inside its test (no report), after its Ray was up under its private RAY_TMPDIR
        assert bt.run_suite(src, src, jobs) == (set(), set())
        ours = jobs / "r1"
        assert list(ours.glob("ray/session_2*/sockets/raylet")), "the file's Ray did not come up under its RAY_TMPDIR"
        assert processes_with(f"RAY_TMPDIR={ours}") == []
        assert processes_with(f"RAY_TMPDIR={other}") == [bystander.pid] and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        shutil.rmtree(jobs, ignore_errors=True)
