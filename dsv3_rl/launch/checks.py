"""Checks of a composed verl config against the model and the hardware, before any GPU is touched.

Each failed check is a :class:`Finding` whose message names the values (``num_hidden_layers=61 is not
divisible by PP=16 ...``). Errors stop the launch; warnings are printed. The memory fit comes from the
planner (:func:`dsv3_rl.planner.check_layout`), whose "does not fit" is a warning: it is a model with
stated assumptions, not megatron's own arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsv3_rl.launch.verl_config import select
from dsv3_rl.layout import Layout

A = "actor_rollout_ref.actor"
M = f"{A}.megatron"
OTC = f"{M}.override_transformer_config"
R = "actor_rollout_ref.rollout"

#: megatron-core 0.16.1 TransformerConfig.recompute_modules allowed values
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
#: router keys whose values are model facts (must match the checkpoint's config) / RL choices (warn)
ROUTER_FACTS = ("moe_router_num_groups", "moe_router_group_topk", "moe_router_score_function",
                "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor")
ROUTER_RL = {"moe_router_bias_update_rate": 0.0, "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0}


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "info"
    check: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: [{self.check}] {self.message}"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The trainer layout and the rollout engine as verl will pass them to megatron and vLLM."""

    layout: Layout
    world: int
    nnodes: int
    gpus_per_node: int
    rollout_tp: int
    rollout_dp: int
    rollout_ep: int
    rollout_pp: int

    @property
    def dp(self) -> int:
        return self.layout.dp(self.world)

    def short(self) -> str:
        lay = self.layout
        s = f"TP{lay.tp} PP{lay.pp}"
        if lay.vpp:
            s += f" VPP{lay.vpp}"
        s += f" EP{lay.ep} ETP{lay.etp_}"
        if lay.cp > 1:
            s += f" CP{lay.cp}"
        if self.dp:
            s += f" DP{self.dp}"
        if lay.pipeline_layout:
            s += f" layout={lay.pipeline_layout}"
        elif lay.first_stage_layers or lay.last_stage_layers:
            s += f" first/last={lay.first_stage_layers or '-'}/{lay.last_stage_layers or '-'}"
        return s

    def rollout_short(self) -> str:
        s = f"TP{self.rollout_tp}"
        if self.rollout_dp > 1:
            s += f" DP{self.rollout_dp}"
        if self.rollout_ep > 1:
            s += f" EP{self.rollout_ep}"
        return s


def layout_from_config(cfg) -> Layout:
    """The trainer :class:`~dsv3_rl.layout.Layout` of a composed verl config (verl's defaults where unset)."""
    g = lambda k, d=None: select(cfg, k, d)  # noqa: E731
    otc = g(OTC) or {}
    gran = otc.get("recompute_granularity") or "none"
    tp, etp, sp = int(g(f"{M}.tensor_model_parallel_size", 1)), g(f"{M}.expert_tensor_parallel_size"), g(f"{M}.sequence_parallel")
    return Layout(
        tp=tp, pp=int(g(f"{M}.pipeline_model_parallel_size", 1)),
        ep=int(g(f"{M}.expert_model_parallel_size", 1)), etp=int(etp) if etp is not None else None,
        vpp=g(f"{M}.virtual_pipeline_model_parallel_size"), cp=int(g(f"{M}.context_parallel_size", 1)),
        sp=bool(sp) if sp is not None and tp > 1 else None, dispatcher=otc.get("moe_token_dispatcher_type") or "alltoall",
        pipeline_layout=otc.get("pipeline_model_parallel_layout"),
        first_stage_layers=otc.get("num_layers_in_first_pipeline_stage"),
        last_stage_layers=otc.get("num_layers_in_last_pipeline_stage"),
        account_for_embedding=bool(otc.get("account_for_embedding_in_pipeline_split", False)),
        account_for_loss=bool(otc.get("account_for_loss_in_pipeline_split", False)),
        recompute=gran, recompute_modules=tuple(otc.get("recompute_modules") or ()) if gran == "selective" else (),
        recompute_method=otc.get("recompute_method") or "uniform",
        recompute_num_layers=int(otc.get("recompute_num_layers") or 1),
    )


def sizes_from_config(cfg) -> Sizes:
    g = lambda k, d=None: select(cfg, k, d)  # noqa: E731
    nnodes, gpn = int(g("trainer.nnodes", 1)), int(g("trainer.n_gpus_per_node", 1))
    return Sizes(
        layout=layout_from_config(cfg), world=nnodes * gpn, nnodes=nnodes, gpus_per_node=gpn,
        rollout_tp=int(g(f"{R}.tensor_model_parallel_size", 1)), rollout_dp=int(g(f"{R}.data_parallel_size", 1)),
        rollout_ep=int(g(f"{R}.expert_parallel_size", 1)), rollout_pp=int(g(f"{R}.pipeline_model_parallel_size", 1) or 1),
    )


def _uneven_suggestions(L: int, pp: int, limit: int = 3) -> list[str]:
    out = []
    for f in range(1, L):
        for last in range(1, L):
            rest = L - f - last
            if pp > 2 and rest > 0 and rest % (pp - 2) == 0 and rest // (pp - 2) >= max(f, last):
                out.append(f"{f}/{last} ({rest // (pp - 2)} per middle stage)")
            if len(out) >= limit:
                return out
    return out


def check_pipeline(L: int, s: Sizes) -> list[Finding]:
    """Layers vs pipeline stages, as megatron's TransformerBlock will split them."""
    from dsv3_rl.planner.pipeline import split_layers

    out: list[Finding] = []
    lay = s.layout
    pp, vpp = lay.pp, lay.vpp_
    first, last = lay.first_stage_layers, lay.last_stage_layers
    if lay.pipeline_layout:
        _, viols = split_layers(L, pp, lay.vpp, layout=lay.pipeline_layout)
        for v in viols:
            out.append(Finding("error", "layers_vs_pp", f"pipeline_model_parallel_layout={lay.pipeline_layout!r}: {v.message}"))
        return out
    if pp > L:
        return [Finding("error", "layers_vs_pp", f"PP={pp} pipeline stages for num_hidden_layers={L}: more stages than layers")]
    if first is None and last is None:
        if L % (pp * vpp):
            hint = ""
            sugg = _uneven_suggestions(L, pp)
            if sugg:
                hint = ("; set layout.first_stage_layers/last_stage_layers (megatron's num_layers_in_first/last"
                        f"pipeline_stage), e.g. first/last = {', '.join(sugg)}")
            what = f"PP={pp}" + (f" x VPP={vpp}" if vpp > 1 else "")
            out.append(Finding("error", "layers_vs_pp", f"num_hidden_layers={L} is not divisible by {what}{hint}"))
        return out
    n_first, n_last = first or 0, last or 0
    middle = pp - (first is not None) - (last is not None)
    rest = L - n_first - n_last
    if rest < 0 or (middle == 0 and rest != 0):
        out.append(Finding("error", "layers_vs_pp", f"first/last stage layers {first}/{last} with PP={pp} do not add "
                                                    f"up to num_hidden_layers={L}"))
    elif middle > 0 and rest % (middle * vpp):
        out.append(Finding("error", "layers_vs_pp",
                           f"num_hidden_layers={L} minus first/last stage layers {first}/{last} leaves {rest} "
                           f"layers for {middle} middle stages{f' x VPP={vpp}' if vpp > 1 else ''}: not divisible"))
    elif middle > 0 and rest // middle == 0:
        out.append(Finding("error", "layers_vs_pp", f"{middle} middle pipeline stages get 0 layers (num_hidden_layers={L}, "
                                                    f"first/last {first}/{last})"))
    for name, n in (("first", first), ("last", last)):
        if n is not None and n % vpp:
            out.append(Finding("error", "layers_vs_pp", f"num_layers_in_{name}_pipeline_stage={n} is not divisible by VPP={vpp}"))
    return out


def check_parallel(model: dict, s: Sizes) -> list[Finding]:
    """Model shape vs parallel sizes, GPUs vs TPxPPxCPxDP, rollout engine sizes vs GPUs."""
    out: list[Finding] = []
    lay = s.layout
    E = lambda check, msg: out.append(Finding("error", check, msg))  # noqa: E731
    L = int(model["num_hidden_layers"])
    heads = int(model["num_attention_heads"])
    experts = int(model.get("n_routed_experts") or 0)
    moe_ffn = int(model.get("moe_intermediate_size") or 0)
    ffn = int(model["intermediate_size"])
    for name, v in (("TP", lay.tp), ("PP", lay.pp), ("EP", lay.ep), ("ETP", lay.etp_), ("CP", lay.cp),
                    ("rollout TP", s.rollout_tp), ("rollout DP", s.rollout_dp)):
        if v < 1:
            E("positive", f"{name}={v} must be >= 1")
    if out:
        return out
    out += check_pipeline(L, s)
    if heads % lay.tp:
        E("heads_vs_tp", f"num_attention_heads={heads} is not divisible by TP={lay.tp}")
    if ffn % lay.tp:
        E("ffn_vs_tp", f"intermediate_size={ffn} is not divisible by TP={lay.tp}")
    if experts:
        if experts % lay.ep:
            E("experts_vs_ep", f"n_routed_experts={experts} is not divisible by EP={lay.ep}")
        if moe_ffn % lay.etp_:
            E("experts_vs_etp", f"moe_intermediate_size={moe_ffn} is not divisible by ETP={lay.etp_}")
    elif lay.ep > 1:
        E("experts_vs_ep", f"EP={lay.ep} but the model has no routed experts")
    mp = lay.tp * lay.pp * lay.cp
    if s.world % mp:
        E("gpus_vs_tp_pp_dp", f"{s.world} GPUs ({s.nnodes} nodes x {s.gpus_per_node}) are not divisible by "
                              f"TP*PP*CP = {lay.tp}*{lay.pp}*{lay.cp} = {mp}, so there is no integer DP")
    emp = lay.etp_ * lay.ep * lay.pp
    if s.world % emp:
        E("gpus_vs_ep", f"{s.world} GPUs are not divisible by ETP*EP*PP = {lay.etp_}*{lay.ep}*{lay.pp} = {emp} "
                        f"(megatron's expert-parallel groups)")
    if lay.tp > s.gpus_per_node:
        out.append(Finding("warning", "tp_vs_node", f"TP={lay.tp} spans nodes ({s.gpus_per_node} GPUs per node): "
                                                    f"tensor-parallel traffic leaves NVLink"))
    # rollout (vLLM) ---------------------------------------------------------------------------------
    inst = s.rollout_tp * s.rollout_dp * s.rollout_pp
    if inst > s.world:
        E("rollout_vs_gpus", f"one vLLM engine needs rollout TP*DP*PP = {s.rollout_tp}*{s.rollout_dp}*{s.rollout_pp} = "
                             f"{inst} GPUs but there are {s.world}")
    elif s.world % inst:
        E("rollout_vs_gpus", f"{s.world} GPUs are not divisible by the vLLM engine size rollout TP*DP*PP = {inst}")
    if heads % s.rollout_tp:
        E("rollout_tp_vs_heads", f"num_attention_heads={heads} is not divisible by rollout TP={s.rollout_tp}")
    if s.rollout_ep > 1 and s.rollout_ep != s.rollout_tp * s.rollout_dp:
        E("rollout_ep", f"rollout EP={s.rollout_ep} must equal rollout TP*DP = {s.rollout_tp * s.rollout_dp} (verl RolloutConfig)")
    if experts and s.rollout_ep > 1 and experts % s.rollout_ep:
        E("rollout_ep", f"n_routed_experts={experts} is not divisible by rollout EP={s.rollout_ep}")
    return out


def check_lengths_and_batches(cfg, model: dict, s: Sizes) -> list[Finding]:
    out: list[Finding] = []
    g = lambda k, d=None: select(cfg, k, d)  # noqa: E731
    prompt, resp = int(g("data.max_prompt_length", 0)), int(g("data.max_response_length", 0))
    maxpos = int(model.get("max_position_embeddings") or 0)
    if maxpos and prompt + resp > maxpos:
        out.append(Finding("error", "seq_vs_positions", f"data.max_prompt_length + data.max_response_length = {prompt}+{resp} "
                                                        f"= {prompt + resp} > the model's max_position_embeddings={maxpos}"))
    bs, n = int(g("data.train_batch_size", 1)), int(g(f"{R}.n", 1))
    mini = int(g(f"{A}.ppo_mini_batch_size", bs))
    if mini > bs:
        out.append(Finding("error", "batch", f"{A}.ppo_mini_batch_size={mini} > data.train_batch_size={bs}"))
    elif bs % mini:
        out.append(Finding("error", "batch", f"data.train_batch_size={bs} is not divisible by {A}.ppo_mini_batch_size={mini}"))
    if s.dp and (mini * n) % s.dp:
        out.append(Finding("error", "batch", f"ppo_mini_batch_size*rollout.n = {mini}*{n} = {mini * n} sequences per "
                                             f"optimizer step do not split over DP={s.dp}"))
    if g(f"{A}.use_dynamic_bsz"):
        tok = int(g(f"{A}.ppo_max_token_len_per_gpu", 0))
        if tok and tok < prompt + resp:
            out.append(Finding("error", "batch", f"{A}.ppo_max_token_len_per_gpu={tok} < max_prompt_length+max_response_"
                                                 f"length={prompt + resp}: a full-length sequence fits no micro-batch"))
    return out


def check_megatron_options(cfg) -> list[Finding]:
    out: list[Finding] = []
    g = lambda k, d=None: select(cfg, k, d)  # noqa: E731
    gran = g(f"{OTC}.recompute_granularity")
    if gran not in (None, "selective", "full"):
        out.append(Finding("error", "recompute", f"recompute_granularity={gran!r} (allowed: null, selective, full)"))
    if gran == "selective":
        mods = g(f"{OTC}.recompute_modules") or []
        bad = [m for m in mods if m not in RECOMPUTE_MODULES]
        if bad:
            out.append(Finding("error", "recompute", f"recompute_modules has {bad}; megatron-core 0.16.1 allows {list(RECOMPUTE_MODULES)}"))
        if "moe_act" in mods and g(f"{OTC}.moe_grouped_gemm") is False:
            out.append(Finding("error", "recompute", "recompute_modules has moe_act but moe_grouped_gemm is off"))
    if gran == "full" and g(f"{OTC}.recompute_method") not in ("uniform", "block"):
        out.append(Finding("error", "recompute", f"recompute_granularity=full needs recompute_method uniform|block "
                                                 f"(got {g(f'{OTC}.recompute_method')!r})"))
    for role in ("actor", "ref"):
        base = f"actor_rollout_ref.{role}.megatron"
        if g(f"{base}.use_dist_checkpointing") and not g(f"{base}.dist_checkpointing_path"):
            out.append(Finding("error", "dist_ckpt", f"{base}.use_dist_checkpointing=True but {base}.dist_checkpointing_path is unset"))
    if not g(f"{M}.use_distributed_optimizer", True):
        out.append(Finding("warning", "optimizer", f"{M}.use_distributed_optimizer=False: every DP rank keeps full optimizer states"))
    out += check_lr_schedule(cfg)
    return out


def check_lr_schedule(cfg) -> list[Finding]:
    """megatron-core's OptimizerParamScheduler asserts ``lr_warmup_steps < lr_decay_steps`` when the trainer builds its
    optimizer (after the model is on the GPUs: the GPU box's proxy_4xH100 run of 2026-11-28 died there, 10 warm-up
    steps over a 4-step run). verl takes the decay steps from ``optim.lr_decay_steps``, else the run's total steps,
    and the warm-up from ``optim.lr_warmup_steps``, else ``lr_warmup_steps_ratio`` x decay
    (verl/utils/megatron/optimizer.py)."""
    g = lambda k, d=None: select(cfg, k, d)  # noqa: E731
    opt = "actor_rollout_ref.actor.optim"
    decay = g(f"{opt}.lr_decay_steps") or g("trainer.total_training_steps")
    if not isinstance(decay, int) or decay <= 0:
        return []  # the total comes from the data at run time
    warm, ratio = g(f"{opt}.lr_warmup_steps"), g(f"{opt}.lr_warmup_steps_ratio")
    if (warm is None or warm <= 0) and ratio is not None:
        warm = int(ratio * decay)
    if isinstance(warm, int) and warm >= decay:
        src = f"{opt}.lr_decay_steps" if g(f"{opt}.lr_decay_steps") else "trainer.total_training_steps"
        return [Finding("error", "optimizer", f"{opt}.lr_warmup_steps={warm} is not below the LR decay steps ({src}="
                                              f"{decay}): megatron-core asserts lr_warmup_steps < lr_decay_steps once "
                                              f"the model is built; lower the warm-up (0 for a short run)")]
    return []


def check_router(cfg, facts: dict[str, Any]) -> list[Finding]:
    """Router keys in override_transformer_config against the model (FACTS from config_map): a value that
    differs from the model is an error; an unset one leaves it to verl's bridge (warning)."""
    out: list[Finding] = []
    unset_facts, unset_rl = [], []
    for k in ROUTER_FACTS:
        if k not in facts:
            continue
        v = select(cfg, f"{OTC}.{k}")
        if v is None:
            unset_facts.append(f"{k}={facts[k]!r}")
        elif v != facts[k] and not (isinstance(v, float) and abs(v - facts[k]) < 1e-9):
            out.append(Finding("error", "router", f"{OTC}.{k}={v!r} but the model's config gives {facts[k]!r} "
                                                   f"(dsv3_rl.models.config_map); training would route differently from vLLM"))
    for k, rl in ROUTER_RL.items():
        v = select(cfg, f"{OTC}.{k}")
        if v is None:
            unset_rl.append(f"{k}={rl!r}")
        elif v != rl:
            out.append(Finding("warning", "router", f"{OTC}.{k}={v!r}: GRPO normally uses {rl!r} (a trained expert bias or "
                                                     f"aux loss makes the trainer's routing drift from the rollout engine's)"))
    if unset_facts:
        out.append(Finding("warning", "router", f"{OTC} does not set {', '.join(unset_facts)} (the model's routing): "
                                                 f"megatron then gets whatever verl's bridge derives; verl's own DeepSeek-V3 "
                                                 f"mapping (use_mbridge=false) sets no group-limited routing"))
    if unset_rl:
        out.append(Finding("warning", "router", f"{OTC} does not set {', '.join(unset_rl)} (GRPO router settings): verl's "
                                                 f"own DeepSeek-V3 mapping then trains the expert bias (0.001) with seq_aux_loss"))
    return out


def trainer_spec() -> str:
    """The layer spec verl will build here: verl's own rule (patch 0013, ``model_initializer._use_transformer_engine``:
    ``transformer_engine`` where megatron-core imports Transformer Engine, else ``local``)."""
    from verl.models.mcore.model_initializer import _use_transformer_engine

    return "transformer_engine" if _use_transformer_engine() else "local"


def rollout_pool(cfg) -> tuple[int, int] | None:
    """verl's standalone rollout pool of the composed config, (``rollout.nnodes``, ``rollout.n_gpus_per_node``): set
    by the off-policy trainer modes, with ``hybrid_engine`` false; None for a colocated run."""
    rn, rg = select(cfg, "rollout.nnodes"), select(cfg, "rollout.n_gpus_per_node")
    if rn and rg and not select(cfg, "actor_rollout_ref.hybrid_engine", True):
        return int(rn), int(rg)
    return None


def planner_inputs(cfg, s: Sizes, gpu: str, options_extra: dict, hardware: dict | None = None) -> tuple:
    """The planner's (Cluster, GRPOShape, Options, RolloutLayout) for the composed config. With the preset's
    HARDWARE, an off-policy trainer mode (``hybrid_engine`` false, verl's ``rollout.nnodes`` x ``n_gpus_per_node``)
    is planned as it runs: ``placement=separate``, the rollout on its own pool and the cluster both pools."""
    from dsv3_rl.planner import Cluster, GRPOShape, Options, RolloutLayout

    g = lambda k, d=None: select(cfg, k, d)  # noqa: E731
    otc_opt = g(f"{A}.optim.override_optimizer_config") or {}
    otc = g(OTC) or {}
    prompt, resp = int(g("data.max_prompt_length")), int(g("data.max_response_length"))
    grpo = GRPOShape(
        prompts_per_step=int(g("data.train_batch_size")), n_samples=int(g(f"{R}.n")), max_prompt_len=prompt,
        max_response_len=resp, ppo_mini_batch_size=int(g(f"{A}.ppo_mini_batch_size")),
        micro_batch_size=int(g(f"{A}.ppo_micro_batch_size_per_gpu") or 1), dynamic_batch=bool(g(f"{A}.use_dynamic_bsz")),
        max_token_len_per_gpu=int(g(f"{A}.ppo_max_token_len_per_gpu") or (prompt + resp)), ppo_epochs=int(g(f"{A}.ppo_epochs", 1)),
    )
    cpu_off = bool(otc_opt.get("optimizer_cpu_offload", False))
    opts = dict(
        param_offload=bool(g(f"{M}.param_offload")), optimizer_offload=bool(g(f"{M}.optimizer_offload")),
        optimizer_cpu_offload_fraction=float(otc_opt.get("optimizer_offload_fraction", 1.0 if cpu_off else 0.0)) if cpu_off else 0.0,
        ref_model=bool(g(f"{A}.use_kl_loss")) or bool(g("algorithm.use_kl_in_reward")),
        ref_param_offload=bool(g("actor_rollout_ref.ref.megatron.param_offload")),
        distributed_optimizer=bool(g(f"{M}.use_distributed_optimizer", True)),
        precision_aware_optimizer=bool(otc_opt.get("use_precision_aware_optimizer", g(f"{A}.optim.use_precision_aware_optimizer", False))),
        moe_grouped_gemm=bool(otc.get("moe_grouped_gemm", True)),
        rollout_enforce_eager=bool(g(f"{R}.enforce_eager")),
        rollout_max_num_batched_tokens=int(g(f"{R}.max_num_batched_tokens") or 8192),
        rollout_quantization=str(g(f"{R}.quantization") or "none"),  # FP8 rollout weights (preset rollout_quantization)
    )
    from dsv3_rl.recipes.train_precision import planner_options  # FP8 training memory (preset train_precision)

    opts.update(planner_options(otc))
    cluster, ro_gpus = Cluster(gpu=gpu, gpus_per_node=s.gpus_per_node, nodes=s.nnodes), s.world
    pool = rollout_pool(cfg)
    if hardware and pool:
        cluster = Cluster(gpu=gpu, gpus_per_node=int(hardware["gpus_per_node"]), nodes=int(hardware["nodes"]))
        ro_gpus = pool[0] * pool[1]
        opts.update(placement="separate", rollout_gpus=ro_gpus)
    opts.update(options_extra or {})
    rollout = RolloutLayout(tp=s.rollout_tp, dp=s.rollout_dp, ep=s.rollout_ep, gpus=ro_gpus,
                            gpu_memory_utilization=float(g(f"{R}.gpu_memory_utilization")))
    return cluster, grpo, Options(**opts), rollout


def planner_check(model: Any, cfg, s: Sizes, gpu: str, options_extra: dict, *, cpu: bool,
                  hardware: dict | None = None) -> list[Finding]:
    """Memory fit of the composed config per the planner; 'does not fit' is a warning. HARDWARE: the preset's
    (an off-policy mode is planned with its separate rollout pool, :func:`planner_inputs`)."""
    if cpu:
        return [Finding("info", "planner", "skipped: CPU run (the planner models GPU memory)")]
    if options_extra is False:
        return [Finding("info", "planner", "skipped: preset sets planner: false")]
    from dsv3_rl.planner import check_layout

    try:
        cluster, grpo, opts, rollout = planner_inputs(cfg, s, gpu, options_extra, hardware)
        fits, report = check_layout(model, cluster, grpo, s.layout, opts, rollout=rollout)
    except Exception as e:  # noqa: BLE001  (the planner is advisory)
        return [Finding("warning", "planner", f"the planner could not evaluate this layout: {type(e).__name__}: {e}")]
    lines = [ln for ln in report.splitlines() if ln.strip()]
    peak = next((ln.strip() for ln in lines if ln.startswith("trainer peak")), "")
    here = trainer_spec()
    planned = opts.transformer_impl
    if peak and here != planned:  # a login node without TE, or a GPU box whose TE is not on the path
        peak += (f"; assumed: this host would build the {here} spec (Transformer Engine "
                 f"{'not ' if here == 'local' else ''}importable here, verl patch 0013)")
    if fits:
        return [Finding("info", "planner", f"fits ({peak})" if peak else "fits")]
    bad = [ln.strip() for ln in lines if ln.lstrip().startswith("[") or "DOES NOT FIT" in ln or "budget" in ln]
    return [Finding("warning", "planner", "DOES NOT FIT per dsv3_rl.planner: " + " | ".join(bad[:4] or lines[:4]))]


#: a modelled sync step shorter than this is not reported: the async model has no per-step fixed costs
ASYNC_MIN_STEP_S = 1.0


def async_estimate(preset, cfg, s: Sizes) -> list[Finding]:
    """The planner's sync vs one-step-off step estimate (``dsv3-plan async``, :mod:`dsv3_rl.planner.async_overlap`)
    for a GPU preset of 2 or more GPUs, with the batch, options and layout of the composed config: an off-policy
    preset's own split against its sync baseline (the preset it extends), a sync preset against its best split
    (nothing when its layout fits no smaller trainer pool). Info only: a model, registered before GPU runs
    (docs/algorithms.md "What async buys")."""
    if preset.is_cpu or preset.planner is False or preset.world < 2 or preset.trainer_mode == "fully_async":
        return []
    from dsv3_rl.planner.async_overlap import for_preset

    try:
        _, grpo, opts, _ = planner_inputs(cfg, s, preset.hardware["gpu"], preset.planner, preset.hardware)
        o = for_preset(preset.path, grpo=grpo, options=opts, layout=s.layout)
    except Exception as e:  # noqa: BLE001  (the estimate is advisory; no split fitting is an answer too)
        if not preset.off_policy:
            return []
        return [Finding("info", "async", f"no sync vs one-step-off estimate: {type(e).__name__}: {e}")]
    if preset.off_policy and o.chosen is None:
        return [Finding("info", "async", f"the preset's split fits no trainer pool in the model; its best split: "
                                         f"{o.split_text(o.best)}")]
    if o.sync_step_s < ASYNC_MIN_STEP_S:
        return [Finding("info", "async", f"no sync vs one-step-off estimate: the model's sync step is {o.sync_step_s:.2f} s, "
                                         f"below the per-step costs it leaves out (Ray calls, vLLM requests, the weight "
                                         f"sync's transport; tiny_1xH100 measured 3.3-4.2 s a steady step on an H100)")]
    return [Finding("info", "async", f"dsv3-plan async (model): {o.line()}")]


def host_memory_check(launch, mem_total: float | None, threshold: float, *, dry_run: bool) -> list[Finding]:
    """The planner's host memory of the trainer processes of one node (:func:`dsv3_rl.planner.memory.
    trainer_host_memory`) + the other processes (:data:`dsv3_rl.planner.memory.HOST_OTHERS_GIB`) against this
    machine's ``mem_total`` bytes x Ray's kill ``threshold``: over it is an error (the run would be killed by Ray's
    memory monitor, as proxy_1xH100 was on 2026-12-07), info in a dry run (planned for another machine) or when it
    fits. GPU presets only: a CPU preset trains on the host, outside this model."""
    if launch.preset.is_cpu or launch.preset.planner is False or launch.sizes is None or launch.cfg is None:
        return []
    from dsv3_rl.planner.memory import HOST_OTHERS_GIB
    from dsv3_rl.planner.report import host_memory_text
    from dsv3_rl.planner.search import evaluate
    from dsv3_rl.planner.spec import GIB

    try:
        cluster, grpo, opts, rollout = planner_inputs(launch.cfg, launch.sizes, launch.preset.hardware["gpu"],
                                                      launch.preset.planner, launch.preset.hardware)
        hm = evaluate(launch.model_cfg, cluster, grpo, launch.sizes.layout, opts, rollout=rollout).host_memory
    except Exception as e:  # noqa: BLE001  (advisory where the planner cannot evaluate; planner_check says why)
        return [Finding("warning", "host_memory", f"the planner could not estimate host memory: {type(e).__name__}: {e}")]
    if hm is None:
        return []
    need = hm.per_node + HOST_OTHERS_GIB * GIB
    if mem_total is None:
        return [Finding("info", "host_memory", f"{host_memory_text(hm)}; this machine's MemTotal is unknown")]
    limit = mem_total * threshold
    nums = (f"trainer {hm.per_node / GIB:.1f} GiB per node + other processes {HOST_OTHERS_GIB:.1f} GiB = "
            f"{need / GIB:.1f} GiB vs this machine's MemTotal {mem_total / GIB:.2f} GiB x RAY_memory_usage_threshold "
            f"{threshold:g} = {limit / GIB:.1f} GiB")
    if need <= limit:
        return [Finding("info", "host_memory", f"fits ({nums}); {host_memory_text(hm)}")]
    if dry_run:
        return [Finding("info", "host_memory", f"would not fit this machine's RAM ({nums}); a run here would be refused "
                                               f"(checked where the run starts)")]
    return [Finding("error", "host_memory", f"host memory: {nums}: Ray's memory monitor would kill the trainer "
                                            f"(proxy_1xH100, 2026-12-07); refused before anything starts. Terms: "
                                            + ", ".join(f"{k} {v:.1f}" for k, v in hm.gib().items() if v))]
