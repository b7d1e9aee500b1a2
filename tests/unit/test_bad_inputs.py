"""Bad input and faults, across every entry point (issue 17): each case asserts the exit status, ONE line
``error: ...`` / ``interrupted: ...`` naming the file, tensor or key, and the state left behind (nothing
half-written, no mix of two runs, the user's files untouched).

CLIs run in-process (``main(argv)``) on tiny synthetic checkpoints. Faults are simulated:

* disk full: ``dsv3_rl.errors.free_bytes`` (the preflights) or a write that raises ``ENOSPC``;
* read-only: :func:`read_only` makes every write under a directory fail with ``EROFS`` at the ``os`` level
  (and chmods it when not root: root ignores mode bits, so the simulation is what the tests rely on);
* interrupts: a write that raises ``KeyboardInterrupt``, or a real SIGTERM sent to this process.

Classes (issue 17): 1 no mix, 2 invalid input, 3 not ours, 4 one line, 5 disk preflight, 6 patch drift,
7 verified skips, 8 conflicting inputs.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import types
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dsv3_rl import errors, patching
from dsv3_rl.checkpoint import fp8, hf_config
from dsv3_rl.checkpoint.hf_config import ConfigError, check_tensor_dtypes
from dsv3_rl.models.hf_config_rules import validate_config
from dsv3_rl.errors import Dsv3Error, cli_main, run_main

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "tests" / "assets"
MATH_MINI = ASSETS / "math_lighteval_mini"


# ------------------------------------------------------------------------------------------ helpers


def call(main, argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of an in-process ``main(argv)``."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


def one_line(err: str, *needles, kind: str = "error") -> str:
    """The single ``error:``/``interrupted`` line of ERR, which names every one of NEEDLES; no traceback."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "interrupted"))]
    assert len(lines) == 1, err
    assert lines[0].startswith(kind), lines[0]
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


def snapshot(d: Path) -> dict[str, str]:
    """Every file under D (hidden ones too) -> sha256."""
    if not d.exists():
        return {}
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def leftovers(parent: Path, name: str) -> list[str]:
    """Siblings a run may leave next to NAME: staging, .incomplete, .tmp-, .old- entries."""
    return sorted(p.name for p in parent.iterdir()
                  if p.name != name and name in p.name and any(t in p.name for t in ("staging", "incomplete", "tmp", "old")))


def read_only(monkeypatch, d: Path) -> None:
    """Make writes under D fail with EROFS (open for writing, mkdir, rename, access(W_OK))."""
    root = os.path.abspath(d)

    def under(p) -> bool:
        try:
            return os.path.abspath(os.fspath(p)).startswith(root)
        except TypeError:
            return False

    def deny(p):
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(p))

    real_open, real_mkdir, real_replace, real_access, real_bopen = os.open, os.mkdir, os.replace, os.access, builtins.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def fake_open(p, flags, *a, **k):
        if flags & writing and under(p):
            raise deny(p)
        return real_open(p, flags, *a, **k)

    def fake_mkdir(p, *a, **k):
        if under(p):
            raise deny(p)
        return real_mkdir(p, *a, **k)

    def fake_replace(a, b, *x, **k):
        if under(a) or under(b):
            raise deny(b)
        return real_replace(a, b, *x, **k)

    def fake_access(p, mode, *a, **k):
        if mode & os.W_OK and under(p):
            return False
        return real_access(p, mode, *a, **k)

    def fake_bopen(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and under(file):
            raise deny(file)
        return real_bopen(file, mode, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "replace", fake_replace)
    monkeypatch.setattr(os, "rename", fake_replace)
    monkeypatch.setattr(os, "access", fake_access)
    monkeypatch.setattr(builtins, "open", fake_bopen)
    monkeypatch.setattr(io, "open", fake_bopen)  # pathlib's write_text/open use io.open


def set_config(d: Path, **kv) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in kv.items():
        if "__" in k:
            a, b = k.split("__")
            cfg[a] = {**cfg[a], b: v}
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg, indent=2))


def relabel(shard: Path, tensor: str, dtype: str) -> None:
    """Change TENSOR's dtype in SHARD's header only (same item size: the file stays well-formed)."""
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[tensor]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


def truncate(p: Path, keep: float = 0.5) -> None:
    with open(p, "r+b") as f:
        f.truncate(int(p.stat().st_size * keep))


# ------------------------------------------------------------------------------- fixtures (module)


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory):
    from dsv3_rl.minimodel.mini_model import write_mini_model

    return write_mini_model("tiny", tmp_path_factory.mktemp("bad_fp8") / "release", fmt="fp8-release", shards=3)


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """(HF dir, mcore dir): the tiny preset and its conversion, written once."""
    from dsv3_rl.convert.weights import hf_to_mcore
    from dsv3_rl.minimodel.mini_model import write_mini_model

    d = tmp_path_factory.mktemp("bad_convert")
    hf = write_mini_model("tiny", d / "hf")
    hf_to_mcore(hf, d / "mcore", progress=False)
    return hf, d / "mcore"


@pytest.fixture
def fp8_copy(fp8_src, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(fp8_src, d)
    return d


@pytest.fixture
def hf_copy(hf_tiny, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(hf_tiny[0], d)
    return d


@pytest.fixture
def mcore_copy(hf_tiny, tmp_path):
    d = tmp_path / "mcore"
    shutil.copytree(hf_tiny[1], d)
    return d


def _cast_main():
    return fp8.main


def _convert_main():
    from dsv3_rl.convert.cli import main

    return main


# ============================================================== class 4: the wrapper itself (one line)


def _raiser(exc):
    def fn(argv):
        raise exc
    return fn


@pytest.mark.parametrize("exc, rc, needles", [
    (Dsv3Error("config.json: hidden_size = -64"), 2, ["config.json", "hidden_size"]),
    (OSError(errno.EROFS, "Read-only file system", "/x/out/model.safetensors"), 2, ["/x/out/model.safetensors", "read-only"]),
    (PermissionError(errno.EACCES, "Permission denied", "/x/out"), 2, ["/x/out", "read-only"]),
    (OSError(errno.ENOSPC, "No space left on device", "/x/out/train.parquet"), 2, ["/x/out/train.parquet", "disk full"]),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/in.json"), 2, ["/x/in.json"]),
    (ZeroDivisionError("division by zero"), 1, ["unexpected ZeroDivisionError", "DSV3_DEBUG=1"]),
], ids=["dsv3error", "erofs", "eacces", "enospc", "enoent", "bug"])
def test_wrapper_maps_each_failure_to_one_line(exc, rc, needles, capsys, monkeypatch):
    monkeypatch.delenv("DSV3_DEBUG", raising=False)
    assert run_main(_raiser(exc), []) == rc
    one_line(capsys.readouterr().err, *needles)


def test_wrapper_interrupt_and_sigterm_say_rerun(capsys):
    assert run_main(_raiser(KeyboardInterrupt()), [], interrupted="finished shards are kept; rerun") == 130
    one_line(capsys.readouterr().err, "Ctrl-C", "rerun", kind="interrupted")
    before = signal.getsignal(signal.SIGTERM)

    def term(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # never reached: the handler raises

    assert run_main(term, []) == 130
    one_line(capsys.readouterr().err, "SIGTERM", "rerun", kind="interrupted")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is restored


def test_wrapper_traceback_only_on_request(capsys, monkeypatch):
    monkeypatch.delenv("DSV3_DEBUG", raising=False)
    seen = []

    def fn(argv):
        seen.append(argv)
        raise Dsv3Error("bad")

    assert run_main(fn, ["--debug", "x"]) == 2
    err = capsys.readouterr().err
    assert seen == [["x"]] and "Traceback" in err and err.strip().endswith("error: bad")  # --debug is ours
    monkeypatch.setenv("DSV3_DEBUG", "1")
    assert run_main(fn, []) == 2 and "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("DSV3_DEBUG", "0")
    assert run_main(fn, []) == 2 and "Traceback" not in capsys.readouterr().err


def test_read_only_is_detected_from_the_mount_flag(tmp_path, monkeypatch):
    assert not errors.is_read_only(tmp_path / "new" / "dir")  # twin: a writable location
    monkeypatch.setattr(os, "statvfs", lambda p: types.SimpleNamespace(f_flag=os.ST_RDONLY))
    assert errors.is_read_only(tmp_path / "new" / "dir")
    with pytest.raises(Dsv3Error, match="read-only"):
        errors.check_space(tmp_path / "out", 1, "the output")


def _entry_points() -> list[str]:
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    mods = sorted(set(v for v in scripts.values()))
    # the python -m tools that have a main of their own
    for extra in ("dsv3_rl.convert.cli:main", "dsv3_rl.convert.verify:main", "dsv3_rl.data.gsm8k:main",
                  "dsv3_rl.data.math_lighteval:main", "dsv3_rl.data.synthetic:main", "dsv3_rl.minimodel.warm_start:main",
                  "dsv3_rl.mcore.layout_check:main"):
        mods.append(extra)
    return mods


def _is_wrapped(fn) -> bool:
    return hasattr(fn, "__wrapped_main__")


def test_every_entry_point_is_wrapped():
    import importlib

    unwrapped = []
    for ep in _entry_points():
        mod, _, attr = ep.partition(":")
        fn = getattr(importlib.import_module(mod), attr)
        if mod == "dsv3_rl.launch" or (attr == "main" and mod.endswith("launch")):
            fn = importlib.import_module("dsv3_rl.launch.cli").main
        if not _is_wrapped(fn):
            unwrapped.append(ep)
    assert not unwrapped, f"entry points without @cli_main: {unwrapped}"
    # planted twin: a plain main is caught by the same check
    assert not _is_wrapped(lambda argv=None: 0) and _is_wrapped(cli_main(lambda argv: 0))


def test_every_package_error_class_is_a_dsv3error():
    import importlib
    import pkgutil

    import dsv3_rl

    bad = []
    for m in pkgutil.walk_packages(dsv3_rl.__path__, "dsv3_rl."):
        if m.name.endswith(("_verify_worker", "__main__")) or ".correctness.worker" in m.name:
            continue
        try:
            mod = importlib.import_module(m.name)
        except ImportError:
            continue
        for name, obj in vars(mod).items():
            if (isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == m.name
                    and name.endswith("Error") and name not in ("WorkerError",) and not issubclass(obj, Dsv3Error)):
                bad.append(f"{m.name}.{name}")
    assert not bad, f"error classes not under Dsv3Error: {bad}"


# =================================================================== FP8 cast (classes 2, 3, 4, 5, 8)


def test_cast_positional_and_flag_paths_disagree(fp8_src, tmp_path, capsys):
    rc, err = call(fp8.main, ["cast", fp8_src, tmp_path / "a", "--output-bf16-hf-path", tmp_path / "b"], capsys)
    assert rc == 2
    one_line(err, "OUTPUT", str(tmp_path / "a"), "--output-bf16-hf-path", str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cast_input_positional_and_flag_disagree(fp8_src, tmp_path, capsys):
    rc, err = call(fp8.main, ["cast", fp8_src, tmp_path / "o", "--input-fp8-hf-path", tmp_path / "other"], capsys)
    assert rc == 2
    one_line(err, "INPUT", "--input-fp8-hf-path")
    assert not (tmp_path / "o").exists()


def test_cast_without_paths(capsys):
    rc, err = call(fp8.main, ["cast"], capsys)
    assert rc == 2
    one_line(err, "INPUT", "--input-fp8-hf-path")


def test_cast_refuses_a_foreign_nonempty_output_dir(fp8_src, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    rc, err = call(fp8.main, [fp8_src, out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, str(out), "not empty", "config.json", "not an output of this tool")
    assert snapshot(out) == before  # the user's config.json is not replaced


def test_cast_overwrite_removes_the_previous_casts_shards(fp8_src, tmp_path, capsys):
    from dsv3_rl.minimodel.mini_model import write_mini_model

    other = write_mini_model("tiny", tmp_path / "other", fmt="fp8-release", shards=4, seed=1)
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    assert fp8.main([str(other), str(out), "--no-progress"]) == 0
    assert fp8.main([str(fp8_src), str(fresh), "--no-progress"]) == 0
    (out / "notes.txt").write_text("the user's")
    old = {p.name for p in out.glob("*.safetensors")}
    assert old and old.isdisjoint(p.name for p in fresh.glob("*.safetensors"))
    assert fp8.main([str(fp8_src), str(out), "--no-progress"]) == 2  # another input: refused without --force
    one_line(capsys.readouterr().err, "--force")
    assert fp8.main([str(fp8_src), str(out), "--no-progress", "--force"]) == 0
    now = {p.name for p in out.glob("*.safetensors")}
    assert now == {p.name for p in fresh.glob("*.safetensors")}  # no shard of the old model left beside them
    mine = {k: v for k, v in snapshot(out).items() if k != fp8.MANIFEST}  # the manifest's order varies by thread
    assert mine == {**{k: v for k, v in snapshot(fresh).items() if k != fp8.MANIFEST},
                    "notes.txt": hashlib.sha256(b"the user's").hexdigest()}
    index = json.loads((out / fp8.INDEX).read_text())
    assert set(index["weight_map"].values()) == now


@pytest.mark.parametrize("key, value, needle", [
    ("hidden_size", -64, "hidden_size"),
    ("n_routed_experts", -8, "n_routed_experts"),
    ("rope_scaling__factor", -4.0, "rope_scaling.factor"),
    ("rope_scaling__type", "warp", "rope_scaling.rope_type"),
    ("n_group", 3, "n_group"),
    ("torch_dtype", "int8", "torch_dtype"),
], ids=["neg-hidden", "neg-experts", "neg-yarn", "rope-type", "divisibility", "dtype"])
def test_cast_refuses_an_invalid_config_by_key(fp8_copy, tmp_path, key, value, needle, capsys):
    set_config(fp8_copy, **{key: value})
    rc, err = call(fp8.main, [fp8_copy, tmp_path / "o", "--no-progress"], capsys)
    assert rc == 2
    one_line(err, "config.json", needle)
    assert not (tmp_path / "o").exists()


def test_cast_refuses_a_tensor_of_a_dtype_the_architecture_forbids(fp8_copy, tmp_path, capsys):
    shard = sorted(fp8_copy.glob("*.safetensors"))[0]
    from dsv3_rl.checkpoint.safetensors_io import read_header

    name = next(n for n, i in read_header(shard).tensors.items() if i.dtype == "BF16")
    relabel(shard, name, "I16")
    rc, err = call(fp8.main, [fp8_copy, tmp_path / "o", "--no-progress"], capsys)
    assert rc == 2
    one_line(err, shard.name, name, "I16", "allowed")
    assert not (tmp_path / "o").exists()


def test_cast_truncated_shard_is_named(fp8_copy, tmp_path, capsys):
    shard = sorted(fp8_copy.glob("*.safetensors"))[1]
    truncate(shard)
    rc, err = call(fp8.main, [fp8_copy, tmp_path / "o", "--no-progress"], capsys)
    assert rc == 2
    one_line(err, shard.name)
    assert not (tmp_path / "o").exists()


def test_cast_read_only_output_says_read_only(fp8_src, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    rc, err = call(fp8.main, [fp8_src, ro / "out", "--no-progress"], capsys)
    monkeypatch.undo()
    assert rc == 2
    one_line(err, "read-only")
    assert "GB free" not in err and not (ro / "out").exists()


def test_cast_disk_space_preflight(fp8_src, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(errors, "free_bytes", lambda p: 1000)
    rc, err = call(fp8.main, [fp8_src, tmp_path / "o", "--no-progress"], capsys)
    assert rc == 2
    one_line(err, str(tmp_path / "o"), "not enough disk space", "GB free")
    assert not (tmp_path / "o").exists()


def test_cast_disk_full_mid_write_names_the_shard_and_resumes(fp8_src, tmp_path, capsys, monkeypatch):
    from dsv3_rl.checkpoint import safetensors_io

    real_write = safetensors_io.ShardWriter.write
    calls = []

    def full(self, name, t):
        calls.append(name)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real_write(self, name, t)

    monkeypatch.setattr(safetensors_io.ShardWriter, "write", full)
    out = tmp_path / "o"
    rc, err = call(fp8.main, [fp8_src, out, "--no-progress", "--workers", "1"], capsys)
    assert rc == 2
    one_line(err, "disk full", str(out))
    assert not list(out.glob("*.tmp-*"))  # no half-written shard
    monkeypatch.undo()
    assert fp8.main([str(fp8_src), str(out), "--no-progress"]) == 0


def test_cast_interrupt_says_rerun_and_resumes(fp8_src, tmp_path, capsys, monkeypatch):
    from dsv3_rl.checkpoint import safetensors_io

    real_write = safetensors_io.ShardWriter.write

    def stop(self, name, t):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors_io.ShardWriter, "write", stop)
    out = tmp_path / "o"
    rc, err = call(fp8.main, [fp8_src, out, "--no-progress", "--workers", "1"], capsys)
    assert rc == 130
    one_line(err, "rerun", kind="interrupted")
    assert not list(out.glob("*.safetensors")) and not list(out.glob("*.tmp-*"))
    monkeypatch.setattr(safetensors_io.ShardWriter, "write", real_write)
    assert fp8.main([str(fp8_src), str(out), "--no-progress"]) == 0


# ============================================================ hf_config / dsv3-fix-config (classes 2, 4)


@pytest.fixture
def cfg_dir(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    from dsv3_rl.models.presets import preset_kwargs

    cfg = {**preset_kwargs("tiny"), "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


@pytest.mark.parametrize("key, value, needle", [
    ("hidden_size", -64, "hidden_size = -64"),
    ("num_experts_per_tok", 99, "num_experts_per_tok = 99"),
    ("q_lora_rank", 0, "q_lora_rank = 0"),
    ("hidden_size", True, "hidden_size = True"),
    ("rms_norm_eps", 0, "rms_norm_eps"),
    ("topk_group", 9, "topk_group = 9"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim = 7"),
    ("rope_parameters__rope_type", "warp", "rope_parameters.rope_type = 'warp'"),
    ("rope_parameters__beta_fast", -1, "rope_parameters.beta_fast"),
    ("dtype", "int8", "dtype = 'int8'"),
], ids=["neg-hidden", "topk", "q-lora-0", "bool-size", "eps-0", "topk-group", "odd-rope", "rope-type", "neg-beta",
        "dtype"])
def test_fix_config_refuses_invalid_values_by_key(cfg_dir, key, value, needle, capsys):
    set_config(cfg_dir, **{key: value})
    before = snapshot(cfg_dir)
    rc, err = call(hf_config.main, [cfg_dir], capsys)
    assert rc == 2
    one_line(err, "config.json", needle)
    assert snapshot(cfg_dir) == before


def test_fix_config_valid_config_passes(cfg_dir, capsys):
    """Twin of the refusals: the unmodified preset config is accepted (nothing to fix or a fix written)."""
    rc, _ = call(hf_config.main, [cfg_dir], capsys)
    assert rc == 0


def test_fix_config_read_only_dir(cfg_dir, capsys, monkeypatch):
    set_config(cfg_dir, auto_map={"x": "y"})  # a change is needed: it has to write
    before = snapshot(cfg_dir)
    read_only(monkeypatch, cfg_dir)
    rc, err = call(hf_config.main, [cfg_dir], capsys)
    monkeypatch.undo()
    assert rc == 2
    one_line(err, str(cfg_dir), "read-only")
    assert snapshot(cfg_dir) == before


def test_fix_config_not_json(cfg_dir, capsys):
    (cfg_dir / "config.json").write_text("{not json")
    rc, err = call(hf_config.main, [cfg_dir], capsys)
    assert rc == 2
    one_line(err, "config.json", "not valid JSON")


def test_tensor_dtype_rules_and_twin():
    check_tensor_dtypes({"model.layers.0.self_attn.o_proj.weight": "F8_E4M3",
                         "model.embed_tokens.weight": "BF16", "model.norm.weight": "F32"}, "x",
                        scaled={"model.layers.0.self_attn.o_proj.weight"})
    check_tensor_dtypes({"model.layers.3.eh_proj.weight": "F8_E4M3"}, "x", scaled={"model.layers.3.eh_proj.weight"})
    with pytest.raises(ConfigError, match="FP8 tensor 'model.embed_tokens.weight' has no scale"):
        check_tensor_dtypes({"model.embed_tokens.weight": "F8_E4M3"}, "x")
    with pytest.raises(ConfigError, match="FP8 tensor 'model.layers.0.self_attn.o_proj.weight' has no scale"):
        check_tensor_dtypes({"model.layers.0.self_attn.o_proj.weight": "F8_E4M3"}, "x")
    with pytest.raises(ConfigError, match="'model.norm.weight' has dtype I64"):
        check_tensor_dtypes({"model.norm.weight": "I64"}, "x")


def test_planner_refuses_a_negative_size(cfg_dir, capsys):
    from dsv3_rl.planner.cli import main

    set_config(cfg_dir, hidden_size=-64)
    rc, err = call(main, ["check", "--model", cfg_dir / "config.json", "--gpu", "H100", "--nodes", "1",
                          "--layout", "tp=1"], capsys)
    assert rc == 2
    one_line(err, "hidden_size = -64")


def test_planner_json_into_read_only_dir(tmp_path, capsys, monkeypatch):
    from dsv3_rl.planner.cli import main

    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    rc, err = call(main, ["check", "--model", "671b", "--gpu", "H100", "--nodes", "64", "--layout",
                          "tp=8,pp=16,ep=64,etp=1", "--json", ro / "r.json"], capsys)
    monkeypatch.undo()
    assert rc == 2
    one_line(err, "read-only", str(ro))
    assert not list(ro.iterdir())


def test_validate_config_require_false_checks_only_present_keys():
    validate_config({"hidden_size": 64}, "x", require=False)
    with pytest.raises(ConfigError, match="hidden_size = -1"):
        validate_config({"hidden_size": -1}, "x", require=False)
    with pytest.raises(ConfigError, match="lacks required keys"):
        validate_config({"hidden_size": 64}, "x")


# ==================================================================== converter (classes 2, 4, 5)


def test_hf_to_mcore_refuses_a_relabelled_dtype(hf_copy, tmp_path, capsys):
    shard = hf_copy / "model.safetensors"
    relabel(shard, "model.norm.weight", "I16")
    out = tmp_path / "mcore"
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_copy, "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, "model.norm.weight", "I16", "model.safetensors")
    assert not out.exists() and not leftovers(tmp_path, "mcore")


def test_hf_to_mcore_rerun_does_not_hide_a_relabelled_dtype(hf_copy, tmp_path, capsys):
    out = tmp_path / "mcore"
    assert _convert_main()(["hf-to-mcore", "--hf-dir", str(hf_copy), "--out", str(out), "--no-progress"]) == 0
    before = snapshot(out)
    relabel(hf_copy / "model.safetensors", "model.norm.weight", "I16")
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_copy, "--out", out, "--no-progress"], capsys)
    assert rc == 2  # not "already complete (68 tensors verified)"
    one_line(err, "model.norm.weight", "I16")
    assert snapshot(out) == before


@pytest.mark.parametrize("key, value", [("n_routed_experts", -8), ("hidden_size", -64),
                                        ("rope_parameters__factor", -4.0)], ids=["experts", "hidden", "yarn"])
def test_hf_to_mcore_refuses_negative_sizes(hf_copy, tmp_path, key, value, capsys):
    set_config(hf_copy, **{key: value})
    out = tmp_path / "mcore"
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_copy, "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, "config.json", key.replace("__", "."))
    assert not out.exists()


def test_hf_to_mcore_truncated_shard_is_one_line(hf_copy, tmp_path, capsys):
    truncate(hf_copy / "model.safetensors")
    out = tmp_path / "mcore"
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_copy, "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, "model.safetensors", "truncated")
    assert not out.exists() and not leftovers(tmp_path, "mcore")


def test_hf_to_mcore_disk_preflight(hf_tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(errors, "free_bytes", lambda p: 1000)
    out = tmp_path / "mcore"
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_tiny[0], "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, "not enough disk space", "megatron checkpoint")
    assert not out.exists() and not leftovers(tmp_path, "mcore")


def test_hf_to_mcore_read_only_says_read_only(hf_tiny, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_tiny[0], "--out", ro / "mcore", "--no-progress"],
                   capsys)
    monkeypatch.undo()
    assert rc == 2
    one_line(err, "read-only")
    assert "GB free" not in err and not list(ro.iterdir())


def test_hf_to_mcore_disk_full_mid_write_cleans_up(hf_tiny, tmp_path, capsys, monkeypatch):
    from dsv3_rl.convert import mcore_ckpt

    real = mcore_ckpt.save

    def full(work, *a, **k):
        (Path(work) / "__0_0.distcp").write_bytes(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(mcore_ckpt, "save", full)
    out = tmp_path / "mcore"
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_tiny[0], "--out", out, "--no-progress"], capsys)
    monkeypatch.setattr(mcore_ckpt, "save", real)
    assert rc == 2
    one_line(err, "mcore.incomplete", "disk full", "partial output was removed")
    assert not out.exists() and not leftovers(tmp_path, "mcore")


def test_hf_to_mcore_existing_foreign_output_untouched(hf_tiny, tmp_path, capsys):
    out = tmp_path / "mcore"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", hf_tiny[0], "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, str(out), "not a conversion output")
    assert snapshot(out) == {"mine.txt": hashlib.sha256(b"mine").hexdigest()}


def test_mcore_to_hf_truncated_distcp_is_named(mcore_copy, tmp_path, capsys):
    distcp = next(mcore_copy.glob("*.distcp"))
    truncate(distcp)
    out = tmp_path / "hf2"
    rc, err = call(_convert_main(), ["mcore-to-hf", "--mcore-dir", mcore_copy, "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, distcp.name, "truncated")
    assert not out.exists() and not leftovers(tmp_path, "hf2")


def test_mcore_to_hf_disk_preflight(hf_tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(errors, "free_bytes", lambda p: 1000)
    out = tmp_path / "hf2"
    rc, err = call(_convert_main(), ["mcore-to-hf", "--mcore-dir", hf_tiny[1], "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, "not enough disk space", "HF checkpoint")
    assert not out.exists() and not leftovers(tmp_path, "hf2")


def test_mcore_to_hf_disk_full_mid_write_cleans_up(hf_tiny, tmp_path, capsys, monkeypatch):
    from dsv3_rl.convert import weights

    def full(path, *a, **k):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(weights, "write_shard", full)
    out = tmp_path / "hf2"
    rc, err = call(_convert_main(), ["mcore-to-hf", "--mcore-dir", hf_tiny[1], "--out", out, "--no-progress"], capsys)
    assert rc == 2
    one_line(err, "hf2.incomplete", ".safetensors", "disk full", "partial output was removed")
    assert not out.exists() and not leftovers(tmp_path, "hf2")


def test_mcore_to_hf_read_only(hf_tiny, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    rc, err = call(_convert_main(), ["mcore-to-hf", "--mcore-dir", hf_tiny[1], "--out", ro / "hf2", "--no-progress"],
                   capsys)
    monkeypatch.undo()
    assert rc == 2
    one_line(err, "read-only")
    assert not list(ro.iterdir())


def test_compare_hf_missing_dir(tmp_path, capsys):
    rc, err = call(_convert_main(), ["compare-hf", tmp_path / "a", tmp_path / "b"], capsys)
    assert rc == 2
    one_line(err, str(tmp_path / "a"))


def test_hf_to_mcore_missing_config(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    rc, err = call(_convert_main(), ["hf-to-mcore", "--hf-dir", tmp_path / "hf", "--out", tmp_path / "m"], capsys)
    assert rc == 2
    one_line(err, "config.json", "does not exist")


# ======================================================================= data prep (classes 1, 4, 7)


def _prep(out: Path, *extra) -> int:
    from dsv3_rl.data import math_lighteval

    return math_lighteval.main(["--input-dir", str(MATH_MINI), "--out", str(out), *map(str, extra)])


@pytest.fixture
def prepared(tmp_path):
    out = tmp_path / "data"
    assert _prep(out) == 0
    return out


def test_data_disk_full_on_the_second_split_leaves_the_old_run(prepared, tmp_path, capsys, monkeypatch):
    before = snapshot(prepared)
    real = pq.write_table
    calls = []

    def full(table, where, *a, **k):
        calls.append(where)
        if len(calls) == 2:  # the test split, after train was written
            raise OSError(errno.ENOSPC, "No space left on device", str(where))
        return real(table, where, *a, **k)

    monkeypatch.setattr(pq, "write_table", full)
    capsys.readouterr()
    assert _prep(prepared, "--train-size", "5") == 2
    one_line(capsys.readouterr().err, "disk full")
    assert snapshot(prepared) == before  # no new train beside the old test and summary
    assert not leftovers(tmp_path, "data")


def test_data_interrupt_leaves_the_old_run(prepared, tmp_path, capsys, monkeypatch):
    before = snapshot(prepared)

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", stop)
    capsys.readouterr()
    assert _prep(prepared, "--train-size", "5") == 130
    one_line(capsys.readouterr().err, "previous outputs", kind="interrupted")
    assert snapshot(prepared) == before and not leftovers(tmp_path, "data")


def test_data_summary_matches_the_files_after_a_rerun(prepared):
    assert _prep(prepared, "--train-size", "5", "--test-size", "3") == 0
    summary = json.loads((prepared / "prep_summary.json").read_text())
    assert summary["splits"]["train"]["written"] == pq.read_metadata(prepared / "train.parquet").num_rows == 5
    assert summary["splits"]["test"]["written"] == pq.read_metadata(prepared / "test.parquet").num_rows == 3


def test_data_one_split_run_does_not_keep_the_other_runs_split(prepared):
    assert _prep(prepared, "--splits", "train", "--train-size", "4") == 0
    assert sorted(p.name for p in prepared.iterdir()) == ["prep_summary.json", "train.parquet"]


def test_data_user_files_in_the_output_dir_are_untouched(prepared):
    (prepared / "README.md").write_text("mine")
    (prepared / "sub").mkdir()
    (prepared / "sub" / "x").write_text("mine too")
    assert _prep(prepared, "--train-size", "4") == 0
    assert (prepared / "README.md").read_text() == "mine" and (prepared / "sub" / "x").read_text() == "mine too"
    assert pq.read_metadata(prepared / "train.parquet").num_rows == 4


def test_data_read_only_output(prepared, tmp_path, capsys, monkeypatch):
    before = snapshot(prepared)
    read_only(monkeypatch, tmp_path)
    capsys.readouterr()
    rc = _prep(prepared, "--train-size", "5")
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert rc == 2
    one_line(err, "read-only", str(tmp_path))
    assert snapshot(prepared) == before


def test_data_local_dir_is_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    capsys.readouterr()
    assert _prep(f) == 2
    one_line(capsys.readouterr().err, "--out", str(f))
    assert f.read_text() == "x"


@pytest.mark.parametrize("flag, value", [("--train-size", "-5"), ("--test-size", "0"), ("--max-prompt-length", "0"),
                                         ("--max-bad-frac", "1.5")])
def test_data_out_of_range_flag(tmp_path, capsys, flag, value):
    """A flag's range is its argparse type (cliargs): argparse's exit 2 naming it, before anything is read."""
    from dsv3_rl.data import math_lighteval

    rc, err = call(math_lighteval.main, ["--input-dir", MATH_MINI, "--out", tmp_path / "o", flag, value], capsys)
    assert rc == 2 and f"argument {flag}: '{value}' is not" in err, err
    assert not (tmp_path / "o").exists()


def test_data_validate_a_corrupt_parquet(tmp_path, capsys):
    from dsv3_rl.data.cli import main

    bad = tmp_path / "train.parquet"
    bad.write_bytes(b"PAR1 not really")
    rc, err = call(main, ["validate", bad], capsys)
    assert rc == 2
    one_line(err, str(bad))


def test_data_unknown_command(capsys):
    from dsv3_rl.data.cli import main

    rc, err = call(main, ["mathh"], capsys)
    assert rc == 2
    one_line(err, "'mathh'", "math_lighteval", "validate")


# ============================================================================== reward (classes 2, 4)


@pytest.mark.parametrize("fs", [5, 1.0, -0.5, float("nan"), True])
def test_format_score_out_of_range_is_refused(fs):
    from dsv3_rl.reward.math_reward import compute_score

    with pytest.raises(ValueError, match="format_score must be in \\[0, 1\\)"):
        compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{6}", "5", format_score=fs)


def test_format_score_in_range_twin():
    from dsv3_rl.reward.math_reward import compute_score

    right = compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{5}", "5", format_score=0.5)["score"]
    wrong = compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{6}", "5", format_score=0.5)["score"]
    assert wrong == 0.5 < right == 1.0


def test_reward_check_negative_limit(capsys):
    from dsv3_rl.reward.check import main

    rc, err = call(main, ["--input", MATH_MINI, "--limit", "-5"], capsys)
    assert rc == 2 and "--limit -5" in err and "Traceback" not in err


def test_reward_check_json_into_read_only_dir(tmp_path, capsys, monkeypatch):
    from dsv3_rl.reward.check import main

    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    rc, err = call(main, ["--input", MATH_MINI, "--limit", "3", "--json", ro / "r.json"], capsys)
    monkeypatch.undo()
    assert rc == 2
    one_line(err, str(ro), "read-only")
    assert not list(ro.iterdir())


def test_reward_check_missing_input(tmp_path, capsys):
    from dsv3_rl.reward.check import main

    rc, err = call(main, ["--input", tmp_path / "nope"], capsys)
    assert rc == 2
    one_line(err, str(tmp_path / "nope"))


# ================================================================================ patches (class 6, 4)

from test_patch_series import fake  # noqa: E402,F401  (the fake backend fixture, used via request.getfixturevalue)


def test_patch_status_and_check_report_drift_by_file(request, capsys):
    root, backend = request.getfixturevalue("fake")
    patching.apply(backend, root, quiet=True)
    assert patching.drift(backend, root) == []  # twin: exactly the series, no drift
    rc, _ = call(patching.main, ["--root", root, "status"], capsys)
    assert rc == 0
    mod = backend.path(root) / "fakepkg" / "mod.py"
    mod.write_text(mod.read_text() + "\n\ndef hand_edit():\n    return 1\n")  # outside every hunk
    assert [f for f, _ in patching.drift(backend, root)] == ["fakepkg/mod.py"]
    capsys.readouterr()
    assert patching.main(["--root", str(root), "status"]) == 1
    out = capsys.readouterr().out
    assert "applied      0001-bump-f.patch" in out and "drift        fakepkg/mod.py (+4 -0 lines)" in out
    assert patching.main(["--root", str(root), "check"]) == 1
    assert "drift        fakepkg/mod.py" in capsys.readouterr().out


def test_patch_drift_sees_a_new_file(request, capsys):
    root, backend = request.getfixturevalue("fake")
    patching.apply(backend, root, quiet=True)
    (backend.path(root) / "fakepkg" / "stray.py").write_text("X = 1\n")
    assert patching.drift(backend, root) == [("fakepkg/stray.py", "+1 -0 lines")]
    assert patching.main(["--root", str(root), "diff"]) == 0
    assert "+X = 1" in capsys.readouterr().out


def test_binary_patch_file_is_named(request, capsys):
    root, backend = request.getfixturevalue("fake")
    p = backend.patch_dir(root) / "0002-add-extra.patch"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe binary")
    rc, err = call(patching.main, ["--root", root, "lint"], capsys)
    assert rc == 2
    one_line(err, str(p), "not a text patch")


def test_make_has_patch_diff():
    r = subprocess.run(["make", "-n", "patch-diff"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "dsv3_rl.patching diff" in r.stdout


# ============================================================================= launcher (classes 7, 8)


def test_launcher_refuses_a_repeated_override(capsys):
    from dsv3_rl.launch.cli import main

    rc, err = call(main, ["run", "--preset", "tiny_cpu", "--dry-run", "data.train_batch_size=4",
                          "+data.train_batch_size=8"], capsys)
    assert rc == 2
    one_line(err, "'data.train_batch_size'", "given twice")


def test_launcher_distinct_overrides_pass_the_check():
    from dsv3_rl.launch.cli import refuse_repeated_overrides

    refuse_repeated_overrides(["a.b=1", "a.c=2", "+a.d=3"])  # twin: no repetition, no error


def _data_stage(tmp_path) -> tuple:
    from dsv3_rl.launch.stages import Stage, verify_data

    out = tmp_path / "data"
    assert _prep(out) == 0
    st = Stage("data", needed=True, why="", argv=["true"], out_dir=None,
               outputs=[out / "train.parquet", out / "test.parquet", out / "prep_summary.json"], inputs=[])
    st.verify = lambda: verify_data(out)
    return st, out


def test_data_stage_skip_is_verified(tmp_path):
    st, out = _data_stage(tmp_path)
    assert st.status()[0] == "done"  # twin: valid data is skipped
    pq.write_table(pq.read_table(out / "train.parquet").drop_columns(["reward_model"]), out / "train.parquet")
    status, detail = st.status()
    assert status == "run" and "does not validate" in detail and "train.parquet" in detail


def test_force_stage_reaches_the_tool(tmp_path, capsys):
    from dsv3_rl.launch.cli import _force_stages
    from dsv3_rl.recipes.presets import PresetError
    from dsv3_rl.launch.stages import Stage

    st = Stage("fp8_cast", needed=True, why="", argv=["python", "-m", "dsv3_rl.checkpoint.fp8", "cast", "a", "b"],
               out_dir=None, outputs=[], inputs=[], force_flag="--force", verify=lambda: (True, "ok"))
    launch = types.SimpleNamespace(stages=[st])
    assert st.status()[0] == "done" and st.run_argv == st.argv
    _force_stages(launch, ["fp8_cast"])
    assert st.status() == ("run", "forced (--force-stage)") and st.run_argv == st.argv + ["--force"]
    assert st.signature()["command"] == st.argv  # the marker does not record the force flag
    with pytest.raises(PresetError, match="--force-stage 'nope'.*fp8_cast"):
        _force_stages(launch, ["nope"])


# ------------------------------------------------- issue 29: the newer tools (warm start, synthetic data, ...)

DEMO_DATA = REPO / "examples" / "deepseek_v3" / "data" / "identity-arith"
DEMO_MODEL = REPO / "examples" / "deepseek_v3" / "models" / "dsv3-tiny-warm"


def _warm(argv, capsys):
    from dsv3_rl.minimodel import warm_start

    return call(warm_start.main, argv, capsys)


def test_warm_start_refuses_a_users_directory(tmp_path, capsys):
    """Issue 29: --out over a user's directory replaced it (their files gone, exit 0)."""
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "x").write_text("mine too")
    before = snapshot(out)
    rc, err = _warm(["--data", DEMO_DATA, "--out", out], capsys)
    assert rc == 2
    one_line(err, str(out), "not an output of this tool", "warm_start.json")
    assert snapshot(out) == before and not leftovers(tmp_path, "mine")


def test_warm_start_output_check_twin(tmp_path):
    """Twin: a new, an empty and an earlier warm-start directory pass the check the user's directory fails."""
    from dsv3_rl.minimodel.warm_start import MARKER, WarmStartError, check_out

    check_out(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty")
    check_out(DEMO_MODEL)  # the shipped warm start (holds warm_start.json)
    earlier = tmp_path / "earlier"
    shutil.copytree(DEMO_MODEL, earlier)
    (earlier / MARKER).unlink()
    with pytest.raises(WarmStartError, match="not an output of this tool"):
        check_out(earlier)


def test_warm_start_data_without_the_expected_column(tmp_path, capsys):
    """Issue 29: a KeyError after the model was built, leaving OUT.tmp-PID."""
    import pyarrow as pa

    data = tmp_path / "task" / "data"
    data.mkdir(parents=True)
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([{"question": "What is 1?", "answer": "1"}]),
                       data / f"{split}-00000-of-00001.parquet")
    rc, err = _warm(["--data", tmp_path / "task", "--out", tmp_path / "o"], capsys)
    assert rc == 2
    one_line(err, "train-00000-of-00001.parquet", "no column problem, solution", "question, answer",
             "dsv3-prep-data synthetic")
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path, "o")


def test_warm_start_missing_data_says_what_it_expected(tmp_path, capsys):
    rc, err = _warm(["--data", "/nonexistent", "--out", tmp_path / "o"], capsys)
    assert rc == 2
    one_line(err, "--data /nonexistent", "expected the synthetic task in MATH layout", "dsv3-prep-data synthetic")
    (tmp_path / "half" / "data").mkdir(parents=True)
    shutil.copy(DEMO_DATA / "data" / "train-00000-of-00001.parquet", tmp_path / "half" / "data")
    rc, err = _warm(["--data", tmp_path / "half", "--out", tmp_path / "o"], capsys)
    assert rc == 2
    one_line(err, "test-00000-of-00001.parquet not found")


@pytest.mark.parametrize("target", ["-1", "1.5", "0", "1", "nan", "x"])
def test_warm_start_target_out_of_range_is_refused_up_front(tmp_path, capsys, target):
    """Issue 29: --target -1 failed after 218 s (leaving a 3.9 MB temp dir), --target 1.5 wrote a model."""
    rc, err = _warm(["--data", DEMO_DATA, "--out", tmp_path / "o", "--target", target], capsys)
    assert rc == 2 and "argument --target" in err and "strictly between 0 and 1" in err, err
    assert not (tmp_path / "o").exists()


def test_warm_start_target_in_range_twin(tmp_path, capsys):
    """Twin: --target 0.5 parses (the run then stops at the next check: the missing data)."""
    rc, err = _warm(["--data", tmp_path / "none", "--out", tmp_path / "o", "--target", "0.5"], capsys)
    assert rc == 2
    one_line(err, "--data")


def test_warm_start_interrupt_leaves_no_tmp(tmp_path, capsys, monkeypatch):
    """Issue 29: after Ctrl-C the warm start said "nothing half-written is kept" but left OUT.tmp-PID."""
    from dsv3_rl.minimodel import mini_model

    def interrupted(preset, out_dir, **kw):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(mini_model, "write_mini_model", interrupted)
    rc, err = _warm(["--data", DEMO_DATA, "--out", tmp_path / "o"], capsys)
    assert rc == 130
    one_line(err, "OUT.tmp-PID removed", "start over", kind="interrupted")
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path, "o")


def test_warm_start_interrupt_check_twin(tmp_path, capsys, monkeypatch):
    """Twin: with the clean-up disabled, the same interrupt leaves OUT.tmp-PID, and the check above sees it."""
    from dsv3_rl.minimodel import mini_model, warm_start

    def interrupted(preset, out_dir, **kw):
        Path(out_dir).mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(mini_model, "write_mini_model", interrupted)
    monkeypatch.setattr(warm_start.shutil, "rmtree", lambda *a, **k: None)
    assert _warm(["--data", DEMO_DATA, "--out", tmp_path / "o"], capsys)[0] == 130
    assert leftovers(tmp_path, "o") == [f"o.tmp-{os.getpid()}"]


def _synthetic(out: Path, *extra) -> int:
    from dsv3_rl.data import cli

    return cli.main(["synthetic", "--out", str(out), *map(str, extra)])


def _mixed(out: Path) -> list[str]:
    """Test problems that are also train problems in OUT (a seed-0 test split beside a seed-1 train split)."""
    files = {s: out / "data" / f"{s}-00000-of-00001.parquet" for s in ("train", "test")}
    problems = {s: set(pq.read_table(f).column("problem").to_pylist()) for s, f in files.items()}
    return sorted(problems["train"] & problems["test"])


def _fail_on_second_write(monkeypatch):
    real, calls = pq.write_table, []

    def write(table, where, *a, **k):
        calls.append(where)
        if len(calls) == 2:  # the test split, after train
            raise OSError(errno.EACCES, "Permission denied", str(where))
        return real(table, where, *a, **k)

    monkeypatch.setattr(pq, "write_table", write)


def test_synthetic_failure_on_test_leaves_the_previous_output(tmp_path, capsys, monkeypatch):
    """Issue 29: a seed-1 run over a seed-0 output whose test file could not be replaced replaced train:
    14 of 18 test problems were then in train. Now both files are swapped in at once, or neither."""
    out = tmp_path / "task"
    assert _synthetic(out) == 0 and _mixed(out) == []
    before = snapshot(out)
    _fail_on_second_write(monkeypatch)
    capsys.readouterr()
    assert _synthetic(out, "--seed", "1") == 2
    one_line(capsys.readouterr().err, "read-only")
    assert snapshot(out) == before and _mixed(out) == []
    assert not [p.name for p in out.iterdir() if p.name != "data"] and not leftovers(out, "data")
    monkeypatch.undo()
    assert _synthetic(out, "--seed", "1") == 0 and _mixed(out) == [] and snapshot(out) != before


def test_synthetic_mix_check_twin(tmp_path, monkeypatch):
    """Twin: writing file by file (as before issue 29), the same failure leaves a mixed output that _mixed sees."""
    import pyarrow as pa

    from dsv3_rl.data import synthetic

    out = tmp_path / "task"
    assert _synthetic(out) == 0
    _fail_on_second_write(monkeypatch)
    with pytest.raises(OSError):
        for name, rows in zip(synthetic.FILES, synthetic.rows(1), strict=True):
            pq.write_table(pa.Table.from_pylist(rows), out / "data" / name)
    assert len(_mixed(out)) > 0


def test_synthetic_refuses_a_directory_where_a_split_goes(tmp_path, capsys):
    out = tmp_path / "task"
    assert _synthetic(out) == 0
    (out / "data" / "test-00000-of-00001.parquet").unlink()
    (out / "data" / "test-00000-of-00001.parquet").mkdir()
    (out / "data" / "test-00000-of-00001.parquet" / "mine").write_text("mine")
    before = snapshot(out)
    capsys.readouterr()
    assert _synthetic(out, "--seed", "1") == 2
    one_line(capsys.readouterr().err, "test-00000-of-00001.parquet: not a file", "nothing was replaced")
    assert snapshot(out) == before and not leftovers(out, "data")


def test_replace_dir_puts_the_old_one_back_when_the_swap_fails(tmp_path, monkeypatch):
    from dsv3_rl import fs

    out, staged = tmp_path / "out", tmp_path / "staged"
    out.mkdir()
    (out / "f").write_text("old")
    staged.mkdir()
    (staged / "f").write_text("new")
    real = os.replace

    def fail_second(a, b):
        if Path(a) == staged:
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(a))
        return real(a, b)

    monkeypatch.setattr(fs.os, "replace", fail_second)
    with pytest.raises(OSError):
        fs.replace_dir(staged, out)
    assert (out / "f").read_text() == "old" and (staged / "f").read_text() == "new"


def test_mini_model_refuses_an_unusable_override(tmp_path, capsys):
    """Issue 29 (bench_refit --set hidden_size=-4 -> 'unexpected RuntimeError'): every tool that takes a model
    preset with --set overrides validates the result (presets.preset_kwargs)."""
    from dsv3_rl.minimodel import mini_model

    rc, err = call(mini_model.main, ["--model", "tiny", "--out", tmp_path / "m", "--set", "hidden_size=-4"], capsys)
    assert rc == 2
    one_line(err, "hidden_size = -4", "expected an integer >= 1")
    assert not (tmp_path / "m").exists() and not leftovers(tmp_path, "m")
    from dsv3_rl.models.presets import preset_kwargs

    assert preset_kwargs("tiny", {"hidden_size": 64})["hidden_size"] == 64  # twin: a usable override passes


def _consistency(argv, capsys):
    from dsv3_rl.consistency import cli

    return call(cli.main, argv, capsys)


@pytest.fixture
def demo_model_copy(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, d)
    return d


def test_consistency_refuses_a_dense_model(demo_model_copy, capsys):
    """Issue 29: a dense model ran vLLM and megatron, then failed 'no TopKRouter to record' as a bug (exit 1)."""
    cfg = json.loads((demo_model_copy / "config.json").read_text())
    cfg["first_k_dense_replace"] = cfg["num_hidden_layers"]
    (demo_model_copy / "config.json").write_text(json.dumps(cfg))
    rc, err = _consistency(["run", "--model", demo_model_copy], capsys)
    assert rc == 2
    one_line(err, str(demo_model_copy), "a dense model", "no MoE layer")


def test_consistency_refuses_a_model_without_tokenizer(demo_model_copy, capsys):
    """Issue 29: one huge flattened vLLM traceback line, exit 1."""
    for f in demo_model_copy.glob("tokenizer*"):
        f.unlink()
    rc, err = _consistency(["run", "--model", demo_model_copy], capsys)
    assert rc == 2
    one_line(err, str(demo_model_copy), "no usable tokenizer", "tokenizer.json")


def test_consistency_model_checks_twin(capsys):
    """Twin: the demo's model passes the model checks (and --max-tokens 600 is honoured: vLLM gets room for
    the longest prompt + 600 tokens, not the 512 that cut it to 500)."""
    from dsv3_rl.consistency.cli import DEFAULT_MODEL_LEN, check_model, load_prompts

    prompts = load_prompts("8")
    assert check_model(DEMO_MODEL, prompts, 24) == DEFAULT_MODEL_LEN
    n = check_model(DEMO_MODEL, prompts, 600)
    assert 600 < n <= 1024 and n - 600 == max(len(p) for p in _prompt_ids(prompts))


def _prompt_ids(prompts):
    from transformers import AutoTokenizer

    from dsv3_rl.consistency.vllm_side import prompt_ids

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    return [prompt_ids(tok, p) for p in prompts]


def test_consistency_refuses_more_tokens_than_the_model_takes(capsys):
    rc, err = _consistency(["run", "--max-tokens", "2000"], capsys)
    assert rc == 2
    one_line(err, "--max-tokens 2000", "max_position_embeddings", "at most")


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_consistency_read_only_output_is_refused_before_the_run(tmp_path, capsys, monkeypatch, flag):
    """Issue 29: a read-only --out lost the valid --json (plots were written first, after the whole run)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    target = ro / ("plots" if flag == "--out" else "r.json")
    rc, err = _consistency(["run", flag, target], capsys)
    monkeypatch.undo()
    assert rc == 2
    one_line(err, flag, "read-only")


def test_consistency_json_is_written_before_the_plots(tmp_path, capsys, monkeypatch):
    """The report reaches --json even when the plots then fail."""
    from dsv3_rl.consistency import cli, mcore_side

    class NoTrainer:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def bad_plots(report, out):
        raise OSError(errno.EROFS, "Read-only file system", str(out))

    monkeypatch.setattr(mcore_side, "Trainer", NoTrainer)
    monkeypatch.setattr(cli, "check_model", lambda *a: 512)
    rec = {"route_agreement": 1.0, "logprob_abs_diff_mean": 0.0, "logprob_abs_diff_max": 0.0, "k3_kl": 0.0,
           "tokens": 1, "per_layer": []}
    report = {"without_replay": rec, "with_replay": {**rec, "passes": {"update": rec}}, "dtype": "bf16",
              "sequences": 1, "routed_rows": 1}
    monkeypatch.setattr(cli, "_measure", lambda *a, **k: (report, None))
    monkeypatch.setattr(cli, "write_plots", bad_plots)
    rc, err = _consistency(["run", "--json", tmp_path / "r.json", "--out", tmp_path / "plots"], capsys)
    assert rc == 2 and "read-only" in err
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True


def _replay(argv, capsys, monkeypatch, world=None):
    from dsv3_rl.consistency import replay_check

    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    if world:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    return call(replay_check.main, argv, capsys)


def test_replay_check_refuses_an_unknown_model(capsys, monkeypatch):
    rc, err = _replay(["--model", "nosuch"], capsys, monkeypatch)
    assert rc == 2
    one_line(err, "--model", "'nosuch'", "tiny-vllm")


def test_replay_check_refuses_a_layout_without_its_ranks(capsys, monkeypatch):
    """Issue 29: --layout tp=2,ep=2 without torchrun was 'unexpected ValueError (a bug)'."""
    rc, err = _replay(["--layout", "tp=2,ep=2"], capsys, monkeypatch)
    assert rc == 2
    one_line(err, "--layout tp=2,ep=2", "not started by torchrun", "torchrun --nproc-per-node 4")
    rc, err = _replay(["--layout", "tp=2,ep=2,etp=1"], capsys, monkeypatch, world=3)
    assert rc == 2
    one_line(err, "torchrun started 3 process(es)", "--nproc-per-node 2")


def test_replay_check_layout_twin(monkeypatch):
    """Twin: the same layout at a world size it divides passes the check."""
    import argparse

    from dsv3_rl.consistency.replay_check import check_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    check_args(argparse.Namespace(model="tiny-vllm", layout="tp=2,ep=2"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_args(argparse.Namespace(model="tiny-vllm", layout="tp=2,ep=2,etp=1"))


@pytest.mark.parametrize("argv, needle", [(["--seq-length", "0"], "argument --seq-length"),
                                          (["--layout", "tp=0"], "Layout.tp=0")])
def test_replay_check_refuses_bad_sizes(capsys, monkeypatch, argv, needle):
    rc, err = _replay(argv, capsys, monkeypatch)
    assert rc == 2 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("rollout, needle", [("tp=0,gpus=96", "RolloutLayout.tp=0: a parallel size is an integer >= 1"),
                                             ("tp=4", "RolloutLayout: missing key(s) ['gpus']")])
def test_planner_refuses_a_bad_rollout_layout(capsys, rollout, needle):
    """Issue 29: dsv3-plan check --rollout tp=0 was 'unexpected ZeroDivisionError (a bug)'."""
    from dsv3_rl.planner.cli import main

    argv = ["check", "--model", "671b", "--gpu", "H20", "--nodes", "12", "--layout", "tp=8,pp=12,ep=8,etp=1"]
    rc, err = call(main, argv + ["--rollout", rollout], capsys)
    assert rc == 2
    one_line(err, needle)
    rc, err = call(main, argv + ["--rollout", "tp=8,gpus=96"], capsys)  # twin: a valid rollout layout is planned
    assert rc in (0, 1) and "error:" not in err, err


@pytest.mark.parametrize("value, on", [(None, False), ("1", True), ("y", True), ("off", False), ("0", False),
                                       ("bogus", True)])
def test_debug_switch_reads_the_shared_words(monkeypatch, value, on):
    """DSV3_DEBUG through cliargs.env_flag (before: 'off' turned tracebacks on); an unknown word turns them on."""
    if value is None:
        monkeypatch.delenv("DSV3_DEBUG", raising=False)
    else:
        monkeypatch.setenv("DSV3_DEBUG", value)
    assert errors.debug_enabled() is on


@pytest.mark.parametrize("kind, text, ok", [
    ("positive_int", "1", True), ("positive_int", "0", False), ("positive_int", "-3", False),
    ("positive_int", "x", False), ("positive_int", "2.5", False), ("non_negative_int", "0", True),
    ("non_negative_int", "-1", False), ("fraction", "0", True), ("fraction", "1", True), ("fraction", "0.5", True),
    ("fraction", "1.01", False), ("fraction", "-0.1", False), ("fraction", "nan", False), ("fraction", "inf", False),
    ("open_fraction", "0.2", True), ("open_fraction", "0", False), ("open_fraction", "1", False),
])
def test_argparse_range_types(kind, text, ok):
    """The shared argparse types (dsv3_rl.cliargs) accept the range they name and refuse the rest by value."""
    import argparse

    from dsv3_rl import cliargs

    check = getattr(cliargs, kind)
    if ok:
        assert check(text) == (int(text) if kind.endswith("int") else float(text))
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^'{text}' is not "):
            check(text)


@pytest.mark.parametrize("flag", ["--workers", "--chunk-mb"])
def test_fp8_cast_size_flags_are_positive(tmp_path, capsys, flag):
    """--workers 0 silently meant "from the CPU count", --chunk-mb -1 a negative chunk: refused by argparse now."""
    for value in ("0", "-1"):
        rc, err = call(fp8.main, ["cast", tmp_path / "in", tmp_path / "out", flag, value], capsys)
        assert rc == 2 and f"argument {flag}: '{value}' is not an integer >= 1" in err, err
    assert not (tmp_path / "out").exists()
