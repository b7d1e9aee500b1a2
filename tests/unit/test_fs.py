"""dsv3_rl.fs (atomic writes, sha256, JSON with named errors) and the checkpoint manifest convention.

Each property is a ``_check_*`` function run against fs.py (must pass) and against a planted-fault twin
implementation (must fail), so the check is shown to bite. References are independent of fs.py:
``hashlib.sha256`` over the bytes, ``json.loads`` of the text, ``Path.read_bytes``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from dsv3_rl import fs
from dsv3_rl.checkpoint import outputs as mf
from dsv3_rl.errors import Dsv3Error


def _fails(check, *args) -> None:
    """The planted-fault twin: CHECK must reject it."""
    with pytest.raises(AssertionError):
        check(*args)


# --------------------------------------------------------------------------- atomic writes

def _check_writes(write, d: Path) -> None:
    p = d / "sub" / "f.bin"
    for data in (b"", b"\x00\xffabc" * 1000, os.urandom(3 << 20)):
        write(p, data)
        assert p.read_bytes() == data
        assert sorted(x.name for x in p.parent.iterdir()) == ["f.bin"]  # no temporary file left
    mask = os.umask(0)
    os.umask(mask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~mask  # an ordinary file's mode, not mkstemp's 0600


def _check_failed_write_keeps_old(write, d: Path, monkeypatch) -> None:
    d.mkdir(exist_ok=True)
    p = d / "f.bin"
    p.write_bytes(b"old contents")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError):
            write(p, b"new contents that never make it")
    assert p.read_bytes() == b"old contents"
    assert sorted(x.name for x in d.iterdir()) == ["f.bin"]


def _naive_write(p: Path, data: bytes) -> None:  # twin: writes in place
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())


def _tmp_left_behind(p: Path, data: bytes) -> None:  # twin: atomic, but leaves its tmp on failure
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    os.replace(tmp, p)


def _truncating_write(p: Path, data: bytes) -> None:  # twin: loses the last byte
    fs.write_bytes_atomic(p, data[:-1])


def test_write_bytes_atomic_writes_exactly_the_bytes(tmp_path):
    _check_writes(fs.write_bytes_atomic, tmp_path / "a")
    _fails(_check_writes, _truncating_write, tmp_path / "twin1")
    _fails(_check_writes, _tmp_left_behind_always, tmp_path / "twin2")


def _tmp_left_behind_always(p: Path, data: bytes) -> None:  # twin: copies instead of renaming
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(data)
    shutil.copyfile(tmp, p)


def test_failed_write_leaves_old_file_and_no_tmp(tmp_path, monkeypatch):
    _check_failed_write_keeps_old(fs.write_bytes_atomic, tmp_path / "a", monkeypatch)
    _check_failed_write_keeps_old(lambda p, b: fs.write_text_atomic(p, b.decode()), tmp_path / "b", monkeypatch)
    _check_failed_write_keeps_old(lambda p, b: fs.write_json_atomic(p, {"x": b.decode()}), tmp_path / "c",
                                  monkeypatch)
    for twin in (_naive_write, _tmp_left_behind):
        d = tmp_path / twin.__name__
        _fails(_check_failed_write_keeps_old, twin, d, monkeypatch)


def test_atomic_path_removes_tmp_when_the_writer_raises(tmp_path):
    p = tmp_path / "out.pt"
    p.write_bytes(b"previous")
    with pytest.raises(RuntimeError), fs.atomic_path(p) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer died")
    assert p.read_bytes() == b"previous" and sorted(x.name for x in tmp_path.iterdir()) == ["out.pt"]
    with fs.atomic_path(p) as tmp:
        tmp.write_bytes(b"whole")
    assert p.read_bytes() == b"whole" and sorted(x.name for x in tmp_path.iterdir()) == ["out.pt"]


def test_write_text_and_json(tmp_path):
    fs.write_text_atomic(tmp_path / "t.txt", "héllo\n")
    assert (tmp_path / "t.txt").read_bytes() == "héllo\n".encode()
    obj = {"b": [1, 2.5, None], "a": "ü", "n": {"x": True}}
    fs.write_json_atomic(tmp_path / "o.json", obj)
    text = (tmp_path / "o.json").read_text(encoding="utf-8")
    assert json.loads(text) == obj and text.endswith("\n") and list(json.loads(text)) == ["b", "a", "n"]
    assert text == json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    # twin: an object JSON cannot hold fails before anything is replaced
    with pytest.raises(TypeError):
        fs.write_json_atomic(tmp_path / "o.json", {"x": object()})
    assert json.loads((tmp_path / "o.json").read_text(encoding="utf-8")) == obj
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.json", "t.txt"]


# --------------------------------------------------------------------------- sha256

def _check_digest(digest, d: Path) -> None:
    d.mkdir(exist_ok=True)
    for i, data in enumerate((b"", b"abc", os.urandom((1 << 20) + 17), os.urandom(5 << 20))):
        p = d / f"f{i}"
        p.write_bytes(data)
        assert digest(p) == hashlib.sha256(data).hexdigest()


def _first_mib_only(p: Path) -> str:  # twin: a chunked loop that stops after one chunk
    with open(p, "rb") as f:
        return hashlib.sha256(f.read(1 << 20)).hexdigest()


def test_sha256_file_matches_hashlib_on_the_bytes(tmp_path):
    _check_digest(fs.sha256_file, tmp_path / "a")
    _fails(_check_digest, _first_mib_only, tmp_path / "b")


def test_one_sha256_helper():
    from dsv3_rl import backends
    from dsv3_rl.checkpoint import fp8

    assert backends.sha256_file is fs.sha256_file and fp8.sha256_file is fs.sha256_file


# --------------------------------------------------------------------------- read_json

def _check_read_json(read, d: Path) -> None:
    d.mkdir(exist_ok=True)
    good = d / "good.json"
    good.write_text('{"a": [1, 2], "b": "\\u00fc"}', encoding="utf-8")
    assert read(good) == json.loads(good.read_text(encoding="utf-8"))
    bad = d / "bad.json"
    bad.write_text('{"a": 1,\n "b": }')
    for p, words in ((bad, "not valid JSON"), (d / "missing.json", "not found")):
        try:
            read(p)
        except Dsv3Error as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001 - any other exception is what the check rejects
            raise AssertionError(f"{type(e).__name__} is not a Dsv3Error: {e}") from None
        else:
            raise AssertionError(f"{p}: no error")
        assert str(p) in msg and words in msg and "\n" not in msg


def _plain_json_loads(p: Path):  # twin: the raw json/OSError exceptions, which name no file
    return json.loads(Path(p).read_text())


def test_read_json_names_the_file(tmp_path):
    _check_read_json(fs.read_json, tmp_path / "a")
    _fails(_check_read_json, _plain_json_loads, tmp_path / "b")
    with pytest.raises(fs.JsonFileError, match=r"manifest: .*line 1"):
        (tmp_path / "m.json").write_text("{")
        fs.read_json(tmp_path / "m.json", what="manifest")


# --------------------------------------------------------------------------- directory swap

def _check_replace_dir(swap, d: Path) -> None:
    d.mkdir()
    out = d / "out"
    for gen in range(3):  # absent, then replacing a previous one twice
        staged = d / f"staged{gen}"
        staged.mkdir()
        (staged / "f").write_text(str(gen))
        swap(staged, out)
        assert (out / "f").read_text() == str(gen) and sorted(x.name for x in out.iterdir()) == ["f"]
        assert sorted(x.name for x in d.iterdir()) == ["out"]  # nothing old or staged left beside it


def _keeps_old(staged: Path, out: Path) -> None:  # twin: moves the old one aside and forgets it
    if out.exists():
        os.replace(out, out.with_name(f"{out.name}.old{len(list(out.parent.iterdir()))}"))
    os.replace(staged, out)


def test_replace_dir(tmp_path):
    _check_replace_dir(fs.replace_dir, tmp_path / "a")
    _fails(_check_replace_dir, _keeps_old, tmp_path / "b")


# --------------------------------------------------------------------------- manifests

def test_manifest_convention(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    assert mf.read_manifest(d, mf.FP8_TOOL) is None and mf.manifest_path(d) is None
    # outputs of earlier versions (legacy names, no "tool" key) are still read as their tool's
    (d / ".dsv3-convert-manifest.json").write_text(json.dumps({"complete": True, "input": "/m"}))
    assert mf.read_manifest(d, mf.FP8_TOOL) == {"complete": True, "input": "/m"}
    assert mf.read_manifest(d, mf.CONVERT_TOOL) is None  # twin: another tool's manifest is not ours
    # writing uses the one name and removes the legacy file
    path = mf.write_manifest(d, mf.FP8_TOOL, {"complete": False, "input": "/m"})
    assert path == d / mf.MANIFEST and sorted(x.name for x in d.iterdir()) == [mf.MANIFEST]
    assert json.loads(path.read_text()) == {"tool": mf.FP8_TOOL, "complete": False, "input": "/m"}
    assert mf.read_manifest(d, mf.FP8_TOOL)["complete"] is False
    assert mf.read_manifest(d, mf.CONVERT_TOOL) is None
    (d / mf.MANIFEST).write_text('{"tool": ')
    with pytest.raises(fs.JsonFileError, match=str(d / mf.MANIFEST)):
        mf.read_manifest(d, mf.FP8_TOOL)


def test_fs_is_at_the_bottom_of_the_package():
    """fs.py imports only the standard library and dsv3_rl.errors (every module may import it)."""
    import ast
    import sys

    tree = ast.parse(Path(fs.__file__).read_text())
    mods = {n.module if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    ours = {m for m in mods if m and m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert ours == {"dsv3_rl.errors"}
