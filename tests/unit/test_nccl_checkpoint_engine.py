"""verl patch 0042: verl's ``nccl`` checkpoint engine (the one-step-off trainer's trainer -> rollout weight sync on
GPUs) carries the refit checksum of patch 0031 (``dsv3_rl.refit.manifest``): actor rank 0 digests every tensor it
puts into the buckets and sends the manifest with the last bucket's metadata; each rollout worker digests what it
received and fails the sync naming the tensor.

verl's own ``NCCLCheckpointEngine`` runs in two processes with only its transport replaced
(tests/unit/nccl_ckpt_engine_worker.py: cupy's buffers are CPU tensors, ``ray.util.collective``'s broadcast is
torch.distributed gloo): three syncs of the same engines, 4 KiB buckets (five broadcasts, the embedding split
across two). A clean sync delivers every tensor bit for bit and passes the check; the planted-fault twin flips one
byte of the sender's second bucket just before its broadcast: the sync fails naming the tensor that byte belongs to,
and with the checksum off (``DSV3_REFIT_MANIFEST=0``) the same corruption reaches the rollout unnoticed (what
upstream's engine does)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import verl  # noqa: F401 - imported, not skipped: a missing or broken backend FAILS (`make setup` installs it)

from dsv3_rl.ports import free_port

WORKER = Path(__file__).with_name("nccl_ckpt_engine_worker.py")
REPO = Path(__file__).resolve().parents[2]
SCENARIOS = ("clean", "flip", "flip_off")


@functools.cache
def _run() -> dict[int, dict]:
    """Each rank's JSON (rank 0: the actor / sender, 1: the rollout / receiver), one launch for all three syncs."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    out = Path(tempfile.mkdtemp(prefix="nccl-ckpt-"))
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCHDYNAMO_DISABLE="1", NCCL_CKPT_TEST_OUT=str(out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(WORKER), *SCENARIOS]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    files = sorted(out.glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], f"not one JSON file per rank:\n{(r.stdout + r.stderr)[-3000:]}"
    res = {d["rank"]: d for d in (json.loads(f.read_text()) for f in files)}
    shutil.rmtree(out)
    return res


def _names() -> list[str]:
    """The names of the tensors the sender sent, in order (the worker's reference)."""
    return _run()[1]["reference"]


def test_nccl_engine_clean_sync_passes_the_manifest():
    sender, receiver = _run()[0]["clean"], _run()[1]["clean"]
    assert sender["error"] is None and sender["broadcasts"] == 5, sender  # several buckets
    assert receiver["error"] is None, receiver
    assert len(_names()) == 7 and receiver["names"] == _names() and receiver["differ"] == [], receiver  # every tensor, bit for bit
    assert receiver["manifest_tensors"] == len(_names()), receiver  # the manifest came with the last bucket


def test_nccl_engine_flipped_bucket_element_fails_naming_the_tensor():
    """Planted-fault twin: one byte flipped in the sender's second bucket on its way. The tensor it lands in (the
    embedding's second chunk) is the one the receiver's error names; with the checksum off the same sync passes and
    the rollout holds the corrupted tensor."""
    receiver = _run()[1]["flip"]
    assert _run()[0]["flip"]["error"] is None  # the sender does not know
    assert receiver["names"] == _names() and len(receiver["differ"]) == 1, receiver  # exactly one tensor corrupted
    (name,) = receiver["differ"]
    assert receiver["error"] and receiver["error"].startswith(
        f"ManifestMismatch: tensor {name!r} differs from what the trainer sent: digest "), receiver
    off = _run()[1]["flip_off"]
    assert off["error"] is None and off["differ"] == [name] and off["manifest_tensors"] is None, off
