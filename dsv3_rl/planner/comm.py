"""Communication volumes per step and a rough step-time estimate (used only to rank layouts).

Volumes are bytes *sent per GPU* (ring/all-to-all algorithms), for the worst PP rank:

* all-to-all (MoE dispatch + combine): each routed token copy that leaves the GPU is sent once
  forward and once in the gradient, ``(EP-1)/EP`` of them leave (uniform routing); full
  recompute repeats the forward.
* gradient sync (distributed optimizer): reduce-scatter of the grads + all-gather of the updated
  bf16 params over DP*CP (dense) and expert-DP (experts), ``(d-1)/d`` of the data each.
* tensor parallel (sequence parallel): all-gather + reduce-scatter around attention and MLP.
"""

from __future__ import annotations

import dataclasses

from dsv3_rl.planner.rules import num_microbatches


@dataclasses.dataclass
class CommVolume:
    a2a_per_optimizer_step: float = 0.0
    a2a_per_grpo_step: float = 0.0
    grad_sync_per_optimizer_step: float = 0.0
    grad_sync_per_grpo_step: float = 0.0
    tp_per_grpo_step: float = 0.0
    a2a_internode_fraction: float = 0.0
    optimizer_steps: int = 1

    def gib(self) -> dict:
        g = 2**30
        return dict(a2a_per_optimizer_step_gib=round(self.a2a_per_optimizer_step / g, 2),
                    a2a_per_grpo_step_gib=round(self.a2a_per_grpo_step / g, 2),
                    grad_sync_per_optimizer_step_gib=round(self.grad_sync_per_optimizer_step / g, 2),
                    grad_sync_per_grpo_step_gib=round(self.grad_sync_per_grpo_step / g, 2),
                    tp_per_grpo_step_gib=round(self.tp_per_grpo_step / g, 2),
                    a2a_internode_fraction=round(self.a2a_internode_fraction, 3),
                    optimizer_steps=self.optimizer_steps)


def comm_volume(m, split, rank_mem, lay, grpo, opt, world: int, gpus_per_node: int) -> CommVolume:
    cv = CommVolume()
    r = rank_mem.pp_rank
    layers = split.rank_layers(r)
    moe_layers = sum(m.is_moe_layer(i) for i in layers) + sum(s.mtp for s in split.stages[r])
    sp = lay.tp if lay.sp_ else 1
    n_micro = num_microbatches(grpo, lay, world)
    tokens_full = grpo.tokens_per_micro_batch / lay.cp  # memory uses the max; volumes the mean
    tokens = tokens_full * grpo.mean_length_fraction
    fwd_repeats = 2 if lay.recompute == "full" else 1
    ep = lay.ep
    leave = (ep - 1) / ep if ep > 1 else 0.0
    per_layer_mb = 2 * tokens / sp * m.topk * lay.etp_ * m.hidden * 2 * leave  # dispatch + combine
    a2a_train = per_layer_mb * (fwd_repeats + 1) * moe_layers * n_micro
    cv.a2a_per_optimizer_step = a2a_train
    group = lay.etp_ * ep
    cv.a2a_internode_fraction = 0.0 if group <= gpus_per_node else 1 - gpus_per_node / group
    steps = -(-grpo.prompts_per_step // grpo.mini_batch_prompts) * grpo.ppo_epochs
    cv.optimizer_steps = steps
    fwd_only_passes = 1 + int(opt.ref_model)  # old log-probs + reference log-probs
    cv.a2a_per_grpo_step = a2a_train * steps + per_layer_mb * moe_layers * n_micro * (steps // grpo.ppo_epochs) * fwd_only_passes
    dpc = max(1, lay.dp(world) * lay.cp)
    edp = max(1, lay.edp(world))
    g_bytes = rank_mem.grads / max(1.0, rank_mem.detail["params"])
    dense, expert = rank_mem.detail["dense_params"], rank_mem.detail["expert_params"]
    if opt.distributed_optimizer:
        sync = dense * (g_bytes + 2) * (dpc - 1) / dpc + expert * (g_bytes + 2) * (edp - 1) / edp
    else:
        sync = 2 * g_bytes * (dense * (dpc - 1) / dpc + expert * (edp - 1) / edp)
    cv.grad_sync_per_optimizer_step = sync
    cv.grad_sync_per_grpo_step = sync * steps
    if lay.tp > 1:
        per_layer = 8 * tokens * m.hidden * 2 * (lay.tp - 1) / lay.tp  # AG + RS around attn and MLP, fwd + bwd
        passes = steps * (fwd_repeats + 1) + (steps // grpo.ppo_epochs) * fwd_only_passes
        cv.tp_per_grpo_step = per_layer * len(layers) * n_micro * passes
    return cv


def train_flops_per_token(m, seq_mean: float) -> float:
    """Forward FLOPs per token: 2 x activated params (no embedding lookup) + causal attention."""
    from dsv3_rl.planner.model import count_params

    c = count_params(m)
    dense = 2 * (c.activated - m.embedding_params)
    attn = m.num_layers * 2 * m.num_heads * (m.qk_head_dim + m.v_head_dim) * seq_mean / 2
    return dense + attn


def batch_flops(m, seq_lens) -> float:
    """Model FLOPs of one forward pass over a batch of sequences (lengths ``seq_lens``, prompt + response):
    per token 2 x (activated parameters - the input embedding, a lookup) for the matmuls, and per sequence of
    length s the causal attention, ``2 * heads * (qk_head_dim + v_head_dim) * s^2 / 2`` per layer (QK^T and PV,
    half the square). Training = 3 x this (forward + backward); recompute is extra work, not model FLOPs. The
    one FLOP count of the planner's phase prediction and of ``bench/bench_grpo_update.py``'s MFU
    (docs/planner.md)."""
    from dsv3_rl.planner.model import count_params

    c = count_params(m)
    per_token = 2 * (c.activated - m.embedding_params)
    attn = m.num_layers * m.num_heads * (m.qk_head_dim + m.v_head_dim)
    return float(sum(per_token * s + attn * s * s for s in seq_lens))


def estimate_train_seconds(m, lay, grpo, opt, cluster, world: int, bubble: float, cv: CommVolume,
                           recompute_factor: float, offload_bytes: float) -> dict:
    gpu = cluster.gpu_type
    seq_mean = grpo.seq_len * grpo.mean_length_fraction
    tokens = grpo.prompts_per_step * grpo.n_samples * seq_mean
    f = train_flops_per_token(m, seq_mean)
    fwd_only = 1 + int(opt.ref_model)
    flops_train = tokens * f * 3 * grpo.ppo_epochs * recompute_factor
    flops_fwd = tokens * f * fwd_only
    rate = world * gpu.bf16_tflops * 1e12 * opt.mfu
    compute = (flops_train / rate) / max(1e-9, 1 - bubble) + flops_fwd / rate
    nvl, net = gpu.nvlink_gbs * 1e9, gpu.network_gbs * 1e9
    a2a_bw = 1 / ((1 - cv.a2a_internode_fraction) / nvl + cv.a2a_internode_fraction / net)
    a2a = cv.a2a_per_grpo_step / a2a_bw
    tp = cv.tp_per_grpo_step / nvl
    dp_bw = net if world > cluster.gpus_per_node else nvl
    grad = 0.5 * cv.grad_sync_per_grpo_step / dp_bw  # about half of it overlaps the backward
    offload = offload_bytes / (gpu.pcie_gbs * 1e9)
    return dict(compute=compute, a2a=a2a, tp=tp, grad_sync=grad, offload=offload,
                total=compute + a2a + tp + grad + offload)


def estimate_rollout_seconds(m, ro, rm, grpo, opt, cluster) -> dict:
    """Decode-bound estimate. Per decode step a GPU reads its weights and its DP rank's KV cache
    from HBM (MLA's latent cache is replicated on every TP rank, so TP does not shrink that
    read), runs two TP all-reduces per layer and, with EP, two all-to-alls per MoE layer
    (latency-bound at decode batch sizes). The batch is what the KV cache and vLLM's
    max_num_seqs (1024 per DP rank) allow; more sequences than that run in waves."""
    from dsv3_rl.planner.model import count_params

    gpu = cluster.gpu_type
    if ro.instances < 1 or rm.max_concurrent_seqs < 1:
        return dict(total=float("inf"), waves=0, batch=0)
    seqs = grpo.prompts_per_step * grpo.n_samples
    per_instance = -(-seqs // ro.instances)
    batch = min(per_instance, rm.max_concurrent_seqs, 1024 * ro.dp)
    waves = -(-per_instance // batch)
    per_rank = batch / ro.dp
    ctx_mean = grpo.max_prompt_len + grpo.max_response_len * grpo.mean_length_fraction / 2
    kv_read = per_rank * ctx_mean * rm.kv_bytes_per_token
    hbm = (rm.weights + kv_read) / (gpu.hbm_tbs * 1e12)
    act = count_params(m).activated
    compute = 2 * act * per_rank / ro.tp / (gpu.bf16_tflops * 1e12 * 0.5)
    gpn = cluster.gpus_per_node
    comm = 0.0
    if ro.tp > 1:
        lat = 8e-6 if ro.tp <= gpn else 25e-6
        bw = (gpu.nvlink_gbs if ro.tp <= gpn else gpu.network_gbs) * 1e9
        comm += 2 * m.num_layers * (lat + 2 * per_rank * m.hidden * 2 * (ro.tp - 1) / ro.tp / bw)
    if ro.ep > 1:
        lat = 15e-6 if ro.ep <= gpn else 30e-6
        bw = (gpu.nvlink_gbs if ro.ep <= gpn else gpu.network_gbs) * 1e9
        comm += 2 * m.num_moe_layers * (lat + per_rank / ro.tp * m.topk * m.hidden * 2 * (ro.ep - 1) / ro.ep / bw)
    step = max(hbm, compute) + comm
    steps = grpo.max_response_len * grpo.mean_length_fraction
    prefill = per_instance * grpo.max_prompt_len * 2 * act / (ro.instance_gpus * gpu.bf16_tflops * 1e12 * 0.4)
    return dict(total=waves * steps * step + prefill, waves=waves, batch=batch, decode_step_ms=step * 1e3,
                prefill=prefill)
