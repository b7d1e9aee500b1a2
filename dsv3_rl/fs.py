"""Files, at the bottom of the package: atomic writes, sha256 digests, JSON read with named errors.

Every write goes to a temporary file in the destination's directory, is fsynced, then renamed over
the destination with ``os.replace``: a reader sees the old file or the new one, never half of one.
If anything fails the temporary file is removed and the old file is left as it was.

Imports only the standard library and :mod:`dsv3_rl.errors`, so every other module may use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsv3_rl.errors import Dsv3Error

__all__ = ["JsonFileError", "atomic_path", "fsync_dir", "read_json", "replace_dir", "sha256_file",
           "write_bytes_atomic", "write_json_atomic", "write_text_atomic"]


class JsonFileError(Dsv3Error, ValueError):
    """A JSON file is missing, unreadable or not valid JSON; the one-line message names the file."""


def _default_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside PATH to write to; on success it is fsynced and renamed to PATH,
    on any exception it is removed (PATH keeps its old contents). Creates PATH's parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:  # the writer may have replaced or closed the file: fsync what is there
            os.fsync(f.fileno())
        os.chmod(tmp, _default_mode())  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write DATA to PATH atomically (temporary file in the same directory, fsync, ``os.replace``)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, **dumps_kwargs: Any) -> None:
    """``json.dumps(OBJ, indent=INDENT, ensure_ascii=False, **DUMPS_KWARGS) + "\\n"``, written atomically."""
    dumps_kwargs.setdefault("ensure_ascii", False)
    write_text_atomic(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (``hashlib.file_digest``: streamed, no whole-file buffer)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """The parsed contents of PATH; raises JsonFileError ``<path>: not found (<what>)``, ``<path>: cannot
    read ...`` or ``<path>: not valid JSON (<what>: <where>)``: one line, naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JsonFileError(f"{path}: not found ({what})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JsonFileError(f"{path}: cannot read {what} ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonFileError(f"{path}: not valid JSON ({what}: {e})") from None


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that renames inside it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(staged: str | os.PathLike, out: str | os.PathLike) -> None:
    """Make the complete directory STAGED take OUT's place (renames only): OUT, if present, is moved to
    a sibling, STAGED renamed to OUT, then the old one removed. A reader never sees a half-built OUT."""
    staged, out = Path(staged), Path(out)
    if not out.exists():
        os.replace(staged, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    try:
        os.replace(staged, out)
    except BaseException:
        os.replace(old, out)  # put the old one back: OUT is never missing after a failed swap
        raise
    shutil.rmtree(old, ignore_errors=True)
