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


#: The terms of :func:`flop_terms`, in the order docs/planner.md ("The FLOP count") lists them.
FLOP_TERMS = ("mla_down", "mla_up", "mla_rope", "mla_out", "attention", "dense_mlp", "router", "routed_experts",
              "shared_experts", "lm_head", "embedding")


def flop_terms(m, seq_lens) -> dict[str, float]:
    """Model FLOPs of one forward pass over sequences of lengths ``seq_lens`` (prompt + response, no padding), per
    term (docs/planner.md, "The FLOP count"). A matmul ``[t, k] x [k, n]`` is ``2 t k n``; a token goes through:

    * ``mla_down``: ``q_a_proj`` (h -> q_lora_rank) and the latent part of ``kv_a_proj_with_mqa`` (h -> kv_lora_rank);
    * ``mla_up``: ``q_b_proj``'s no-rope columns (q_lora_rank -> heads x qk_nope) and ``kv_b_proj``
      (kv_lora_rank -> heads x (qk_nope + v)); without q LoRA, ``q_proj``'s no-rope columns (h -> heads x qk_nope);
    * ``mla_rope``: the rope columns, ``q_b_proj``'s heads x qk_rope and ``kv_a_proj_with_mqa``'s shared qk_rope;
    * ``mla_out``: ``o_proj`` (heads x v -> h);
    * ``attention``: per sequence of length s and layer, QK^T ``2 x heads x qk_head_dim x s^2`` and PV
      ``2 x heads x v_head_dim x s^2``, halved for the causal mask (what a causal flash kernel computes, and
      Megatron-LM's ``num_floating_point_operations``);
    * ``dense_mlp``: SwiGLU ``3 x h x intermediate_size`` in the ``first_k_dense_replace`` dense layers;
    * ``router``: the gate ``h x n_routed_experts`` of each MoE layer;
    * ``routed_experts`` / ``shared_experts``: ``3 x h x moe_intermediate_size`` per each of the top-k routed
      experts and per shared expert, each MoE layer;
    * ``lm_head``: ``h x vocab`` (every position's logits; tied or not);
    * ``embedding``: 0, a row lookup, no multiply (verl's ``FlopsCounter`` counts it as an ``h x vocab`` matmul).

    Not counted (no matmul, or not this model's work): RMSNorm, RoPE, SwiGLU's product, softmax, the router's
    sigmoid/top-k, the MTP module (the GRPO trainer does not run it). Training = 3 x this (forward + backward);
    recompute is extra work, not model FLOPs."""
    h, nh, layers, moe = m.hidden, m.num_heads, m.num_layers, m.num_moe_layers
    q_in = m.q_lora_rank or h  # q_b_proj's input, or q_proj's without q LoRA
    per_token = {
        "mla_down": layers * ((h * m.q_lora_rank if m.q_lora_rank else 0) + h * m.kv_lora_rank),
        "mla_up": layers * (q_in * nh * m.qk_nope_dim + m.kv_lora_rank * nh * (m.qk_nope_dim + m.v_head_dim)),
        "mla_rope": layers * (q_in * nh * m.qk_rope_dim + h * m.qk_rope_dim),
        "mla_out": layers * nh * m.v_head_dim * h,
        "dense_mlp": (layers - moe) * 3 * h * m.dense_ffn,
        "router": moe * h * m.num_experts,
        "routed_experts": moe * m.topk * 3 * h * m.moe_ffn,
        "shared_experts": moe * 3 * h * m.shared_ffn,
        "lm_head": h * m.vocab,
        "embedding": 0,
    }
    tokens = float(sum(seq_lens))
    terms = {k: 2.0 * v * tokens for k, v in per_token.items()}
    square = float(sum(s * s for s in seq_lens))
    terms["attention"] = 2.0 * layers * nh * (m.qk_head_dim + m.v_head_dim) * square / 2
    return {k: terms[k] for k in FLOP_TERMS}


def batch_flops(m, seq_lens) -> float:
    """Model FLOPs of one forward pass over a batch of sequences (lengths ``seq_lens``, prompt + response): the sum
    of :func:`flop_terms` (every weight matmul a token goes through, lm_head included, the embedding lookup not;
    causal attention ``2 x heads x (qk_head_dim + v_head_dim) x s^2 / 2`` per layer and sequence). Training = 3 x
    this. The one FLOP count of the planner (phases, ranking) and of ``bench/bench_grpo_update.py``'s MFU."""
    return float(sum(flop_terms(m, seq_lens).values()))


def train_flops_per_token(m, seq_mean: float) -> float:
    """Forward FLOPs per token of a sequence of ``seq_mean`` tokens (:func:`flop_terms`: the weight matmuls + the
    causal attention, whose per-token cost grows with the sequence)."""
    f = flop_terms(m, [1])
    attn = f.pop("attention")
    return sum(f.values()) + attn * seq_mean


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


#: achieved fraction of HBM bandwidth of a vLLM decode step (weights + KV cache read once per step), measured on
#: ``proxy_1xH100`` (1x H100, vLLM 0.24 TP1, 128 sequences at once, BF16; docs/results/2026-12-08-gpu-proxy1, step 3):
#: ``timing_s/gen`` 5.449 s for responses of mean 1019 / max 1024 tokens after prompts of mean 94 tokens; less the
#: modelled prefill (0.22 s) that is 5.23 s of decode where reading 8.0 GiB of weights + the KV cache at the full
#: 3.35 TB/s takes 2.70 s: 0.517. The model read the full bandwidth before (its 5.21 s prediction for that run matched
#: only because it counted 1024-token prompts: a prefill 10x too long made up for a decode 1.9x too fast). One
#: measurement: it cannot tell a bandwidth shortfall from a fixed cost per step (vLLM's scheduler, sampling); read as
#: the latter (2.5 ms a step) a 671B decode step would be faster than this efficiency says (docs/planner.md, "NeMo-RL's
#: DeepSeek-V3 workload, predicted"). The one decode efficiency of the planner (the async model's too).
DECODE_HBM_EFFICIENCY = 0.52


def estimate_rollout_seconds(m, ro, rm, grpo, opt, cluster) -> dict:
    """Decode-bound estimate. Per decode step a GPU reads its weights and its DP rank's KV cache
    from HBM at :data:`DECODE_HBM_EFFICIENCY` of its bandwidth (MLA's latent cache is replicated on
    every TP rank, so TP does not shrink that read), runs two TP all-reduces per layer and, with EP,
    two all-to-alls per MoE layer (latency-bound at decode batch sizes). The batch is what the KV
    cache and vLLM's max_num_seqs (1024 per DP rank) allow; more sequences than that run in waves."""
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
    hbm = (rm.weights + kv_read) / (gpu.hbm_tbs * 1e12 * DECODE_HBM_EFFICIENCY)
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
