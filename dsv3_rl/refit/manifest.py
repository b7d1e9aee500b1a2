"""Per-tensor checksum manifest of a refit: computed on the trainer side over the exported ``(name, tensor)``
stream, recomputed on the receiving side; a mismatch names the tensor.

The digest is computed where the tensor lives (GPU or CPU) with integer torch ops, so it costs one read of
the tensor and no host copy, and gives the same value on every device for the same bytes: the bytes, read
as int32 words (zero-padded to a whole word), are summed twice in int64 arithmetic (wrapping mod 2**64,
which is exact and order-independent): plainly, and weighted by a fixed pseudo-random weight per position
(the weight vector is one chunk long and each chunk is additionally scaled by its index; chunks are
processed ``BLOCK_CHUNKS`` at a time, so the extra memory is bounded and the kernel launches are few). The dtype and shape are part of the entry. A swapped pair of tensors, a stale or
shifted bucket, a transposed or truncated tensor all change some entry; this is an integrity check against
bugs, not a cryptographic hash.

    manifest = Manifest()
    for name, t in manifest.tap(trainer_stream):   # trainer side: record while sending
        send(name, t)
    manifest.verify(received_pairs)               # receiver side: raises ManifestMismatch naming the tensor
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from dsv3_rl.errors import Dsv3Error

ENV = "DSV3_REFIT_MANIFEST"
"""``0`` switches the check in verl's weight sync off (verl patch 0031); on by default."""
CHUNK_WORDS = 1 << 20
BLOCK_CHUNKS = 16
"""Chunks digested per kernel launch: at most 2 x 16 x 8 MiB = 256 MiB of int64 working memory."""
_MASK = (1 << 64) - 1
_weights: dict[torch.device, torch.Tensor] = {}


class ManifestMismatch(Dsv3Error, ValueError):
    """A received tensor differs from what the trainer sent (the message names it)."""


def enabled() -> bool:
    """Whether verl's weight sync (patch 0031) records and checks the manifest: ``DSV3_REFIT_MANIFEST`` != 0."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _chunk_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = torch.randint(1, 1 << 31, (CHUNK_WORDS,), generator=g, dtype=torch.int64).to(device)
        _weights[device] = w
    return w


def _words(t: torch.Tensor) -> torch.Tensor:
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(torch.int32)


def digest(t: torch.Tensor) -> str:
    """Deterministic 128-bit digest of T's bytes (hex), computed on T's device with one host sync."""
    words = _words(t)
    w = _chunk_weights(words.device)
    acc = torch.zeros(2, dtype=torch.int64, device=words.device)  # plain, weighted
    full = words.numel() // CHUNK_WORDS
    for b0 in range(0, full, BLOCK_CHUNKS):  # whole chunks, BLOCK_CHUNKS at a time: few kernel launches
        b1 = min(full, b0 + BLOCK_CHUNKS)
        c = words[b0 * CHUNK_WORDS:b1 * CHUNK_WORDS].view(b1 - b0, CHUNK_WORDS).to(torch.int64)
        acc[0] += c.sum()
        scale = torch.arange(2 * b0 + 1, 2 * b1, 2, dtype=torch.int64, device=words.device)
        acc[1] += ((c * w).sum(dim=1) * scale).sum()
    tail = words[full * CHUNK_WORDS:].to(torch.int64)
    if tail.numel():
        acc[0] += tail.sum()
        acc[1] += (tail * w[: tail.numel()]).sum() * (2 * full + 1)
    plain, weighted = acc.tolist()
    return f"{plain & _MASK:016x}{weighted & _MASK:016x}"


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    digest: str

    @classmethod
    def of(cls, t: torch.Tensor) -> Entry:
        return cls(str(t.dtype).removeprefix("torch."), tuple(t.shape), digest(t))


def _compare(name: str, want: Entry, got: Entry) -> None:
    if got != want:
        what = [f"{k} {getattr(got, k)} != sent {getattr(want, k)}" for k in ("dtype", "shape", "digest")
                if getattr(got, k) != getattr(want, k)]
        raise ManifestMismatch(f"tensor {name!r} differs from what the trainer sent: {'; '.join(what)}")


class Manifest:
    """Ordered ``name -> Entry`` of one export."""

    def __init__(self, entries: dict[str, Entry] | None = None):
        self.entries: dict[str, Entry] = dict(entries or {})

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries:
            raise ManifestMismatch(f"tensor {name!r} exported twice")
        self.entries[name] = Entry.of(t)

    def tap(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass STREAM through, recording each tensor (trainer side)."""
        for name, t in stream:
            self.add(name, t)
            yield name, t

    def check(self, name: str, t: torch.Tensor) -> None:
        """Receiver side, one tensor: raises ManifestMismatch naming it."""
        want = self.entries.get(name)
        if want is None:
            raise ManifestMismatch(f"received tensor {name!r} is not in the trainer's manifest")
        _compare(name, want, Entry.of(t))

    def verify(self, received: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Receiver side, the whole export: every tensor matches and none is missing. Returns the count."""
        got = Manifest()
        for name, t in received:
            self.check(name, t)
            got.add(name, t)
        return self.verify_manifest(got)

    def verify_manifest(self, received: Manifest) -> int:
        """Receiver side, when the receiver recorded its own manifest of what it got: same tensors, same entries."""
        for name, got in received.entries.items():
            want = self.entries.get(name)
            if want is None:
                raise ManifestMismatch(f"received tensor {name!r} is not in the trainer's manifest")
            _compare(name, want, got)
        missing = [n for n in self.entries if n not in received.entries]
        if missing:
            raise ManifestMismatch(f"{len(missing)} tensor(s) sent but not received, first {missing[0]!r}")
        return len(received)

    def to_json(self) -> str:
        return json.dumps({n: [e.dtype, list(e.shape), e.digest] for n, e in self.entries.items()})

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        return cls({n: Entry(d, tuple(s), h) for n, (d, s, h) in json.loads(text).items()})

    def __len__(self) -> int:
        return len(self.entries)
