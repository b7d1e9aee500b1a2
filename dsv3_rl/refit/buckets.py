"""verl's bucketing of a refit, as a reusable loop (bench/bench_refit.py, manifest tests).

verl's colocated weight sync (``BucketedWeightSender.async_send_weights`` in
``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``) packs the exported ``(name, tensor)``
stream into one preallocated byte buffer of ``rollout.update_weights_bucket_megabytes`` (default 2048 MiB):
each tensor's offset is aligned to its element size, the bucket is handed over when the next tensor would
not fit (and is not the first), and a tensor larger than the bucket is sent on its own ("direct"). That
file imports zmq and needs a receiving process, so it is not run here; ``fill_buckets`` is the same loop
and tests/unit/test_refit.py drives verl's sender with a stand-in socket to check that both cut the stream
into the same buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

DEFAULT_BUCKET_MB = 2048  # verl RolloutConfig.update_weights_bucket_megabytes / CheckpointEngineConfig default


@dataclass
class Bucket:
    index: int
    items: list[tuple[str, torch.Size, torch.dtype, int]] = field(default_factory=list)  # name, shape, dtype, offset
    direct: torch.Tensor | None = None  # a tensor larger than the bucket, sent as itself
    nbytes: int = 0

    def tensors(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors as views of BUFFER (what the receiver reads)."""
        if self.direct is not None:
            return [(self.items[0][0], self.direct)]
        return [(n, buffer[o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape))
                for n, shape, dtype, o in self.items]


def fill_buckets(stream: Iterable[tuple[str, torch.Tensor]], buffer: torch.Tensor,
                 on_bucket: Callable[[Bucket, torch.Tensor], None]) -> tuple[int, int]:
    """Copy STREAM into BUFFER (uint8) bucket by bucket as verl does, calling ON_BUCKET(bucket, buffer) for each
    full bucket before the buffer is reused. Returns (tensors, bytes)."""
    size = buffer.numel()
    bucket, offset, count, total = Bucket(0), 0, 0, 0
    for name, weight in stream:
        alignment = weight.element_size()
        offset = (offset + alignment - 1) // alignment * alignment
        if offset + weight.nbytes > size and bucket.items:
            on_bucket(bucket, buffer)
            bucket, offset = Bucket(bucket.index + 1), 0
        count += 1
        total += weight.nbytes
        if offset + weight.nbytes > size:
            direct = Bucket(bucket.index, [(name, weight.shape, weight.dtype, 0)], weight, weight.nbytes)
            on_bucket(direct, buffer)
            bucket = Bucket(bucket.index + 1)
            continue
        bucket.items.append((name, weight.shape, weight.dtype, offset))
        buffer[offset:offset + weight.nbytes].view(weight.dtype).view(weight.shape).copy_(weight, non_blocking=True)
        offset += weight.nbytes
        bucket.nbytes = offset
    on_bucket(bucket, buffer)  # verl sends the last bucket even when empty
    return count, total
