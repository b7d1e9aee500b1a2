"""The package's one streaming safetensors reader/writer (format: 8-byte LE header length, JSON header, data).

Why not ``safetensors.torch``: ``load_file``/``save_file`` hold a whole shard in memory, while the
FP8 cast streams a shard tensor by tensor (and large tensors in row chunks) with bounded memory,
writes to a temporary name, hashes what it writes, and renames when complete. Files written here
are ordinary safetensors files (``safe_open``/``load_file`` and transformers read them; tests check).

Reading validates what the ``safetensors`` library validates (header size, JSON, dtype, shape vs
byte count, contiguous offsets) plus the file size, and names the file in every error, so a
truncated download is reported as such rather than as a crash deep inside a load.

Reads use ``pread`` into fresh memory (no mmap), so a process's RSS is what it really holds, not the
page cache of a 1.3 TB checkpoint. :class:`HFReader` reads every tensor of an HF checkpoint directory;
:func:`write_shard` writes one shard, producing each tensor only when it is written (the converter).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from dsv3_rl.errors import Dsv3Error
from dsv3_rl.fs import read_json, sha256_file

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# safetensors dtype string -> (torch dtype or None where torch lacks it, itemsize in bytes)
_DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "U16": (getattr(torch, "uint16", None), 2),
    "U32": (getattr(torch, "uint32", None), 4),
    "U64": (getattr(torch, "uint64", None), 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 1),
}
_TORCH_TO_ST = {dt: name for name, (dt, _) in _DTYPES.items() if dt is not None}


class CheckpointFormatError(Dsv3Error, ValueError):
    """A checkpoint file is not what it should be (truncated, not safetensors, bad index); names the file."""


class SafetensorsError(CheckpointFormatError):
    """A safetensors file is truncated, corrupt or not safetensors at all; the message names the file."""


def st_dtype(dtype: torch.dtype) -> str:
    return _TORCH_TO_ST[dtype]


def torch_dtype(st: str) -> torch.dtype:
    dt = _DTYPES[st][0]
    if dt is None:
        raise SafetensorsError(f"dtype {st} has no torch equivalent in torch {torch.__version__}")
    return dt


def itemsize(st: str) -> int:
    return _DTYPES[st][1]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int
    path: Path | None = None  # the file that holds it

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]  # in file (offset) order
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate a safetensors header; raises SafetensorsError naming PATH on any problem."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: truncated or not a safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SafetensorsError(
                f"{path}: truncated or not a safetensors file (header length {n} bytes, file has {size} bytes)"
            )
        blob = f.read(n)
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt header (JSON {type(header).__name__}, expected an object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    infos = []
    for name, entry in header.items():
        try:
            dtype, shape, (b, e) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as err:
            raise SafetensorsError(f"{path}: corrupt header entry for tensor {name!r}: {entry!r} ({err})") from None
        if dtype not in _DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        want = math.prod(shape) * itemsize(dtype)
        if e - b != want or b < 0:
            raise SafetensorsError(
                f"{path}: corrupt header: tensor {name!r} {dtype}{list(shape)} needs {want} bytes, offsets say {e - b}"
            )
        infos.append(TensorInfo(name, dtype, shape, data_start + b, data_start + e, path))
    infos.sort(key=lambda t: (t.begin, t.end))
    pos = data_start
    for t in infos:
        if t.begin != pos:
            raise SafetensorsError(f"{path}: corrupt header: tensor {t.name!r} starts at byte {t.begin}, expected {pos}")
        pos = t.end
    if pos != size:
        what = "truncated" if pos > size else "corrupt (trailing bytes)"
        raise SafetensorsError(
            f"{path}: {what}: the header describes {pos} bytes, the file has {size} "
            f"(re-download or re-copy this shard)"
        )
    return Header(path, {t.name: t for t in infos}, metadata, data_start, size)


def _pread_into(fd: int, view: memoryview, offset: int, path: Path | str, what: str = "") -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise SafetensorsError(f"{path}: truncated: short read at byte {offset + done}{what}")
        done += got


def pread_exact(fd: int, nbytes: int, offset: int, path: Path | str = "?") -> bytearray:
    """Read exactly NBYTES at OFFSET (a short read means the file shrank under us)."""
    buf = bytearray(nbytes)
    _pread_into(fd, memoryview(buf), offset, path)
    return buf


def read_tensor(fd: int, info: TensorInfo, path: Path | str = "?", rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The tensor INFO (or its rows [r0, r1) along dim 0) read from FD into fresh CPU memory."""
    shape = list(info.shape)
    begin, end = info.begin, info.end
    if rows is not None:
        r0, r1 = rows
        row_bytes = (info.nbytes // shape[0]) if shape and shape[0] else 0
        begin, end = info.begin + r0 * row_bytes, info.begin + r1 * row_bytes
        shape[0] = r1 - r0
    out = torch.empty(end - begin, dtype=torch.uint8)  # no zero-fill, unlike bytearray
    if out.numel():
        _pread_into(fd, memoryview(out.numpy()), begin, path, f" (tensor {info.name!r})")
    return out.view(torch_dtype(info.dtype)).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (made contiguous), without copying when already contiguous."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


class ShardWriter:
    """Write one safetensors file to ``<path>.tmp-<pid>`` (or ``<path><tmp_suffix>``), then ``close()``
    renames it into place.

    ``entries`` (name, dtype string, shape) fixes the header up front; data is laid out by itemsize,
    largest first (as the safetensors library does, so every tensor is aligned), then in the given
    order; ``keep_order=True`` keeps the given order. ``order`` is that file order. ``write(name,
    chunk)`` appends bytes to a tensor; with ``digest=True`` writes in file order are hashed on the fly,
    otherwise the file is re-read for the hash at close.
    """

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, *, keep_order: bool = False, digest: bool = True,
                 tmp_suffix: str | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + (tmp_suffix or f".tmp-{os.getpid()}"))
        ordered = list(range(len(entries))) if keep_order else \
            sorted(range(len(entries)), key=lambda i: (-itemsize(entries[i][1]), i))
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._slots: dict[str, list[int]] = {}  # name -> [relative begin, end, written]
        self.order: list[str] = []
        for i in ordered:
            name, dtype, shape = entries[i]
            if name in self._slots:
                raise ValueError(f"{self.path.name}: duplicate tensor name {name!r}")
            n = math.prod(shape) * itemsize(dtype)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._slots[name] = [offset, offset + n, 0]
            self.order.append(name)
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._prefix = struct.pack("<Q", len(blob)) + blob
        self.data_bytes = offset
        self.size = len(self._prefix) + offset
        self._hash = hashlib.sha256(self._prefix) if digest else None
        self._hashed_to = 0  # data bytes hashed so far (sequential writes only)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._write_at(self._prefix, 0)

    def _write_at(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def write(self, name: str, chunk) -> None:
        """Append CHUNK (a CPU tensor, or bytes-like) to tensor NAME."""
        data = tensor_bytes(chunk) if isinstance(chunk, torch.Tensor) else memoryview(chunk).cast("B")
        slot = self._slots[name]
        at = slot[0] + slot[2]
        if at + len(data) > slot[1]:
            raise ValueError(f"{self.path.name}: {name!r} is {slot[1] - slot[0]} bytes; write past its end")
        self._write_at(data, len(self._prefix) + at)
        slot[2] += len(data)
        if at == self._hashed_to and self._hash is not None:
            self._hash.update(data)
            self._hashed_to += len(data)
        else:
            self._hash = None

    def close(self, fsync: bool = True, digest: bool = True) -> tuple[int, str]:
        """Check every tensor is complete, fsync, rename into place; returns (size, sha256).
        DIGEST=False skips re-reading the file when writes were out of order (sha256 is then "")."""
        missing = [n for n, (b, e, w) in self._slots.items() if w != e - b]
        if missing:
            self.abort()
            raise ValueError(f"{self.path.name}: tensors not fully written: {missing[:5]}")
        if fsync:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if self._hash is not None:
            sha = self._hash.hexdigest()
        else:
            sha = sha256_file(self.tmp) if digest else ""
        os.replace(self.tmp, self.path)
        return self.size, sha

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                  fsync: bool = False) -> tuple[int, str]:
    """Write a dict of CPU tensors as one safetensors file (atomically); returns (size, sha256)."""
    entries = [(n, st_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with ShardWriter(path, entries, metadata) as w:
        for name in w.order:
            w.write(name, tensors[name])
        return w.close(fsync=fsync)


def write_shard(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None,
                on_tensor: Callable[[str, int], None] | None = None) -> int:
    """Write one safetensors file, producing each tensor only when it is written, in ``entries`` order
    (which is also the file order). Goes to ``<path>.tmp``, fsynced and renamed when complete; a rerun
    writes the same temporary name. Returns the file size."""
    planned = [(n, st_dtype(dt), tuple(shape)) for n, dt, shape in entries]
    with ShardWriter(path, planned, metadata, keep_order=True, digest=False, tmp_suffix=".tmp") as w:
        for name, dtype, shape in entries:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{Path(path).name}: {name!r} produced {t.dtype}{list(t.shape)}, "
                                 f"planned {dtype}{list(shape)}")
            w.write(name, t)
            if on_tensor:
                on_tensor(name, t.numel() * t.element_size())
            del t
        return w.close(fsync=True, digest=False)[0]


def shard_names(n: int) -> Iterable[str]:
    """HF's shard file names: ``model-00001-of-0000N.safetensors``."""
    for i in range(n):
        yield f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class HFReader:
    """All tensors of an HF checkpoint directory (``model.safetensors.index.json`` or ``*.safetensors``),
    read one at a time with ``pread``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            try:
                wm = read_json(index, what="safetensors index")["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointFormatError(f"{index}: not a safetensors index ({e})") from None
            files = sorted(set(wm.values()))
            missing = [f for f in files if not (self.root / f).exists()]
            if missing:
                raise CheckpointFormatError(f"{index} names shard(s) that do not exist: {missing[:5]}")
        else:
            files = sorted(p.name for p in self.root.glob("*.safetensors"))
            wm = None
            if not files:
                raise CheckpointFormatError(f"{self.root}: no model.safetensors.index.json and no *.safetensors files")
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_header(self.root / f).tensors.items():
                if name in self.tensors:
                    raise CheckpointFormatError(f"tensor {name!r} is in both {self.tensors[name].path.name} and {f}")
                self.tensors[name] = info
        if wm is not None:
            for name, f in wm.items():
                if name not in self.tensors or self.tensors[name].path.name != f:
                    raise CheckpointFormatError(f"{index}: {name!r} -> {f}, but {f} does not hold it")
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or rows [r0, r1) of it) in fresh memory."""
        info = self.tensors[name]
        fd = self._fds.get(info.path)
        if fd is None:
            fd = self._fds[info.path] = os.open(info.path, os.O_RDONLY)
        t = read_tensor(fd, info, info.path, rows)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
