"""Streaming read/write of megatron-core ``torch_dist`` distributed checkpoints, by global tensor.

Writing uses megatron-core's own pieces -- ``ShardedTensor``/``ShardedObject``,
``mcore_to_pyt_state_dict`` (its translation to PyTorch DCP objects) and ``MCoreSavePlanner`` -- so
the checkpoint is what ``dist_checkpointing.save`` would write for the same global tensors:
``.metadata`` + ``__R_F.distcp`` files, ``common.pt`` and ``metadata.json`` (``torch_dist``). Two
things differ, both for bounded memory:

* the state dict holds *meta* tensors; the planner's ``resolve_data`` produces each chunk's data
  only when the writer reaches it (megatron's own writer would preload every tensor of the rank);
* files are cut every ``file_bytes`` (PyTorch's writer keeps a reference to every tensor of a file
  until the file is closed), so a rank holds at most one file's worth of converted tensors.

Each rank writes the chunks it is given (any split across ranks works: DCP's global plan is the
union), through one collective ``torch.distributed.checkpoint.save``.

Reading requests global-tensor chunks (a whole tensor, one expert's slice, ...) through PyTorch
DCP with megatron's ``CheckpointableShardedTensor``, so it reads checkpoints written at any layout
(ours, ``dist_checkpointing.save`` from training, verl's ``dist_ckpt``), without collectives.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import warnings
from pathlib import Path
from collections.abc import Callable, Iterable

import torch

from dsv3_rl.checkpoint.safetensors_io import CheckpointFormatError

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A rectangular piece of a global tensor: ``key[offset : offset + shape]``."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _sharded_tensor(c: Chunk, data: torch.Tensor):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor(key=c.key, data=data, dtype=c.dtype, local_shape=tuple(c.shape),
                         global_shape=tuple(c.global_shape), global_offset=tuple(c.offset),
                         axis_fragmentations=None, replica_id=0, prepend_axis_num=0)


def _dcp_state_dict(chunks: list[Chunk], datas: list[torch.Tensor], objects: Iterable = ()) -> dict:
    """megatron ShardedTensors/ShardedObjects -> PyTorch DCP objects, via megatron's own translation."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    sd = {f"t{i}": _sharded_tensor(c, d) for i, (c, d) in enumerate(zip(chunks, datas))}
    for j, (key, shape, offset) in enumerate(objects):
        sd[f"o{j}"] = ShardedObject(key, None, tuple(shape), tuple(offset), replica_id=0)
    grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sd, keep_only_main_replica=True)
    return mcore_to_pyt_state_dict(grouped, is_loading=False)


class _LazyPlanner:
    """Factory for a ``MCoreSavePlanner`` whose tensor data is produced on demand."""

    def __new__(cls, produce: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]):
        from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
        from torch.distributed.checkpoint.planner import WriteItemType

        class LazyMCoreSavePlanner(MCoreSavePlanner):
            def resolve_data(self, write_item):
                if write_item.type == WriteItemType.BYTE_IO:
                    return super().resolve_data(write_item)
                chunk = write_item.tensor_data.chunk
                t = produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
                if tuple(t.shape) != tuple(chunk.sizes):
                    raise ValueError(f"{write_item.index.fqn}@{tuple(chunk.offsets)}: produced shape "
                                     f"{tuple(t.shape)}, planned {tuple(chunk.sizes)}")
                return t

        return LazyMCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)


def _bucketed_writer(path: Path, file_bytes: int):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

    class BucketedFileSystemWriter(FileSystemWriter):
        """One ``.distcp`` file per ``file_bytes`` of tensors (plus the small objects in the first)."""

        def write_data(self, plan, planner):
            prefix = plan.storage_data.prefix
            buckets: list[list] = [[]]
            size = 0
            for wi in sorted(plan.items, key=lambda w: w.type != WriteItemType.BYTE_IO):
                n = 0
                if wi.type != WriteItemType.BYTE_IO:
                    td = wi.tensor_data
                    n = math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
                if size and size + n > file_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append(wi)
                size += n
            file_queue: queue.Queue = queue.Queue()
            for i, bucket in enumerate(b for b in buckets if b):
                name = f"{prefix}{i}.distcp"
                file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
            return self._write_data(planner, file_queue)

    return BucketedFileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1,
                                    overwrite=True)


def save(path: Path, chunks: list[Chunk], objects: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
         produce: Callable[[Chunk], torch.Tensor], file_bytes: int = 1 << 30) -> None:
    """Write this rank's ``chunks`` (data from ``produce``) and ``objects`` (``_extra_state`` keys,
    shapes, offsets; value ``None``) into the distributed checkpoint at ``path``. Collective when
    torch.distributed is initialised; rank 0 also writes ``common.pt`` and ``metadata.json``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    by_loc = {(c.key, tuple(c.offset)): c for c in chunks}
    if len(by_loc) != len(chunks):
        raise ValueError("duplicate chunk (key, offset) in the write plan")

    def make(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        c = by_loc[(fqn, offsets)]
        t = produce(c)
        if t.dtype != c.dtype:
            raise ValueError(f"{fqn}@{offsets}: produced {t.dtype}, planned {c.dtype}")
        return t

    state = _dcp_state_dict(chunks, [torch.empty(c.shape, dtype=c.dtype, device="meta") for c in chunks], objects)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state, storage_writer=_bucketed_writer(path, file_bytes), planner=_LazyPlanner(make),
                 no_dist=not distributed)
    except CheckpointException as e:  # surface the real error (a bad tensor, a full disk), not DCP's wrapper
        failures = getattr(e, "failures", {}) or {}
        mine = failures.get(rank) or (next(iter(failures.values())) if failures else None)
        if mine is not None:
            exc = mine[0] if isinstance(mine, tuple) else mine
            if isinstance(exc, BaseException):
                raise exc from e
        raise
    if rank == 0:
        torch.save({}, path / "common.pt")  # what megatron's common strategy writes for a model-only dict
        save_config(CheckpointingConfig("torch_dist", 1), str(path))
    if distributed:
        dist.barrier()


# --------------------------------------------------------------------------- reading

@dataclasses.dataclass
class TensorMeta:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def read_metadata(path: Path) -> tuple[dict[str, TensorMeta], list[str]]:
    """Global tensors (key -> shape, dtype) and object keys of a torch_dist checkpoint."""
    from megatron.core.dist_checkpointing.core import maybe_load_config
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    cfg = maybe_load_config(str(path))
    if cfg is None:
        raise FileNotFoundError(f"{path}: no metadata.json, not a megatron distributed checkpoint (or an incomplete one)")
    if cfg.sharded_backend != "torch_dist":
        raise ValueError(f"{path}: sharded backend {cfg.sharded_backend!r}; this converter reads 'torch_dist'")
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path}: metadata.json but no .metadata: an incomplete torch_dist checkpoint")
    md = FileSystemReader(str(path)).read_metadata()
    tensors, objects = {}, []
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            tensors[k] = TensorMeta(k, tuple(v.size), v.properties.dtype)
        else:
            objects.append(k)
    return tensors, objects


def check_data_files(path: Path) -> None:
    """Every data file the checkpoint's .metadata points into exists and is long enough; raises
    CheckpointFormatError naming the first missing or truncated one."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for f, n in sorted(need.items()):
        p = Path(path) / f
        have = p.stat().st_size if p.exists() else 0
        if have < n:
            raise CheckpointFormatError(f"{path}: data file {f} is missing or truncated ({have} < {n} bytes)")


class Reader:
    """Read chunks of global tensors from one checkpoint, in batches (one DCP load per batch)."""

    def __init__(self, path: Path):
        from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
            CachedMetadataFileSystemReader,
        )

        self.path = Path(path)
        self.tensors, self.objects = read_metadata(self.path)
        check_data_files(self.path)
        self._reader = CachedMetadataFileSystemReader(str(self.path))
        self.bytes_read = 0

    def read(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

        for c in chunks:
            meta = self.tensors.get(c.key)
            if meta is None:
                raise KeyError(f"{self.path}: no tensor {c.key!r} in the checkpoint")
            if meta.shape != tuple(c.global_shape):
                raise ValueError(f"{self.path}: {c.key} has global shape {list(meta.shape)}, expected {list(c.global_shape)}")
        if not chunks:
            return []
        want = [c.dtype for c in chunks]
        chunks = [dataclasses.replace(c, dtype=self.tensors[c.key].dtype) for c in chunks]
        bufs = [torch.empty(c.shape, dtype=c.dtype) for c in chunks]
        state = _dcp_state_dict(chunks, bufs)
        # A fresh reader per load would re-read .metadata; the cached one is reset by DCP per call.
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(state, storage_reader=self._reader, planner=MCoreLoadPlanner(), no_dist=True)
            except (EOFError, RuntimeError, ValueError, OSError) as e:  # DCP wraps a reader's error in its own
                first = " ".join(str(e).split())[:300]
                raise CheckpointFormatError(f"{self.path}: cannot read {chunks[0].key}"
                                            f"{f' (+{len(chunks) - 1} more)' if len(chunks) > 1 else ''}: a data "
                                            f"file is corrupt ({type(e).__name__}: {first})") from None
        self.bytes_read += sum(b.numel() * b.element_size() for b in bufs)
        return [b if b.dtype == w else b.to(w) for b, w in zip(bufs, want)]
