"""The README's toolkit commands work as written from a fresh shell: the shell wrappers under toolkits/ find
the project's .venv when no virtualenv is active (a bare `python` on PATH has no torch)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONVERT_SH = REPO / "toolkits/distributed_checkpoints_convertor/scripts/deepseek_v3/run_32xH20.sh"


def _hf_dir(tmp_path: Path) -> Path:
    cfg = json.loads((REPO / "tests/assets/deepseek_v3_config.json").read_text())
    cfg.pop("quantization_config")  # as the FP8 -> BF16 cast leaves it
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _fresh_shell(*args, **env) -> subprocess.CompletedProcess:
    """bash with the environment of a new login: no virtualenv, no venv on PATH."""
    return subprocess.run(["bash", str(CONVERT_SH), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "DRY_RUN": "1", **env}, cwd="/")


def test_convert_wrapper_finds_the_project_venv(tmp_path):
    r = _fresh_shell("A37B", _hf_dir(tmp_path), tmp_path / "mc", "false", "false", "bf16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"would run: {REPO}/.venv/bin/python -m dsv3_rl.convert hf-to-mcore" in r.stdout


def test_convert_wrapper_keeps_an_explicit_python(tmp_path):
    """Twin: PYTHON set by the caller wins (here one that cannot run anything, so the wrapper fails)."""
    r = _fresh_shell("A37B", _hf_dir(tmp_path), tmp_path / "mc", "false", "false", "bf16", PYTHON="/bin/false")
    assert r.returncode != 0 and "would run" not in r.stdout
