"""HF checkpoint I/O for the converter: read tensors one at a time with ``pread`` (no mmap, so the
process's RSS is what it really holds, not the page cache of a 1.3 TB checkpoint), and write
safetensors shards tensor by tensor to a temporary name, renamed into place when complete.

Files are ordinary safetensors (``safetensors.safe_open`` and transformers read them; tests check).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable

import torch
from dsv3_rl.errors import Dsv3Error

_DT = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ST = {v: k for k, v in _DT.items()}


class CheckpointFormatError(Dsv3Error, ValueError):
    """A file is not what it should be (truncated, not safetensors, bad index); names the file."""


@dataclass(frozen=True)
class TensorRef:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DT[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, TensorRef]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointFormatError(f"{path}: not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size or n > 100 << 20:
            raise CheckpointFormatError(f"{path}: truncated or not safetensors (header {n} bytes, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointFormatError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    out = {}
    end_max = 0
    for name, e in header.items():
        dtype, shape, (b, en) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
        if dtype not in _DT:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {dtype}, which the converter does not read")
        if en - b != math.prod(shape) * _DT[dtype].itemsize:
            raise CheckpointFormatError(f"{path}: tensor {name!r} {dtype}{list(shape)} has {en - b} bytes")
        out[name] = TensorRef(name, path, dtype, shape, 8 + n + b, 8 + n + en)
        end_max = max(end_max, 8 + n + en)
    if end_max > size:
        raise CheckpointFormatError(f"{path}: truncated: tensors need {end_max} bytes, the file has {size}")
    return out


class HFReader:
    """All tensors of an HF checkpoint directory (``model.safetensors.index.json`` or ``*.safetensors``)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
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
        self.tensors: dict[str, TensorRef] = {}
        for f in files:
            for name, ref in read_header(self.root / f).items():
                if name in self.tensors:
                    raise CheckpointFormatError(f"tensor {name!r} is in both {self.tensors[name].path.name} and {f}")
                self.tensors[name] = ref
        if wm is not None:
            for name, f in wm.items():
                if name not in self.tensors or self.tensors[name].path.name != f:
                    raise CheckpointFormatError(f"{index}: {name!r} -> {f}, but {f} does not hold it")
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or rows [r0, r1) of it) in fresh memory."""
        ref = self.tensors[name]
        shape = list(ref.shape)
        begin, end = ref.begin, ref.end
        if rows is not None:
            row = ref.nbytes // shape[0] if shape and shape[0] else 0
            begin, end = ref.begin + rows[0] * row, ref.begin + rows[1] * row
            shape[0] = rows[1] - rows[0]
        fd = self._fds.get(ref.path)
        if fd is None:
            fd = self._fds[ref.path] = os.open(ref.path, os.O_RDONLY)
        out = torch.empty(end - begin, dtype=torch.uint8)  # no zero-fill, unlike bytearray
        if out.numel():
            view, done = memoryview(out.numpy()), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], begin + done)
                if got == 0:
                    raise CheckpointFormatError(f"{ref.path}: truncated while reading {name!r}")
                done += got
        self.bytes_read += out.numel()
        return out.view(ref.torch_dtype).reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def write_shard(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None,
                on_tensor: Callable[[str, int], None] | None = None) -> int:
    """Write one safetensors file, producing each tensor only when it is written (in ``entries``
    order). Goes to ``<path>.tmp``, fsynced and renamed when complete. Returns the file size."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, dtype, shape in entries:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path.name}: {name!r} produced {t.dtype}{list(t.shape)}, planned {dtype}{list(shape)}")
            t = t.detach().contiguous().cpu()
            if t.numel():
                f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
            if on_tensor:
                on_tensor(name, t.numel() * t.element_size())
            del t
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, path)
    return size


def shard_names(n: int) -> Iterable[str]:
    for i in range(n):
        yield f"model-{i + 1:05d}-of-{n:05d}.safetensors"
