"""Evaluate one layout (:func:`evaluate`, :func:`check_layout`) or search all of them (:func:`plan`)."""

from __future__ import annotations

import dataclasses
import itertools

from dsv3_rl.planner import comm as comm_mod
from dsv3_rl.planner import memory as mem
from dsv3_rl.planner.model import ModelSpec, count_params, load_model
from dsv3_rl.planner.pipeline import bubble_fraction, split_layers, suggest_splits
from dsv3_rl.planner.rules import Violation, num_microbatches, rollout_rules, trainer_rules
from dsv3_rl.planner.spec import GIB, RECOMPUTE_LADDER, Cluster, GRPOShape, Layout, Options, RolloutLayout, from_dict


@dataclasses.dataclass
class Evaluation:
    """One candidate: trainer layout + rollout layout, with everything the planner computed."""

    layout: Layout
    rollout: RolloutLayout | None
    trainer_gpus: int
    feasible: bool = False
    violations: list[Violation] = dataclasses.field(default_factory=list)
    memory: mem.MemoryBreakdown | None = None
    stage_memory: list[mem.MemoryBreakdown] = dataclasses.field(default_factory=list)
    rollout_memory: mem.RolloutMemory | None = None
    host_memory: mem.HostMemory | None = None
    """host memory of the trainer processes (worst PP rank, per node); not a fit rule: the launcher checks it
    against the machine it starts on (docs/planner.md, "Host memory")"""
    bubble: float = 0.0
    microbatches: int = 0
    comm: comm_mod.CommVolume | None = None
    time: dict = dataclasses.field(default_factory=dict)
    rollout_time: dict = dataclasses.field(default_factory=dict)
    pipeline: str = ""
    tight: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    overrides: list[str] = dataclasses.field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        t = self.time.get("total", float("inf"))
        r = self.rollout_time.get("total", 0.0)
        return t + r if not self.time.get("overlapped") else max(t, r)

    def headroom_gib(self, capacity: float) -> float:
        return (capacity - self.memory.total) / GIB if self.memory else float("-inf")

    def describe(self) -> str:
        s = self.layout.short()
        if self.rollout:
            s += " | " + self.rollout.short()
        return s

    def to_dict(self) -> dict:
        d = dict(layout=dataclasses.asdict(self.layout), rollout=dataclasses.asdict(self.rollout) if self.rollout else None,
                 trainer_gpus=self.trainer_gpus, feasible=self.feasible, tight=self.tight,
                 violations=[dataclasses.asdict(v) for v in self.violations], pipeline=self.pipeline,
                 bubble=round(self.bubble, 4), microbatches=self.microbatches, notes=self.notes,
                 overrides=self.overrides, time={k: (round(v, 2) if isinstance(v, float) else v) for k, v in self.time.items()},
                 rollout_time={k: (round(v, 2) if isinstance(v, float) else v) for k, v in self.rollout_time.items()})
        if self.memory:
            d["memory_gib"] = self.memory.gib()
            d["memory_pp_rank"] = self.memory.pp_rank
            d["stage_memory_gib"] = [x.gib()["total"] for x in self.stage_memory]
        if self.host_memory:
            d["host_memory_gib"] = dict(self.host_memory.gib(), per_node=round(self.host_memory.per_node / GIB, 2))
        if self.rollout_memory:
            d["rollout_memory_gib"] = self.rollout_memory.gib()
            d["rollout_kv_tokens"] = self.rollout_memory.kv_tokens
            d["rollout_max_concurrent_seqs"] = self.rollout_memory.max_concurrent_seqs
        if self.comm:
            d["comm"] = self.comm.gib()
        return d


@dataclasses.dataclass
class PlanResult:
    """Ranked feasible candidates (best first) and every rejected one with its reasons."""

    model: ModelSpec
    cluster: Cluster
    grpo: GRPOShape
    options: Options
    feasible: list[Evaluation]
    rejected: list[Evaluation]
    evaluated: int = 0

    @property
    def best(self) -> Evaluation | None:
        return self.feasible[0] if self.feasible else None

    def table(self, top: int | None = None, rejected: int = 10) -> str:
        from dsv3_rl.planner.report import plan_table

        return plan_table(self, top=top or self.options.top_k, rejected=rejected)

    def to_dict(self, top: int | None = None) -> dict:
        c = count_params(self.model)
        return dict(model=dataclasses.asdict(self.model), params=c.as_dict(), cluster=dataclasses.asdict(self.cluster),
                    grpo=dataclasses.asdict(self.grpo), options=dataclasses.asdict(self.options),
                    evaluated=self.evaluated, feasible=[e.to_dict() for e in self.feasible[:top]],
                    rejected=[e.to_dict() for e in self.rejected])

    def plot(self, path, top: int = 5) -> None:
        from dsv3_rl.planner.plot import plot_plan

        plot_plan(self, path, top=top)


# ---------------------------------------------------------------------------------------------


def _coerce(model, cluster, grpo, options):
    m = load_model(model)
    c = from_dict(Cluster, cluster) if not isinstance(cluster, Cluster) else cluster
    g = from_dict(GRPOShape, grpo) if not isinstance(grpo, GRPOShape) else grpo
    o = from_dict(Options, options) if not isinstance(options, Options) else options
    return m, c, g, o


def _rollout_candidates(m, opt, gpus: int) -> list[tuple[int, int, int]]:
    """(tp, dp, ep) for vLLM: plain TP, and data-parallel attention with expert parallelism
    (ep = tp * dp, verl's rule) when the model has experts."""
    tps = [opt.rollout_tp] if opt.rollout_tp else [t for t in (1, 2, 4, 8, 16, 32, 64, 128) if t <= gpus]
    dps = [opt.rollout_dp] if opt.rollout_dp else [1, 2, 4, 8, 16, 32, 64]
    out = []
    for tp in tps:
        for dp in dps:
            if tp * dp > min(gpus, opt.rollout_max_instance_gpus) or gpus % (tp * dp) or m.num_heads % tp:
                continue
            eps = []
            if opt.rollout_ep is not True and dp == 1:
                eps.append(1)
            if opt.rollout_ep is not False and m.num_experts and tp * dp > 1:
                eps.append(tp * dp)
            out += [(tp, dp, ep) for ep in eps]
    return out


_ROLLOUT_CACHE: dict = {}


def best_rollout(m, cluster, grpo, opt, gpus: int, trainer_world: int, resident: float):
    """The rollout layout with the shortest estimated generation time on ``gpus`` GPUs, given what
    the trainer keeps on them (colocated); or the reasons every candidate failed."""
    key = (m, cluster, grpo, opt, gpus, trainer_world, round(resident / 2**26))
    if key not in _ROLLOUT_CACHE:
        if len(_ROLLOUT_CACHE) > 4096:
            _ROLLOUT_CACHE.clear()
        _ROLLOUT_CACHE[key] = _best_rollout(m, cluster, grpo, opt, gpus, trainer_world, resident)
    return _ROLLOUT_CACHE[key]


def _best_rollout(m, cluster, grpo, opt, gpus: int, trainer_world: int, resident: float):
    cap = cluster.memory_bytes
    best, reasons = None, []
    for tp, dp, ep in _rollout_candidates(m, opt, gpus):
        if opt.rollout_gpu_memory_utilization is not None:
            util = opt.rollout_gpu_memory_utilization
        else:
            free = (cap - resident) / cap - 0.02
            util = min(0.9, int(free * 20) / 20)
            if util < 0.3:
                reasons.append(Violation("mem.rollout_no_room", f"vLLM TP{tp}: the trainer keeps {resident / GIB:.1f} GiB per "
                                         f"GPU during rollout, leaving < 30% of {cap / GIB:.0f} GiB for vLLM", "planner memory model"))
                continue
        ro = RolloutLayout(tp=tp, dp=dp, ep=ep, gpus=gpus, gpu_memory_utilization=util)
        total = gpus + (trainer_world if opt.placement == "separate" else 0)
        v = rollout_rules(m, ro, opt, trainer_world, total)
        if v:
            reasons.extend(v)
            continue
        rm = mem.rollout_memory(m, ro, grpo, opt, cap, resident)
        if opt.placement == "colocated" and resident + rm.budget > cap:
            reasons.append(Violation("mem.colocated_overcommit",
                                     f"{ro.short()}: trainer leftovers {resident / GIB:.1f} GiB + vLLM budget "
                                     f"{util:.2f} x {cap / GIB:.0f} GiB = {(resident + rm.budget) / GIB:.1f} GiB "
                                     f"> {cap / GIB:.0f} GiB", "planner memory model (verl hybrid engine)"))
            continue
        if rm.kv_tokens < grpo.seq_len * dp:
            reasons.append(Violation("mem.rollout_kv",
                                     f"{ro.short()}: weights {rm.weights / GIB:.1f} GiB + activations {rm.activations / GIB:.1f} GiB "
                                     f"leave KV room for {rm.kv_tokens // dp} tokens per DP rank < one sequence of {grpo.seq_len} "
                                     f"(budget {rm.budget / GIB:.1f} GiB)", "planner memory model (vLLM)"))
            continue
        t = comm_mod.estimate_rollout_seconds(m, ro, rm, grpo, opt, cluster)
        if best is None or t["total"] < best[2]["total"]:
            best = (ro, rm, t)
    if best is None:
        return None, None, {}, reasons
    return best[0], best[1], best[2], []


def evaluate(model, cluster, grpo, layout: Layout, options, *, rollout: RolloutLayout | None = None,
             trainer_gpus: int | None = None) -> Evaluation:
    """Check one trainer layout (and a rollout layout, chosen if not given) against every rule and
    the memory model."""
    m, c, g, o = _coerce(model, cluster, grpo, options)
    world = trainer_gpus or (c.world if o.placement == "colocated" else c.world - (o.rollout_gpus or c.world // 2))
    ev = Evaluation(layout=layout, rollout=rollout, trainer_gpus=world)
    if world < 1:
        ev.violations.append(Violation("placement.no_trainer_gpus", f"no GPUs left for the trainer ({world})", "-"))
        return ev
    mtp = m.mtp_layers if o.mtp else 0
    ev.violations += trainer_rules(m, world, layout, g, o)
    split, sv = split_layers(m.num_layers, layout.pp, layout.vpp, layout=layout.pipeline_layout,
                             first=layout.first_stage_layers, last=layout.last_stage_layers,
                             account_for_embedding=layout.account_for_embedding,
                             account_for_loss=layout.account_for_loss, mtp_layers=mtp)
    ev.violations += sv
    if split is not None:
        ev.pipeline = split.how
    if ev.violations or split is None:
        return ev
    n_micro = num_microbatches(g, layout, world)
    ev.microbatches = n_micro
    ev.bubble = bubble_fraction(layout.pp, split.vpp, n_micro)
    worst, ranks = mem.train_memory(m, split, layout, g, o, world, n_micro)
    ev.memory, ev.stage_memory = worst, ranks
    ev.host_memory = mem.trainer_host_memory(m, split, layout, o, world, c.gpus_per_node)
    cap = c.memory_bytes
    if worst.total > cap:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in worst.gib().items() if k != "total" and v)
        ev.violations.append(Violation("mem.trainer", f"trainer peak {worst.total / GIB:.1f} GiB on PP rank {worst.pp_rank} > "
                                       f"{cap / GIB:.1f} GiB per GPU ({parts})", "planner memory model"))
    ev.comm = comm_mod.comm_volume(m, split, worst, layout, g, o, world, c.gpus_per_node)
    rc_factor = _recompute_factor(layout)
    offload_bytes = 0.0
    if o.placement == "colocated":
        per_gpu = 0.0
        if o.param_offload:
            per_gpu += worst.weights + worst.grads
        if o.optimizer_offload:
            per_gpu += worst.optimizer
        offload_bytes = 2 * per_gpu
    if o.optimizer_cpu_offload_fraction:
        offload_bytes += 2 * worst.detail["params"] * 6 * o.optimizer_cpu_offload_fraction  # grads down, params up
    ev.time = comm_mod.estimate_train_seconds(m, layout, g, o, c, world, ev.bubble, ev.comm, rc_factor, offload_bytes)
    # rollout
    if not o.rollout:
        ev.feasible = not ev.violations
        ev.tight = worst.allocated > o.tight_fraction * (cap - worst.reserve)
        from dsv3_rl.planner.report import overrides

        ev.overrides = overrides(ev, m, c, g, o)
        return ev
    resident = mem.trainer_resident_during_rollout(worst, o) if o.placement == "colocated" else 0.0
    ro_gpus = world if o.placement == "colocated" else c.world - world
    if rollout is not None:
        v = rollout_rules(m, rollout, o, world, c.world)
        if v:
            ev.violations += v
        else:
            rm = mem.rollout_memory(m, rollout, g, o, cap, resident)
            ev.rollout_memory = rm
            ev.rollout_time = comm_mod.estimate_rollout_seconds(m, rollout, rm, g, o, c)
            if o.placement == "colocated" and resident + rm.budget > cap:
                ev.violations.append(Violation("mem.colocated_overcommit",
                                               f"trainer leftovers {resident / GIB:.1f} GiB + vLLM budget "
                                               f"{rollout.gpu_memory_utilization:.2f} x {cap / GIB:.0f} GiB > {cap / GIB:.0f} GiB",
                                               "planner memory model (verl hybrid engine)"))
            if rm.kv_tokens < g.seq_len * rollout.dp:
                ev.violations.append(Violation("mem.rollout_kv", f"vLLM KV cache holds {rm.kv_tokens // rollout.dp} tokens per DP rank < one sequence of "
                                               f"{g.seq_len} (weights {rm.weights / GIB:.1f} GiB of a "
                                               f"{rm.budget / GIB:.1f} GiB budget)", "planner memory model (vLLM)"))
    else:
        ro, rm, rt, reasons = best_rollout(m, c, g, o, ro_gpus, world, resident)
        if ro is None:
            ev.violations += reasons or [Violation("rollout.none", "no rollout layout fits", "-")]
        ev.rollout, ev.rollout_memory, ev.rollout_time = ro, rm, rt
    if o.placement == "separate":
        ev.time["overlapped"] = True
        ev.notes.append("separate pools: verl's main_ppo asserts hybrid_engine (ray_trainer.py:334); use the "
                        "one-step-off / fully-async trainer with actor_rollout_ref.rollout.nnodes > 0")
    if layout.tp > c.gpus_per_node:
        ev.notes.append(f"TP={layout.tp} spans nodes (GPUs per node: {c.gpus_per_node})")
    ev.feasible = not ev.violations
    if ev.memory is not None:
        ev.tight = ev.memory.allocated > o.tight_fraction * (cap - ev.memory.reserve)
    from dsv3_rl.planner.report import overrides

    ev.overrides = overrides(ev, m, c, g, o)
    return ev


def _recompute_factor(lay: Layout) -> float:
    if lay.recompute == "none":
        return 1.0
    if lay.recompute == "full":
        return 4 / 3
    for mode, mods, f in RECOMPUTE_LADDER:
        if mode == "selective" and set(mods) == set(lay.recompute_modules or ("core_attn",)):
            return f
    mods = set(lay.recompute_modules or ("core_attn",))
    return 1.0 + 0.02 * len(mods) + (0.1 if "moe" in mods else 0.0)


def check_layout(model, cluster, grpo, layout, options=None, *, rollout: RolloutLayout | dict | None = None) -> tuple[bool, str]:
    """Does this layout fit? ``(fits, report)``: the report is the memory breakdown, the numbers
    and, when it does not fit, every rule that failed with its values and source. ``layout`` is a
    :class:`Layout` or a dict of its fields; ``rollout`` a :class:`RolloutLayout` (or dict), or
    None to pick the best rollout layout."""
    from dsv3_rl.planner.report import evaluation_report

    lay = from_dict(Layout, layout) if isinstance(layout, dict) else layout
    ro = from_dict(RolloutLayout, rollout) if isinstance(rollout, dict) else rollout
    m, c, g, o = _coerce(model, cluster, grpo, options)
    ev = evaluate(m, c, g, lay, o, rollout=ro)
    return ev.feasible, evaluation_report(ev, m, c, g, o)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def candidate_layouts(m: ModelSpec, world: int, c: Cluster, o: Options) -> list[Layout]:
    """Structural layouts to try (recompute is filled in later). For each (TP, CP, PP, ETP, EP,
    VPP) the pipeline split megatron accepts (even, uneven first/last, or a layout string); when
    the plain even split is not legal it is listed too, so the report shows why."""
    max_tp = o.max_tp or c.gpus_per_node
    tps = o.tp_choices or tuple(t for t in _divisors(world, max_tp) if t & (t - 1) == 0)
    out = []
    for tp, cp in itertools.product(tps, o.cp_choices):
        if world % (tp * cp):
            continue
        pps = o.pp_choices or tuple(_divisors(world // (tp * cp), min(o.max_pp, m.num_layers)))
        for pp in pps:
            if world % (tp * pp * cp):
                continue
            for etp in o.etp_choices:
                if o.ep_choices:
                    eps = o.ep_choices
                elif not m.num_experts:
                    eps = (1,)
                else:  # powers of two the world allows, up to twice the expert count
                    eps = tuple(e for e in (2**i for i in range(16))
                                if e <= 2 * m.num_experts and world % (etp * e * pp) == 0)
                for ep in eps:
                    for vpp in o.vpp_choices:
                        if vpp is not None and pp == 1:
                            continue
                        sds = suggest_splits(m.num_layers, pp, vpp, m.mtp_layers if o.mtp else 0)
                        if pp > 1 and {} not in sds and ep == eps[0]:
                            sds = [{}] + sds  # the plain even split, to show why it is rejected
                        for sd in sds:
                            out.append(Layout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, cp=cp, **sd))
    return out


def _ladder(o: Options) -> list[tuple[str, tuple[str, ...]]]:
    if o.recompute == "auto":
        return [(mode, mods) for mode, mods, _ in RECOMPUTE_LADDER
                if not ("moe_act" in mods and not o.moe_grouped_gemm)
                and not (o.transformer_impl == "local" and ({"moe_act", "layernorm"} & set(mods)))]
    if o.recompute == "selective":
        return [("selective", tuple(o.recompute_modules or ("core_attn",)))]
    return [(o.recompute, ())]


def plan(model, cluster, grpo, options=None, *, progress: bool = False) -> PlanResult:
    """Search every layout; return the feasible ones ranked by estimated GRPO step time and every
    rejected one with the rules it broke."""
    m, c, g, o = _coerce(model, cluster, grpo, options)
    if o.placement == "colocated":
        splits = [(c.world, None)]
    else:
        if o.rollout_gpus:
            splits = [(c.world - o.rollout_gpus, o.rollout_gpus)]
        else:
            n = c.nodes
            fr = sorted({max(1, min(n - 1, round(n * f))) for f in (0.25, 1 / 3, 0.5, 2 / 3, 0.75)}) if n > 1 else []
            splits = [((n - k) * c.gpus_per_node, k * c.gpus_per_node) for k in fr]
            if not splits:
                splits = [(c.world // 2, c.world - c.world // 2)]
    feasible, rejected, n_eval = [], [], 0
    work = [(w, lay) for w, _ in splits for lay in candidate_layouts(m, w, c, o)]
    it = work
    if progress:
        try:
            from tqdm import tqdm

            it = tqdm(work, desc="layouts", unit="layout")
        except ImportError:  # pragma: no cover
            pass
    for world, base in it:
        last = None
        for mode, mods in _ladder(o):
            lay = dataclasses.replace(base, recompute=mode, recompute_modules=mods,
                                      recompute_method=o.recompute_method, recompute_num_layers=o.recompute_num_layers)
            ev = evaluate(m, c, g, lay, o, trainer_gpus=world)
            n_eval += 1
            last = ev
            structural = [v for v in ev.violations if not v.rule.startswith("mem.")]
            if ev.feasible or structural:
                break
        (feasible if last.feasible else rejected).append(last)
    cap = c.memory_bytes
    feasible.sort(key=lambda e: (e.tight, round(e.step_seconds, 1), -e.headroom_gib(cap)))
    return PlanResult(m, c, g, o, feasible, rejected, n_eval)
