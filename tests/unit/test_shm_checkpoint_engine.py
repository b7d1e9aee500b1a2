"""verl patch 0035: the shared-memory checkpoint engine (``checkpoint_engine.backend: shm``), the CPU path of the
one-step-off trainer's trainer -> rollout weight sync. Driven through verl's own registry and topology contract
(``CheckpointEngineManager.build_process_group``'s steps, without Ray), against the sender's tensors. The sync
carries the refit checksum of patch 0031 (``dsv3_rl.refit.manifest``): per-tensor checksums in the manifest,
verified by every receiver."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import zipfile

import pytest
import torch

from verl.checkpoint_engine import CheckpointEngineRegistry

from dsv3_rl.refit.manifest import Manifest, ManifestMismatch


def _weights():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    return [("embed.weight", big), ("layers.0.q.weight", big[:8]),  # a view: must not carry the whole storage
            ("layers.0.norm.weight", torch.ones(48)), ("layers.0.experts.0.w", torch.randn(96, 32, generator=g))]


def _group(tmp_path, n_actor=2, n_rollout=2, bucket_size=4096):
    cls = CheckpointEngineRegistry.get("shm")
    actors = [CheckpointEngineRegistry.new("shm", bucket_size=bucket_size, is_master=(i == 0), root=str(tmp_path))
              for i in range(n_actor)]
    rollouts = [CheckpointEngineRegistry.new("shm", bucket_size=bucket_size, root=str(tmp_path), timeout_s=5)
                for _ in range(n_rollout)]
    meta = [e.prepare() for e in actors + rollouts]
    akw, rkw = cls.build_topology(n_actor, n_rollout, meta)
    for i, e in enumerate(actors):
        e.init_process_group(**{k: v[i] for k, v in akw.items()})
    for i, e in enumerate(rollouts):
        e.init_process_group(**{k: v[i] for k, v in rkw.items()})
    return actors, rollouts


async def _collect(engine, step):
    return [(n, t.clone()) async for n, t in engine.receive_weights(global_steps=step)]


def _sync(actors, rollouts, send_step, recv_step):
    drained = []

    def gen(tag):
        for n, t in _weights():
            drained.append(tag)
            yield n, t

    async def main():
        return await asyncio.gather(*[a.send_weights(gen(i), global_steps=send_step) for i, a in enumerate(actors)],
                                    *[_collect(r, recv_step) for r in rollouts], return_exceptions=True)

    return asyncio.run(main()), drained


def test_shm_engine_round_trip_bucketed(tmp_path):
    actors, rollouts = _group(tmp_path)
    path = actors[0].path
    out, drained = _sync(actors, rollouts, 3, 3)
    ref = _weights()
    for got in out[len(actors):]:
        assert [n for n, _ in got] == [n for n, _ in ref]
        for (_, a), (_, b) in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert drained.count(1) == len(ref)                 # the non-master actor rank drained its (collective) export
    assert len([f for f in os.listdir(path) if f.startswith("bucket_")]) > 1   # 4 KiB buckets: split
    # the view was written with its own storage, not the 64x48 base
    saved = dict(torch.load(os.path.join(path, "bucket_00001.pt"), weights_only=True))
    assert saved["layers.0.q.weight"].untyped_storage().nbytes() == 8 * 48 * 2
    # the refit checksum (patch 0031's manifest) of every tensor sent, against the sender's own tensors
    with open(os.path.join(path, "manifest.json")) as f:
        sent = Manifest.from_json(json.load(f)["dsv3_manifest"])
    assert sent.verify(ref) == len(ref)
    for e in actors + rollouts:
        e.finalize()
    assert not os.path.exists(path)


def test_shm_engine_version_mismatch_fails(tmp_path):
    """Planted-fault twin: the rollout expects version 4, the trainer sent version 3's weights."""
    actors, rollouts = _group(tmp_path, n_rollout=1)
    out, _ = _sync(actors, rollouts, 3, 4)
    assert isinstance(out[-1], RuntimeError) and "version 4" in str(out[-1]) and "version 3" in str(out[-1])


def test_shm_engine_no_sender_times_out(tmp_path):
    """Planted-fault twin: the trainer never sends (the rollout would keep stale weights): the receiver fails."""
    _, rollouts = _group(tmp_path, n_rollout=1)
    rollouts[0].timeout_s = 0.3
    with pytest.raises(TimeoutError, match="no bucket 0"):
        asyncio.run(_collect(rollouts[0], 1))


def test_shm_engine_refuses_two_hosts():
    cls = CheckpointEngineRegistry.get("shm")
    with pytest.raises(RuntimeError, match="one host"):
        cls.build_topology(1, 1, [{"host": "a", "path": "/dev/shm/x"}, {"host": "b", "path": None}])


def _corrupt_tensor_byte(bucket: str) -> str:
    """Flip one bit of the first tensor's data in a bucket file (torch.save's zip stores it uncompressed, and
    torch.load does not check the zip CRC); returns that tensor's name."""
    name = torch.load(bucket, weights_only=True)[0][0]
    with zipfile.ZipFile(bucket) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(open(bucket, "rb").read())
    n, extra = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    raw[info.header_offset + 30 + n + extra + 5] ^= 0x10
    with open(bucket, "wb") as f:
        f.write(raw)
    return name


def _sync_corrupted(tmp_path, monkeypatch, checksum: bool):
    """Send, flip a byte of a tensor in bucket 1, then receive."""
    if not checksum:
        monkeypatch.setenv("DSV3_REFIT_MANIFEST", "0")
    tmp_path.mkdir()
    actors, rollouts = _group(tmp_path, n_actor=1, n_rollout=1)

    async def main():
        await actors[0].send_weights(iter(_weights()), global_steps=2)
        name = _corrupt_tensor_byte(os.path.join(actors[0].path, "bucket_00001.pt"))
        try:
            return name, await _collect(rollouts[0], 2)
        except ManifestMismatch as e:
            return name, e

    return asyncio.run(main())


def test_shm_engine_corrupted_bucket_fails_naming_the_tensor(tmp_path, monkeypatch):
    """Planted-fault twin of the checksum: one flipped bit in a bucket file fails the receiver's sync, naming the
    tensor; with the checksum off (DSV3_REFIT_MANIFEST=0) the same corruption passes the version and count checks
    and reaches the rollout (what the checksum is for)."""
    name, got = _sync_corrupted(tmp_path / "on", monkeypatch, checksum=True)
    assert isinstance(got, ManifestMismatch), got
    assert f"tensor {name!r} differs from what the trainer sent: digest" in str(got)
    name, got = _sync_corrupted(tmp_path / "off", monkeypatch, checksum=False)
    assert isinstance(got, list) and not torch.equal(dict(got)[name], dict(_weights())[name])
