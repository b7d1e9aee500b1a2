"""tests/conftest.py's guard against global state leaking between test modules: a module that leaves
torch.distributed (or megatron's parallel state) initialized fails at its own teardown, named, and the
state is destroyed so that the next module's ``init_process_group`` works. Without the guard the
next in-process init fails in an unrelated test ("trying to initialize the default process group
twice!"), which is how CI saw it.

Run as a separate pytest on a scratch directory holding a copy of our conftest."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

LEAKS = """
import torch.distributed as dist

def test_leaks_a_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""

NEXT = """
import torch.distributed as dist

def test_next_module_can_init():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
"""


def run_pytest(tmp_path: Path, conftest: bool) -> subprocess.CompletedProcess:
    if conftest:
        shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_a_leaks.py").write_text(textwrap.dedent(LEAKS))
    (tmp_path / "test_b_next.py").write_text(textwrap.dedent(NEXT))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line", "-rA",
                           "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_leaking_module_is_named_and_cleaned_up(tmp_path):
    r = run_pytest(tmp_path, conftest=True)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "left torch.distributed default process group initialized" in out, out
    assert "ERROR test_a_leaks.py::test_leaks_a_group" in out, out
    assert "PASSED test_b_next.py::test_next_module_can_init" in out, out


def test_planted_fault_without_guard_next_module_fails(tmp_path):
    """Twin: without the conftest the leak is not named and the innocent next module fails."""
    r = run_pytest(tmp_path, conftest=False)
    out = r.stdout + r.stderr
    assert "FAILED test_b_next.py::test_next_module_can_init" in out, out
    assert "twice" in out, out
    assert "left torch.distributed" not in out
