"""Self-checks of a GRPO run: what makes a finished ``main_ppo`` run *believable*.

* every step logged its reward and log-probs, all finite;
* the rollout engine computed with the trainer's weights: the token probabilities vLLM reported while
  sampling match the ones the Megatron trainer recomputes for the same tokens (``old_log_prob``) at
  *every* step (verl's ``training/rollout_probs_diff_*`` metrics). vLLM starts from random weights
  (``load_format=dummy``), so step 1 passing proves the trainer -> vLLM weight sync works; step 2
  passing shows the rollout still matches after the update and the second sync (it tells stale from
  updated weights only when the update moved the probabilities by more than the bf16 noise, which the
  demo's small entropy-driven update does not);
* the actor's weights changed: saved checkpoint vs the dist checkpoint the run started from;
* the saved checkpoint reloads: every tensor of the initial checkpoint is there with its shape, finite,
  and a megatron model at another layout (TP1, one process) loads it strictly.

:func:`check_run` returns a :class:`Report`; each check is a :class:`Check` with a one-line detail.
Planted-fault twins in ``tests/unit/test_grpo_demo*.py`` show each check can fail.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# verl metric names (verl 0.9.1, trainer/ppo/metric_utils.py and utils/debug/metrics.py)
REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
LOGPROB_KEYS = ("actor/pg_loss", "actor/ppo_kl")
PROB_DIFF_MAX = "training/rollout_probs_diff_max"
PROB_DIFF_MEAN = "training/rollout_probs_diff_mean"
PEARSON = "training/rollout_actor_probs_pearson_corr"

DEFAULT_TOLERANCES = {
    "rollout_vs_trainer_prob_diff_max": 0.05,
    "rollout_vs_trainer_pearson_min": 0.99,
    "min_weight_change": 1e-6,
}


class CheckError(RuntimeError):
    """The run's outputs are missing or unreadable (the message names the file)."""


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


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


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """verl's file logger (``trainer.logger=[file]``, ``VERL_FILE_LOGGER_PATH``): one JSON line per
    step, ``{"step": n, "data": {metric: value}}`` -> ``[{"step": n, **metrics}]`` sorted by step."""
    path = Path(path)
    if not path.is_file():
        raise CheckError(f"metrics file {path} does not exist (did main_ppo run with trainer.logger containing 'file'?)")
    steps: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CheckError(f"{path}:{n}: not JSON ({e})") from None
        steps.setdefault(int(rec["step"]), {}).update(rec.get("data") or {})
    return [{"step": s, **steps[s]} for s in sorted(steps)]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(float(x))


def _first(step: dict, keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in step:
            return k, step[k]
    return None, None


def check_metrics(steps: list[dict[str, Any]], expected_steps: int, tol: dict[str, float]) -> list[Check]:
    out = []
    got = [s["step"] for s in steps if "training/global_step" in s or any(k in s for k in REWARD_KEYS)]
    out.append(Check("steps", len(got) >= expected_steps,
                     f"{len(got)} training steps logged ({got}), expected >= {expected_steps}"))
    bad, parts = [], []
    for s in steps:
        rk, rv = _first(s, REWARD_KEYS)
        if rk is None or not _finite(rv):
            bad.append(f"step {s['step']}: reward {rk}={rv}")
        else:
            parts.append(f"{rv:.3f}")
        for k in LOGPROB_KEYS + (PROB_DIFF_MEAN,):
            if k not in s or not _finite(s[k]):
                bad.append(f"step {s['step']}: {k}={s.get(k)}")
    out.append(Check("finite rewards and log-probs", not bad and bool(steps),
                     "; ".join(bad) if bad else f"reward mean per step {', '.join(parts)}; "
                     f"{', '.join(LOGPROB_KEYS)} and log-prob diffs finite"))
    lim, rmin = tol["rollout_vs_trainer_prob_diff_max"], tol["rollout_vs_trainer_pearson_min"]
    for s in steps:
        d, r = s.get(PROB_DIFF_MAX), s.get(PEARSON)
        ok = _finite(d) and _finite(r) and d <= lim and r >= rmin
        out.append(Check(f"rollout == trainer at step {s['step']}", ok,
                         f"max |p_vllm - p_megatron| = {d if d is None else f'{d:.2e}'} (<= {lim}), "
                         f"pearson = {r if r is None else f'{r:.5f}'} (>= {rmin})"))
    return out


# ------------------------------------------------------------------------------- checkpoints

def _load_plain(ckpt_dir: Path) -> dict:
    from megatron.core import dist_checkpointing

    if not (ckpt_dir / "metadata.json").is_file():
        raise CheckError(f"{ckpt_dir} is not a megatron dist checkpoint (no metadata.json)")
    return {k: v for k, v in dist_checkpointing.load_plain_tensors(str(ckpt_dir)).items()
            if hasattr(v, "dtype") and "_extra_state" not in k}


def find_saved_model(ckpt_root: Path, step: int) -> Path:
    """The actor's model dist checkpoint that verl saved at ``step`` under ``trainer.default_local_dir``."""
    base = ckpt_root / f"global_step_{step}" / "actor"
    cands = [p.parent for p in base.rglob("metadata.json")] if base.is_dir() else []
    model = [p for p in cands if "optim" not in p.as_posix()]
    if not model:
        raise CheckError(f"no model dist checkpoint under {base} (found {[str(p) for p in cands]})")
    return sorted(model, key=lambda p: len(p.parts))[0]


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
    runtime.init_distributed(runtime.Parallel() if hasattr(runtime, "Parallel") else _parallel1())
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
    from dsv3_rl.convert.config_map import Parallel

    return Parallel()


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
              hf_dir: Path | None, tolerances: dict[str, float] | None = None) -> Report:
    tol = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    steps = read_metrics(metrics_path)
    checks = check_metrics(steps, expected_steps, tol)
    change = None
    if initial_ckpt is not None and ckpt_root is not None:
        try:
            saved = find_saved_model(ckpt_root, expected_steps)
            cks, change = check_checkpoint(initial_ckpt, saved, hf_dir, tol)
            checks += cks
        except CheckError as e:
            checks.append(Check("checkpoint saved", False, str(e)))
    return Report(checks=checks, steps=steps, weight_change=change)
