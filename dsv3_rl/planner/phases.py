"""Per-phase prediction of one GRPO *training* step (the actor side, what ``bench/bench_grpo_update.py``
measures): ``log_prob`` (verl's ``compute_log_prob``, one forward over the batch), ``update`` (forward +
backward over every micro-batch, gradient sync, optimizer step) and ``export`` (verl's refit export of the
weights as HF tensors), each with time, tokens/s/GPU, model TFLOP/s/GPU, MFU and peak memory per GPU in the
units the bench reports, so that ``dsv3-plan validate`` can put one next to the other.

The model (assumptions; docs/planner.md, "Measured against the planner"):

* model FLOPs (:func:`dsv3_rl.planner.comm.batch_flops`, per term :func:`~dsv3_rl.planner.comm.flop_terms`): per
  token 2 x the weights it multiplies (no input embedding, a lookup; no norm weights) forward, plus causal attention
  per sequence, ``2 * heads * (qk_dim + v_dim) * s^2 / 2`` per layer; training = 3 x forward (recompute is extra
  work, not model FLOPs);
* micro-batches as verl builds them (:func:`micro_batches`): with ``Options.remove_padding=False`` (BSHD, the local
  spec) every micro-batch is padded to the longest sequence of the DP rank's mini-batch, and the model computes and
  stores the padded tokens (the largest padded micro-batch sets the activations; the padded FLOPs the time; MFU
  counts the real ones);
* time (rules measured on 4 x H100, 2026-11-26; docs/planner.md, "Measured vs predicted (4x H100, 2026-11-26)"):
  GEMM + attention = padded FLOPs / (GPUs x dense BF16 peak x :data:`GEMM_EFFICIENCY`) / (1 - pipeline bubble);
  memory-bound kernels (:data:`ELEMENTWISE_BYTES_PER_SAVED_BYTE` x the saved activation bytes, plus the fp32
  grad accumulation per micro-batch); host gaps per layer and micro-batch (:data:`HOST_GAP_S_PER_LAYER_MB`);
  exposed communication (no overlap inside a micro-batch) at ``COMM_EFFICIENCY`` x nominal NVLink (inter-node by
  the NIC) plus :data:`COLLECTIVE_LATENCY_S` per call: MoE all-to-all (dispatch + combine of every routed copy that
  leaves the GPU, forward; again in the backward), TP/SP collectives (:data:`TP_COLLECTIVES_FWD` /
  :data:`TP_COLLECTIVES_BWD` per layer and micro-batch), PP sends;
* gradient sync (distributed optimizer): reduce-scatter of the grads + all-gather of the bf16 params over DP
  (dense) and expert-DP (experts), not overlapped (verl's default ``overlap_grad_reduce`` is off);
* optimizer step: memory-bound, ``OPTIMIZER_BYTES_PER_PARAM`` bytes of HBM traffic per local main parameter;
* export: verl's per-tensor export as :func:`dsv3_rl.planner.refit.estimate_refit` models it (``verl``
  algorithm, PP broadcast + EP/TP gather + producing every HF tensor), without the rollout's load;
* memory: the update's peak is the planner's trainer peak (``allocated``: what
  ``torch.cuda.max_memory_allocated`` shows, the reserve excluded); log-prob = weights + grads + optimizer
  states (they stay resident) + on the last stage verl's entropy/log-prob buffers (:data:`LOGPROB_VOCAB_BYTES`
  per token x vocab/TP), else one layer's forward working set; export = the same
  static memory + the 2 GiB bucket + one MoE layer's experts gathered over EP (bf16).
"""

from __future__ import annotations

import dataclasses
import math

from dsv3_rl.planner import comm as comm_mod
from dsv3_rl.planner import memory as mem
from dsv3_rl.planner.model import load_model
from dsv3_rl.planner.pipeline import bubble_fraction
from dsv3_rl.planner.spec import GIB, Cluster, GRPOShape, Layout, Options, from_dict

PHASES = ("log_prob", "update", "export")
#: HBM bytes per local main parameter of one optimizer step: Adam reads param, grad, m, v (16 B) and writes
#: param, m, v (12 B), torch's foreach temporaries (~8 B), the fp32 -> bf16 model-param copy (6 B) and zeroing
#: the fp32 grad buffer (4 B)
OPTIMIZER_BYTES_PER_PARAM = 46.0
#: achieved fraction of the nominal per-GPU link bandwidth for all-to-all / TP collectives / gradient sync
COMM_EFFICIENCY = 0.6
#: achieved fraction of HBM bandwidth for the memory-bound optimizer step
HBM_EFFICIENCY = 0.7
#: the refit's bucket buffer the export fills (bench_grpo_update.py's GPU default, ``--bucket-mb 2048``)
EXPORT_BUCKET = 2 * GIB
#: bytes per (token x vocab/TP) element alive at once on the last PP stage while verl's ``compute_log_prob`` runs
#: its logits processor with ``calculate_entropy=True`` (transformer_impl.py ``_lm_head_logits_processor``): the
#: bf16 logits and megatron's ``transpose(0, 1).contiguous()`` copy, ``logits.clone()`` for the entropy, the
#: entropy's ``logits - max`` tensor, then megatron's cross entropy's fp32 ``.float()`` copy. Measured as
#: (log-prob peak - static memory) / (largest padded micro-batch x vocab/TP): 16.6 B at TP2 (3 runs) and 17.1 B
#: at TP4 (H100, 2026-11-26); best3's rank 3 held 12.5 B when the fp32 copy (4 B) failed. (The old rule counted
#: the update's 6 B: fp32 saved + bf16 logits.)
LOGPROB_VOCAB_BYTES = 16.6
#: achieved fraction of the BF16 peak of the GEMM (nvjet, cutlass grouped) and cuDNN SDPA kernels on the padded
#: FLOPs: 0.841 PFLOP per GPU in 1.011 s GEMM + 0.520 s attention kernel time (best1 trace, H100, 2026-11-26)
GEMM_EFFICIENCY = 0.555
#: HBM bytes of memory-bound (elementwise, norm, SwiGLU, RoPE, cat/copy, permutation) kernels per byte of saved
#: activations, forward + backward: best1's 0.92 s of such kernels (1.06 s "other" minus 0.14 s of fp32 gradient
#: accumulation) moved ~2.16 TB at 0.7 x 3.35 TB/s against 100 GB of activations saved over its 9 micro-batches
ELEMENTWISE_BYTES_PER_SAVED_BYTE = 21.5
#: fp32 main-grad accumulation after each micro-batch's backward: read fp32 + bf16 grad, write fp32 (10 B per
#: local parameter per micro-batch; best1: 3.68 G params x 9 x 10 B / 2.35 TB/s = 0.14 s, trace 0.139 s)
GRAD_ACCUM_BYTES_PER_PARAM = 10.0
#: per collective launch + synchronisation latency (NCCL on NVLink, small calls of the best1 trace: 15-46 us)
COLLECTIVE_LATENCY_S = 30e-6
#: hidden-sized TP/SP collectives per decoder layer and micro-batch with sequence parallelism (megatron-core
#: 0.16.1 local spec, MLA down-projections column-parallel): forward 3 all-gathers (q_down, kv_down, MLP/shared
#: fc1 inputs) + 2 reduce-scatters (linear_proj, fc2); backward 3 re-gathers of those inputs for the weight grads,
#: 2 all-gathers of the row-parallel output grads and 3 reduce-scatters of the column-parallel input grads.
#: best1 trace: 35 all-gathers + 22 reduce-scatters of hidden size per micro-batch = 4 layers x (8 + 5) + output layer
TP_COLLECTIVES_FWD = 5
TP_COLLECTIVES_BWD = 8
#: GPU idle while the host launches kernels (the local spec runs ~600 small kernels per layer and micro-batch, fwd +
#: bwd; 21k kernels in best1's update), per decoder layer and micro-batch, forward + backward (a third of it in a
#: forward-only pass): best1's update measured 3.90 s with 3.20 s of kernel time = 0.70 s / (9 x 4) = 19.4 ms.
#: It does not shrink with the tokens, so layouts with more micro-batches per GPU (TP4: DP1, 18) pay more.
HOST_GAP_S_PER_LAYER_MB = 0.0194


@dataclasses.dataclass
class PhaseTime:
    seconds: float
    flops: float                  # model FLOPs of the phase (all GPUs)
    tokens: float                 # tokens of the phase (all GPUs)
    parts: dict[str, float]       # seconds by part (compute, all-to-all, ...)
    peak_memory: float            # bytes per GPU (torch-allocated peak)

    def per_gpu(self, world: int, peak_tflops: float) -> dict:
        tps = self.tokens / self.seconds / world if self.seconds > 0 else 0.0
        tf = self.flops / self.seconds / world / 1e12 if self.seconds > 0 else 0.0
        return dict(seconds=round(self.seconds, 4), tokens=int(self.tokens), tokens_per_s_per_gpu=round(tps, 1),
                    tflops_per_gpu=round(tf, 1), mfu=round(tf / peak_tflops, 4),
                    peak_memory_gib=round(self.peak_memory / GIB, 2),
                    parts={k: round(v, 4) for k, v in self.parts.items()})


@dataclasses.dataclass
class PhasePrediction:
    """The per-phase prediction for one layout and batch."""

    layout: Layout
    world: int
    feasible: bool
    violations: list
    memory: mem.MemoryBreakdown | None
    phases: dict[str, PhaseTime]
    gpu: str
    peak_tflops: float

    @property
    def step_seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def peak_memory(self) -> float:
        """Bytes per GPU: the largest torch-allocated peak of the phases."""
        return max((p.peak_memory for p in self.phases.values()), default=0.0)

    def to_dict(self) -> dict:
        return dict(layout=self.layout.short(), layout_fields=dataclasses.asdict(self.layout), world=self.world,
                    feasible=self.feasible, violations=[f"[{v.rule}] {v.message}" for v in self.violations],
                    gpu=self.gpu, peak_memory_gib=round(self.peak_memory / GIB, 2),
                    memory_gib=self.memory.gib() if self.memory else None,
                    step_seconds=round(self.step_seconds, 4),
                    phases={k: v.per_gpu(self.world, self.peak_tflops) for k, v in self.phases.items()})


def expected_seq_lens(grpo: GRPOShape, response_lens: list[int] | None = None) -> list[int]:
    """Sequence lengths (prompt + response) of a batch: the given response lengths, or every sequence at
    ``max_prompt_len + mean_length_fraction * max_response_len``."""
    n = grpo.prompts_per_step * grpo.n_samples
    if response_lens is None:
        r = round(grpo.max_response_len * grpo.mean_length_fraction)
        response_lens = [r] * n
    if len(response_lens) != n:
        raise ValueError(f"{len(response_lens)} response lengths for prompts x n = {n} sequences")
    return [grpo.max_prompt_len + int(x) for x in response_lens]


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    rank: int            # DP rank
    seqs: int            # sequences in it
    tokens: int          # real tokens
    padded: int          # tokens the model computes: real (THD) or seqs x the rank's longest sequence (BSHD)
    seq_max: int         # the length it is padded to


def micro_batches(seq_lens: list[int], dp: int, max_token_len: int, remove_padding: bool = True) -> list[MicroBatch]:
    """verl 0.9.1's dynamic micro-batches of a batch: the sequences split over ``dp`` ranks in contiguous chunks
    (DataProto.chunk, as the worker dispatch splits them), each rank's chunk partitioned by verl's own
    ``rearrange_micro_batches`` rule: ceil(tokens / max_token_len) micro-batches (the same count on every DP rank),
    balanced by verl's workload with ``get_seqlen_balanced_partitions`` (Karmarkar-Karp), one more until every
    micro-batch holds <= max_token_len tokens. Without remove-padding each micro-batch is padded to the longest
    sequence of the rank's mini-batch (``pad_bshd_to_minibatch_max``, engine/megatron/transformer_impl.py)."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    import torch

    n = len(seq_lens)
    if n % dp:
        raise ValueError(f"{n} sequences do not split over DP={dp} ranks")
    per = n // dp
    chunks = [seq_lens[r * per:(r + 1) * per] for r in range(dp)]
    if max(seq_lens) > max_token_len:
        raise ValueError(f"a sequence of {max(seq_lens)} tokens > max_token_len {max_token_len} (verl asserts it)")
    k = max(min(len(c), -(-sum(c) // max_token_len)) for c in chunks)  # same_micro_num_in_dp: the max over ranks
    while True:
        parts = []
        for c in chunks:
            work = calculate_workload(torch.tensor(c, dtype=torch.long)).tolist()
            parts.append(get_seqlen_balanced_partitions(work, k, equal_size=False))
        if all(sum(c[i] for i in p) <= max_token_len for c, ps in zip(chunks, parts) for p in ps):
            break
        k += 1
    out = []
    for r, (c, ps) in enumerate(zip(chunks, parts)):
        top = max(c)
        for p in ps:
            real = sum(c[i] for i in p)
            out.append(MicroBatch(r, len(p), real, real if remove_padding else len(p) * top, top))
    return out


def _link_bw(gpu, group: int, gpus_per_node: int) -> float:
    nvl, net = gpu.nvlink_gbs * 1e9, gpu.network_gbs * 1e9
    f = 0.0 if group <= gpus_per_node else 1 - gpus_per_node / group
    return COMM_EFFICIENCY / ((1 - f) / nvl + f / net)


def predict_phases(model, cluster, grpo, layout, options, *, seq_lens: list[int] | None = None) -> PhasePrediction:
    """Per-phase prediction for ``layout`` on all of ``cluster`` (the trainer alone, as the bench runs it).
    ``seq_lens``: prompt + response length of every sequence (default :func:`expected_seq_lens`)."""
    from dsv3_rl.planner.refit import estimate_refit
    from dsv3_rl.planner.search import evaluate

    m = load_model(model)
    c = from_dict(Cluster, cluster) if isinstance(cluster, dict) else cluster
    g = from_dict(GRPOShape, grpo) if isinstance(grpo, dict) else grpo
    o = from_dict(Options, options) if isinstance(options, dict) else options
    lay = from_dict(Layout, layout) if isinstance(layout, dict) else layout
    o = dataclasses.replace(o, rollout=False)
    world = c.world
    lens = seq_lens or expected_seq_lens(g)
    dp = max(1, lay.dp(world))
    edp = max(1, lay.edp(world))
    sp = lay.tp if lay.sp_ else 1
    mb_tokens = g.tokens_per_micro_batch
    f_real = comm_mod.batch_flops(m, lens)  # model FLOPs (MFU, as the bench counts them)
    if not o.remove_padding and g.dynamic_batch and len(lens) % dp == 0:
        # BSHD: the model computes the padded micro-batches; the largest one sets the activations
        mbs = micro_batches(lens, dp, mb_tokens, remove_padding=False)
        per_rank = [[x for x in mbs if x.rank == r] for r in range(dp)]
        f_work = max(sum(comm_mod.batch_flops(m, [x.seq_max] * x.seqs) for x in rk) for rk in per_rank) * dp
        tok_gpu = float(max(sum(x.padded for x in rk) for rk in per_rank))
        n_micro = len(per_rank[0])
        worst = max(mbs, key=lambda x: x.padded)
        g_mem = dataclasses.replace(g, max_token_len_per_gpu=max(worst.padded, 1))
    else:
        f_work = f_real
        tok_gpu = float(sum(lens)) / dp  # tokens through one DP replica (one GPU sees tok_gpu / sp at a time)
        n_micro = max(1, math.ceil(sum(lens) / dp / mb_tokens)) if g.dynamic_batch else max(1, len(lens) // dp // g.micro_batch_size)
        g_mem = g
    ev = evaluate(m, c, g_mem, lay, o, trainer_gpus=world)
    gpu = c.gpu_type
    peak = gpu.bf16_tflops * 1e12
    tokens = float(sum(lens))
    if lay.vpp and lay.pp > 1:
        n_micro = -(-n_micro // lay.pp) * lay.pp
    bubble = bubble_fraction(lay.pp, lay.vpp_, n_micro)
    rate = world * peak * GEMM_EFFICIENCY  # GEMM + attention kernels; the memory-bound rest is its own part
    gpn = c.gpus_per_node
    # the worst PP rank's layers (per layer the traffic is the same; the stage with most layers counts)
    split_layers_ = ev.memory.detail["layers"] if ev.memory else list(range(m.num_layers))
    moe_layers = sum(m.is_moe_layer(i) for i in split_layers_)
    layers = len(split_layers_)
    ep = lay.ep
    lat = COLLECTIVE_LATENCY_S * n_micro
    a2a_fwd = 0.0
    if ep > 1:  # dispatch + combine per MoE layer (+ the token-count exchange before each), per micro-batch
        a2a_bytes = 2 * tok_gpu / sp * m.topk * lay.etp_ * m.hidden * 2 * (ep - 1) / ep * moe_layers
        a2a_fwd = a2a_bytes / _link_bw(gpu, lay.etp_ * ep, gpn) + 4 * moe_layers * lat
    tp_fwd = tp_bwd = 0.0
    if lay.tp > 1:  # each call moves one hidden-sized shard of the micro-batch (decoder layers + the output layer)
        per_call = tok_gpu * m.hidden * 2 * (lay.tp - 1) / lay.tp / _link_bw(gpu, lay.tp, gpn) + lat
        tp_fwd = per_call * (TP_COLLECTIVES_FWD * layers + 1)
        tp_bwd = per_call * (TP_COLLECTIVES_BWD * layers + 2)
    pp_fwd = 0.0
    if lay.pp > 1:  # activations sent between stages, per micro-batch (point-to-point, small)
        pp_fwd = tok_gpu / sp * m.hidden * 2 * (lay.pp - 1) / lay.pp / _link_bw(gpu, 2, gpn) + lat
    # memory-bound kernels: elementwise traffic over the saved activations of the rank's layers (padded tokens of
    # one GPU: tok_gpu is per DP replica, activations per token per GPU already divided by TP/SP where split)
    act_tok = sum(mem.layer_activation(m, m.is_moe_layer(i), lay, o, g.seq_len if o.transformer_impl == "local" else 0).full
                  for i in split_layers_)
    hbm = gpu.hbm_tbs * 1e12 * HBM_EFFICIENCY
    elem_fb = ELEMENTWISE_BYTES_PER_SAVED_BYTE * act_tok * tok_gpu / hbm / max(1e-9, 1 - bubble)
    # log-prob
    host = HOST_GAP_S_PER_LAYER_MB * layers * n_micro / max(1e-9, 1 - bubble)
    lp_parts = dict(compute=f_work / rate / max(1e-9, 1 - bubble), elementwise=elem_fb / 3, host_gaps=host / 3,
                    all_to_all=a2a_fwd, tp=tp_fwd, pp=pp_fwd)
    rc = 4 / 3 if lay.recompute == "full" else 1.0
    passes = 2 + (1 if lay.recompute == "full" else 0)  # fwd + bwd (+ recomputed fwd)
    # update: forward + backward, gradient sync, optimizer step
    params = ev.memory.detail if ev.memory else {"dense_params": 0.0, "expert_params": 0.0}
    g_bytes = mem.grad_bytes_per_param(o)
    sync = 0.0
    if o.distributed_optimizer:
        dense, expert = params["dense_params"], params["expert_params"]
        sync_dense = dense * (g_bytes + 2) * (dp * lay.cp - 1) / (dp * lay.cp) if dp * lay.cp > 1 else 0.0
        sync_exp = expert * (g_bytes + 2) * (edp - 1) / edp if edp > 1 else 0.0
        sync = sync_dense / _link_bw(gpu, dp * lay.cp * lay.tp * lay.pp, gpn) + \
            sync_exp / _link_bw(gpu, world, gpn)
    local_main = (params["dense_params"] / max(1, dp * lay.cp) + params["expert_params"] / edp) \
        if o.distributed_optimizer else params["dense_params"] + params["expert_params"]
    opt_step = local_main * OPTIMIZER_BYTES_PER_PARAM * (1 - o.optimizer_cpu_offload_fraction) / (gpu.hbm_tbs * 1e12 * HBM_EFFICIENCY)
    local_params = params["dense_params"] + params["expert_params"]
    grad_accum = GRAD_ACCUM_BYTES_PER_PARAM * local_params * n_micro / hbm
    up_parts = dict(compute=3 * f_work * rc / rate / max(1e-9, 1 - bubble), elementwise=elem_fb * rc + grad_accum,
                    host_gaps=host * rc,
                    all_to_all=a2a_fwd * passes, tp=tp_fwd * (passes - 1) + tp_bwd, pp=pp_fwd * 2, grad_sync=sync,
                    optimizer=opt_step)
    # export (verl's per-tensor export; no rollout engine to load into)
    rf = estimate_refit(m, gpu, gpn, world, tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp_, rollout_tp=1,
                        algorithm="verl")
    ex_parts = {k: v for k, v in rf.phases.items() if k != "load"}
    # memory per phase
    phases = {}
    if ev.memory is not None:
        mb = ev.memory
        static = mb.weights + mb.grads + mb.optimizer + mb.ref_weights
        tokens_mb = g_mem.tokens_per_micro_batch / lay.cp
        # log-prob, per PP stage: the stage holding the output layer runs verl's logits processor (entropy +
        # log-probs) on the largest padded micro-batch; the others hold one layer's forward working set
        seq_ = g.seq_len if o.transformer_impl == "local" else 0
        lp_mem = 0.0
        for st in (ev.stage_memory or [mb]):
            st_static = st.weights + st.grads + st.optimizer + st.ref_weights
            st_layers = st.detail.get("layers", split_layers_)
            biggest = max((mem.layer_activation(m, m.is_moe_layer(i), lay, o, seq_).full for i in st_layers), default=0.0)
            vocab_ws = LOGPROB_VOCAB_BYTES * m.vocab / lay.tp * tokens_mb if st.logits > 0 else 0.0
            lp_mem = max(lp_mem, st_static + max(vocab_ws, biggest * tokens_mb) + st.comm_buffers)
        moe_i = [i for i in split_layers_ if m.is_moe_layer(i)]
        gathered = m.num_experts * m.expert_params() * 2.0 * lay.etp_ if moe_i else 0.0
        ex_mem = static + EXPORT_BUCKET + (gathered * (1 - 1 / max(1, ep * lay.etp_)) if moe_i else 0.0)
        up_mem = mb.allocated
    else:
        lp_mem = up_mem = ex_mem = 0.0
    violations = list(ev.violations)
    if ev.memory is not None:
        cap = c.memory_bytes
        for name, peak_b in (("log-prob", lp_mem), ("export", ex_mem)):
            if peak_b + ev.memory.reserve > cap and not any(v.rule == "mem.trainer" for v in violations):
                from dsv3_rl.planner.rules import Violation

                violations.append(Violation("mem.trainer", f"{name} peak {peak_b / GIB:.1f} GiB + "
                                            f"{ev.memory.reserve / GIB:.1f} GiB non-PyTorch/fragmentation > "
                                            f"{cap / GIB:.1f} GiB per GPU", "planner memory model (verl log-prob path)"))
    phases["log_prob"] = PhaseTime(sum(lp_parts.values()), f_real, tokens, lp_parts, lp_mem)
    phases["update"] = PhaseTime(sum(up_parts.values()), 3 * f_real, tokens, up_parts, up_mem)
    phases["export"] = PhaseTime(sum(ex_parts.values()), 0.0, tokens, ex_parts, ex_mem)
    return PhasePrediction(layout=lay, world=world, feasible=not violations, violations=violations,
                           memory=ev.memory, phases=phases, gpu=c.gpu, peak_tflops=gpu.bf16_tflops)


def phase_table(preds: list[tuple[str, PhasePrediction]], capacity_gib: float) -> str:
    """One line per layout: verdict, peak GiB per GPU, and seconds / tokens/s/GPU / MFU per phase."""
    hdr = (f"{'':10s} {'layout':28s} {'GPUs':>4s} {'peak GiB':>8s}  "
           + "  ".join(f"{p + ' s':>12s} {'tok/s/GPU':>9s} {'MFU':>5s}" for p in PHASES[:2])
           + f"  {'export s':>8s}  {'step s':>7s}")
    lines = [hdr]
    for tag, p in preds:
        d = p.to_dict()
        cells = []
        for ph in PHASES[:2]:
            x = d["phases"][ph]
            cells.append(f"{x['seconds']:12.2f} {x['tokens_per_s_per_gpu']:9.0f} {x['mfu']:5.1%}")
        lines.append(f"{tag:10s} {d['layout']:28s} {p.world:4d} {d['peak_memory_gib']:8.1f}  " + "  ".join(cells)
                     + f"  {d['phases']['export']['seconds']:8.2f}  {d['step_seconds']:7.2f}")
    lines.append(f"(capacity {capacity_gib:.1f} GiB per GPU; peak = torch-allocated, the planner's reserve excluded)")
    return "\n".join(lines)


def sample_seq_lens(prompts: int, n: int, prompt_dist: str, resp_dist: str, seed: int = 1) -> list[int]:
    """Prompt + response lengths of a batch drawn from the bench's distributions (``fixed:N`` | ``uniform:LO:HI`` |
    ``lognormal:MEDIAN:SIGMA:MAX``; each prompt's length shared by its ``n`` responses), seeded. The same laws as
    ``bench/bench_grpo_update.py --prompt-len/--resp-len``, not the same draws (the bench's own lengths are in its
    JSON and ``dsv3-plan validate`` predicts with those)."""
    import random

    rnd = random.Random(seed)

    def draw(text: str) -> int:
        kind, _, rest = text.partition(":")
        v = [float(x) for x in rest.split(":") if x]
        if kind == "fixed" and len(v) == 1:
            return int(v[0])
        if kind == "uniform" and len(v) == 2:
            return rnd.randint(int(v[0]), int(v[1]))
        if kind == "lognormal" and len(v) == 3:
            return max(1, min(int(v[2]), round(rnd.lognormvariate(math.log(v[0]), v[1]))))
        raise ValueError(f"length distribution {text!r}: expected fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA:MAX")

    p = [draw(prompt_dist) for _ in range(prompts)]
    return [p[i // n] + draw(resp_dist) for i in range(prompts * n)]


def pick_bench_layouts(model, cluster, grpo, options, *, top: int = 3, oom_factor: float = 1.15,
                       seq_lens: list[int] | None = None) -> list[tuple[str, Layout]]:
    """The ``top`` feasible layouts of :func:`dsv3_rl.planner.search.plan`, ranked by the predicted GRPO training
    step (:func:`predict_phases`), and one rejected layout that breaks *only* the memory rule with a predicted
    torch-allocated peak at or above ``oom_factor`` x the GPU memory (buildable, and out of memory even if the model
    over-predicts by the 15% it is validated to: the one that must really run out of memory), the simplest such:
    fewest PP stages, then the smallest TP, then the smallest overshoot. Feasibility and ranking are
    :func:`predict_phases`' for ``seq_lens`` (BSHD padding included)."""
    from dsv3_rl.planner.search import plan

    o = dataclasses.replace(options, rollout=False)
    res = plan(model, cluster, grpo, o)
    cands = res.feasible + [e for e in res.rejected if e.memory is not None and e.violations
                            and all(v.rule == "mem.trainer" for v in e.violations)]
    preds = [predict_phases(res.model, res.cluster, res.grpo, e.layout, o, seq_lens=seq_lens) for e in cands]
    ranked = sorted((p for p in preds if p.feasible), key=lambda p: p.step_seconds)
    out = [(f"best{i + 1}", p.layout) for i, p in enumerate(ranked[:top])]
    cap = res.cluster.memory_bytes
    oom = [p for p in preds if not p.feasible and p.memory is not None and all(v.rule == "mem.trainer" for v in p.violations)
           and p.memory.allocated >= oom_factor * cap]
    if oom:  # the layout a user tries first: no PP, no TP (plain DP x EP) before the smallest overshoot
        out.append(("oom", min(oom, key=lambda p: (p.layout.pp, p.layout.tp, p.memory.allocated)).layout))
    return out


def predictions_json(model, cluster, grpo, options, preds: list[tuple[str, PhasePrediction]], *,
                     model_set: dict | None = None, seq_lens: list[int] | None = None, previous: dict | None = None) -> dict:
    """What ``dsv3-plan phases --json`` writes (``dsv3-plan validate --predicted`` reads it back): one entry per
    layout under ``runs``, keyed by tag. With ``previous`` (the file's current content, ``--add``) its other runs
    are kept and runs of the same tag replaced."""
    m = load_model(model)
    runs = {r["tag"]: r for r in (previous or {}).get("runs", [])}
    for tag, p in preds:
        runs[tag] = dict(tag=tag, model=model if isinstance(model, str) else m.name.split()[0], model_set=model_set or {},
                         world=p.world, gpu=cluster.gpu, layout=p.layout.short(),
                         layout_arg=layout_arg(p.layout), grpo=dataclasses.asdict(grpo),
                         seq_lens_mean=round(sum(seq_lens) / len(seq_lens), 1) if seq_lens else None,
                         options=dataclasses.asdict(options), capacity_gib=round(cluster.memory_bytes / GIB, 2),
                         assumptions=dict(gemm_efficiency=GEMM_EFFICIENCY, comm_efficiency=COMM_EFFICIENCY,
                                          hbm_efficiency=HBM_EFFICIENCY,
                                          optimizer_bytes_per_param=OPTIMIZER_BYTES_PER_PARAM,
                                          elementwise_bytes_per_saved_byte=ELEMENTWISE_BYTES_PER_SAVED_BYTE,
                                          grad_accum_bytes_per_param=GRAD_ACCUM_BYTES_PER_PARAM,
                                          host_gap_s_per_layer_mb=HOST_GAP_S_PER_LAYER_MB,
                                          collective_latency_s=COLLECTIVE_LATENCY_S,
                                          tp_collectives_fwd_bwd=[TP_COLLECTIVES_FWD, TP_COLLECTIVES_BWD],
                                          logprob_vocab_bytes=LOGPROB_VOCAB_BYTES,
                                          reserve_gib=round(mem.non_torch_reserve(p.layout, options) / GIB, 2)),
                         predicted=p.to_dict())
    return dict(kind="dsv3-plan phases", runs=list(runs.values()))


def layout_arg(lay: Layout) -> str:
    """``--layout`` text for a layout (the fields that differ from the defaults)."""
    d, base = dataclasses.asdict(lay), dataclasses.asdict(Layout())
    keep = {k: v for k, v in d.items() if v != base[k] or k in ("tp", "pp", "ep")}
    out = []
    for k, v in keep.items():
        if isinstance(v, tuple):
            v = ":".join(map(str, v))
        out.append(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    return ",".join(out)
