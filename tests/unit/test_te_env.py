"""Transformer Engine beside torch (``dsv3_rl.mcore.te_env``), on CPU with fakes: megatron-core's TE pin read
from megatron-core itself (accepts 2.11, refuses 2.12: the twin), and the one-cuDNN-per-process check: the
/proc/self/maps parser, torch's compatibility rule, the pin that points TE at torch's cuDNN, and a real
process that maps two fake libcudnn builds (9.19 as torch's, 9.14 as TE's), where the mismatch MUST be
reported in one line naming both versions (the GPU box's crash of issue 26), beside its one-cuDNN twin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest

from dsv3_rl.backends import load_lock
from dsv3_rl.mcore import te_env

MCORE = load_lock()["megatron-core"]
assert MCORE.path().exists(), f"{MCORE.path()} is missing: megatron-core is not fetched; run `make setup`"


def _pin_from_pyproject() -> str:
    """The independent reference: megatron-core's own pyproject.toml, read directly."""
    data = tomllib.loads((MCORE.path() / "pyproject.toml").read_text())
    reqs = [r for extra in data["project"]["optional-dependencies"].values() for r in extra
            if r.startswith("transformer-engine")]
    assert reqs, "megatron-core's pyproject.toml names no transformer-engine requirement"
    return reqs[0]


# --------------------------------------------------------------------------- TE version


def test_mcore_te_pin_is_read_from_megatron_core():
    spec, where = te_env._mcore_te_requirement()
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(spec) == Requirement(_pin_from_pyproject()).specifier, (spec, where)
    assert "megatron-core" in where


def test_mcore_te_pin_from_pyproject_when_only_on_pythonpath(monkeypatch):
    def no_metadata(name):
        raise te_env.md.PackageNotFoundError(name)

    monkeypatch.setattr(te_env.md, "requires", no_metadata)
    spec, where = te_env._mcore_te_requirement()
    assert where.endswith("pyproject.toml") and spec, (spec, where)


@pytest.mark.parametrize("version,accepted", [("2.11.0", True), ("2.9.0", True), ("2.9.0rc1", True),
                                              ("2.12.0", False), ("2.8.0", False), ("2.12.0.dev0", False)])
def test_te_support_follows_the_pin(version, accepted):
    s = te_env.te_support(version)
    assert s.accepted is accepted, s.line
    assert version in s.line and ("NOT accepted" in s.line) is (not accepted), s.line


def test_te_support_not_installed_and_installed_version(monkeypatch):
    monkeypatch.setattr(te_env, "installed_te_version", lambda: None)
    s = te_env.te_support()
    assert s.accepted is None and "not installed" in s.line
    monkeypatch.setattr(te_env, "installed_te_version", lambda: "2.12.1")  # the planted fault: outside the pin
    s = te_env.te_support()
    assert s.accepted is False and "NOT accepted" in s.line and "2.12.1" in s.line


def test_te_only_cli_line(capsys, monkeypatch):
    monkeypatch.setattr(te_env, "installed_te_version", lambda: "2.11.0")
    assert te_env.main(["--te-only"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("Transformer Engine 2.11.0: accepted by megatron-core"), out


# --------------------------------------------------------------------------- cuDNN


MAPS = textwrap.dedent("""\
    7f0000000000-7f0000100000 r-xp 00000000 08:01 11 /venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
    7f0000100000-7f0000200000 r--p 00100000 08:01 11 /venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
    7f0000200000-7f0000300000 r-xp 00000000 08:01 12 /venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn_graph.so.9
    7f0000300000-7f0000400000 r-xp 00000000 08:01 13 /usr/local/cuda/lib64/libcudnn.so.9.14.0
    7f0000400000-7f0000500000 rw-p 00000000 00:00 0
    7f0000500000-7f0000600000 r-xp 00000000 08:01 14 /usr/lib/libcudnnfoo.so
    """)
TORCH_LIB = "/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9"
TE_LIB = "/usr/local/cuda/lib64/libcudnn.so.9.14.0"


def test_maps_parser_finds_each_front_library_once():
    assert te_env.mapped_cudnn_libs(MAPS) == [TORCH_LIB, TE_LIB]
    assert te_env.mapped_cudnn_libs("") == []


@pytest.mark.parametrize("loaded,ok", [
    ([(TORCH_LIB, (9, 19, 0))], True),
    ([(TORCH_LIB, (9, 20, 1))], True),                       # newer minor: torch's rule accepts it
    ([(TE_LIB, (9, 14, 0))], False),                         # older minor
    ([(TORCH_LIB, (9, 19, 0)), (TE_LIB, (9, 14, 0))], False),  # the GPU box: two cuDNNs
    ([(TORCH_LIB, (9, 19, 0)), (TE_LIB, (9, 20, 0))], False),  # two, each fine alone
    ([(TE_LIB, (8, 9, 7))], False),                          # other major
    ([(TE_LIB, None)], False),                               # version unreadable
])
def test_cudnn_report_rule(loaded, ok):
    r = te_env.cudnn_report((9, 19, 0), loaded, "2.11.0+cu130", "/venv/nvidia/cudnn/lib", environ={})
    assert r.ok is ok, r.line
    assert "\n" not in r.line
    if not ok:
        assert r.line.startswith("cuDNN mismatch: torch 2.11.0+cu130 was built against cuDNN 9.19.0"), r.line
        assert all(p in r.line for p, _ in loaded)
        assert "export CUDNN_HOME=/venv/nvidia/cudnn/lib" in r.line


def test_cudnn_report_names_the_users_cudnn_home():
    r = te_env.cudnn_report((9, 19, 0), [(TE_LIB, (9, 14, 0))], "2.11", None, environ={"CUDNN_HOME": "/usr/local/cuda"})
    assert not r.ok and "(now CUDNN_HOME=/usr/local/cuda)" in r.line


def test_cudnn_report_without_cudnn_torch():
    assert te_env.cudnn_report(None, [], "2.13.0+cpu").ok


def test_pin_points_te_at_torchs_cudnn():
    env, calls = {}, []
    got = te_env.pin_torch_cudnn(env, TORCH_LIB, modules={}, load=lambda p, mode: calls.append((p, mode)),
                                 purelib="/nonexistent", maps_text="")
    assert got == TORCH_LIB and env == {"CUDNN_HOME": os.path.dirname(TORCH_LIB)}
    assert calls == [(TORCH_LIB, os.RTLD_GLOBAL)]
    env = {"CUDNN_PATH": "/opt/cudnn"}  # the user's choice stays (the check reports it if it is wrong)
    te_env.pin_torch_cudnn(env, TORCH_LIB, modules={}, load=lambda p, mode: None, purelib="/nonexistent", maps_text="")
    assert env == {"CUDNN_PATH": "/opt/cudnn"}
    env = {}  # too late: TE already imported
    assert te_env.pin_torch_cudnn(env, TORCH_LIB, modules={"transformer_engine": object()}, load=None) is None
    assert env == {}


def test_one_entry_per_cudnn_directory():
    assert te_env.cudnn_by_directory(MAPS) == [TORCH_LIB, TE_LIB]  # torch's libcudnn_graph joins its front library
    parts_only = MAPS.replace(TE_LIB, "/sp/nvidia/cu13/lib/libcudnn_graph.so.9")
    assert te_env.cudnn_by_directory(parts_only) == [TORCH_LIB, "/sp/nvidia/cu13/lib/libcudnn_graph.so.9"]


def _site(tmp_path, files):
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    return str(tmp_path)


def test_te_python_cudnn_search_order(tmp_path):
    sp = _site(tmp_path, ["nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cu13/lib/libcudnn_graph.so.9", "nvidia/cu13/lib/libnvrtc.so.13"])
    assert te_env.te_python_cudnn_dir(sp) == str(tmp_path / "nvidia/cu13/lib")
    assert te_env.te_python_cudnn_dir(str(tmp_path / "none")) is None


def test_pin_keeps_te_off_a_second_pip_cudnn(tmp_path):
    sp = _site(tmp_path, ["nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cu13/lib/libcudnn.so.9", "nvidia/cu13/lib/libnvrtc.so.13"])
    torch_lib = str(tmp_path / "nvidia/cudnn/lib/libcudnn.so.9")
    env = {}
    te_env.pin_torch_cudnn(env, torch_lib, modules={}, load=lambda p, mode: None, purelib=sp, maps_text="")
    assert env == {"CUDNN_HOME": str(tmp_path / "nvidia/cudnn/lib"), "NVRTC_HOME": str(tmp_path / "nvidia/cu13/lib")}
    env = {"NVRTC_HOME": "/opt/cuda"}  # the user's toolkit stays
    te_env.pin_torch_cudnn(env, torch_lib, modules={}, load=lambda p, mode: None, purelib=sp, maps_text="")
    assert env["NVRTC_HOME"] == "/opt/cuda"
    # the twin: TE's pip search finds torch's own directory -> nothing more to do
    sp2 = _site(tmp_path / "b", ["nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cu13/lib/libnvrtc.so.13"])
    env = {}
    te_env.pin_torch_cudnn(env, str(tmp_path / "b/nvidia/cudnn/lib/libcudnn.so.9"), modules={}, load=lambda p, mode: None,
                           purelib=sp2, maps_text="")
    assert "NVRTC_HOME" not in env


def test_torch_cudnn_candidates_follow_torchs_search(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (a / "nvidia" / "cu13" / "lib" / "libcudnn.so.9").write_text("")
    (b / "nvidia" / "cudnn" / "lib").mkdir(parents=True)
    (b / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9").write_text("")
    (b / "nvidia" / "cudnn" / "lib" / "libcudnn.so").write_text("")  # the dev symlink: torch skips it
    got = te_env.torch_cudnn_candidates([str(a), str(b)], cuda_major="13")
    assert got == [str(a / "nvidia/cu13/lib/libcudnn.so.9"), str(b / "nvidia/cudnn/lib/libcudnn.so.9")]


def test_check_cudnn_raises_one_line_with_fakes(monkeypatch):
    monkeypatch.setattr(te_env, "torch_cudnn_compiled", lambda: (9, 19, 0))
    monkeypatch.setattr(te_env, "pin_torch_cudnn", lambda: TORCH_LIB)
    monkeypatch.setattr(te_env, "installed_te_version", lambda: None)
    vers = {TORCH_LIB: (9, 19, 0), TE_LIB: (9, 14, 0)}
    monkeypatch.setattr(te_env, "library_cudnn_version", vers.get)
    with pytest.raises(te_env.CudnnMismatchError) as e:
        te_env.check_cudnn(MAPS)
    assert "9.19.0" in str(e.value) and "9.14.0" in str(e.value) and "\n" not in str(e.value)
    one = "\n".join(line for line in MAPS.splitlines() if TE_LIB not in line)  # the twin: torch's cuDNN only
    assert te_env.check_cudnn(one).ok


# A real process: two shared libraries that export cudnnGetVersion, named like the two cuDNNs of the GPU box,
# loaded the way torch (RTLD_LOCAL) and TE (RTLD_GLOBAL) load them; the check reads the real /proc/self/maps
# and asks each library for its version through ctypes.
FAKE_C = "#include <stddef.h>\nsize_t cudnnGetVersion(void) { return VERSION; }\n"


@pytest.fixture(scope="module")
def fake_cudnns(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (cc) is needed to build the fake libcudnn libraries"
    root = tmp_path_factory.mktemp("cudnn")
    src = root / "fake.c"
    src.write_text(FAKE_C)
    out = {}
    for name, ver in (("torch/nvidia/cudnn/lib", 91900), ("te/cuda/lib64", 91400)):
        d = root / name
        d.mkdir(parents=True)
        lib = d / "libcudnn.so.9"
        subprocess.run([cc, "-shared", "-fPIC", f"-DVERSION={ver}", "-Wl,-soname,libcudnn.so.9", "-o", str(lib), str(src)],
                       check=True)
        out[ver] = str(lib)
    return out


PROBE = textwrap.dedent("""\
    import ctypes, os, sys
    from dsv3_rl.mcore import te_env
    te_env.torch_cudnn_compiled = lambda: (9, 19, 0)
    te_env.installed_te_version = lambda: None
    te_env.pin_torch_cudnn = lambda: None
    ctypes.CDLL(sys.argv[1])                              # torch: RTLD_LOCAL
    for p in sys.argv[2:]:
        ctypes.CDLL(p, mode=os.RTLD_GLOBAL)               # TE: RTLD_GLOBAL
    sys.argv[1:] = []
    sys.exit(te_env.main([]))
    """)


def _run_probe(libs):
    return subprocess.run([sys.executable, "-c", PROBE, *libs], capture_output=True, text=True, timeout=120)


def test_real_process_with_two_cudnns_reports_the_mismatch(fake_cudnns):
    p = _run_probe([fake_cudnns[91900], fake_cudnns[91400]])
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert len(err) == 1 and err[0].startswith("error: cuDNN mismatch:"), p.stderr
    assert "9.19.0" in err[0] and "9.14.0" in err[0] and fake_cudnns[91400] in err[0], err[0]


def test_real_process_with_one_cudnn_passes(fake_cudnns):
    p = _run_probe([fake_cudnns[91900]])
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "one cuDNN 9.19.0" in p.stdout, p.stdout


# --------------------------------------------------------------------------- `make setup-gpu`'s report line


def _setup_te_line() -> str:
    """The command scripts/setup.sh runs for the GPU extras' TE report (the test runs exactly that)."""
    from pathlib import Path

    lines = [ln.strip() for ln in (Path(__file__).resolve().parents[2] / "scripts/setup.sh").read_text().splitlines()
             if "dsv3_rl.mcore.te_env" in ln and not ln.strip().startswith("#")]
    assert len(lines) == 1, f"scripts/setup.sh should run dsv3_rl.mcore.te_env once: {lines}"
    return lines[0]


@pytest.mark.parametrize("version,verdict", [("2.11.0", "accepted by"), ("2.12.0", "NOT accepted by")])
def test_setup_gpu_reports_a_fake_installed_te(tmp_path, version, verdict):
    dist = tmp_path / f"transformer_engine-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer-engine\nVersion: {version}\n")
    env = dict(os.environ, PY=sys.executable, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run(["bash", "-c", _setup_te_line()], env=env, capture_output=True, text=True, timeout=120,
                       cwd=str(MCORE.path().parents[1]))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == p.stdout.strip().splitlines()[0], p.stdout
    assert p.stdout.startswith(f"[setup] Transformer Engine {version}: {verdict} megatron-core (<2.12.0,>=2.9.0a0"), p.stdout


def test_child_env_for_the_launchers_processes(tmp_path):
    sp = _site(tmp_path, ["nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cu13/lib/libcudnn.so.9", "nvidia/cu13/lib/libnvrtc.so.13"])
    got = te_env.child_cudnn_env({}, [sp], sp, te_installed=True)
    assert got == {"CUDNN_HOME": str(tmp_path / "nvidia/cudnn/lib"), "NVRTC_HOME": str(tmp_path / "nvidia/cu13/lib")}
    assert te_env.child_cudnn_env({}, [sp], sp, te_installed=False) == {}
    assert te_env.child_cudnn_env({"CUDNN_PATH": "/x"}, [sp], sp, te_installed=True) == {}


def test_launcher_env_carries_the_pin(monkeypatch):
    """The launcher's process environment (Launch.full_env) gets child_cudnn_env on GPU presets, not on CPU ones."""
    import types

    from dsv3_rl.launch import run

    monkeypatch.setattr(te_env, "child_cudnn_env", lambda env: {"CUDNN_HOME": "/torch/cudnn/lib"})
    gpu = types.SimpleNamespace(env={}, preset=types.SimpleNamespace(is_cpu=False))
    cpu = types.SimpleNamespace(env={}, preset=types.SimpleNamespace(is_cpu=True))
    assert run.Launch.full_env(gpu, {})["CUDNN_HOME"] == "/torch/cudnn/lib"
    assert "CUDNN_HOME" not in run.Launch.full_env(cpu, {})


def test_pin_loads_torchs_cudnn_parts_before_te(tmp_path):
    """cuDNN's front library opens its parts by soname; the box's loader found /usr/lib's 9.14 parts behind
    torch's 9.19 front library. The pin loads torch's own parts first (the dev symlinks and the front excluded)."""
    d = tmp_path / "nvidia" / "cudnn" / "lib"
    d.mkdir(parents=True)
    for f in ("libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_heuristic.so.9", "libcudnn_heuristic.so",
              "libcudnn_engines_precompiled.so.9"):
        (d / f).write_text("")
    front = str(d / "libcudnn.so.9")
    calls = []
    te_env.pin_torch_cudnn({}, front, modules={}, load=lambda p, mode: calls.append(p), purelib="/nonexistent",
                           maps_text="")
    assert calls[0] == front
    assert sorted(calls[1:]) == sorted(str(d / f) for f in ("libcudnn_graph.so.9", "libcudnn_heuristic.so.9",
                                                            "libcudnn_engines_precompiled.so.9"))


def test_torch_verdict_decides_whether_a_mixed_process_is_fatal(monkeypatch):
    """Two cuDNN versions mapped is fatal only where torch's own check refuses its runtime (the crash it
    prevents); where torch accepts it, a note; where torch cannot tell (CPU torch), the mapped versions decide."""
    monkeypatch.setattr(te_env, "torch_cudnn_compiled", lambda: (9, 19, 0))
    monkeypatch.setattr(te_env, "pin_torch_cudnn", lambda: TORCH_LIB)
    monkeypatch.setattr(te_env, "installed_te_version", lambda: None)
    monkeypatch.setattr(te_env, "library_cudnn_version", {TORCH_LIB: (9, 19, 0), TE_LIB: (9, 14, 0)}.get)
    r = te_env.check_cudnn(MAPS, torch_check=lambda: "accepted")
    assert r.ok and r.line.startswith("cuDNN note") and "9.14.0" in r.line
    for verdict in ("refused", "unknown"):  # the twins: fatal
        with pytest.raises(te_env.CudnnMismatchError):
            te_env.check_cudnn(MAPS, torch_check=lambda v=verdict: v)


def test_cudnn_check_warn_mode(monkeypatch, capsys):
    """DSV3_CUDNN_CHECK=warn: the mismatch line is printed, nothing raised; an unknown value is refused."""
    monkeypatch.setattr(te_env, "torch_cudnn_compiled", lambda: (9, 19, 0))
    monkeypatch.setattr(te_env, "pin_torch_cudnn", lambda: TORCH_LIB)
    monkeypatch.setattr(te_env, "installed_te_version", lambda: None)
    monkeypatch.setattr(te_env, "library_cudnn_version", {TORCH_LIB: (9, 19, 0), TE_LIB: (9, 14, 0)}.get)
    monkeypatch.setenv("DSV3_CUDNN_CHECK", "warn")
    assert not te_env.check_cudnn(MAPS, torch_check=lambda: "refused").ok
    assert "cuDNN mismatch" in capsys.readouterr().err
    monkeypatch.setenv("DSV3_CUDNN_CHECK", "off")
    with pytest.raises(te_env.CudnnMismatchError, match="allowed error"):
        te_env.check_cudnn(MAPS, torch_check=lambda: "refused")
