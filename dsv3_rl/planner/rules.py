"""Divisibility and consistency rules a layout must satisfy, each one taken from what
megatron-core 0.16.1, verl 0.9.1 or vLLM actually assert, with the file:line it comes from.

A failed rule is a :class:`Violation`; its message names the rule and the values. Memory rules
live in :mod:`dsv3_rl.planner.memory` and the pipeline split rules in
:mod:`dsv3_rl.planner.pipeline`.

Paths: ``MCORE`` is ``backends/megatron-core-0.16.1/megatron/core``, ``VERL`` is
``backends/verl-0.9.1/verl`` (the pinned, patched trees).
"""

from __future__ import annotations

import dataclasses

MCORE = "megatron/core"
VERL = "verl"


@dataclasses.dataclass(frozen=True)
class Violation:
    rule: str
    message: str
    source: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message} ({self.source})"


def trainer_rules(m, world: int, lay, grpo, opt) -> list[Violation]:
    """megatron-core + verl rules for a trainer layout on ``world`` GPUs (not the pipeline split)."""
    v: list[Violation] = []
    tp, pp, cp, ep, etp = lay.tp, lay.pp, lay.cp, lay.ep, lay.etp_
    for name, x in (("TP", tp), ("PP", pp), ("CP", cp), ("EP", ep), ("ETP", etp)):
        if x < 1:
            v.append(Violation("positive", f"{name}={x} must be >= 1", "-"))
    if v:
        return v
    # --- parallel_state.initialize_model_parallel ---
    if world % (tp * pp * cp):
        v.append(Violation("mcore.world_div_tp_pp_cp",
                           f"world size {world} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}",
                           f"{MCORE}/parallel_state.py:738-741; {VERL}/utils/config.py:109-113"))
    if world % (etp * ep * pp):
        v.append(Violation("mcore.world_div_etp_ep_pp",
                           f"world size {world} is not divisible by ETP*EP*PP = {etp}*{ep}*{pp} = {etp * ep * pp}",
                           f"{MCORE}/parallel_state.py:786-795"))
    # --- TransformerConfig / ModelParallelConfig.__post_init__ ---
    if m.num_heads % tp:
        v.append(Violation("mcore.heads_div_tp",
                           f"num_attention_heads={m.num_heads} is not a multiple of TP={tp}",
                           f"{MCORE}/transformer/transformer_config.py:924-928"))
    if lay.sp and tp <= 1:
        v.append(Violation("mcore.sp_needs_tp", f"sequence_parallel=True needs TP > 1 (TP={tp})",
                           f"{MCORE}/model_parallel_config.py:409-411"))
    if ep > 1 and not m.num_experts:
        v.append(Violation("mcore.ep_needs_experts", f"EP={ep} but the model has no routed experts",
                           f"{MCORE}/transformer/transformer_config.py:1048-1049"))
    if lay.recompute == "selective":
        mods = set(lay.recompute_modules or ("core_attn",))
        if "moe_act" in mods and not opt.moe_grouped_gemm:
            v.append(Violation("mcore.moe_act_needs_grouped_gemm",
                               "recompute_modules has moe_act but moe_grouped_gemm is off",
                               f"{MCORE}/transformer/transformer_config.py:1213-1216"))
    if lay.recompute == "full":
        per_rank = -(-m.num_layers // pp)
        if not 1 <= lay.recompute_num_layers <= max(1, per_rank):
            v.append(Violation("mcore.recompute_num_layers",
                               f"recompute_num_layers={lay.recompute_num_layers} must be between 1 and the layers per "
                               f"pipeline rank ({per_rank})", f"{MCORE}/transformer/transformer_config.py:1172-1179"))
    # --- MoE layer / experts / dispatcher ---
    if m.num_experts:
        if m.num_experts % ep:
            v.append(Violation("mcore.experts_div_ep",
                               f"num_moe_experts={m.num_experts} is not divisible by EP={ep}",
                               f"{MCORE}/transformer/moe/moe_layer.py:101"))
        if (2 * m.moe_ffn) % etp or m.moe_ffn % etp:
            v.append(Violation("mcore.moe_ffn_div_etp",
                               f"moe_ffn_hidden_size={m.moe_ffn} is not divisible by ETP={etp}",
                               f"{MCORE}/transformer/moe/experts.py:139-142"))
        if m.shared_ffn and m.shared_ffn % tp:
            v.append(Violation("mcore.shared_ffn_div_tp",
                               f"moe_shared_expert_intermediate_size={m.shared_ffn} is not divisible by TP={tp}",
                               f"{MCORE}/tensor_parallel/layers.py:849"))
        if tp > 1 and not lay.sp_:
            v.append(Violation("mcore.moe_tp_needs_sp",
                               f"MoE training with TP={tp} needs sequence_parallel=True",
                               f"{MCORE}/transformer/moe/moe_layer.py:379-383"))
        if lay.dispatcher == "flex" and tp * ep <= 1:
            v.append(Violation("mcore.flex_needs_tp_ep", f"the flex dispatcher needs TP*EP > 1 (TP={tp}, EP={ep})",
                               f"{MCORE}/transformer/moe/token_dispatcher.py:1350"))
    if m.num_dense_layers and m.dense_ffn % tp:
        v.append(Violation("mcore.ffn_div_tp", f"ffn_hidden_size={m.dense_ffn} is not divisible by TP={tp}",
                           f"{MCORE}/tensor_parallel/layers.py:849,1179"))
    if m.vocab % tp:
        v.append(Violation("mcore.vocab_div_tp", f"vocab_size={m.vocab} is not divisible by TP={tp} (pad the vocabulary)",
                           f"{MCORE}/tensor_parallel/utils.py:119; {MCORE}/tensor_parallel/layers.py:849"))
    if tp > 1:
        # both layer specs build the MLA down-projections as ColumnParallelLinear in this repository
        # (local spec upstream; TE spec with patches/megatron-core/0.16.1/0001-te-spec-mla-down-proj-...)
        for name, n in (("q_lora_rank", m.q_lora_rank), ("kv_lora_rank + qk_rope_head_dim", m.kv_lora_rank + m.qk_rope_dim)):
            if n and n % tp:
                v.append(Violation("mcore.mla_down_div_tp", f"{name}={n} is not divisible by TP={tp} (column-parallel "
                                   f"MLA down-projection)", f"{MCORE}/models/gpt/gpt_layer_specs.py:259-261,382-385; "
                                   f"{MCORE}/tensor_parallel/layers.py:849"))
    # --- verl batch rules ---
    dp = lay.dp(world)
    if dp:
        mini = grpo.mini_batch_prompts * grpo.n_samples
        if mini % dp:
            v.append(Violation("verl.mini_batch_div_dp",
                               f"ppo_mini_batch_size*n = {grpo.mini_batch_prompts}*{grpo.n_samples} = {mini} is not divisible "
                               f"by DP={dp}", f"{VERL}/workers/engine_workers.py:267-270; {VERL}/trainer/ppo/ray_trainer.py:1352-1353"))
        if not grpo.dynamic_batch:
            real = grpo.prompts_per_step * grpo.n_samples
            minimal = dp * grpo.micro_batch_size
            if real % minimal:
                v.append(Violation("verl.batch_div_dp_micro",
                                   f"train_batch_size*n = {real} is not divisible by DP*micro_batch_size = {dp}*"
                                   f"{grpo.micro_batch_size} = {minimal}", f"{VERL}/utils/config.py:115-127"))
            if grpo.prompts_per_step < grpo.mini_batch_prompts:
                v.append(Violation("verl.train_ge_mini",
                                   f"train_batch_size={grpo.prompts_per_step} < ppo_mini_batch_size={grpo.mini_batch_prompts}",
                                   f"{VERL}/workers/config/actor.py:225-229"))
        m_count = num_microbatches(grpo, lay, world)
        if lay.vpp and pp > 1:
            if m_count < pp:
                v.append(Violation("mcore.vpp_microbatches_ge_pp",
                                   f"interleaved schedule needs >= PP={pp} micro-batches per mini-batch per DP rank, "
                                   f"got {m_count}", f"{MCORE}/pipeline_parallel/schedules.py:996-1003"))
            elif not grpo.dynamic_batch and m_count % pp:
                v.append(Violation("verl.vpp_microbatches_div",
                                   f"{m_count} micro-batches per mini-batch are not divisible by "
                                   f"microbatch_group_size_per_vp_stage=PP={pp}",
                                   f"{VERL}/workers/engine/megatron/transformer_impl.py:914-918; "
                                   f"{MCORE}/pipeline_parallel/schedules.py:1007-1015"))
    return v


def num_microbatches(grpo, lay, world: int) -> int:
    """Micro-batches per mini-batch per DP rank (dynamic batching packs to the token budget; the
    worst case assumes every sequence has the maximum length, verl rounds the count up to a
    multiple of PP with VPP: rearrange_micro_batches(num_batches_divided_by=...))."""
    dp = max(1, lay.dp(world))
    seqs = -(-grpo.mini_batch_prompts * grpo.n_samples // dp)
    if grpo.dynamic_batch:
        per_mb = max(1, grpo.tokens_per_micro_batch // grpo.seq_len)
        m = -(-seqs // per_mb)
        if lay.vpp and lay.pp > 1:
            m = -(-m // lay.pp) * lay.pp
        return m
    return max(1, seqs // grpo.micro_batch_size)


def rollout_rules(m, ro, opt, trainer_world: int, total_world: int) -> list[Violation]:
    """verl + vLLM rules for a rollout layout."""
    v: list[Violation] = []
    size = ro.tp * ro.dp
    if ro.gpus % size:
        v.append(Violation("verl.rollout_world_div",
                           f"rollout world size {ro.gpus} is not divisible by rollout TP*DP*PP = {ro.tp}*{ro.dp}*1 = {size}",
                           f"{VERL}/workers/engine_workers.py:655-661"))
    if ro.ep > 1 and ro.ep != ro.tp * ro.dp:
        v.append(Violation("verl.rollout_ep", f"rollout expert_parallel_size={ro.ep} must equal TP*DP = {ro.tp * ro.dp}",
                           f"{VERL}/workers/config/rollout.py:294-297"))
    if m.num_heads % ro.tp:
        v.append(Violation("vllm.heads_div_tp", f"num_attention_heads={m.num_heads} is not divisible by rollout TP={ro.tp}",
                           "vllm ModelConfig.verify_with_parallel_config"))
    if m.num_experts:
        if ro.ep > 1 and m.num_experts % ro.ep:
            v.append(Violation("vllm.experts_div_ep", f"n_routed_experts={m.num_experts} is not divisible by rollout EP={ro.ep}",
                               "vllm FusedMoE (num_experts % ep_size)"))
        if ro.ep == 1 and m.moe_ffn % ro.tp:
            v.append(Violation("vllm.moe_ffn_div_tp", f"moe_intermediate_size={m.moe_ffn} is not divisible by rollout TP={ro.tp}",
                               "vllm FusedMoE (intermediate_size_per_partition)"))
    if opt.placement == "colocated" and ro.gpus != trainer_world:
        v.append(Violation("verl.colocated_pool", f"colocated rollout must use the trainer's {trainer_world} GPUs "
                           f"(got {ro.gpus})", f"{VERL}/trainer/ppo/ray_trainer.py:333-336 (hybrid engine)"))
    if opt.placement == "separate" and ro.gpus + trainer_world != total_world:
        v.append(Violation("placement.separate_sum", f"rollout {ro.gpus} + trainer {trainer_world} GPUs != cluster {total_world}",
                           "-"))
    return v
