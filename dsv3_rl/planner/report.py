"""Text output: the ranked table, per-layout reports, and the exact verl launcher overrides."""

from __future__ import annotations

import collections

from dsv3_rl.planner.model import count_params
from dsv3_rl.planner.spec import GIB

A = "actor_rollout_ref"


def verl_tree(ev, m, c, g, o) -> dict:
    """verl 0.9.1 config keys (trainer/config/ppo_megatron_trainer.yaml) for this candidate, as a nested dict."""
    lay, ro = ev.layout, ev.rollout
    world = ev.trainer_gpus
    actor: dict = {"ppo_mini_batch_size": g.mini_batch_prompts, "ppo_epochs": g.ppo_epochs,
                   "use_dynamic_bsz": g.dynamic_batch}
    if g.dynamic_batch:
        actor["ppo_max_token_len_per_gpu"] = g.tokens_per_micro_batch
    else:
        actor["ppo_micro_batch_size_per_gpu"] = g.micro_batch_size
    t: dict = {"trainer": {"n_gpus_per_node": c.gpus_per_node, "nnodes": max(1, world // c.gpus_per_node)},
               "data": {"train_batch_size": g.prompts_per_step, "max_prompt_length": g.max_prompt_len,
                        "max_response_length": g.max_response_len},
               A: {"rollout": {"n": g.n_samples}, "actor": actor}}
    if o.ref_model:  # verl's ref takes its sizes and override_transformer_config from the actor's (megatron_ref.yaml)
        ref_off = o.param_offload if o.ref_param_offload is None else o.ref_param_offload
        t[A]["ref"] = {"megatron": {"param_offload": ref_off}}
    meg = {"tensor_model_parallel_size": lay.tp, "pipeline_model_parallel_size": lay.pp,
           "virtual_pipeline_model_parallel_size": lay.vpp or None, "expert_model_parallel_size": lay.ep,
           "expert_tensor_parallel_size": lay.etp_, "context_parallel_size": lay.cp, "sequence_parallel": lay.sp_}
    otc: dict = {}
    if lay.pipeline_layout:
        otc["pipeline_model_parallel_layout"] = lay.pipeline_layout
    if lay.first_stage_layers is not None:
        otc["num_layers_in_first_pipeline_stage"] = lay.first_stage_layers
    if lay.last_stage_layers is not None:
        otc["num_layers_in_last_pipeline_stage"] = lay.last_stage_layers
    if lay.account_for_embedding:
        otc["account_for_embedding_in_pipeline_split"] = True
    if lay.account_for_loss:
        otc["account_for_loss_in_pipeline_split"] = True
    meg.update(param_offload=o.param_offload, optimizer_offload=o.optimizer_offload,
               use_distributed_optimizer=o.distributed_optimizer)
    if lay.recompute == "none":
        otc["recompute_granularity"] = None
    elif lay.recompute == "full":
        otc.update(recompute_granularity="full", recompute_method=lay.recompute_method,
                   recompute_num_layers=lay.recompute_num_layers)
    else:
        otc.update(recompute_granularity="selective", recompute_modules=list(lay.recompute_modules or ("core_attn",)))
    if lay.dispatcher != "alltoall":
        otc["moe_token_dispatcher_type"] = lay.dispatcher
    meg["override_transformer_config"] = otc
    actor["megatron"] = meg
    optim: dict = {}
    if o.optimizer_cpu_offload_fraction:
        optim["override_optimizer_config"] = {"optimizer_cpu_offload": True,
                                              "optimizer_offload_fraction": o.optimizer_cpu_offload_fraction,
                                              "overlap_cpu_optimizer_d2h_h2d": True}
    if o.precision_aware_optimizer:
        optim.update(use_precision_aware_optimizer=True, exp_avg_dtype=o.exp_avg_dtype, exp_avg_sq_dtype=o.exp_avg_dtype,
                     main_grads_dtype=o.main_grads_dtype)
    if optim:
        actor["optim"] = optim
    if ro is not None:
        r = t[A]["rollout"]
        r.update(name="vllm", tensor_model_parallel_size=ro.tp, data_parallel_size=ro.dp, expert_parallel_size=ro.ep,
                 gpu_memory_utilization=round(ro.gpu_memory_utilization, 2))
        if o.rollout_enforce_eager:
            r["enforce_eager"] = True
        if o.placement == "separate":
            r.update(nnodes=max(1, ro.gpus // c.gpus_per_node), n_gpus_per_node=c.gpus_per_node)
        from dsv3_rl.recipes import rollout_quantization  # the preset key's verl keys (rollout.quantization)
        from dsv3_rl.verl_glue.overrides import deep_merge

        t = deep_merge(t, rollout_quantization.verl_tree(o.rollout_quantization))
    return t


def overrides(ev, m, c, g, o) -> list[str]:
    """The verl launcher overrides for this candidate (:func:`verl_tree` through the launcher's one emitter,
    :func:`dsv3_rl.verl_glue.overrides.to_overrides`: ``+`` exactly where verl's config lacks the key)."""
    from dsv3_rl.verl_glue.compose import base_config
    from dsv3_rl.verl_glue.overrides import to_overrides

    return to_overrides(verl_tree(ev, m, c, g, o), base_config(), f"planner candidate {ev.layout.short()}")


def _gib(x: float) -> str:
    return f"{x / GIB:6.1f}"


_ATTENTION_TEXT = {"fused": "TE flash/fused attention", "sdpa": "torch SDPA fused-kernel attention (patch 0012)",
                   "unfused": "unfused matmul+softmax attention (S x S saved)"}


def _attention_text(o) -> str:
    """The attention path the memory model used, and whether it was the default."""
    how = "auto" if o.attention == "auto" else "set"
    return f"attention {o.attention_impl} ({_ATTENTION_TEXT[o.attention_impl]}, {how})"


def routed_experts_text(m, g, ev) -> str:
    """One line: verl's router-replay tensor (routed expert ids) per step on the host, per micro-batch on a GPU."""
    from dsv3_rl.planner.memory import routed_experts

    ranks = [x.detail["layers"] for x in ev.stage_memory]
    r3, r2 = (routed_experts(m, g, ev.layout, ranks, mode) for mode in ("R3", "R2"))
    return (f"routed experts (router replay, int16 ids x top-{m.topk}): per step on the host {r3.host / GIB:.1f} GiB "
            f"R3 ({r3.layers} layers from vLLM) / {r2.host / GIB:.1f} GiB R2 ({r2.layers} MoE layers); per micro-batch "
            f"on PP rank {r3.pp_rank}: {r3.gpu / 2**20:.1f} MiB int64 targets ({r3.stage_moe_layers} MoE layers) + "
            f"{r3.staging / 2**20:.1f} MiB int16 staging")


def host_memory_text(hm) -> str:
    """The trainer's host memory per node (planner/memory.py ``trainer_host_memory``), by term, non-zero ones."""
    from dsv3_rl.planner.memory import HOST_OTHERS_GIB

    terms = ", ".join(f"{k} {v:.1f}" for k, v in hm.gib().items() if v)
    return (f"host memory per node: trainer {hm.per_node / GIB:.1f} GiB = {hm.processes_per_node} process(es) x "
            f"{hm.per_process / GIB:.1f} GiB ({terms}); other processes ~{HOST_OTHERS_GIB:.1f} GiB (measured on one GPU); "
            f"the launcher compares the sum with MemTotal x RAY_memory_usage_threshold where the run starts")


def rollout_weights_text(m, ro, o) -> str:
    """What the rollout weights are: BF16, or FP8 with the BF16 figure they replace (planner/memory.py)."""
    if o.rollout_quantization != "fp8":
        return "BF16"
    from dsv3_rl.planner.memory import rollout_weight_bytes

    return f"FP8 as DeepSeek's release + scales; BF16 {rollout_weight_bytes(m, ro.tp, ro.ep) / GIB:.1f}"


def evaluation_report(ev, m, c, g, o) -> str:
    cap = c.memory_bytes
    lines = [f"layout: {ev.describe()}", f"trainer GPUs: {ev.trainer_gpus}  DP={ev.layout.dp(ev.trainer_gpus)} "
             f"expert-DP={ev.layout.edp(ev.trainer_gpus)}  pipeline: {ev.pipeline or '-'}",
             f"verdict: {'FITS' if ev.feasible else 'DOES NOT FIT'}"]
    for v in ev.violations:
        lines.append(f"  rejected by {v}")
    if ev.memory:
        mb = ev.memory
        lines.append(f"trainer peak per GPU (PP rank {mb.pp_rank}, {mb.detail['params'] / 1e9:.2f}B params on it; "
                     f"{o.transformer_impl} spec, {_attention_text(o)}): {mb.total / GIB:.1f} GiB of {cap / GIB:.1f} GiB")
        for f in mb.FIELDS:
            lines.append(f"  {f:13s}{_gib(getattr(mb, f))} GiB")
        if len(ev.stage_memory) > 1:
            lines.append("  per PP rank: " + " ".join(f"{x.total / GIB:.1f}" for x in ev.stage_memory))
        lines.append(f"micro-batches per mini-batch per DP rank: {ev.microbatches}; pipeline bubble {ev.bubble:.1%}")
        if m.num_experts:
            lines.append(routed_experts_text(m, g, ev))
    if ev.host_memory:
        lines.append(host_memory_text(ev.host_memory))
    if ev.comm:
        cv = ev.comm.gib()
        lines.append(f"per GPU per GRPO step: all-to-all {cv['a2a_per_grpo_step_gib']} GiB "
                     f"({cv['a2a_internode_fraction']:.0%} inter-node), gradient sync {cv['grad_sync_per_grpo_step_gib']} GiB "
                     f"over {cv['optimizer_steps']} optimizer step(s), TP {cv['tp_per_grpo_step_gib']} GiB")
    if ev.rollout_memory:
        rm = ev.rollout_memory
        lines.append(f"rollout per GPU: budget {rm.budget / GIB:.1f} GiB = weights {rm.weights / GIB:.1f} "
                     f"({rollout_weights_text(m, ev.rollout, o)}) + activations "
                     f"{rm.activations / GIB:.1f} + graphs {rm.cuda_graphs / GIB:.1f} + KV {rm.kv_cache / GIB:.1f}; trainer "
                     f"leftovers {rm.trainer_resident / GIB:.1f} GiB")
        lines.append(f"rollout KV capacity: {rm.kv_tokens} tokens per engine ({rm.kv_bytes_per_token / 1024:.1f} KiB/token), "
                     f"{rm.max_concurrent_seqs} sequences of {g.seq_len} at once")
    if ev.rollout:  # refit-time model (dsv3_rl/planner/refit.py, docs/refit.md)
        from dsv3_rl.planner.refit import refit_lines

        lines += refit_lines(m, c.gpu_type, c.gpus_per_node, ev.trainer_gpus, ev.layout, ev.rollout,
                             o.rollout_quantization)
    if ev.time:
        t = ev.time
        ro = f"{ev.rollout_time['total']:.0f}s" if ev.rollout_time.get("total") is not None else "-"
        from dsv3_rl.planner.measured import measured_layout

        meas = measured_layout(m.name, ev.trainer_gpus, c.gpu, ev.layout.short())
        label = (f"training half measured on GPU: {meas[0]:.2f} s, `dsv3-plan phases` predicts {meas[1]:.2f}x of it, "
                 f"{meas[2]}" if meas else "ranking only")
        lines.append(f"estimated step ({label}): train {t['total']:.0f}s (compute {t['compute']:.0f}, all-to-all "
                     f"{t['a2a']:.0f}, TP {t['tp']:.0f}, grad sync {t['grad_sync']:.0f}, offload {t['offload']:.0f}), "
                     f"rollout {ro}" + (" (overlapped with training)" if t.get("overlapped") else ""))
    for n in ev.notes:
        lines.append(f"note: {n}")
    if ev.overrides:
        lines.append("overrides:")
        lines += [f"  {x}" for x in ev.overrides]
    return "\n".join(lines)


def lower_bound_text(res) -> str:
    """Why nothing can fit: the static memory if every parameter were sharded over every GPU."""
    from dsv3_rl.planner.memory import grad_bytes_per_param, optimizer_bytes_per_param

    m, c, o = res.model, res.cluster, res.options
    n = count_params(m).total + (count_params(m).mtp if o.mtp else 0)
    w, g = 2 * n / c.world, grad_bytes_per_param(o) * n / c.world
    opt = optimizer_bytes_per_param(o) * (1 - o.optimizer_cpu_offload_fraction) * n / c.world
    return (f"lower bound: even with all {n / 1e9:.0f}B params sharded over all {c.world} GPUs, one GPU holds weights "
            f"{w / GIB:.0f} GiB + grads {g / GIB:.0f} GiB + optimizer {opt / GIB:.0f} GiB = {(w + g + opt) / GIB:.0f} GiB "
            f"vs {c.memory_bytes / GIB:.1f} GiB; the vLLM weights alone need {2 * n / c.world / GIB:.0f} GiB per GPU")


def plan_table(res, top: int = 10, rejected: int = 10) -> str:
    m, c, g, o = res.model, res.cluster, res.grpo, res.options
    pc = count_params(m)
    cap = c.memory_bytes
    head = [f"model {m.name}: {pc.total / 1e9:.1f}B params ({pc.activated / 1e9:.1f}B activated, MTP {pc.mtp / 1e9:.1f}B "
            f"{'on' if o.mtp else 'off'}), cluster {c.nodes}x{c.gpus_per_node} {c.gpu} ({cap / GIB:.1f} GiB), "
            f"GRPO {g.prompts_per_step} prompts x {g.n_samples}, seq {g.max_prompt_len}+{g.max_response_len}, "
            f"{o.placement}; {o.transformer_impl} spec, {_attention_text(o)}",
            f"evaluated {res.evaluated} candidates: {len(res.feasible)} feasible, {len(res.rejected)} rejected", ""]
    cols = ("#", "layout", "rollout", "peak GiB", "wts", "grad", "optim", "act", "logit", "other", "bubble", "a2a GiB",
            "sync GiB", "KV tok", "est s")
    rows = []
    for i, e in enumerate(res.feasible[:top]):
        mb, rm = e.memory, e.rollout_memory
        other = mb.transient + mb.comm_buffers + mb.ref_weights + mb.reserve
        rows.append((str(i + 1) + ("!" if e.tight else ""), e.layout.short(), e.rollout.short() if e.rollout else "-", f"{mb.total / GIB:.1f}",
                     f"{mb.weights / GIB:.1f}", f"{mb.grads / GIB:.1f}", f"{mb.optimizer / GIB:.1f}",
                     f"{mb.activations / GIB:.1f}", f"{mb.logits / GIB:.1f}", f"{other / GIB:.1f}", f"{e.bubble:.0%}",
                     f"{e.comm.a2a_per_grpo_step / GIB:.0f}", f"{e.comm.grad_sync_per_grpo_step / GIB:.0f}",
                     f"{rm.kv_tokens if rm else 0}", f"{e.step_seconds:.0f}"))
    out = head
    if rows:
        w = [max(len(cols[j]), *(len(r[j]) for r in rows)) for j in range(len(cols))]
        out.append("  ".join(cols[j].ljust(w[j]) for j in range(len(cols))))
        out += ["  ".join(r[j].ljust(w[j]) for j in range(len(cols))) for r in rows]
    else:
        out.append("no feasible layout")
        out.append(lower_bound_text(res))
    if any(e.tight for e in res.feasible[:top]):
        out.append(f"! tight: predicted allocated memory above {o.tight_fraction:.0%} of (GPU memory - reserve); "
                   f"the model is validated to 15%")
    if res.feasible:
        out += ["", "best layout:", evaluation_report(res.feasible[0], m, c, g, o)]
    if res.rejected:
        counts = collections.Counter(v.rule for e in res.rejected for v in e.violations[:1])
        out += ["", "rejected (first failed rule): " + ", ".join(f"{k} x{n}" for k, n in counts.most_common())]
        seen = set()
        shown = 0
        for e in sorted(res.rejected, key=lambda e: (e.violations[0].rule.startswith("mem."), e.layout.tp * e.layout.pp), reverse=True):
            key = e.violations[0].rule
            if key in seen and shown >= len(counts):
                continue
            seen.add(key)
            out.append(f"  {e.layout.short()}: " + "; ".join(str(v) for v in e.violations[:3]))
            shown += 1
            if shown >= rejected:
                break
    return "\n".join(out)
