"""Per-tensor checksum manifest of a refit: computed on the trainer side over the exported ``(name, tensor)``
stream, recomputed on the receiving side; a mismatch names the tensor.

The digest is computed where the tensor lives (GPU or CPU) with integer torch ops, so it costs one read of
the tensor and no host copy, and gives the same value on every device for the same bytes: the bytes, read
as int32 words (zero-padded to a whole word), are summed twice in int64 arithmetic (wrapping mod 2**64,
which is exact and order-independent): plainly, and weighted by a weight per position that no other position
of the tensor shares. Word ``i = c * CHUNK_WORDS + p`` (chunk ``c``) weighs ``perm[p] + c * CHUNK_WORDS``, with
``perm`` a fixed pseudo-random permutation of ``1..CHUNK_WORDS``: the weights are the distinct integers
``1..words`` (rounded up to whole chunks), so swapping two unequal words ``a != b`` at positions ``i, j``
changes the weighted sum by ``(a - b) * (w_i - w_j)``, never 0 mod 2**64 (both factors are non-zero and below
2**33 in size, so their product has fewer than 64 factors of two) for any tensor under 2**33 words (32 GiB;
DeepSeek-V3's largest, the embedding, is 1.9 GB). Chunks are processed ``BLOCK_CHUNKS`` at a time, so the
extra memory is bounded and the kernel launches are few; the same integer ops run on CPU and GPU, and the
weights are drawn on the CPU, so a tensor's digest is the same on every device. The dtype and shape are part
of the entry. A swapped pair of tensors or of words, a stale or shifted bucket, a transposed or truncated
tensor all change some entry; this is an integrity check against bugs, not a cryptographic hash.

    manifest = Manifest()
    for name, t in manifest.tap(trainer_stream):   # trainer side: record while sending
        send(name, t)
    manifest.verify(received_pairs)               # receiver side: raises ManifestMismatch naming the tensor

Under FP8 rollout (``rollout.quantization=fp8``) the trainer still sends BF16 and vLLM's worker quantizes each
received weight into ``float8_e4m3fn`` plus ``<name>_scale_inv`` before its loader takes them (verl's
``load_quanted_weights``). :class:`LoaderFeed` covers those tensors: verl's receiver opens one per sync, the
quantizer's output passes through :func:`tap_loader_feed`, which digests every tensor the worker made (not a
received one) as it is handed to the loader, and the receiver digests the same tensors again after the bucket's
load; a difference names the tensor. The BF16 tensors they were made from are checked against the trainer's
manifest, so the chain runs trainer -> received BF16 -> FP8 handed to the loader -> FP8 after the load.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from dsv3_rl.errors import Dsv3Error, env_flag

ENV = "DSV3_REFIT_MANIFEST"
"""``0`` (or another no-word of :func:`dsv3_rl.errors.env_flag`) switches the check in verl's weight sync off
(verl patch 0031); on by default; an unknown word is refused."""
CHUNK_WORDS = 1 << 20
BLOCK_CHUNKS = 16
"""Chunks digested per kernel launch: at most 2 x 16 x 8 MiB = 256 MiB of int64 working memory."""
_MASK = (1 << 64) - 1
_weights: dict[torch.device, torch.Tensor] = {}


class ManifestMismatch(Dsv3Error, ValueError):
    """A received tensor differs from what the trainer sent (the message names it)."""


class ManifestFormatError(Dsv3Error, ValueError):
    """A manifest's JSON text is not a manifest (the message names its source and the field)."""


def enabled() -> bool:
    """Whether verl's weight sync (patch 0031) records and checks the manifest: ``DSV3_REFIT_MANIFEST`` is
    unset or a yes-word; a no-word (``0``, ``no``, ``off``, ...) switches it off; anything else is refused."""
    return env_flag(ENV, default=True)


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """``perm``: a fixed permutation of ``1..CHUNK_WORDS`` (int64), drawn on the CPU, cached per device."""
    w = _weights.get(device)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = (torch.randperm(CHUNK_WORDS, generator=g, dtype=torch.int64) + 1).to(device)
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
    # word i = c * CHUNK_WORDS + p weighs w[p] + c * CHUNK_WORDS: sum_p x w[p] + CHUNK_WORDS * c * sum_p x, per chunk
    for b0 in range(0, full, BLOCK_CHUNKS):  # whole chunks, BLOCK_CHUNKS at a time: few kernel launches
        b1 = min(full, b0 + BLOCK_CHUNKS)
        c = words[b0 * CHUNK_WORDS:b1 * CHUNK_WORDS].view(b1 - b0, CHUNK_WORDS).to(torch.int64)
        rows = c.sum(dim=1)
        acc[0] += rows.sum()
        index = torch.arange(b0, b1, dtype=torch.int64, device=words.device)
        acc[1] += (c * w).sum() + (rows * index).sum() * CHUNK_WORDS
    tail = words[full * CHUNK_WORDS:].to(torch.int64)
    if tail.numel():
        rows = tail.sum()
        acc[0] += rows
        acc[1] += (tail * w[: tail.numel()]).sum() + rows * (full * CHUNK_WORDS)
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


def _compare(name: str, want: Entry, got: Entry, differs: str = "differs from what the trainer sent",
             ref: str = "sent") -> None:
    if got != want:
        what = [f"{k} {getattr(got, k)} != {ref} {getattr(want, k)}" for k in ("dtype", "shape", "digest")
                if getattr(got, k) != getattr(want, k)]
        raise ManifestMismatch(f"tensor {name!r} {differs}: {'; '.join(what)}")


class Manifest:
    """Ordered ``name -> Entry`` of one export. ROLE says what :meth:`add` records, for its messages:
    ``"exported"`` (the trainer's side), ``"received"`` (the receiver's own record), ``"handed to the loader"`` /
    ``"loaded"`` (a :class:`LoaderFeed`'s two records)."""

    ROLES = ("exported", "received", "handed to the loader", "loaded")

    def __init__(self, entries: dict[str, Entry] | None = None, *, role: str = "exported"):
        if role not in self.ROLES:
            raise ValueError(f"Manifest role {role!r}; allowed: {', '.join(self.ROLES)}")
        self.entries: dict[str, Entry] = dict(entries or {})
        self.role = role

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries:
            raise ManifestMismatch(f"tensor {name!r} {self.role} twice in one refit")
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
        got = Manifest(role="received")
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
    def from_json(cls, text: str | bytes, source: str = "the refit manifest") -> Manifest:
        """The manifest :meth:`to_json` wrote; raises ManifestFormatError naming SOURCE (and the tensor or field)
        when TEXT is not valid JSON or not ``{name: [dtype, [shape...], digest]}``."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise ManifestFormatError(f"{source}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ManifestFormatError(f"{source}: a JSON {type(data).__name__}; expected an object "
                                      f"{{tensor name: [dtype, shape, digest]}}")
        entries = {}
        for n, v in data.items():
            ok = (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and isinstance(v[1], list)
                  and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v[1])
                  and isinstance(v[2], str) and len(v[2]) == 32)
            if not ok:
                raise ManifestFormatError(f"{source}: entry of tensor {n!r} is {json.dumps(v)[:120]}; expected "
                                          f"[dtype, [non-negative sizes], 32-hex-digit digest]")
            entries[n] = Entry(v[0], tuple(v[1]), v[2])
        return cls(entries)

    def __len__(self) -> int:
        return len(self.entries)


_FEED: ContextVar[LoaderFeed | None] = ContextVar("dsv3_refit_loader_feed", default=None)


class LoaderFeed:
    """Receiver side, one sync: the tensors the rollout worker makes from the received ones for its loader (FP8
    rollout: each quantized weight and its ``_scale_inv``), digested as they are handed to the loader
    (:meth:`tap`) and again after the bucket's load (:meth:`after_load`); :meth:`verify` names the first that
    changed. Per loader SCOPE (the model, the MTP drafter), since verl quantizes the same weights once for each.
    Opened by verl's receiver for the thread it runs in (:meth:`start` / :meth:`stop`); the tensors of the bucket
    being loaded are kept until :meth:`after_load` (at most the FP8 copy of one bucket and its scales)."""

    def __init__(self):
        self.handed: dict[str, Manifest] = {}
        self.loaded: dict[str, Manifest] = {}
        self._pending: list[tuple[str, str, torch.Tensor]] = []
        self._token = None

    @classmethod
    def start(cls) -> LoaderFeed:
        feed = cls()
        feed._token = _FEED.set(feed)
        return feed

    def stop(self) -> None:
        if self._token is not None:
            _FEED.reset(self._token)
            self._token = None

    def tap(self, stream: Iterable[tuple[str, torch.Tensor]], received: Iterable[tuple[str, torch.Tensor]],
            scope: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
        """Pass STREAM (what the loader takes) through, recording each tensor that is not one of RECEIVED."""
        got = {id(t) for _n, t in received}
        handed = self.handed.setdefault(scope, Manifest(role="handed to the loader"))
        for name, t in stream:
            if id(t) not in got:
                handed.add(name, t)
                self._pending.append((scope, name, t))
            yield name, t

    def after_load(self) -> None:
        """The bucket's load is done: digest what was handed to the loader again, and let it go."""
        for scope, name, t in self._pending:
            self.loaded.setdefault(scope, Manifest(role="loaded")).add(name, t)
        self._pending.clear()

    def verify(self) -> int:
        """Every tensor handed to a loader is unchanged after the load. Returns the count."""
        self.after_load()
        for scope, handed in self.handed.items():
            loaded = self.loaded.get(scope, Manifest(role="loaded"))
            whose = "vLLM's loader" if scope == "model" else f"the {scope}'s loader"
            for name, want in handed.entries.items():
                _compare(name, want, loaded.entries[name], differs=f"differs after the load from what the rollout "
                         f"worker's quantizer handed {whose}", ref="handed")
        return sum(len(m) for m in self.handed.values())


def tap_loader_feed(stream: Iterable[tuple[str, torch.Tensor]], received: Iterable[tuple[str, torch.Tensor]],
                    scope: str = "model") -> Iterable[tuple[str, torch.Tensor]]:
    """The hook in verl's FP8 load (patch 0031): STREAM through the receiver's open :class:`LoaderFeed`, or
    unchanged when no sync with the check on is receiving in this thread."""
    feed = _FEED.get()
    return stream if feed is None else feed.tap(stream, received, scope)
