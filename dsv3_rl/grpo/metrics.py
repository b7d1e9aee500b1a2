"""What a GRPO run logged, read back: verl's metric names that both the self-checks (:mod:`.checks`) and the progress
lines (:mod:`.progress`) read, the reader of verl's file logger, the values of a step record, and :class:`Check`, the
one-line verdict every check returns (:mod:`.checks`, :mod:`.off_policy`).

The bottom of :mod:`dsv3_rl.grpo`: it imports nothing of the package but :mod:`dsv3_rl.errors`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dsv3_rl.errors import Dsv3Error

# verl metric names (verl 0.9.1, trainer/ppo/metric_utils.py and utils/debug/metrics.py)
REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
PROB_DIFF_MAX = "training/rollout_probs_diff_max"
PROB_DIFF_MEAN = "training/rollout_probs_diff_mean"
#: NeMo-RL's token_mult_prob_error: mean over response tokens of exp(|logp_vllm - logp_megatron|), 1.0 = identical
#: (verl patch 0036)
TOKEN_MULT_PROB_ERROR = "training/rollout_token_mult_prob_error"
#: suffix of the R3 route-agreement metric of verl's Megatron engine (verl patch 0023; verl prefixes it)
ROUTE_AGREEMENT = "router_replay/route_agreement"


class CheckError(Dsv3Error, RuntimeError):
    """The run's outputs are missing or unreadable (the message names the file)."""


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


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


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(float(x))


def number(x: Any) -> float | None:
    """``x`` as a float when it is a number (bool is not), else None. NaN/inf are kept: they are values."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def val_reward(step: dict) -> float | None:
    """The validation reward of a step record: the first ``val-core/...`` key containing ``mean@``
    (verl's ``val-core/<data_source>/<reward|acc|score>/mean@N``); failing that, the first ``val/...`` key
    containing ``score`` or ``reward`` (older verl). None when the step has no validation metric."""
    for k, v in step.items():
        if k.startswith("val-core/") and "mean@" in k and number(v) is not None:
            return number(v)
    for k, v in step.items():
        if k.startswith("val/") and ("score" in k or "reward" in k) and number(v) is not None:
            return number(v)
    return None


def route_agreement(step: dict[str, Any]) -> float | None:
    """Fraction of replayed (token, MoE layer) routes the trainer's router would have chosen itself (R3 only)."""
    return next((float(v) for k, v in step.items() if k.endswith(ROUTE_AGREEMENT) and finite(v)), None)
