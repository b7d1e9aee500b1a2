"""The GPU box's offline environment (dsv3_rl.gpubox): lock -> files -> parts -> check/join/install.

Real pip installs real (tiny, pure-Python) wheels from parts cut small enough that the bundle spans several; the
twins damage or remove one part and must be named, with nothing installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsv3_rl import gpubox

ROOT = Path(__file__).resolve().parents[2]


def _wheel(d: Path, name: str, payload: int) -> Path:
    """A pure-Python wheel whose module says its name and carries PAYLOAD random bytes (incompressible)."""
    di = f"{name}-1.0.dist-info"
    p = d / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr(f"{name}/__init__.py", f"NAME = {name!r}\n")
        z.writestr(f"{name}/blob.bin", os.urandom(payload))
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    return p


@pytest.fixture
def bundle(tmp_path):
    """Three wheels (one in the te group), their lock, and parts of 1 MiB (3.2 MB: four parts)."""
    files = tmp_path / "files"
    files.mkdir()
    lines = []
    for name, size, source in (("alpha_pkg", 1_500_000, "pypi"), ("beta_pkg", 1_200_000, "pypi"),
                               ("gamma_te", 500_000, "te")):
        w = _wheel(files, name, size)
        lines.append(gpubox.Entry(f"{name}==1.0", w.name, gpubox.sha256_file(w), w.stat().st_size, source).line())
    lock = tmp_path / "gpu-box.lock"
    lock.write_text("# test lock\n" + "\n".join(lines) + "\n")
    parts = tmp_path / "parts"
    assert gpubox.split(files, parts, 1.0, lock) == 0
    return tmp_path, lock, parts


def _imports(site: Path, module: str) -> str:
    r = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.NAME)"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(site)}, cwd="/")
    return r.stdout.strip()


def test_split_check_install_round_trip(bundle, capsys):
    tmp, lock, parts = bundle
    m = json.loads((parts / gpubox.MANIFEST).read_text())
    assert len(m["parts"]) >= 3 and [p["name"] for p in m["parts"]][:2] == ["part001", "part002"]
    assert gpubox.check_parts(parts)["total_sha256"] == m["total_sha256"]
    target = tmp / "env"
    assert gpubox.install(parts, target) == 0
    assert _imports(target / "site", "alpha_pkg") == "alpha_pkg" and _imports(target / "site", "beta_pkg") == "beta_pkg"
    assert _imports(target / "te", "gamma_te") == "gamma_te"
    assert _imports(target / "site", "gamma_te") == ""  # TE only where asked for
    assert not (target / "files").exists() and not target.with_name("env.staging").exists()
    assert json.loads((target / "DONE.json").read_text())["files"] == 3
    assert gpubox.install(parts, target) == 0  # a second install of the same bundle: nothing to do
    assert "already holds this bundle" in capsys.readouterr().out


@pytest.mark.parametrize("fault", ["missing", "truncated", "flipped"])
def test_a_missing_or_damaged_part_is_named_and_nothing_is_installed(bundle, fault):
    tmp, lock, parts = bundle
    p = parts / "part002"
    if fault == "missing":
        p.unlink()
    elif fault == "truncated":
        p.write_bytes(p.read_bytes()[:-10])
    else:
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 1
        p.write_bytes(bytes(b))
    with pytest.raises(gpubox.GpuBoxError) as e:
        gpubox.install(parts, tmp / "env")
    msg = str(e.value)
    assert "part002 is " + ("missing" if fault == "missing" else "damaged") in msg and "nothing was installed" in msg
    assert "part001" not in msg and "part003" not in msg  # only the bad one is named
    assert not (tmp / "env").exists() and not (tmp / "env.staging").exists()


def test_cli_names_the_bad_part_in_one_line_exit_2(bundle):
    tmp, lock, parts = bundle
    (parts / "part001").unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for cmd in (["check", str(parts)], ["install", str(parts), "--target", str(tmp / "env")]):
        r = subprocess.run([sys.executable, "-m", "dsv3_rl.gpubox", *cmd], capture_output=True, text=True, env=env)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "part001 is missing" in lines[0], r.stderr
    assert not (tmp / "env").exists()


def test_split_refuses_files_that_differ_from_the_lock(bundle):
    tmp, lock, parts = bundle
    with pytest.raises(gpubox.GpuBoxError, match="exists"):  # never mix two bundles' parts in one directory
        gpubox.split(tmp / "files", parts, 1.0, lock)
    assert gpubox.split(tmp / "files", tmp / "parts2", 1.0, lock) == 0  # twin: a new directory
    w = next((tmp / "files").glob("beta_pkg-*.whl"))
    w.write_bytes(w.read_bytes() + b"x")
    with pytest.raises(gpubox.GpuBoxError, match=r"beta_pkg-1.0-py3-none-any.whl: \d+ bytes, the lock says"):
        gpubox.split(tmp / "files", tmp / "parts3", 1.0, lock)
    assert not (tmp / "parts3").exists()


def test_the_repo_lock_reads_and_holds_what_the_box_needs():
    """scripts/gpu-box.lock: one version of each package; vLLM and Ray at verl 0.9.1's GPU pins; the two pins the box
    needed beyond vLLM's metadata; transformers at verl's range; cupy for verl's nccl checkpoint engine resolved but left to the image; TE; none of the
    excluded heavy packages."""
    entries = gpubox.read_lock()
    by = {e.name: e for e in entries}
    assert by["vllm"].spec == "vllm==0.24.0" and by["ray"].spec == "ray==2.60.0"
    assert by["xgrammar"].spec == "xgrammar==0.2.3" and by["openai"].spec.startswith("openai==2.")
    assert by["transformers"].spec == "transformers==5.10.4" and by["pydantic"].spec == "pydantic==2.14.4"
    assert {"transferqueue", "math-verify", "hydra-core", "tensordict", "torchdata"} <= set(by)
    assert by["antlr4-python3-runtime"].source == "sdist"
    # cupy, for verl's nccl checkpoint engine (patch 0042), is resolved and left to the box's image (14.2.0)
    assert "cupy-cuda13x" not in by and "cupy-cuda13x" in gpubox.LOCK.read_text().split("carried", 1)[1].split("\n", 2)[1]
    assert {e.name for e in entries if e.source == "te"} == {"transformer-engine-cu13", "transformer-engine",
                                                             "transformer-engine-torch"}
    assert not set(by) & {gpubox._norm(n) for n in gpubox.EXCLUDED}


def test_a_lock_with_a_package_twice_is_refused(tmp_path):
    e = gpubox.Entry("foo==1.0", "foo-1.0-py3-none-any.whl", "0" * 64, 1)
    p = tmp_path / "lock"
    p.write_text(e.line() + "\n" + gpubox.Entry("Foo==2.0", "Foo-2.0-py3-none-any.whl", "1" * 64, 1).line() + "\n")
    with pytest.raises(gpubox.GpuBoxError, match="foo is locked twice"):
        gpubox.read_lock(p)
    p.write_text(e.line() + "\n")  # twin: once is fine
    assert [x.spec for x in gpubox.read_lock(p)] == ["foo==1.0"]
