"""Refit-time model: how long pushing the trainer's weights into colocated vLLM engines takes, for a layout
pair (trainer TP/PP/EP -> rollout TP/DP/EP), from bytes per GPU and bandwidths. See docs/refit.md.

Two algorithms, each a sum of phases (no overlap between phases: an upper bound of that algorithm's
bandwidth limits; nominal NVLink/IB bandwidths of the GPU catalog, so a lower bound of real overheads):

``sharded`` (NeMo-RL's design class; what a refit can do):
  1. gather: within the pipeline stage that owns a layer, every GPU assembles full HF tensors of the stage
     (TP shards of dense weights, EP x ETP shards of the experts), over NVLink inside a node and the
     network for the peers outside it;
  2. export: the stage's HF-named tensors are packed into buckets at the trainer-side export rate
     (bench/bench_refit.py measures it; default: half the HBM copy rate, the bench's target);
  3. scatter: every rollout GPU receives the bytes it keeps (its TP/EP shard of every tensor, the
     replicated MLA down-projections whole) from the stage owning them; the part owned by a stage on its own
     node comes over NVLink, the rest over the network; every trainer GPU sends as many bytes as a rollout
     GPU receives (colocated, same GPU count) or proportionally more;
  4. load: the rollout GPU copies what it received into its weights (HBM copy rate).

``verl`` (verl 0.9.1's bridge-free export, ``per_tensor_generator``, as this repo runs it): every tensor is
  broadcast from its pipeline stage to every PP rank, all-gathered over EP/TP there, and every trainer GPU
  produces the *whole* HF model and hands it to its colocated vLLM worker through the bucket (one copy of
  every byte), which slices its shard out of it.
"""

from __future__ import annotations

import dataclasses

from dsv3_rl.planner.memory import rollout_weight_bytes
from dsv3_rl.planner.model import ModelSpec, count_params
from dsv3_rl.planner.spec import GPUType

GB = 1e9


@dataclasses.dataclass(frozen=True)
class RefitEstimate:
    algorithm: str
    seconds: float
    phases: dict[str, float]          # seconds per phase
    trainer_bytes_per_gpu: float      # HF-named bytes each trainer GPU produces
    rollout_bytes_per_gpu: float      # bytes each rollout GPU keeps
    export_gbps: float

    def short(self) -> str:
        ph = ", ".join(f"{k} {v:.2f}" for k, v in self.phases.items())
        return (f"{self.algorithm} {self.seconds:.2f} s ({ph}; {self.trainer_bytes_per_gpu / GB:.0f} GB produced per "
                f"trainer GPU, {self.rollout_bytes_per_gpu / GB:.1f} GB kept per rollout GPU)")


def copy_gbps(gpu: GPUType) -> float:
    """Bytes copied per second by a device-to-device copy: half the HBM bandwidth (read + write)."""
    return gpu.hbm_tbs * 1000 / 2


def _split_time(nbytes: float, remote_fraction: float, gpu: GPUType) -> float:
    """NVLink and network in parallel: the slower of the two shares."""
    return max(nbytes * remote_fraction / (gpu.network_gbs * GB), nbytes * (1 - remote_fraction) / (gpu.nvlink_gbs * GB))


def _outside_node(group: int, gpus_per_node: int) -> float:
    """Share of a group's peers outside the node (groups of consecutive ranks)."""
    if group <= 1 or group <= gpus_per_node:
        return 0.0
    return (group - gpus_per_node) / (group - 1)


def rollout_bytes_per_gpu(m: ModelSpec, tp: int, dp: int = 1, ep: bool = False, quantization: str = "none") -> float:
    """What one vLLM GPU keeps: experts over TP (or over TP x DP with EP), everything else over TP, except the
    MLA down-projections (q_a_proj, kv_a_proj_with_mqa), norms and router, which vLLM replicates; with
    ``quantization="fp8"`` DeepSeek's FP8 set in FP8 + scales, the rest BF16. The rollout memory's count
    (:func:`dsv3_rl.planner.memory.rollout_weight_bytes`)."""
    return rollout_weight_bytes(m, tp, tp * dp if ep else 1, quantization)


def estimate_refit(m: ModelSpec, gpu: GPUType, gpus_per_node: int, trainer_gpus: int, tp: int, pp: int, ep: int,
                   rollout_tp: int, rollout_dp: int = 1, rollout_ep: bool = False, rollout_gpus: int | None = None,
                   etp: int | None = None, export_gbps: float | None = None, quantization: str = "none",
                   algorithm: str = "sharded") -> RefitEstimate:
    if algorithm not in ("sharded", "verl"):
        raise ValueError(f"refit algorithm {algorithm!r} (allowed: sharded, verl)")
    etp = tp if etp is None else etp
    rollout_gpus = rollout_gpus or trainer_gpus
    export_gbps = export_gbps or copy_gbps(gpu) / 2
    p = count_params(m)
    w_exp, w_dense = p.experts * 2.0, (p.total - p.experts) * 2.0  # the trainer exports BF16
    w_all = w_exp + w_dense
    r = rollout_bytes_per_gpu(m, rollout_tp, rollout_dp, rollout_ep, quantization)
    load = r / (copy_gbps(gpu) * GB)
    quant = (w_all / pp if algorithm == "sharded" else w_all) * (quantization == "fp8") / (0.8 * copy_gbps(gpu) * GB)
    if algorithm == "sharded":
        stage_gpus = trainer_gpus // pp
        gather = max(_split_time(w_exp / pp * (1 - 1 / (ep * etp)), _outside_node(ep * etp, gpus_per_node), gpu),
                     w_dense / pp * (1 - 1 / tp) / (gpu.nvlink_gbs * GB))
        produced = w_all / pp
        export = produced / (export_gbps * GB) + quant
        local = min(1.0, max(1.0, gpus_per_node / stage_gpus) / pp)  # stages whose full tensors sit on this node
        recv = _split_time(r, 1 - local, gpu)
        send = _split_time(r * rollout_gpus / trainer_gpus, 1 - local, gpu)
        phases = {"gather": gather, "export": export, "scatter": max(recv, send), "load": load}
    else:
        # PP broadcast of each owner's shard to every PP rank, then EP/TP all-gather on every rank
        shard = w_exp / (ep * etp) + w_dense / tp
        stage_gpus = trainer_gpus // pp
        same_node = min(pp, max(1, gpus_per_node // stage_gpus))  # PP peers are stage_gpus ranks apart
        bcast = _split_time(shard * (1 - 1 / pp), 1 - (same_node - 1) / max(1, pp - 1), gpu) if pp > 1 else 0.0
        gather = max(_split_time(w_exp * (1 - 1 / (ep * etp)), _outside_node(ep * etp, gpus_per_node), gpu),
                     w_dense * (1 - 1 / tp) / (gpu.nvlink_gbs * GB))
        produced = w_all
        export = produced / (export_gbps * GB) + quant
        phases = {"pp-broadcast": bcast, "gather": gather, "export": export, "load": load}
    return RefitEstimate(algorithm, sum(phases.values()), phases, produced, r, export_gbps)


def refit_lines(m: ModelSpec, gpu: GPUType, gpus_per_node: int, trainer_gpus: int, layout, rollout,
                quantization: str = "none", export_gbps: float | None = None) -> list[str]:
    """The planner's report lines for a trainer Layout and a RolloutLayout (both algorithms)."""
    kw = dict(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, rollout_tp=rollout.tp,
              rollout_dp=rollout.dp, rollout_ep=rollout.ep > 1, rollout_gpus=rollout.gpus, quantization=quantization,
              export_gbps=export_gbps)
    out = []
    for alg in ("sharded", "verl"):
        e = estimate_refit(m, gpu, gpus_per_node, trainer_gpus, algorithm=alg, **kw)
        out.append(f"refit estimate ({'FP8' if quantization == 'fp8' else 'BF16'} rollout weights): {e.short()}")
    return out
