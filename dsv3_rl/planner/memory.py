"""Per-GPU memory model: trainer (weights, grads, optimizer states, activations for the chosen
recompute, logits, transient working set, communication buffers) and vLLM rollout (weights,
KV cache capacity), for colocated or separate placement. Assumptions are listed in docs/planner.md.

Activations are *bytes saved for backward per token per layer* for two implementations:

* ``local``: megatron-core's local spec (the one ``bench/measure_train_memory.py`` runs; no TE).
  Every coefficient here was read off real megatron-core 0.16.1 autograd graphs with
  ``saved_tensors_hooks`` (``tests/unit/test_planner_activations.py`` re-checks them on CPU):
  torch ``RMSNorm`` keeps fp32 weights, so norms save an fp32 input + output; the unfused
  SwiGLU saves five ffn-wide tensors. Core attention per ``Options.attention_impl``: ``sdpa``
  (patch 0012's default without TE: torch SDPA with a fused kernel saves q, k, v, its output and
  the fp32 logsumexp; nothing S x S) or ``unfused`` (attention_backend=unfused: fp32 softmax +
  bf16 probs, S x S per head, plus megatron's persistent S x S matmul buffer).
* ``transformer_engine``: the TE spec used on GPU clusters: fused norms saving bf16, fused
  LayerNorm+Linear for the MLA up-projections and the dense fc1, fused SwiGLU (input + output),
  flash/fused attention (q, k, v, out, lse; no S^2 term), column-parallel MLA down-projections
  (patch 0001). Derived from reading the code, checked only through the published cases.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from dsv3_rl.planner.spec import GIB

# --- parameters per GPU ------------------------------------------------------------------------


@dataclasses.dataclass
class ParamsOnGPU:
    dense: float = 0.0   # non-expert params (optimizer sharded over DP*CP)
    expert: float = 0.0  # routed-expert params (optimizer sharded over expert-DP)

    @property
    def total(self) -> float:
        return self.dense + self.expert


def attn_params_on_gpu(m, tp: int, impl: str) -> float:
    """MLA params of one layer on one GPU. Both specs build the q/kv down-projections
    column-parallel in this repository (local spec upstream; TE spec with
    patches/megatron-core/0.16.1/0001-te-spec-mla-down-proj-column-parallel.patch, where upstream TE
    duplicates them), so everything but the norms is split by TP."""
    a = m.attn_params()
    replicated = a.get("q_a_layernorm", 0) + a["kv_a_layernorm"] + a["input_layernorm"]
    return replicated + (sum(a.values()) - replicated) / tp


def stage_params(m, split, rank: int, lay, impl: str) -> ParamsOnGPU:
    """Params held by one PP rank (all its virtual chunks)."""
    tp, ep, etp = lay.tp, lay.ep, lay.etp_
    p = ParamsOnGPU()
    for st in split.stages[rank]:
        for i in st.decoder:
            p.dense += attn_params_on_gpu(m, tp, impl)
            if m.is_moe_layer(i):
                p.dense += m.num_experts * m.hidden + 3 * m.hidden * m.shared_ffn / tp + m.hidden
                p.expert += (m.num_experts / ep) * m.expert_params() / etp
            else:
                p.dense += 3 * m.hidden * m.dense_ffn / tp + m.hidden
        if st.embedding:
            p.dense += m.embedding_params / tp
        if st.loss:
            p.dense += m.hidden + (0 if m.tie_embeddings else m.embedding_params / tp)
        if st.mtp:
            for _ in range(st.mtp):
                p.dense += 2 * m.hidden + 2 * m.hidden * m.hidden / tp + m.hidden + attn_params_on_gpu(m, tp, impl)
                p.dense += m.num_experts * m.hidden + 3 * m.hidden * m.shared_ffn / tp + m.hidden
                p.expert += (m.num_experts / ep) * m.expert_params() / etp
            if not st.embedding and not any(s.embedding for s in split.stages[rank]):
                p.dense += m.embedding_params / tp  # MTP needs the embedding on its stage
    return p


# --- activations ----------------------------------------------------------------------------


@dataclasses.dataclass
class LayerAct:
    """Bytes per token saved for backward by one layer, by part (before recompute), and what the
    chosen recompute keeps."""

    parts: dict[str, float]
    kept: float          # saved with the chosen recompute
    full: float          # saved without recompute (the recompute working set)


def _layer_parts(m, moe: bool, lay, opt, seq: int, batch: int = 1) -> dict[str, float]:
    """Saved bytes per token of the micro-batch on this GPU (before SP), by part. ``seq``: tokens
    per sequence, ``batch``: sequences per micro-batch (local spec only; decides whether SDPA saves
    views of the checkpointed q, k, v or its own copies)."""
    h, nh = m.hidden, m.num_heads
    qr, kvr, dn, dr, dv = m.q_lora_rank or 0, m.kv_lora_rank, m.qk_nope_dim, m.qk_rope_dim, m.v_head_dim
    t, etp = lay.tp, lay.etp_
    sp = t if lay.sp_ else 1
    k, E = m.topk, m.num_experts
    copies = k * etp / sp  # routed token copies per token after dispatch (+ expert-TP all-gather)
    d: dict[str, float] = {}
    if opt.transformer_impl == "local":
        d["ln_in"] = (8 * h + 4) / sp
        d["ln_in_out"] = 2 * h / sp
        d["q_lora"] = (10 * qr + 4) / sp if qr else 0.0
        d["kv_lora"] = (10 * kvr + 4) / sp
        d["rope_k"] = 8 * dr
        d["qkv"] = 2 * nh / t * (2 * (dn + dr) + dv)
        d["attn_out"] = 2 * nh / t * dv
        if opt.attention_impl == "unfused":
            d["core_attn_s2"] = (6 * nh / t + 1) * seq
            d["core_attn_lse"] = 0.0
        else:  # torch SDPA, fused kernel (flash / cuDNN / memory-efficient; CPU: flash-for-cpu)
            # q, k, v as above (for batch > 1 the contiguous [b, h, s, d] copies patch 0012 makes);
            # the kernel's output ([b, s, h, d] memory) is a view of linear_proj's [s, b, h*d] input
            # (attn_out), so only the fp32 logsumexp per head is new
            d["core_attn_s2"] = 0.0
            d["core_attn_lse"] = 4 * nh / t
        d["ln_mlp"] = (8 * h + 4) / sp
        if moe:
            d["shared"] = 2 * h / sp + 10 * m.shared_ffn / t
            d["router"] = (9 * E + 20 * k + 4) / sp
            d["experts"] = copies * (2 * h + 12 * m.moe_ffn / etp + 4)
            d["moe_act"] = 0.0
        else:
            d["mlp"] = 2 * h / sp + 10 * m.dense_ffn / t
        return d
    # transformer_engine
    d["ln_in"] = (2 * h + 4) / sp
    d["ln_in_out"] = 2 * h / sp
    d["q_lora"] = (4 * qr + 4) / sp if qr else 0.0
    d["kv_lora"] = (2 * kvr + 2 * kvr + 4) / sp
    d["rope_k"] = 2 * dr
    d["qkv"] = 2 * nh / t * (2 * (dn + dr) + dv)
    d["attn_out"] = 2 * nh / t * dv + 4 * nh / t
    d["core_attn_s2"] = d["core_attn_lse"] = 0.0
    if moe:
        d["ln_mlp"] = (4 * h + 4) / sp
        d["shared"] = 6 * m.shared_ffn / t
        d["router"] = (9 * E + 20 * k + 4) / sp
        d["experts"] = copies * (2 * h + 4 * m.moe_ffn / etp + 4)
        d["moe_act"] = copies * 2 * m.moe_ffn / etp
    else:
        d["ln_mlp"] = (4 * h + 4) / sp
        d["mlp"] = 6 * m.dense_ffn / t
    if opt.train_precision == "fp8":
        _fp8_saved_inputs(d, m, moe, lay, opt)
    return d


#: bytes per element of a GEMM input TE saves for the backward in FP8: 1 B of data, plus for the blockwise recipe
#: an fp32 scale per 1 x 128 tile (TE 2.11 Float8BlockQuantizer, block_scaling_dim=1 for activations)
def _fp8_elem_bytes(opt) -> float:
    return 1.0 + (4.0 / 128 if opt.fp8_recipe == "blockwise" else 0.0)


def _fp8_saved_inputs(d: dict[str, float], m, moe: bool, lay, opt) -> None:
    """FP8 training (TE spec): every TE GEMM saves its *input* for the weight gradient quantized, 1 B per element
    (TE 2.11 ``module/linear.py``: ``inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)``, the
    row-wise copy discarded; ``grouped_linear.py`` / ``layernorm_linear.py`` the same) instead of BF16. Where the
    BF16 tensor is saved anyway by another op (the core attention output, which flash attention keeps, and the
    fused norms' inputs) the FP8 copy comes on top; where the GEMM was its only keeper the 2 B become 1 B. Not
    GEMM inputs and unchanged: q, k, v (flash attention, BF16 unless fp8_dot_product_attention), the fc1 outputs
    the SwiGLU saves, the router, the norms' inputs, the logits (the output layer is megatron's own
    ColumnParallelLinear, not TE)."""
    h, t, etp = m.hidden, lay.tp, lay.etp_
    sp = t if lay.sp_ else 1
    f8 = _fp8_elem_bytes(opt)
    qr, kvr = m.q_lora_rank or 0, m.kv_lora_rank
    copies = m.topk * etp / sp
    d["ln_in_out"] += (f8 - 2) * h / sp                     # the down-projections' input (norm output)
    if qr:
        d["q_lora"] += (f8 - 2) * qr / sp                   # q up-projection input (its fused norm's output)
    d["kv_lora"] += (f8 - 2) * kvr / sp                     # kv up-projection input
    d["attn_out"] += f8 * m.num_heads / t * m.v_head_dim     # linear_proj's FP8 input next to flash's BF16 output
    d["ln_mlp"] += (f8 - 2) * h / sp                        # fc1 input of the dense MLP / shared expert (norm output)
    if moe:
        d["shared"] += (f8 - 2) * m.shared_ffn / t           # shared-expert fc2 input (SwiGLU output)
        d["experts"] += copies * (f8 - 2) * h                # permuted tokens: grouped fc1 input
        d["moe_act"] += copies * (f8 - 2) * m.moe_ffn / etp  # grouped fc2 input (SwiGLU output)
    else:
        d["mlp"] += (f8 - 2) * m.dense_ffn / t               # fc2 input (SwiGLU output)


def fp8_weight_cache_bytes_per_param(opt) -> float:
    """Extra bytes per TE GEMM weight element with FP8 training: megatron-core's TE wrappers pass
    ``is_first_microbatch`` (``disable_parameter_transpose_cache`` is off by default,
    extensions/transformer_engine.py:678-685), so TE keeps the quantized weight in ``module._fp8_workspaces``
    across micro-batches and steps, with row-wise data for the forward and column-wise (Hopper: a transposed
    copy) for the backward's dgrad: 2 B, plus fp32 scales per 128 x 128 block for the blockwise recipe. verl frees
    these caches only on offload (``_clear_te_fp8_weight_workspaces``). With ``fp8_param`` the weight itself is
    the FP8 tensor (row-wise + column-wise, 2 B) and replaces the BF16 weight: 0 B extra, and the BF16 2 B go
    (:func:`train_memory`)."""
    if opt.train_precision != "fp8" or opt.fp8_param:
        return 0.0
    return 2.0 + (2 * 4.0 / (128 * 128) if opt.fp8_recipe == "blockwise" else 0.0)


def te_gemm_params(m, split, rank: int, lay) -> float:
    """Weights of TE GEMMs held by one PP rank: every linear layer of the decoder (MLA projections, dense MLP,
    shared and routed experts, MTP's eh_proj), not the embedding, the output layer, the router or the norms."""
    tp, ep, etp = lay.tp, lay.ep, lay.etp_
    a = m.attn_params()
    norms = a.get("q_a_layernorm", 0) + a["kv_a_layernorm"] + a["input_layernorm"]
    attn = (sum(a.values()) - norms) / tp
    n = 0.0
    for st in split.stages[rank]:
        idx = list(st.decoder) + [m.num_layers] * st.mtp
        for i in idx:
            n += attn
            if m.is_moe_layer(i):
                n += 3 * m.hidden * m.shared_ffn / tp + (m.num_experts / ep) * m.expert_params() / etp
            else:
                n += 3 * m.hidden * m.dense_ffn / tp
        n += st.mtp * 2 * m.hidden * m.hidden / tp
    return n


def _dropped(m, moe: bool, lay, opt, parts: dict[str, float], batch: int = 1) -> float:
    """Bytes per token the recompute choice does not keep."""
    if lay.recompute == "none":
        return 0.0
    total = sum(parts.values())
    h, sp = m.hidden, (lay.tp if lay.sp_ else 1)
    if lay.recompute == "full":
        return total - 2 * h / sp  # keeps the layer input
    mods = set(lay.recompute_modules or ("core_attn",))
    local = opt.transformer_impl == "local"
    drop = 0.0
    if "core_attn" in mods:
        # the checkpoint keeps q, k, v (its inputs) and the output (linear_proj's input): it frees
        # the S x S tensors (unfused) or only the logsumexp of a fused kernel
        drop += parts["core_attn_s2"] + parts["core_attn_lse"]
        drop += 0.0 if local else 4 * m.num_heads / lay.tp
    if "mla_up_proj" in mods:
        if not local:
            # TE: flash attention saves the up-projected q, k, v themselves, which the checkpoint
            # frees; plus the fused up-proj LayerNorms' outputs.
            drop += parts["qkv"] + parts["rope_k"] + (2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank) / sp
        elif opt.attention_impl == "unfused" or batch == 1 or "core_attn" in mods:
            # local: the checkpoint discards its outputs q, k, v after core attention; the unfused
            # path saves views of them, SDPA too for one sequence per micro-batch ([b, h, s, d]
            # views of [s, b, h, d]), so they are freed. The rope, norms and up-projection inputs
            # stay (the checkpoint's inputs). SDPA with batch > 1 saves its own contiguous copies:
            # nothing freed - unless core attention is recomputed too, so that SDPA saves nothing
            # in the forward (the 671B presets' core_attn + mla_up_proj). (Bytes alive after the
            # forward, tests/unit/test_planner_activations.py; H100 row act-L12-E16-s8192x2-preset512.)
            drop += parts["qkv"]
    if "layernorm" in mods:
        if local:  # fp32 in + out replaced by the bf16 checkpoint input
            drop += 2 * ((8 * h + 4) - 2 * h) / sp
        else:
            drop += 2 * h / sp + (2 * h / sp if moe else 0.0)
    if moe and "moe" in mods:
        drop += parts["shared"] + parts["router"] + parts["experts"] + parts["moe_act"]
    else:
        if moe and "moe_act" in mods:
            drop += parts["moe_act"]
        if moe and "shared_experts" in mods:
            drop += parts["shared"]
        if not moe and "mlp" in mods:
            drop += parts["mlp"] - (0.0 if local else 0.0)
    return min(drop, total)


@functools.lru_cache(maxsize=4096)
def layer_activation(m, moe: bool, lay, opt, seq: int, batch: int = 1) -> LayerAct:
    parts = _layer_parts(m, moe, lay, opt, seq, batch)
    full = sum(parts.values())
    return LayerAct(parts=parts, kept=full - _dropped(m, moe, lay, opt, parts, batch), full=full)


def logits_bytes_per_token(m, lay, opt) -> tuple[float, float]:
    """(saved, transient) bytes per token for the output layer + loss on the last stage.
    megatron's vocab-parallel cross entropy (verl's log-prob path calls the same function,
    verl/utils/megatron/tensor_parallel.py:201-205) upcasts the logits to fp32 once and computes
    exp() in place, saving that fp32 buffer (cross_entropy.py); the bf16 logits are alive next to
    it until the loss returns (and their bf16 gradient in the backward)."""
    v = m.vocab / lay.tp
    sp = lay.tp if lay.sp_ else 1
    h = m.hidden
    # final norm (local: fp32 in + out; TE: bf16 in) + the output layer's bf16 input
    final_norm = ((8 * h + 4) if opt.transformer_impl == "local" else (2 * h + 4)) / sp + 2 * h / sp
    if opt.loss == "fused":
        return final_norm, 0.0
    return 4 * v + final_norm, 2 * v


# --- training memory per GPU ------------------------------------------------------------------


@dataclasses.dataclass
class MemoryBreakdown:
    """Bytes on one GPU at the trainer's peak (the worst PP rank)."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    transient: float = 0.0
    comm_buffers: float = 0.0
    ref_weights: float = 0.0
    reserve: float = 0.0
    pp_rank: int = 0
    detail: dict = dataclasses.field(default_factory=dict)

    FIELDS = ("weights", "grads", "optimizer", "activations", "logits", "transient", "comm_buffers", "ref_weights",
              "reserve")

    @property
    def allocated(self) -> float:
        """What ``torch.cuda.max_memory_allocated`` would show (everything but the reserve)."""
        return self.total - self.reserve

    @property
    def total(self) -> float:
        return sum(getattr(self, f) for f in self.FIELDS)

    def gib(self) -> dict[str, float]:
        d = {f: round(getattr(self, f) / GIB, 2) for f in self.FIELDS}
        d["total"] = round(self.total / GIB, 2)
        return d


def optimizer_bytes_per_param(opt) -> float:
    """fp32 main param + Adam m + v (precision-aware optimizer may store m, v in bf16)."""
    mv = 2 + 2 if (opt.precision_aware_optimizer and opt.exp_avg_dtype == "bf16") else 4 + 4
    return 4 + mv


def grad_bytes_per_param(opt) -> float:
    """megatron's grad buffer: fp32 when grad_reduce_in_fp32 (verl's default), bf16 when the
    precision-aware optimizer keeps bf16 main grads."""
    if opt.precision_aware_optimizer and opt.main_grads_dtype == "bf16":
        return 2.0
    return 4.0 if opt.grad_reduce_in_fp32 else 2.0


def train_memory(m, split, lay, grpo, opt, world: int, n_micro: int) -> tuple[MemoryBreakdown, list[MemoryBreakdown]]:
    """Peak trainer memory per PP rank; returns (worst rank, all ranks)."""
    dp_cp = max(1, lay.dp(world) * lay.cp)
    edp = max(1, lay.edp(world))
    w_bytes = 2.0
    g_bytes = grad_bytes_per_param(opt)
    o_bytes = optimizer_bytes_per_param(opt) * (1 - opt.optimizer_cpu_offload_fraction)
    tokens = grpo.tokens_per_micro_batch / lay.cp  # tokens of one micro-batch on this GPU
    seq = grpo.seq_len if opt.transformer_impl == "local" else 0
    # sequences per micro-batch (the local spec has no packed THD format)
    batch = max(1, round(grpo.tokens_per_micro_batch / grpo.seq_len)) if opt.transformer_impl == "local" else 1
    attention = opt.attention_impl
    ref_offload = opt.param_offload if opt.ref_param_offload is None else opt.ref_param_offload
    out = []
    for r in range(split.pp):
        p = stage_params(m, split, r, lay, opt.transformer_impl)
        mb = MemoryBreakdown(pp_rank=r)
        mb.weights = p.total * w_bytes
        fp8_cache = 0.0
        if opt.train_precision == "fp8":
            gemm = te_gemm_params(m, split, r, lay)
            # fp8_param: the GEMM weights are FP8 tensors (row-wise + column-wise, 2 B) instead of BF16 (2 B): same
            # bytes; otherwise the BF16 weights stay and the FP8 cache comes on top
            fp8_cache = gemm * fp8_weight_cache_bytes_per_param(opt)
            mb.weights += fp8_cache
        mb.grads = p.total * g_bytes
        if opt.distributed_optimizer:
            mb.optimizer = (p.dense / dp_cp + p.expert / edp) * o_bytes
        else:
            mb.optimizer = p.total * o_bytes
        if opt.ref_model and not ref_offload:
            mb.ref_weights = p.total * w_bytes
        # activations of the in-flight model chunks
        chunk_kept, chunk_full, has_loss = [], [], False
        biggest_layer_full, biggest_layer_extra = 0.0, 0.0
        for st in split.stages[r]:
            kept = 0.0
            full = 0.0
            n_layers = len(st.decoder) + st.mtp
            for idx in list(st.decoder) + [m.num_layers] * st.mtp:  # MTP is a MoE layer
                la = layer_activation(m, m.is_moe_layer(idx), lay, opt, seq, batch)
                kept += la.kept
                full += la.full
                biggest_layer_full = max(biggest_layer_full, la.full)
                biggest_layer_extra = max(biggest_layer_extra, la.full - la.kept)
            if lay.recompute == "full" and lay.recompute_method == "uniform" and lay.recompute_num_layers > 1 and n_layers:
                groups = -(-n_layers // lay.recompute_num_layers)
                kept = kept * groups / n_layers
            chunk_kept.append(kept * tokens)
            chunk_full.append(full * tokens)
            has_loss |= st.loss
        n_inflight = _inflight(split.pp, split.vpp, r, n_micro)
        mb.activations = n_inflight * sum(chunk_kept) / split.vpp
        if lay.recompute == "full":
            # backward recomputes recompute_num_layers layers at once and holds their activations
            biggest_layer_extra = biggest_layer_full * lay.recompute_num_layers
        saved_logits, transient_logits = logits_bytes_per_token(m, lay, opt)
        if has_loss:  # the loss phase: fp32 exp(logits) saved + the bf16 logits alive
            mb.logits = (saved_logits + transient_logits) * tokens
        # the backward of the biggest layer: its recomputed part + the gradients flowing through
        # it. The loss phase is over by then, so only the excess over it adds to the peak.
        layer_ws = (biggest_layer_extra + _grad_working_set(m, lay, opt, seq)) * tokens
        mb.transient = max(0.0, layer_ws - mb.logits)
        if attention == "unfused":
            # unfused DotProductAttention keeps a persistent bf16 [b*heads, s, s] matmul buffer
            # (megatron's global memory buffer, dot_product_attention.py:195)
            mb.transient += 2 * m.num_heads / lay.tp * seq * tokens
        if opt.optimizer_impl == "torch":
            # torch Adam(W) foreach: sqrt(exp_avg_sq) for every main param at once, after the
            # activations are gone; only its excess over the fwd/bwd peak matters
            # megatron builds one optimizer for the dense and one for the expert-parallel params (a ChainedOptimizer,
            # optimizer/__init__.py filter_fn on 'is_expert_parallel'): each step() allocates its own foreach
            # temporary and frees it before the next, so the largest of the two counts (measured: 4xH100 best2,
            # 2026-11-26, 68.5 GiB vs 71.7 predicted with the sum)
            step_ws = 4 * (max(p.dense / dp_cp, p.expert / edp) if opt.distributed_optimizer else max(p.dense, p.expert))
            step_ws *= 1 - opt.optimizer_cpu_offload_fraction
            mb.transient += max(0.0, step_ws - (mb.activations + mb.logits + mb.transient))
        mb.comm_buffers = _comm_buffer_bytes(m, lay, opt, tokens)
        mb.reserve = non_torch_reserve(lay, opt)
        mb.detail = dict(params=p.total, dense_params=p.dense, expert_params=p.expert, inflight_chunks=n_inflight,
                         layers=split.rank_layers(r), tokens_per_microbatch=tokens, attention=attention,
                         fp8_weight_cache=fp8_cache, train_precision=opt.train_precision)
        out.append(mb)
    worst = max(out, key=lambda x: x.total)
    return worst, out


def _inflight(pp: int, vpp: int, rank: int, m: int) -> int:
    from dsv3_rl.planner.pipeline import inflight_chunks

    if pp == 1:
        return vpp  # one micro-batch through every chunk
    return inflight_chunks(pp, vpp, rank, m) if vpp > 1 else min(pp - rank, m)


def _grad_working_set(m, lay, opt, seq: int) -> float:
    """Bytes per token alive only during a layer's backward: activation gradients of its widest
    tensors (unfused attention: grads of the S x S scores in bf16 + fp32; MoE: routed copies)."""
    t = lay.tp
    sp = t if lay.sp_ else 1
    w = 4 * m.hidden / sp  # gradient of the layer input and output
    if opt.attention_impl == "unfused":
        w += 2 * m.num_heads / t * seq  # bf16 gradient of the S x S probabilities
    return w


def _comm_buffer_bytes(m, lay, opt, tokens: float) -> float:
    """All-to-all buffers beyond the activations: none. The dispatch's output *is* the permuted tokens the expert
    GEMMs save (counted in the activations) and its input is freed by then. The former rule (one extra receive
    buffer of ``2 x topk x tokens x hidden`` bytes) was refuted by the 2-GPU pair measured on 2026-11-26 (H100,
    TP2 EP1 vs TP2 EP2, same batch: the update's dynamic peak 9.20 vs 9.28 GiB, no EP-dependent term)."""
    return 0.0


#: non-PyTorch memory per GPU of a megatron/verl trainer process (CUDA context, cuBLAS/cuDNN workspaces, NCCL
#: communicators and their buffers) as the CUDA OOM message reports it ("this process has X in use" - allocated -
#: reserved-but-unallocated): 6.74 GiB on all 4 ranks of TP1 EP4 (H100, torch 2.11+cu130, 2026-11-26, oom row)
NON_TORCH_GIB = 6.74
#: each lazily created NCCL communicator for megatron's pipeline send/recv (PP > 1 makes two per rank, the log's
#: "unbatched P2P op ... new 2-rank NCCL communicator"): best3 (TP2 PP2 EP2) rank 3 had 7.61 GiB non-PyTorch
NCCL_P2P_COMM_GIB = 0.435
#: the caching allocator's reserved-but-unallocated memory that a large request cannot reuse (fragmentation):
#: 2.90 GiB on best3's rank 3 when its 2.44 GiB request failed (and 1.4-3.4 GiB on the oom row's ranks)
FRAGMENTATION_GIB = 2.90


def non_torch_reserve(lay, opt) -> float:
    """Bytes per GPU the torch-allocated peak must leave free: ``Options.reserve_gib`` when set (it replaces this
    rule); otherwise the measured non-PyTorch memory (:data:`NON_TORCH_GIB`, + :data:`NCCL_P2P_COMM_GIB` per
    pipeline send/recv communicator) and the allocator's fragmentation (:data:`FRAGMENTATION_GIB`)."""
    if opt.reserve_gib is not None:
        return opt.reserve_gib * GIB
    p2p = 2 if lay.pp > 1 else 0
    return (NON_TORCH_GIB + p2p * NCCL_P2P_COMM_GIB + FRAGMENTATION_GIB) * GIB


# --- host memory of the trainer processes -------------------------------------------------------

#: host bytes of a CUDA process that imports torch and holds a model on its GPU, before any offload (CUDA context,
#: libraries, Python heap): not derived from code but measured, the RSS of the colocated vLLM worker (a CUDA + torch
#: process whose weights sit on its GPU) in Ray's memory report of proxy_1xH100, 2026-12-07
#: (docs/results/2026-12-07-gpu-proxy1/README.md): 1.60 GiB
HOST_PROCESS_GIB = 1.60
#: host memory of everything but the trainer processes on a one-GPU node of a colocated GRPO run (vLLM engine and
#: HTTP server, agent-loop, reward and TransferQueue workers, the launcher, main_ppo, raylet, the kernel): measured,
#: Ray's node total less the trainer at the kill of proxy_1xH100 (119.76 - 101.45 GiB, same report). Not scaled with
#: the number of GPUs: a larger node runs more of them, so this is a floor there
HOST_OTHERS_GIB = 18.31


def _pinned(nbytes: float) -> float:
    """Bytes torch's pinned allocator takes for a request: the CachingHostAllocator rounds every pinned allocation up
    to a power of two (ATen/core/CachingHostAllocator.h ``allocate``, ``c10::llvm::PowerOf2Ceil(size)``; the limits
    ``pinned_max_round_threshold`` / ``pinned_max_cached_size`` default to SIZE_MAX, c10/core/AllocatorConfig.h), and
    keeps a freed pinned block cached for reuse instead of returning it."""
    n = int(math.ceil(nbytes))
    return float(1 << (n - 1).bit_length()) if n > 1 else float(n)


def rank_param_tensors(m, split, rank: int, lay) -> list[tuple[float, bool]]:
    """(elements, is_expert) of each parameter tensor megatron builds on one rank (TE spec: one tensor per routed
    expert's fc1 and fc2, ``TEGroupedMLP`` weight0..N-1; the local spec's ``GroupedMLP`` merges them per layer).
    The same counts as :func:`stage_params`, as tensors, since the pinned allocator rounds each one."""
    tp, ep, etp = lay.tp, lay.ep, lay.etp_
    a = m.attn_params()
    repl = {"q_a_layernorm", "kv_a_layernorm", "input_layernorm"}
    attn = [(float(v) if k in repl else v / tp, False) for k, v in a.items()]

    def moe_layer():
        out = attn + [(m.num_experts * m.hidden, False), (m.hidden, False),
                      (2 * m.hidden * m.shared_ffn / tp, False), (m.hidden * m.shared_ffn / tp, False)]
        e_local = m.num_experts / ep
        fc1, fc2 = 2 * m.hidden * m.moe_ffn / etp, m.hidden * m.moe_ffn / etp
        out += [(fc1, True), (fc2, True)] * max(1, int(e_local))
        return out

    ts: list[tuple[float, bool]] = []
    for st in split.stages[rank]:
        for i in st.decoder:
            if m.is_moe_layer(i):
                ts += moe_layer()
            else:
                ts += attn + [(2 * m.hidden * m.dense_ffn / tp, False), (m.hidden * m.dense_ffn / tp, False),
                              (m.hidden, False)]
        if st.embedding:
            ts.append((m.embedding_params / tp, False))
        if st.loss:
            ts.append((m.hidden, False))
            if not m.tie_embeddings:
                ts.append((m.embedding_params / tp, False))
        for _ in range(st.mtp):
            ts += moe_layer() + [(2 * m.hidden * m.hidden / tp, False), (2 * m.hidden, False), (m.hidden, False)]
    return ts


@dataclasses.dataclass
class HostMemory:
    """Host bytes of the trainer: one process (the worst PP rank) by term, and a node's trainer processes."""

    terms: dict[str, float]
    processes_per_node: int
    pp_rank: int = 0

    @property
    def per_process(self) -> float:
        return sum(self.terms.values())

    @property
    def per_node(self) -> float:
        return self.per_process * self.processes_per_node

    def gib(self) -> dict[str, float]:
        return {k: round(v / GIB, 2) for k, v in self.terms.items()}


def trainer_host_memory(m, split, lay, opt, world: int, gpus_per_node: int) -> HostMemory:
    """Host memory of one megatron trainer process (verl 0.9.1 + megatron-core 0.16.1) once it has trained a step and
    offloaded, the worst PP rank, and of a node's ``min(world, gpus_per_node)`` trainer processes. Terms, each from
    the code that allocates it (``_pinned`` marks pinned memory, rounded up to a power of two per tensor):

    * ``param_offload`` (``param_offload``, distributed optimizer): one pinned bf16 copy of each DDP buffer's
      ``param_data``, allocated at the first offload and kept for the process's life
      (verl ``utils/megatron_utils.py:751-756``; the grad buffer is only freed on the GPU, ``:778-781``, no host
      copy; without the distributed optimizer there is no ``param_data`` to move, ``:732-733``).
    * HybridDeviceOptimizer (``optimizer_cpu_offload_fraction`` f > 0; megatron-core ``optimizer/__init__.py:336-345``
      builds it with ``param_update_in_fp32=True`` and ``torch.optim.AdamW`` as the CPU optimizer, ``:10``), for the
      first f of this rank's optimizer-shard elements (``cpu_offloading/hybrid_optimizer.py:258-276``):
      ``hdo_pinned_clone``: ``param.detach().clone().cpu().pin_memory()`` (``:274``), the shard's own dtype (bf16 with
      the precision-aware optimizer, whose shard params are the bf16 model shards, ``distrib_optimizer.py:440-449``;
      fp32 main params otherwise), freed once ``.float()`` copies it but kept by the pinned allocator's cache
      (0 B without the precision-aware optimizer: the fp32 clone is the master itself); ``hdo_master_fp32``: that
      ``.float()`` copy (``:277-279``, pageable); ``hdo_grads_fp32``: a pinned fp32 gradient per offloaded param,
      allocated at the first step (``:108-112``); ``hdo_adam_fp32``: AdamW's ``exp_avg`` and ``exp_avg_sq``,
      ``zeros_like`` the fp32 master, 8 B (``exp_avg_dtype`` is not passed to the CPU optimizer, ``__init__.py:336-345``).
      The first HybridDeviceOptimizer, built over the whole params before the distributed optimizer rebuilds it
      (``distrib_optimizer.py:602-605``), leaves its clones in the same cache; the rebuilt one reuses them where the
      shard is the whole param (DP 1); with DP > 1 the model counts the shard clones only.
    * ``optimizer_offload`` for the GPU part (1 - f): verl moves the optimizer's fp32 main params and Adam states to
      pageable host memory while the trainer sleeps (``megatron_utils.py:857-900, 961-970``): 12 B, or 4 B + 2 x 2 B
      with the precision-aware optimizer's bf16 moments.
    * ``process``: :data:`HOST_PROCESS_GIB` (measured, not derived).

    Not modelled: the pinned allocator's rounding of verl's per-offload transient copies (none in verl 0.9.1), the
    reference model (``ref_model``: its weights follow ``param_offload`` into pageable memory, 2 B a param, added when
    offloaded), the Ray object store (shared memory, outside the process)."""
    dp_cp = max(1, lay.dp(world) * lay.cp)
    edp = max(1, lay.edp(world))
    f = opt.optimizer_cpu_offload_fraction
    worst: HostMemory | None = None
    for r in range(split.pp):
        ts = rank_param_tensors(m, split, r, lay)
        dense = sum(n for n, e in ts if not e)
        expert = sum(n for n, e in ts if e)
        t: dict[str, float] = {}
        t["param_offload"] = (_pinned(2 * dense) + (_pinned(2 * expert) if expert else 0.0)) \
            if opt.param_offload and opt.distributed_optimizer else 0.0
        shards = [n / ((edp if e else dp_cp) if opt.distributed_optimizer else 1) for n, e in ts]
        # HybridDeviceOptimizer offloads params in order until f of the elements are on the CPU (:258, :273)
        off, limit, cpu = 0.0, f * sum(shards), []
        for n in shards:
            if off < limit:
                cpu.append(n)
                off += n
        pa = opt.precision_aware_optimizer
        t["hdo_pinned_clone"] = sum(_pinned(2 * n) for n in cpu) if pa else 0.0
        t["hdo_master_fp32"] = 4 * off if pa else sum(_pinned(4 * n) for n in cpu)
        t["hdo_grads_fp32"] = sum(_pinned(4 * n) for n in cpu)
        t["hdo_adam_fp32"] = 8 * off
        gpu_part = sum(shards) - off
        t["optimizer_offload"] = gpu_part * optimizer_bytes_per_param(opt) if opt.optimizer_offload else 0.0
        ref_offload = opt.param_offload if opt.ref_param_offload is None else opt.ref_param_offload
        t["ref_offload"] = 2 * (dense + expert) if opt.ref_model and ref_offload else 0.0
        t["process"] = HOST_PROCESS_GIB * GIB
        hm = HostMemory(terms=t, processes_per_node=min(world, gpus_per_node), pp_rank=r)
        if worst is None or hm.per_process > worst.per_process:
            worst = hm
    return worst


# --- rollout memory ---------------------------------------------------------------------------


@dataclasses.dataclass
class RolloutMemory:
    """Bytes on one rollout GPU (vLLM), plus the trainer's leftovers on it when colocated."""

    weights: float = 0.0
    kv_cache: float = 0.0
    activations: float = 0.0
    cuda_graphs: float = 0.0
    trainer_resident: float = 0.0
    reserve: float = 0.0
    budget: float = 0.0
    kv_tokens: int = 0            # KV capacity of one engine instance, tokens
    kv_bytes_per_token: float = 0.0
    max_concurrent_seqs: int = 0  # per instance, at max length

    def gib(self) -> dict[str, float]:
        return {k: round(getattr(self, k) / GIB, 2) for k in
                ("weights", "kv_cache", "activations", "cuda_graphs", "trainer_resident", "reserve", "budget")}


def rollout_weight_params(m, ro) -> float:
    return _rollout_weight_params(m, ro.tp, ro.ep)


@functools.lru_cache(maxsize=256)
def _rollout_weight_params(m, tp: int, ep: int) -> float:
    """Params on one vLLM GPU: MLA down-projections, norms and the router replicated (vLLM
    ReplicatedLinear), the rest split by TP; experts split by TP (intermediate dim) or, with
    EP, whole experts split over TP*DP; DP > 1 without EP replicates everything."""
    a = m.attn_params()
    repl = a.get("q_a_proj", 0) + a["kv_a_proj_with_mqa"] + a.get("q_a_layernorm", 0) + a["kv_a_layernorm"] + a["input_layernorm"]
    split = a.get("q_b_proj", 0) + a.get("q_proj", 0) + a["kv_b_proj"] + a["o_proj"]
    per_layer_attn = repl + split / tp
    total = m.num_layers * per_layer_attn
    for i in range(m.num_layers):
        if m.is_moe_layer(i):
            total += m.num_experts * m.hidden + m.hidden + 3 * m.hidden * m.shared_ffn / tp
            total += m.num_experts * m.expert_params() / (ep if ep > 1 else tp)
        else:
            total += m.hidden + 3 * m.hidden * m.dense_ffn / tp
    total += 2 * m.embedding_params / tp + m.hidden
    return total


#: the three ways vLLM places a rollout weight (:func:`_rollout_weight_params`), by HF tensor name
def _rollout_placement(name: str) -> str:
    if ".mlp.experts." in name:
        return "experts"  # whole experts over EP, or split by TP
    if any(x in name for x in ("q_a_proj", "kv_a_proj_with_mqa", "layernorm", "norm.", ".mlp.gate.")):
        return "replicated"  # MLA down-projections, norms, router
    return "tp"


@functools.lru_cache(maxsize=16)
def fp8_savings(m) -> dict[str, float]:
    """Bytes FP8 rollout weights save against BF16, per placement (replicated / tp / experts), unsharded:
    for every tensor DeepSeek's FP8 release keeps in FP8 (the rule of :func:`dsv3_rl.refit.fp8_layout.reference_layout`,
    over this model's shapes, MTP excluded: vLLM's rollout model has no MTP layer) 1 byte per element instead of 2,
    less its fp32 ``_scale_inv`` (4 bytes per 128 x 128 block)."""
    from dsv3_rl.refit.fp8_layout import SCALE_SUFFIX, reference_layout

    if not m.q_lora_rank:
        raise ValueError(f"rollout_quantization=fp8: model {m.name} has no q_lora_rank; DeepSeek's FP8 layout "
                         "(tests/assets/deepseek_v3_fp8_layout) describes q_a_proj/q_b_proj models only")
    out = {"replicated": 0.0, "tp": 0.0, "experts": 0.0}
    for name, (dtype, shape) in reference_layout({**m.to_hf(), "num_nextn_predict_layers": 0}).items():
        numel = math.prod(shape)
        if name.endswith(SCALE_SUFFIX):
            out[_rollout_placement(name[: -len(SCALE_SUFFIX)])] -= 4.0 * numel
        elif dtype == "F8_E4M3":
            out[_rollout_placement(name)] += 1.0 * numel
    return out


def rollout_weight_bytes(m, tp: int, ep: int = 1, quantization: str = "none") -> float:
    """Weight bytes on one vLLM GPU (TP ``tp``, expert parallel over ``ep`` GPUs, 1 = none): BF16 for
    ``quantization="none"``; for ``"fp8"`` the BF16 bytes less :func:`fp8_savings`, each placement divided as vLLM
    divides it. The one count the rollout memory (:func:`rollout_memory`) and the refit model
    (:func:`dsv3_rl.planner.refit.rollout_bytes_per_gpu`) use."""
    b = 2.0 * _rollout_weight_params(m, tp, ep)
    if quantization == "fp8":
        s = fp8_savings(m)
        b -= s["replicated"] + s["tp"] / tp + s["experts"] / (ep if ep > 1 else tp)
    elif quantization != "none":
        from dsv3_rl.recipes.rollout_quantization import MODES

        raise ValueError(f"rollout_quantization={quantization!r} (allowed: {', '.join(MODES)})")
    return b


def kv_bytes_per_token(m, dtype_bytes: int = 2) -> float:
    """vLLM's MLA cache holds the compressed latent (kv_lora_rank) + the rope key per token per
    layer, one copy on *every* TP rank (MLA has a single latent 'head', so TP does not shard it)."""
    return m.num_layers * (m.kv_lora_rank + m.qk_rope_dim) * dtype_bytes


def rollout_memory(m, ro, grpo, opt, mem_bytes: float, trainer_resident: float) -> RolloutMemory:
    rm = RolloutMemory()
    rm.weights = rollout_weight_bytes(m, ro.tp, ro.ep, opt.rollout_quantization)
    # vLLM's profiling run: one forward of max_num_batched_tokens; roughly hidden states, the MLA
    # up-projected q/k/v of a chunk, and the MoE intermediate on this GPU
    tkn = opt.rollout_max_num_batched_tokens
    per_tok = 2 * (4 * m.hidden + m.num_heads / ro.tp * (2 * m.qk_head_dim + m.v_head_dim)
                   + m.topk * (m.hidden + 2 * m.moe_ffn / (1 if ro.ep > 1 else ro.tp)) + 2 * m.vocab / ro.tp)
    rm.activations = tkn * per_tok
    rm.cuda_graphs = 0.0 if opt.rollout_enforce_eager else 1.5 * GIB
    rm.reserve = 1.0 * GIB  # vLLM's non-torch memory (context + NCCL) inside its budget
    rm.budget = ro.gpu_memory_utilization * mem_bytes
    rm.trainer_resident = trainer_resident
    rm.kv_cache = max(0.0, rm.budget - rm.weights - rm.activations - rm.cuda_graphs - rm.reserve)
    rm.kv_bytes_per_token = kv_bytes_per_token(m)
    rm.kv_tokens = int(rm.kv_cache // rm.kv_bytes_per_token) * (ro.dp if ro.dp > 1 else 1)
    rm.max_concurrent_seqs = rm.kv_tokens // grpo.seq_len
    return rm


def trainer_resident_during_rollout(train: MemoryBreakdown, opt) -> float:
    """What the trainer leaves on a colocated GPU while vLLM runs (verl hybrid engine)."""
    keep = 0.0
    if not opt.param_offload:
        keep += train.weights + train.grads
    if not opt.optimizer_offload:
        keep += train.optimizer
    keep += train.ref_weights
    keep += (opt.reserve_gib if opt.reserve_gib is not None else NON_TORCH_GIB + FRAGMENTATION_GIB) * GIB * 0.5  # the trainer process's own context + NCCL communicators
    return keep


# --- routed-expert tensors (verl router replay R2 / R3) ----------------------------------------

#: bytes per routed-expert id where verl keeps them per step: int16, for the rollout's routes
#: (verl/experimental/agent_loop/agent_loop.py:131 and 796) and the trainer's recorded ones
#: (verl/utils/megatron/router_replay_utils.py:323, 657)
ROUTE_ID_BYTES = 2
#: bytes per id of a replay target: each local MoE router gets its layer's ids as int64
#: (router_replay_utils.py:538 and 563), kept in RouterReplay.replay_backward_list until the micro-batch's
#: backward (router_replay_patch.py:94-99)
REPLAY_TARGET_BYTES = 8


@dataclasses.dataclass
class RoutedExperts:
    """verl's routed-experts tensor (tokens, layers, top_k) for one GRPO step, and its GPU share."""

    mode: str
    layers: int              # layers of the tensor (R3: every hidden layer, R2: the MoE layers)
    tokens: int              # tokens of the step: prompts x n x (prompt + response), padded to the maximum as
                             # the agent loop pads R3's routes (agent_loop.py:786-797; R2's jagged ones are fewer)
    host: float              # bytes of the step's tensor (int16) in the driver's batch
    pp_rank: int             # the trainer PP rank with the most MoE layers
    stage_moe_layers: int    # ... and their number
    gpu_tokens: float        # tokens of one micro-batch on one GPU: / CP, / TP (verl scatters to the SP region)
    gpu: float               # int64 replay targets of that rank's MoE layers, one micro-batch, forward to backward
    staging: float           # the micro-batch's int16 routes of every layer, copied to the GPU while targets are set


def routed_experts(m, grpo, lay, rank_layers: list[list[int]], mode: str = "R3") -> RoutedExperts:
    """Bytes of the routed-expert ids of one step (host) and of one micro-batch on one trainer GPU.

    ``rank_layers``: the decoder layers of each PP rank (:meth:`Split.rank_layers`). The tensor's layers:
    R3 takes vLLM's routes, recorded for every hidden layer (vLLM's RoutedExpertsCapturer buffer is
    ``get_total_num_hidden_layers() x num_experts_per_tok``, a dense layer's rows stay 0; verl then indexes
    them by absolute layer, router_replay_utils.py:520-523); R2 records the trainer's own MoE routers and
    gathers them over PP (``pp_gather``, router_replay_utils.py:691), MoE layers only. On the GPU, verl
    copies the micro-batch's whole route tensor (every layer, int16, this CP rank's tokens) to the device,
    scatters the tokens over TP and gives each local router its layer as int64
    (``set_router_replay_data``, router_replay_utils.py:505-563)."""
    if mode not in ("R2", "R3"):
        raise ValueError(f"router replay mode={mode!r}; allowed: ('R2', 'R3')")
    layers = m.num_layers if mode == "R3" else m.num_moe_layers
    tokens = grpo.prompts_per_step * grpo.n_samples * grpo.seq_len
    per_rank = [sum(m.is_moe_layer(i) for i in layers_) for layers_ in rank_layers]
    rank = max(range(len(per_rank)), key=lambda r: per_rank[r]) if per_rank else 0
    moe = per_rank[rank] if per_rank else 0
    mb_tokens = grpo.tokens_per_micro_batch / lay.cp
    gpu_tokens = mb_tokens / lay.tp
    return RoutedExperts(mode=mode, layers=layers, tokens=tokens, host=tokens * layers * m.topk * ROUTE_ID_BYTES,
                         pp_rank=rank, stage_moe_layers=moe, gpu_tokens=gpu_tokens,
                         gpu=gpu_tokens * moe * m.topk * REPLAY_TARGET_BYTES,
                         staging=mb_tokens * layers * m.topk * ROUTE_ID_BYTES)
