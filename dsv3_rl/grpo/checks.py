"""Self-checks of a GRPO run: what makes a finished ``main_ppo`` run *believable*.

* every training step logged its reward and log-probs, all finite;
* the rollout engine computed with the trainer's weights: the token probabilities vLLM reported while
  sampling match the ones the Megatron trainer recomputes for the same tokens (``old_log_prob``) at
  *every* step (verl's ``training/rollout_probs_diff_*`` and Pearson metrics): the mean gap and the
  correlation are gated (the per-token max is reported: in bf16 an MoE token whose top-k experts flip
  between the engines reaches 0.5). vLLM starts from random weights (``load_format=dummy``), so step 1
  proves the trainer -> vLLM sync; later steps prove every sync delivered the update once the policy moves;
* the policy learned (``checks.learning``): the mean reward of the last ``window`` steps exceeds the first
  ``window`` steps' by ``min_gain``, and the validation reward ends higher than it started;
* the actor's weights changed: saved checkpoint vs the dist checkpoint the run started from;
* the saved checkpoint reloads: every tensor of the initial checkpoint is there with its shape, finite,
  and a megatron model at another layout (TP1, one process) loads it strictly.

:func:`check_run` returns a :class:`Report`; each check is a :class:`Check` with a one-line detail.
A run resumed after an interrupt is read across its attempts (:func:`read_run_metrics`).
Planted-fault twins in ``tests/unit/test_grpo_checks.py`` (on metrics) and ``tests/unit/test_grpo_learning.py``
(real runs with a fault planted) show each check can fail.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from dsv3_rl.checkpoint.verl_layout import model_dir
from dsv3_rl.grpo.metrics import (PROB_DIFF_MAX, PROB_DIFF_MEAN, REWARD_KEYS, TOKEN_MULT_PROB_ERROR, Check, CheckError,
                                  finite as _finite, read_metrics, route_agreement, val_reward)
from dsv3_rl.grpo.off_policy import run_checks  # trainer_mode (staleness) and algorithm (DAPO) checks, issue 27

# verl metric names (verl 0.9.1, trainer/ppo/metric_utils.py and utils/debug/metrics.py); the reward, prob-diff and
# route-agreement names, the metric reader and Check live in dsv3_rl.grpo.metrics (progress reads them too)
LOGPROB_KEYS = ("actor/pg_loss", "actor/ppo_kl")
PEARSON = "training/rollout_actor_probs_pearson_corr"
#: NeMo-RL gates its token_mult_prob_error (metrics.TOKEN_MULT_PROB_ERROR) at < 1.05; a preset may gate it too
#: (rollout_vs_trainer_token_mult_prob_error_max), else it is reported beside our limits
NEMO_RL_TOKEN_MULT_PROB_ERROR_MAX = 1.05
ENTROPY = "actor/entropy"
#: the pearson limit judges a step whose policy entropy (nats per token, ENTROPY) is at least this: below it the
#: sampled tokens' probabilities sit near 1, their spread collapses and one token's difference moves the correlation
#: (the CI demo of 2026-11-27 05:48 UTC: step 12 at entropy 0.107, pearson 0.9605 with mean |p_vllm - p_megatron| 0.0048,
#: the run's smallest; steps 1-11 >= 0.984). The mean limit judges every step; a run that logs no entropy has its
#: pearson judged at every step.
PEARSON_MIN_ENTROPY = 0.2

#: verl's rollout MoE load metrics found routes in the batch (1.0) or not (0.0)
MOE_ROUTES_FOUND = "rollout/moe/routed_experts_found"

DEFAULT_TOLERANCES = {
    "rollout_vs_trainer_prob_diff_mean_max": 0.03,
    # NeMo-RL's gate, per step (None: reported, not judged; the CPU demo's bf16 vLLM vs Megatron measures 1.02-1.28,
    # one GPU 1.000-1.001): a constant log-prob offset (a different softmax normaliser) moves it while the
    # probability differences stay small (2026-12-07: vLLM masked ids >= len(tokenizer), 4.15 nats, 63.6)
    "rollout_vs_trainer_token_mult_prob_error_max": None,
    # R3: fraction of vLLM's (token, MoE layer) routes that the trainer's router picks too (demo: >= 0.97)
    "route_agreement_min": 0.9,
    "rollout_vs_trainer_pearson_min": 0.97,
    "min_weight_change": 1e-6,
    "learning": None,
}


@dataclasses.dataclass
class Report:
    checks: list[Check]
    steps: list[dict[str, Any]]
    weight_change: float | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def render(self) -> str:
        lines = [f"  [{'PASS' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"ok": self.ok, "weight_change": self.weight_change,
                "checks": [dataclasses.asdict(c) for c in self.checks], "steps": self.steps}


def _first(step: dict, keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in step:
            return k, step[k]
    return None, None


def read_run_metrics(path: str | Path) -> list[dict[str, Any]]:
    """A run's metrics across resumed attempts: the launcher keeps an interrupted attempt's file as
    ``metrics.attempt-N.jsonl`` (verl's file logger truncates its file at start); later attempts win for
    a step logged twice (a step redone after the resume)."""
    path = Path(path)
    olds = sorted(path.parent.glob(f"{path.stem}.attempt-*{path.suffix}"),
                  key=lambda p: int(p.stem.rsplit("-", 1)[1]) if p.stem.rsplit("-", 1)[1].isdigit() else 0)
    merged: dict[int, dict] = {}
    for p in [*olds, path]:
        if p == path and not p.is_file() and olds:
            continue
        for rec in read_metrics(p):
            merged[rec["step"]] = {**merged.get(rec["step"], {}), **rec}
    return [merged[k] for k in sorted(merged)]


def training_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of steps that trained (a validation-only record, e.g. step 0 of val_before_train, is not one)."""
    return [s for s in steps if any(k in s for k in REWARD_KEYS)]


def pearson_judged(step: dict[str, Any]) -> bool:
    """Whether the pearson limit judges STEP: its policy entropy is logged and below PEARSON_MIN_ENTROPY, or not."""
    e = step.get(ENTROPY)
    return not (_finite(e) and e < PEARSON_MIN_ENTROPY)


def check_metrics(steps: list[dict[str, Any]], expected_steps: int, tol: dict[str, Any],
                  resumed_from: int | None = None) -> list[Check]:
    out = []
    train = training_steps(steps)
    got = [s["step"] for s in train]
    missing = sorted(set(range(1, expected_steps + 1)) - set(got))
    # verl saves step K's checkpoint before it logs step K: an attempt stopped in between leaves K trained
    # and checkpointed but not logged, and the resumed attempt starts at K + 1
    excused = [k for k in missing if resumed_from is not None and k <= resumed_from]
    detail = f"{len(got)} training steps logged ({got}), expected {expected_steps}"
    if excused:
        detail += (f"; step(s) {excused} trained and checkpointed by an interrupted attempt but not logged "
                   f"(resumed from step {resumed_from})")
    out.append(Check("steps", not (set(missing) - set(excused)) and bool(got), detail))
    bad, parts = [], []
    for s in train:
        rk, rv = _first(s, REWARD_KEYS)
        if rk is None or not _finite(rv):
            bad.append(f"step {s['step']}: reward {rk}={rv}")
        else:
            parts.append(f"{rv:.3f}")
        for k in LOGPROB_KEYS + (PROB_DIFF_MEAN,):
            if k not in s or not _finite(s[k]):
                bad.append(f"step {s['step']}: {k}={s.get(k)}")
    out.append(Check("finite rewards and log-probs", not bad and bool(train),
                     "; ".join(bad[:5]) if bad else f"reward mean per step {', '.join(parts)}; "
                     f"{', '.join(LOGPROB_KEYS)} and log-prob diffs finite"))
    lim, rmin = tol["rollout_vs_trainer_prob_diff_mean_max"], tol["rollout_vs_trainer_pearson_min"]
    tmax = tol.get("rollout_vs_trainer_token_mult_prob_error_max")
    worst, judged = [], []
    for s in train:
        m, r, e = s.get(PROB_DIFF_MEAN), s.get(PEARSON), s.get(TOKEN_MULT_PROB_ERROR)
        if pearson_judged(s):
            judged.append(s)
            ok = _finite(m) and _finite(r) and m <= lim and r >= rmin
        else:
            ok = _finite(m) and m <= lim  # low entropy: the mean alone judges this step
        e_ok = tmax is None or (_finite(e) and e <= tmax)
        if not (ok and e_ok):
            worst.append(f"step {s['step']}: mean {m if m is None else f'{m:.3g}'}, pearson {r if r is None else f'{r:.4f}'}"
                         + ("" if tmax is None else f", token_mult_prob_error {e if e is None else f'{e:.4g}'}"))
    means = [s.get(PROB_DIFF_MEAN) for s in train if _finite(s.get(PROB_DIFF_MEAN))]
    maxes = [s.get(PROB_DIFF_MAX) for s in train if _finite(s.get(PROB_DIFF_MAX))]
    rs = [s.get(PEARSON) for s in judged if _finite(s.get(PEARSON))]
    low = len(train) - len(judged)
    tmpe = [s.get(TOKEN_MULT_PROB_ERROR) for s in train if _finite(s.get(TOKEN_MULT_PROB_ERROR))]
    nemo = (f"; NeMo-RL's token_mult_prob_error {min(tmpe):.4f}-{max(tmpe):.4f} "
            + (f"(<= {tmax})" if tmax is not None else f"(NeMo-RL gates < {NEMO_RL_TOKEN_MULT_PROB_ERROR_MAX})")
            if tmpe else "")
    limits = (f"mean |p_vllm - p_megatron| <= {lim}, pearson >= {rmin}"
              + ("" if tmax is None else f", token_mult_prob_error <= {tmax}"))
    out.append(Check("rollout == trainer every step", bool(train) and not worst,
                     ("; ".join(worst[:4]) + f" (limits: {limits})") if worst else
                     f"mean |p_vllm - p_megatron| <= {max(means):.3g} (<= {lim}) at all {len(train)} steps; "
                     + (f"pearson >= {min(rs):.4f} (>= {rmin}) at " if rs else "pearson at ")
                     + ("all of them" if not low else f"the {len(judged)} with policy entropy >= {PEARSON_MIN_ENTROPY}, "
                        f"not judged at the {low} below (probabilities near 1)") + f"; max per token {max(maxes):.2g}"
                     + nemo))
    out += run_checks(train, tol)
    if tol.get("router_replay") == "R3":
        # verl's off-policy trainers (experimental separation trainer) log no rollout MoE metrics (MOE_ROUTES_FOUND)
        out.append(check_router_replay(train, float(tol["route_agreement_min"]),
                                       found_logged=tol.get("trainer_mode", "sync") == "sync"))
    learning = tol.get("learning")
    if learning:
        out.append(check_learning(steps, learning))
    return out


def check_router_replay(train: list[dict[str, Any]], agreement_min: float, found_logged: bool = True) -> Check:
    """R3: every training step replayed vLLM's routes (verl found them in the batch) and the trainer's own router
    agreed with at least ``agreement_min`` of them. ``found_logged=False`` (off-policy trainers, which log no
    MOE_ROUTES_FOUND): the route agreement is the evidence, logged only while the Megatron engine replays the
    batch's routes (verl patch 0023; R3 without routes in the batch raises)."""
    bad, vals = [], []
    for s in train:
        a, found = route_agreement(s), s.get(MOE_ROUTES_FOUND)
        if a is None or (found != 1.0 if found_logged else found not in (None, 1.0)) or a < agreement_min:
            bad.append(f"step {s['step']}: route agreement {a if a is None else f'{a:.4f}'}, "
                       f"{MOE_ROUTES_FOUND}={found}")
        else:
            vals.append(a)
    if bad or not train:
        return Check("router replay (R3)", False, "; ".join(bad[:4]) + f" (need vLLM's routes in every step and "
                     f"agreement >= {agreement_min}; docs/consistency.md)" if bad else "no training step")
    return Check("router replay (R3)", True, f"vLLM's routes replayed at all {len(train)} steps; trainer's router "
                 f"agreed on {min(vals):.4f}-{max(vals):.4f} of them (>= {agreement_min})")


def check_learning(steps: list[dict[str, Any]], learning: dict[str, Any]) -> Check:
    """Mean reward of the last ``window`` training steps minus the first ``window`` >= ``min_gain``, and the
    validation reward (verl's test_freq) higher at its last measurement than at its first."""
    if learning.get("reason_off"):
        return Check("learning", True, f"not gated: {learning['reason_off']}")
    w, gain_min = int(learning.get("window", 3)), float(learning.get("min_gain", 0.15))
    rewards = [_first(s, REWARD_KEYS)[1] for s in training_steps(steps)]
    rewards = [float(r) for r in rewards if _finite(r)]
    vals = [(s["step"], val_reward(s)) for s in steps]
    vals = [(k, v) for k, v in vals if v is not None]
    if len(rewards) < 2 * w:
        return Check("learning", False, f"{len(rewards)} training steps with a reward; need >= {2 * w} to compare "
                                        f"the first {w} with the last {w}")
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    gain = last - first
    ok = gain >= gain_min
    detail = f"reward first {w} steps {first:.3f} -> last {w} {last:.3f} (gain {gain:+.3f}, need >= {gain_min})"
    if len(vals) >= 2:
        (k0, v0), (k1, v1) = vals[0], vals[-1]
        ok = ok and v1 > v0
        detail += f"; validation {v0:.3f} (step {k0}) -> {v1:.3f} (step {k1}){'' if v1 > v0 else ' did not rise'}"
    else:
        ok = False
        detail += f"; validation measured {len(vals)} time(s), need >= 2 (trainer.test_freq, val_before_train)"
    return Check("learning", ok, detail)


def learning_summary(steps: list[dict[str, Any]], window: int = 3) -> tuple[float | None, float | None]:
    """(mean reward of the first WINDOW training steps, of the last WINDOW) for the summary line."""
    rewards = [float(_first(s, REWARD_KEYS)[1]) for s in training_steps(steps) if _finite(_first(s, REWARD_KEYS)[1])]
    if not rewards:
        return None, None
    w = min(window, len(rewards))
    return sum(rewards[:w]) / w, sum(rewards[-w:]) / w


# ------------------------------------------------------------------------------- checkpoints

def _load_plain(ckpt_dir: Path) -> dict:
    from megatron.core import dist_checkpointing

    if not (ckpt_dir / "metadata.json").is_file():
        raise CheckError(f"{ckpt_dir} is not a megatron dist checkpoint (no metadata.json)")
    return {k: v for k, v in dist_checkpointing.load_plain_tensors(str(ckpt_dir)).items()
            if hasattr(v, "dtype") and "_extra_state" not in k}


def find_saved_model(ckpt_root: Path, step: int) -> Path:
    """The actor's model dist checkpoint that verl saved at ``step`` under ``trainer.default_local_dir``, found by
    verl's own layout (``actor/ckpt_contents.json``, else ``actor/model/dist_ckpt``), not by searching: an
    ``optimizer/`` or ``extra/`` dist checkpoint is never taken for the model, whatever order a file system lists."""
    step_dir = ckpt_root / f"global_step_{step}"
    d = model_dir(step_dir)
    if not (d / "metadata.json").is_file():
        found = sorted(str(p.parent) for p in (step_dir / "actor").rglob("metadata.json")) if step_dir.is_dir() else []
        raise CheckError(f"no model dist checkpoint at {d} (verl's layout; dist checkpoints under {step_dir}: {found})")
    return d


_TE_NORM_SUFFIXES = (".layer_norm_weight", ".layer_norm_bias")


def weight_change(initial: dict, saved: dict) -> tuple[float, list[str]]:
    """Relative L2 change over the tensors both checkpoints hold; problems (missing, shape, non-finite)."""
    import torch

    problems, num, den = [], 0.0, 0.0
    # the converter writes the norm weights under both specs' names (--spec both); a run on the local spec
    # (no Transformer Engine) saves only the local names, so TE's fused-norm aliases may be absent then
    saved_has_te_names = any(k.endswith(_TE_NORM_SUFFIXES) for k in saved)
    for k, a in initial.items():
        b = saved.get(k)
        if b is None:
            if not (k.endswith(_TE_NORM_SUFFIXES) and not saved_has_te_names):
                problems.append(f"{k} missing from the saved checkpoint")
            continue
        if tuple(b.shape) != tuple(a.shape):
            problems.append(f"{k}: shape {tuple(b.shape)} != initial {tuple(a.shape)}")
            continue
        bf = b.float()
        if not torch.isfinite(bf).all():
            problems.append(f"{k}: non-finite values")
            continue
        num += float((bf - a.float()).pow(2).sum())
        den += float(a.float().pow(2).sum())
    return (math.sqrt(num / den) if den else 0.0), problems


def check_checkpoint(initial_dir: Path, saved_dir: Path, hf_dir: Path, tol: dict[str, float],
                     reload_model: bool = True) -> tuple[list[Check], float | None]:
    from dsv3_rl.mcore import runtime

    out: list[Check] = []
    runtime.init_distributed(_parallel1())
    try:
        initial, saved = _load_plain(initial_dir), _load_plain(saved_dir)
        change, problems = weight_change(initial, saved)
        compared = sum(k in saved for k in initial)
        out.append(Check("checkpoint complete", not problems,
                         "; ".join(problems[:5]) if problems else
                         f"{saved_dir}: {compared} tensors, shapes as the initial checkpoint, finite"))
        lim = tol["min_weight_change"]
        out.append(Check("actor weights changed", change > lim,
                         f"relative L2 change {change:.3e} over the run (> {lim})"))
        if reload_model:
            out.append(_reload(saved_dir, hf_dir))
        return out, change
    finally:
        runtime.destroy()


def _parallel1():
    from dsv3_rl.layout import Layout

    return Layout()  # TP1, one process


def _reload(saved_dir: Path, hf_dir: Path) -> Check:
    """Load the saved checkpoint strictly into a fresh TP1 megatron model (a layout the run did not use)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from transformers import AutoConfig

    from dsv3_rl.mcore import runtime

    hf = AutoConfig.from_pretrained(hf_dir)
    try:
        chunks = runtime.build_model(hf, _parallel1(), dtype=torch.bfloat16, use_te=False)
        sd = chunks[0].sharded_state_dict(prefix="")
        missing_unexpected = dist_checkpointing.load(sd, str(saved_dir), strict=StrictHandling.RAISE_UNEXPECTED)
        del missing_unexpected
        n = sum(p.numel() for p in chunks[0].parameters())
        return Check("checkpoint reloads", True, f"strict load into a TP1 megatron model ({n / 1e6:.2f}M params)")
    except Exception as e:  # noqa: BLE001 - the check reports any failure
        return Check("checkpoint reloads", False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")


def check_run(metrics_path: Path, expected_steps: int, initial_ckpt: Path | None, ckpt_root: Path | None,
              hf_dir: Path | None, tolerances: dict[str, Any] | None = None,
              resumed_from: int | None = None) -> Report:
    """``resumed_from``: the checkpoint step the last attempt resumed from (the launcher's ``resume.json``)."""
    tol = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    steps = read_run_metrics(metrics_path)
    checks = check_metrics(steps, expected_steps, tol, resumed_from)
    change = None
    # min_weight_change None: the run saves no checkpoint to compare (the proxies: throughput and agreement only)
    if initial_ckpt is not None and ckpt_root is not None and tol.get("min_weight_change") is not None:
        try:
            saved = find_saved_model(ckpt_root, expected_steps)
            cks, change = check_checkpoint(initial_ckpt, saved, hf_dir, tol)
            checks += cks
        except CheckError as e:
            checks.append(Check("checkpoint saved", False, str(e)))
    return Report(checks=checks, steps=steps, weight_change=change)
