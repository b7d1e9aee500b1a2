"""What one-step-off-policy GRPO buys on a GPU layout: rollout and training on separate pools, overlapped.

Sync (colocated, verl ``main_ppo``): every GPU generates, then every GPU trains, then the weights are refitted::

    step_sync = R(N) + T(N) + F

One-step-off (verl ``one_step_off_policy``, rollout on Nr GPUs, training on Nt = N - Nr): the rollout generates
batch k+1 while the trainer trains on batch k; the weight sync (trainer -> rollout, F) sits between the two::

    step_async = max(R(Nr), T(Nt)) + F

The gain is ``step_sync / step_async`` at the same number of samples per step, i.e. the ratio of tokens/s/GPU
(tokens of a step / step seconds / all N GPUs, both pools: verl's own ``perf/throughput`` of the one-step-off trainer
divides by the trainer pool's GPUs alone). The split Nr is searched over whole rollout engines and whole nodes, or on
one node over its GPUs (the rollout on part of the node, as ``off_policy`` allows there), for the smallest
``step_async``; an off-policy preset's own split is reported beside the best (:attr:`Overlap.chosen`).

The phase models (assumptions, first order; docs/algorithms.md "What async buys"):

* T(N): the planner's per-phase prediction of one training step (``log_prob + update + export``,
  :func:`dsv3_rl.planner.phases.predict_phases`) for the preset's layout on N trainer GPUs (the layout's DP
  shrinks with N; an infeasible pool is skipped).
* R(N): decode-bound generation. Each engine (``tp x dp`` GPUs) runs its share of the batch's sequences at once
  when its KV cache holds them (else in waves); a decode step reads the engine's weights once
  (:func:`dsv3_rl.planner.refit.rollout_bytes_per_gpu`, experts over the engine with EP) plus the live KV cache
  of the sequences on that GPU (MLA: ``(kv_lora_rank + qk_rope_dim) x 2`` bytes per token per layer, sequences
  spread over the engine's DP ranks), at :data:`dsv3_rl.planner.comm.DECODE_HBM_EFFICIENCY` of HBM bandwidth; a wave lasts
  ``max_response_len`` steps (the longest response sets the tail) plus prefill at ``PREFILL_MFU``.
  Fewer rollout GPUs do not slow a decode step that is weight-read bound, so R(N) is sub-linear in 1/N: that is
  where the overlap gains.
* F: the planner's refit estimate (``verl`` algorithm, :func:`dsv3_rl.planner.refit.estimate_refit`) on the
  trainer pool (the same in both modes: the sync trainer also exports every weight). The transport (CUDA IPC
  colocated, NCCL between pools) is not modelled.
* Tokens of a step (for tokens/s/GPU): the sequence lengths T is predicted on
  (:func:`dsv3_rl.planner.phases.expected_seq_lens`: every sequence ``max_prompt_len + mean_length_fraction x
  max_response_len``).
* Not modelled (both would add to the async gain): the colocated run's offload/onload of the trainer's state
  around generation (``param_offload``; an off-policy trainer that keeps ``param_offload`` pays it too: verl's
  Megatron engine offloads around every phase), and vLLM's sleep/wake.

NeMo-RL publishes DeepSeek-V3 GRPO on 512 H100 at 7.24 tokens/s/GPU on-policy and 12.8 one-step-off
(+77%, :data:`NEMO_RL`); the report prints the model's estimate next to it.
"""

from __future__ import annotations

import dataclasses
import math

from dsv3_rl.planner import comm
from dsv3_rl.planner.spec import GPUS, Cluster, GRPOShape, Layout, Options

#: NeMo-RL's published DeepSeek-V3 GRPO throughput on 512 H100 (tokens/s/GPU): on-policy vs one-step-off
#: (BF16 rows). Their unit is ours: prompt + generated tokens of a step / step seconds / all GPUs
#: (nemo_rl/algorithms/utils.py ``e2e_tokens_per_sec_per_gpu``), but their step is 32 prompts x 16 samples of <= 1536
#: tokens (~0.41M tokens), 1/140 of 671b_512xH100's 57M: only the ratio of the two is comparable with the model's.
NEMO_RL = {"sync_tok_s_gpu": 7.24, "one_step_off_tok_s_gpu": 12.8, "gpus": 512, "sync_step_s": 111.0,
           "one_step_off_step_s": 64.1, "samples_per_step": 512, "max_seq_len": 1536,
           "source": "NVIDIA NeMo-RL v0.6.0 docs/about/performance-summary.md, H100 BF16 table, DeepSeek V3 GRPO on 512 "
                     "H100 (recipes examples/configs/recipes/llm/performance/grpo-deepseek-v3-64n8g*.yaml)"}
#: model-FLOPs efficiency of prefill
PREFILL_MFU = 0.3


@dataclasses.dataclass(frozen=True)
class Split:
    rollout_gpus: int
    trainer_gpus: int
    rollout_s: float
    train_s: float
    refit_s: float
    layout: str = ""
    """the trainer layout T was predicted for (the preset's, or the planner's best for the pool with replan)"""

    @property
    def step_s(self) -> float:
        return max(self.rollout_s, self.train_s) + self.refit_s


@dataclasses.dataclass(frozen=True)
class Overlap:
    gpus: int
    sync_rollout_s: float
    sync_train_s: float
    refit_s: float
    best: Split
    splits: list[Split]
    sync_layout: str = ""
    tokens: int = 0
    """prompt + response tokens of one step (the sequence lengths T is predicted on)"""
    chosen: Split | None = None
    """the off-policy preset's own split (None: a sync preset, or a split that does not fit)"""

    @property
    def sync_step_s(self) -> float:
        return self.sync_rollout_s + self.sync_train_s + self.refit_s

    @property
    def gain(self) -> float:
        return self.sync_step_s / self.best.step_s

    def tok_s_gpu(self, step_s: float) -> float:
        """Tokens of a step / STEP_S / all GPUs (both pools)."""
        return self.tokens / step_s / self.gpus if step_s and self.tokens else math.nan

    def report(self) -> str:
        pub = NEMO_RL["one_step_off_tok_s_gpu"] / NEMO_RL["sync_tok_s_gpu"]
        b = self.best
        lines = [
            f"async overlap ({self.gpus} GPUs): sync step ({self.sync_layout}) = rollout {self.sync_rollout_s:.0f} s + train "
            f"{self.sync_train_s:.0f} s + refit {self.refit_s:.0f} s = {self.sync_step_s:.0f} s",
            f"  one-step-off best split: {self.split_text(b)}",
        ]
        if self.chosen is not None and self.chosen != b:
            lines.append(f"  one-step-off preset's split: {self.split_text(self.chosen)}")
        lines.append(f"  expected gain {self.gain - 1:+.0%} tokens/s/GPU (model) vs NeMo-RL published {pub - 1:+.0%} "
                     f"({NEMO_RL['sync_tok_s_gpu']} -> {NEMO_RL['one_step_off_tok_s_gpu']} tok/s/GPU on "
                     f"{NEMO_RL['gpus']} H100); not modelled: offload/onload and vLLM sleep/wake of the colocated run")
        return "\n".join(lines)

    @staticmethod
    def split_text(s: Split) -> str:
        return (f"rollout {s.rollout_gpus} GPUs ({s.rollout_s:.0f} s) | trainer {s.trainer_gpus} GPUs ({s.train_s:.0f} s, "
                f"{s.layout}) -> max + refit {s.refit_s:.0f} s = {s.step_s:.0f} s")

    def line(self) -> str:
        """One line for the launcher's dry run: sync vs the preset's split (else the best), step seconds and
        tokens/s/GPU over all GPUs, with the precision the short steps of small presets need."""
        c = self.chosen or self.best
        f = (lambda x: f"{x:.1f}") if self.sync_step_s < 100 else (lambda x: f"{x:.0f}")
        return (f"sync {self.gpus} GPUs: rollout {f(self.sync_rollout_s)} + train {f(self.sync_train_s)} + refit "
                f"{self.refit_s:.2f} = {f(self.sync_step_s)} s/step, {self.tok_s_gpu(self.sync_step_s):.0f} tok/s/GPU; "
                f"one-step-off rollout {c.rollout_gpus} | trainer {c.trainer_gpus} GPUs: max(rollout {f(c.rollout_s)}, "
                f"train {f(c.train_s)}) + refit {c.refit_s:.2f} = {f(c.step_s)} s/step, {self.tok_s_gpu(c.step_s):.0f} "
                f"tok/s/GPU ({self.sync_step_s / c.step_s - 1:+.0%}; {self.tokens} tokens a step, all {self.gpus} GPUs; "
                f"not modelled: offload, sleep/wake, the sync's transport)")


def rollout_seconds(m, gpu: str, gpus: int, grpo: GRPOShape, tp: int, dp: int, ep: bool,
                    gpu_memory_utilization: float) -> float:
    """R(gpus): the decode-bound generation time of one batch (module docstring)."""
    from dsv3_rl.planner.model import count_params
    from dsv3_rl.planner.refit import rollout_bytes_per_gpu

    g = GPUS[gpu]
    engine = tp * dp
    engines = gpus // engine
    if engines < 1:
        return math.inf
    seqs = grpo.prompts_per_step * grpo.n_samples
    per_rank = math.ceil(seqs / (engines * dp))                       # sequences per DP rank (attention)
    weights = rollout_bytes_per_gpu(m, tp, dp, ep)
    kv_tok = (m.kv_lora_rank + m.qk_rope_dim) * 2 * m.num_layers      # MLA latent cache, bf16, per token
    max_ctx = grpo.max_prompt_len + grpo.max_response_len
    kv_free = g.memory_gib * 2**30 * gpu_memory_utilization - weights
    if kv_free <= 0:
        return math.inf
    fit = max(1, int(kv_free // (kv_tok * max_ctx / tp)))             # sequences a DP rank's KV holds
    waves = math.ceil(per_rank / fit)
    live = min(per_rank, fit)
    mean_ctx = grpo.max_prompt_len + grpo.max_response_len * grpo.mean_length_fraction / 2
    step = (weights + live * mean_ctx * kv_tok / tp) / (g.hbm_tbs * 1e12 * comm.DECODE_HBM_EFFICIENCY)
    flops_per_token = 2.0 * count_params(m).activated
    prefill = seqs * grpo.max_prompt_len * flops_per_token / (gpus * g.bf16_tflops * 1e12 * PREFILL_MFU)
    return waves * grpo.max_response_len * step + prefill


def train_seconds(m, cluster: Cluster, grpo: GRPOShape, layout: Layout, options: Options) -> tuple[float, float]:
    """(T, F) on CLUSTER: the planner's log_prob + update, and its export (refit) time; inf when infeasible."""
    from dsv3_rl.planner.phases import predict_phases

    p = predict_phases(m, cluster, grpo, layout, options)
    if not p.feasible:
        return math.inf, math.inf
    export = p.phases["export"].seconds if "export" in p.phases else 0.0
    return p.step_seconds - export, export


REPLAN_CANDIDATES = 8  #: the search's best layouts per pool that --replan runs through the phase model


def _pool_train(m, c: Cluster, grpo: GRPOShape, layout: Layout, options: Options, replan: bool):
    """(T, F, layout) on pool C: the preset's layout, or with REPLAN the faster of it and the planner's best layout
    for the pool (:func:`dsv3_rl.planner.search.plan`, trainer alone); (inf, inf, "") when none fits."""
    cands = [layout]
    if replan:
        from dsv3_rl.planner.search import plan

        res = plan(m, c, grpo, dataclasses.replace(options, rollout=False))
        # the search ranks by the update's memory; the phase model also checks the log-prob and export peaks, so
        # its first few candidates are tried (the search's best can fail there: TP4 PP40 EP8 on 320 H100s)
        cands += [e.layout for e in res.feasible[:REPLAN_CANDIDATES]]
    best = (math.inf, math.inf, "")
    for lay in cands:
        try:
            t, f = train_seconds(m, c, grpo, lay, options)
        except Exception:  # noqa: BLE001  (a layout that does not divide the pool: not a candidate)
            continue
        if t + f < best[0] + best[1]:
            best = (t, f, lay.short())
    return best


def _trainer_pool(cluster: Cluster, nt: int) -> Cluster:
    """The trainer's pool of NT GPUs: whole nodes, or on a one-node cluster the node's remaining GPUs."""
    if cluster.nodes == 1:
        return dataclasses.replace(cluster, gpus_per_node=nt, nodes=1)
    return dataclasses.replace(cluster, nodes=nt // cluster.gpus_per_node)


def overlap(model, cluster: Cluster, grpo: GRPOShape, layout: Layout, options: Options, *, rollout_tp: int,
            rollout_dp: int, rollout_ep: bool, gpu_memory_utilization: float = 0.9, replan: bool = False,
            sync_layout: Layout | None = None, rollout_gpus: int | None = None) -> Overlap:
    """Sync vs the best one-step-off split of CLUSTER (module docstring). REPLAN: each trainer pool may also use
    the planner's best layout for its size (the preset's layout often does not divide a smaller pool).
    ROLLOUT_GPUS: the preset's own split, reported as :attr:`Overlap.chosen`. On one node the rollout may take part
    of it (whole engines); on several, whole nodes."""
    from dsv3_rl.planner.model import load_model
    from dsv3_rl.planner.phases import expected_seq_lens

    m = load_model(model)
    n, gpn = cluster.world, cluster.gpus_per_node
    ro = dict(tp=rollout_tp, dp=rollout_dp, ep=rollout_ep, gpu_memory_utilization=gpu_memory_utilization)
    options = dataclasses.replace(options, placement="colocated", rollout_gpus=None)  # T: the trainer alone
    r_all = rollout_seconds(m, cluster.gpu, n, grpo, **ro)
    t_all, f = train_seconds(m, cluster, grpo, sync_layout or layout, options)  # the sync run's own layout
    engine = rollout_tp * rollout_dp
    unit = engine if cluster.nodes == 1 else math.lcm(engine, gpn)
    splits = []
    for nr in range(unit, n, unit):
        nt = n - nr
        if cluster.nodes > 1 and nt % gpn:
            continue
        t, ft, lay = _pool_train(m, _trainer_pool(cluster, nt), grpo, layout, options, replan)
        if math.isinf(t):
            continue
        splits.append(Split(nr, nt, rollout_seconds(m, cluster.gpu, nr, grpo, **ro), t, ft, lay))
    if not splits:
        raise ValueError(f"no rollout/trainer split of {n} GPUs fits layout {layout.short()} "
                         f"(rollout engines of {rollout_tp * rollout_dp} GPUs)")
    best = min(splits, key=lambda s: s.step_s)
    chosen = next((s for s in splits if s.rollout_gpus == rollout_gpus), None) if rollout_gpus else None
    return Overlap(n, r_all, t_all, f, best, splits, (sync_layout or layout).short(),
                   tokens=sum(expected_seq_lens(grpo)), chosen=chosen)


def _layout(p) -> Layout:
    from dsv3_rl.planner.spec import from_dict

    return from_dict(Layout, {k: (tuple(v) if isinstance(v, list) else v) for k, v in p.layout.items()})


def sync_baseline(p):
    """The sync preset an off-policy preset is compared with: the nearest runnable preset it extends (its own
    layout on the whole machine), else the preset itself; a sync preset is its own."""
    from dsv3_rl.recipes.presets import load_preset

    if not p.off_policy:
        return p
    for f in reversed(p.files[:-1]):
        if not f.name.startswith("_"):
            return load_preset(f)
    return p


def for_preset(name, replan: bool = False, *, grpo: GRPOShape | None = None, options: Options | None = None,
               layout: Layout | None = None) -> Overlap:
    """The overlap estimate for a run preset's hardware, batch and rollout: sync with the layout of
    :func:`sync_baseline`, one-step-off with the preset's layout on the trainer pool (sync or one_step_off: the
    hardware is the whole machine either way), the preset's own split as :attr:`Overlap.chosen`. GRPO, OPTIONS and
    LAYOUT: the launcher's, from the composed verl config (dsv3_rl.launch.checks.planner_inputs); without them they
    are read from the preset file (verl's defaults for what it does not set)."""
    from dsv3_rl.recipes.algorithms import rollout_world
    from dsv3_rl.recipes.presets import load_preset

    p = load_preset(name)
    v = p.verl
    d, a = v.get("data", {}), v.get("actor_rollout_ref", {}).get("actor", {})
    ro = v.get("actor_rollout_ref", {}).get("rollout", {})
    prompt, resp = int(d.get("max_prompt_length", 2048)), int(d.get("max_response_length", 8192))
    if grpo is None:
        grpo = GRPOShape(prompts_per_step=int(d["train_batch_size"]), n_samples=int(ro.get("n", 8)),
                         max_prompt_len=prompt, max_response_len=resp, ppo_mini_batch_size=a.get("ppo_mini_batch_size"),
                         dynamic_batch=bool(a.get("use_dynamic_bsz", True)),
                         max_token_len_per_gpu=a.get("ppo_max_token_len_per_gpu") or prompt + resp)
    if options is None:
        mg, oc = a.get("megatron", {}), (a.get("optim", {}).get("override_optimizer_config") or {})
        cpu_off = bool(oc.get("optimizer_cpu_offload", False))  # the CPU optimizer (proxy_1xH100 and its kin)
        options = Options(param_offload=bool(mg.get("param_offload", False)),
                          optimizer_offload=bool(mg.get("optimizer_offload", False)), ref_model=bool(a.get("use_kl_loss", False)),
                          optimizer_cpu_offload_fraction=float(oc.get("optimizer_offload_fraction", 1.0)) if cpu_off else 0.0,
                          precision_aware_optimizer=bool(oc.get("use_precision_aware_optimizer", False)))
    cl = Cluster(gpu=p.hardware["gpu"], gpus_per_node=p.gpus_per_node, nodes=p.nodes)
    r = p.rollout
    return overlap(p.model, cl, grpo, layout or _layout(p), options, rollout_tp=int(r.get("tp", 1)),
                   rollout_dp=int(r.get("dp", 1)), rollout_ep=int(r.get("ep", 1)) > 1,
                   gpu_memory_utilization=float(r.get("gpu_memory_utilization", 0.9)), replan=replan,
                   sync_layout=_layout(sync_baseline(p)), rollout_gpus=rollout_world(p) or None)


def cmd_async(a) -> int:
    o = for_preset(a.preset, replan=a.replan)
    print(o.report())
    if a.json:
        from dsv3_rl.fs import write_json_atomic

        split = lambda s: {**dataclasses.asdict(s), "step_s": s.step_s, "tok_s_gpu": o.tok_s_gpu(s.step_s)}  # noqa: E731
        write_json_atomic(a.json, {"preset": a.preset, "gpus": o.gpus, "tokens_per_step": o.tokens,
                                   "sync": {"rollout_s": o.sync_rollout_s, "train_s": o.sync_train_s, "refit_s": o.refit_s,
                                            "step_s": o.sync_step_s, "tok_s_gpu": o.tok_s_gpu(o.sync_step_s),
                                            "layout": o.sync_layout},
                                   "sync_step_s": o.sync_step_s, "best": split(o.best), "gain": o.gain,
                                   "chosen": split(o.chosen) if o.chosen else None,
                                   "splits": [dataclasses.asdict(s) for s in o.splits], "published": NEMO_RL},
                          indent=1, ensure_ascii=True)
        print(f"json: {a.json}")
    print(f"summary: one-step-off on {o.gpus} GPUs: rollout {o.best.rollout_gpus} | trainer {o.best.trainer_gpus}, "
          f"expected {o.gain - 1:+.0%} tokens/s/GPU over sync (NeMo-RL published "
          f"{NEMO_RL['one_step_off_tok_s_gpu'] / NEMO_RL['sync_tok_s_gpu'] - 1:+.0%})")
    return 0


def add_parser(sub) -> None:
    """``dsv3-plan async [PRESET]``: the sync vs one-step-off estimate of a run preset."""
    from pathlib import Path

    p = sub.add_parser("async", help="what one-step-off-policy GRPO buys on a preset's GPUs (rollout and training on "
                                     "separate pools, overlapped) next to NeMo-RL's published +77%%")
    p.add_argument("preset", nargs="?", default="671b_512xH100_async",
                   help="run preset (dsv3-launch list; default 671b_512xH100_async)")
    p.add_argument("--json", type=Path, help="write the estimate and every split as JSON (atomic)")
    p.add_argument("--replan", action="store_true", help="let each trainer pool use the planner's best layout for "
                   "its size too (a planner search per split: ~15 s each)")
    p.set_defaults(func=cmd_async)
