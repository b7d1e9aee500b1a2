"""One rank of tests/unit/test_nccl_checkpoint_engine.py (torchrun, two processes, gloo): verl's own
``NCCLCheckpointEngine`` (with patch 0042's refit manifest) syncs weights from rank 0 (actor rank 0, the engine's
master) to rank 1 (a rollout worker), with only the transport replaced:

* ``cupy`` (it needs CUDA, and pip has no CPU build) is a module whose arrays are CPU torch tensors: the master
  makes its two buckets with ``cp.zeros(bucket_size, dtype=cp.uint8)`` and copies each chunk in with
  ``cp.asarray(chunk)``;
* ``ray.util.collective`` (NCCL) is torch.distributed over gloo, one group per group name
  (:class:`GlooCollective`: the five calls the engine makes);
* the rollout's ``torch.zeros(..., device="cuda")`` buckets are made on the CPU (:class:`CudaOnCpu`, around
  ``prepare`` only) and ``torch.cuda.synchronize`` does nothing (CPU ops are synchronous);
* ``get_node_id`` (Ray's runtime context, which would start a Ray instance) is the host name.

The engine's zmq PUB/SUB metadata channel, its bucket packing and double buffering, the broadcast threads, the chunk
split / merge and the patch's hooks are verl's code as it runs on GPUs. The manager's part (verl's
``CheckpointEngineManager.update_weights``, steps 4-6: ``prepare`` on every worker, ``build_topology``,
``init_process_group``, send / receive, ``finalize``) runs here over the default gloo group (``all_gather_object``
in place of ``ray.get``); the engines live across the syncs, as verl's do.

argv: SCENARIO..., one sync each, in order: ``clean``; ``flip`` (one byte of the sender's second bucket flipped
just before its broadcast: a bucket corrupted on the way); ``flip_off`` (the same with ``DSV3_REFIT_MANIFEST=0`` on
both ranks). Each rank writes one JSON file, $NCCL_CKPT_TEST_OUT/rank<r>.json: the reference's tensor names and, per scenario, what it saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

BUCKET = 4096  # bytes: the weights below take several buckets and the embedding is split across two


def weights() -> list[tuple[str, torch.Tensor]]:
    """What the trainer exports (both ranks make the same: the rollout's reference)."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(64, 48, generator=g).to(torch.bfloat16)  # 6 KiB: larger than a bucket
    return [("model.embed_tokens.weight", emb),
            ("model.layers.0.self_attn.q_a_proj.weight", torch.randn(16, 48, generator=g).to(torch.bfloat16)),
            ("model.layers.0.input_layernorm.weight", torch.ones(48)),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.randn(32, 24, generator=g)),
            ("model.layers.0.mlp.experts.1.gate_proj.weight", torch.randn(32, 24, generator=g)),
            ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(8, generator=g)),
            ("lm_head.weight", emb[:32])]  # a view of the first rows


def _cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    cp.ndarray, cp.uint8 = torch.Tensor, torch.uint8
    cp.zeros = lambda n, dtype: torch.zeros(n, dtype=dtype)
    cp.asarray = lambda a: a  # cupy wraps a CUDA tensor without a copy (__cuda_array_interface__)
    return cp


class GlooCollective:
    """The ``ray.util.collective`` calls of verl's NCCL engine, on torch.distributed gloo. ``flip`` plants the fault:
    the source flips one byte in the middle of its broadcast number ``flip`` (0-based, counted per sync)."""

    def __init__(self):
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.flip: int | None = None
        self.broadcasts = 0

    def init_collective_group(self, world_size, rank, backend, group_name):
        assert backend == "nccl" and (world_size, rank) == (dist.get_world_size(), dist.get_rank()), (backend, rank)
        self.groups[group_name] = dist.new_group(list(range(world_size)), backend="gloo")

    def is_group_initialized(self, group_name):
        return group_name in self.groups

    def barrier(self, group_name):
        dist.barrier(group=self.groups[group_name])

    def broadcast(self, tensor, src_rank, group_name):
        if dist.get_rank() == src_rank:
            if self.broadcasts == self.flip:
                tensor[tensor.numel() // 2] ^= 0x10
            self.broadcasts += 1
        dist.broadcast(tensor, src=src_rank, group=self.groups[group_name])

    def destroy_collective_group(self, group_name):
        dist.destroy_process_group(self.groups.pop(group_name))


class CudaOnCpu(TorchFunctionMode):
    """``device="cuda"`` -> the CPU, for the rollout's buckets in ``prepare``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


async def _receive(engine, step: int, got: list) -> None:
    async for name, t in engine.receive_weights(global_steps=step):
        got.append((name, t.clone()))


def main() -> None:
    sys.modules["cupy"] = _cupy()
    torch.cuda.synchronize = lambda *a, **k: None
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.checkpoint_engine import nccl_checkpoint_engine as nccl

    from dsv3_rl.refit.manifest import Manifest

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    collective = nccl.collective = GlooCollective()
    nccl.NCCLCheckpointEngine.get_node_id = staticmethod(socket.gethostname)
    cls = CheckpointEngineRegistry.get("nccl")
    engine = CheckpointEngineRegistry.new("nccl", bucket_size=BUCKET, is_master=(rank == 0))
    ref = weights()
    out = {"rank": rank, "reference": [n for n, _ in ref]}
    for step, scenario in enumerate(sys.argv[1:], 1):
        os.environ["DSV3_REFIT_MANIFEST"] = "0" if scenario.endswith("_off") else "1"
        collective.flip = 1 if scenario.startswith("flip") else None
        collective.broadcasts = 0
        t0 = time.monotonic()
        with CudaOnCpu():
            meta = engine.prepare()
        metadata = [None, None]
        dist.all_gather_object(metadata, meta)  # the manager's ray.get of every worker's prepare()
        actor_kw, rollout_kw = cls.build_topology(1, 1, metadata)
        engine.init_process_group(**{k: v[0] for k, v in (actor_kw if rank == 0 else rollout_kw).items()})
        # the manager's round trip between init_process_group and update_weights: the receiver's zmq subscription
        # reaches the publisher before the first bucket's metadata (a PUB socket drops what no subscriber has asked for)
        dist.barrier()
        time.sleep(0.3)
        res, got = {"error": None}, []
        try:
            if rank == 0:
                asyncio.run(engine.send_weights(iter(weights()), global_steps=step))
            else:
                asyncio.run(_receive(engine, step, got))
        except Exception as e:  # noqa: BLE001 - reported, the test asserts on it
            res["error"] = f"{type(e).__name__}: {e}"
        if rank == 1:
            want = dict(ref)
            res["names"] = [n for n, _ in got]
            res["differ"] = [n for n, t in got if not (t.dtype == want[n].dtype and t.shape == want[n].shape
                                                       and torch.equal(t, want[n]))]
            carried = getattr(engine, "_dsv3_manifest", None)
            res["manifest_tensors"] = None if carried is None else len(Manifest.from_json(carried))
        else:
            res["broadcasts"] = collective.broadcasts
        engine.finalize()
        res["seconds"] = round(time.monotonic() - t0, 3)
        out[scenario] = res
    dist.barrier()
    # one file per rank (the two ranks' stdout share one pipe: a line of each can arrive joined)
    path = os.path.join(os.environ["NCCL_CKPT_TEST_OUT"], f"rank{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
