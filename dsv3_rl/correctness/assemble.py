"""Put a layout's per-rank records back together as full tensors.

Activations: each rank wrote its hook records per call (= per micro-batch of its data-parallel
share) in megatron's ``[seq, batch, ...]`` layout. Sequence-parallel ranks hold consecutive slices
of the sequence, the output layer's TP ranks consecutive slices of the vocabulary; replicated
copies (TP without SP, the router at TP without SP) are checked to be identical and one is kept.
The result is canonical ``[batch, seq, ...]`` over the whole test batch, in micro-batch order.

Gradients: the worker saved them as a dist checkpoint sharded like the weights; megatron's own
dist_checkpointing reassembles them at TP1/PP1/EP1 (as ``layout_check.load_full`` does), keeping
only entries that are parameters (buffers such as ``router.expert_bias`` are saved beside them).
"""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path

import torch

from dsv3_rl.correctness.hooks import ROUTER_KEYS
from dsv3_rl.errors import Dsv3Error


class AssemblyError(Dsv3Error, RuntimeError):
    pass


def _component(key: str) -> str:
    return key.split("/")[-1]


def load_ranks(out: Path) -> list[dict]:
    files = sorted((out / "acts").glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise AssemblyError(f"{out}/acts has no rank*.pt: the worker did not finish")
    return [torch.load(f, weights_only=False) for f in files]


def assemble(out: Path, batch_size: int, seq_length: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(canonical records, info): info has ``loss`` (training loss), ``micro_losses`` and
    ``replica_max_diff`` (largest difference between copies that should be identical)."""
    ranks = load_ranks(out)
    pieces: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = collections.defaultdict(list)
    micro_losses: dict[int, float] = {}
    mbs = ranks[0]["meta"]["micro_batch_size"]
    n_global = batch_size // mbs
    for r in ranks:
        meta = r["meta"]
        for key, calls in r["records"].items():
            if len(calls) != meta["n_micro"]:
                raise AssemblyError(f"rank {meta['rank']}: hook {key} fired {len(calls)} times for {meta['n_micro']} micro-batches")
            for k, t in enumerate(calls):
                pieces[(key, meta["dp_rank"] * meta["n_micro"] + k)].append((meta["tp_rank"], t))
        if r["losses"] is not None:
            for k, v in enumerate(r["losses"]):
                g = meta["dp_rank"] * meta["n_micro"] + k
                if g in micro_losses and abs(micro_losses[g] - v) > 1e-6 * max(1.0, abs(v)):
                    raise AssemblyError(f"micro-batch {g}: ranks report different losses {micro_losses[g]} vs {v}")
                micro_losses[g] = v
    replica_diff = 0.0
    full: dict[str, list[torch.Tensor | None]] = collections.defaultdict(lambda: [None] * n_global)
    for (key, g), ps in pieces.items():
        comp = _component(key)
        by_tp: dict[int, torch.Tensor] = {}
        for tp_rank, t in ps:
            if comp in ROUTER_KEYS:  # [s_local * b, E] -> [s_local, b, E]
                t = t.view(-1, mbs, t.shape[-1])
            if tp_rank in by_tp:
                replica_diff = max(replica_diff, _diff(by_tp[tp_rank], t))
            else:
                by_tp[tp_rank] = t
        parts = [by_tp[k] for k in sorted(by_tp)]
        dim = -1 if comp == "logits" else 0
        if all(p.shape == parts[0].shape for p in parts) and parts[0].shape[0] == seq_length and (
                comp != "logits" or len(parts) == 1 or _same(parts)):
            for p in parts[1:]:
                replica_diff = max(replica_diff, _diff(parts[0], p))
            t = parts[0]
        else:
            t = torch.cat(parts, dim=dim)
        if t.shape[0] != seq_length:
            raise AssemblyError(f"{key} micro-batch {g}: reassembled sequence length {t.shape[0]} != {seq_length}")
        full[key][g] = t.transpose(0, 1)  # [s, b, ...] -> [b, s, ...]
    records = {}
    for key, parts in full.items():
        missing = [g for g, p in enumerate(parts) if p is None]
        if missing:
            raise AssemblyError(f"{key}: no record for micro-batch(es) {missing}")
        records[key] = torch.cat(parts, dim=0)
    if sorted(micro_losses) != list(range(n_global)):
        raise AssemblyError(f"losses reported for micro-batches {sorted(micro_losses)}, expected 0..{n_global - 1}")
    losses = torch.tensor([micro_losses[g] for g in range(n_global)], dtype=torch.float64)
    info = dict(micro_losses=losses, loss=float(losses.mean()), replica_max_diff=replica_diff, world=len(ranks))
    return records, info


def _same(parts: list[torch.Tensor]) -> bool:
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise AssemblyError(f"replicas differ in shape {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dtype == torch.bool:
        return float((a != b).float().max()) if a.numel() else 0.0
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


@contextlib.contextmanager
def single_process_megatron():
    """A one-process megatron context (gloo/NCCL world of 1) in this process; restores the
    rendezvous environment afterwards so that child processes see none of it."""
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    own_init = not torch.distributed.is_initialized()
    try:
        if own_init:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        runtime.init_distributed(Parallel())
        yield
    finally:
        if own_init:
            runtime.destroy()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def full_grads(hf_config, grads_dir: Path, dtype: torch.dtype = torch.float32,
               use_te: bool | None = None) -> dict[str, torch.Tensor]:
    """Full gradients (megatron TP1 names, fp32, CPU) from a gradient dist checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime
    from dsv3_rl.mcore.layout_check import sharded_state_dict

    with single_process_megatron():
        chunks = runtime.build_model(hf_config, Parallel(), dtype=dtype, use_te=use_te)
        params = {n for n, _ in chunks[0].named_parameters()}
        sd = dist_checkpointing.load(sharded_state_dict(chunks), str(grads_dir))
        missing = params - set(sd)
        if missing:
            raise AssemblyError(f"gradient checkpoint {grads_dir} lacks {sorted(missing)[:5]}")
        return {k: sd[k].detach().float().cpu().clone() for k in sorted(params)}
