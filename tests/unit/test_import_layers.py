"""The package's import layers and its freedom from import cycles (docs/architecture.md, issue 42): ``lint-imports``
with the contracts of pyproject.toml ``[tool.importlinter]`` passes on the tree, and fails on a scratch copy of the
package with one upward import, or one import cycle, planted (function-level, as a hidden import would be).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on the dsv3_rl under ROOT with ROOT's pyproject.toml (only CONTRACTS, by id, if given)."""
    assert LINT_IMPORTS.is_file(), f"{LINT_IMPORTS} is missing: `make setup` installs import-linter"
    argv = [str(LINT_IMPORTS), "--no-cache", "--no-logo", *(f"--contract={c}" for c in contracts)]
    env = {**os.environ, "PYTHONPATH": str(root)}  # this tree's dsv3_rl, not the installed one
    return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def scratch_copy(tmp_path: Path) -> Path:
    """A copy of the package and the contracts to plant a fault in."""
    shutil.copytree(REPO / "dsv3_rl", tmp_path / "dsv3_rl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(path: Path, text: str) -> None:
    """Append a function that imports TEXT: a function-level import, which counts as an import."""
    with path.open("a") as f:
        f.write(f"\n\ndef _planted():\n    {text}\n")


def test_lint_imports_passes_on_the_tree():
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    for contract in ("imports only downwards", "stand alone", "No import cycle"):
        assert contract in out.stdout, out.stdout
    assert "broken" in out.stdout and " 0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize("module, text, says", [
    # the planner (a tool) importing the launcher: the layers contract names the import and its line
    ("planner/search.py", "from dsv3_rl.launch import run  # noqa: F401",
     "dsv3_rl.planner is not allowed to import dsv3_rl.launch"),
    # the foundation importing a tool
    ("errors.py", "from dsv3_rl.grpo import checks  # noqa: F401",
     "dsv3_rl.errors is not allowed to import dsv3_rl.grpo"),
    # two tools of one row that must not know each other
    ("grpo/checks.py", "from dsv3_rl.planner import spec  # noqa: F401",
     "dsv3_rl.grpo is not allowed to import dsv3_rl.planner"),
])
def test_an_upward_import_fails_lint_imports(tmp_path, module, text, says):
    """Twin of the test above: the same contracts on a copy with one import that goes up (or sideways)."""
    root = scratch_copy(tmp_path)
    assert lint_imports(root).returncode == 0  # the copy passes as the tree does
    plant(root / "dsv3_rl" / module, text)
    out = lint_imports(root, "layers")
    assert out.returncode != 0, out.stdout
    assert "BROKEN" in out.stdout and says in out.stdout, out.stdout


@pytest.mark.parametrize("module, text, says", [
    # the cycle issue 42 found at the ground floor: errors importing cliargs back
    ("errors.py", "from dsv3_rl.cliargs import env_flag  # noqa: F401", "No cycles are allowed in dsv3_rl."),
    # a module cycle inside one package (planner.spec <- ... <- planner.search)
    ("planner/spec.py", "from dsv3_rl.planner.search import plan  # noqa: F401",
     "No cycles are allowed in dsv3_rl.planner."),
])
def test_a_planted_import_cycle_is_found(tmp_path, module, text, says):
    """The acyclic contract on its own finds a cycle made by one function-level import, at package and module level."""
    root = scratch_copy(tmp_path)
    plant(root / "dsv3_rl" / module, text)
    out = lint_imports(root, "acyclic")
    assert out.returncode != 0, out.stdout
    assert says in out.stdout, out.stdout
