"""Rule-based math reward for verl: MATH (boxed answers) and GSM8K.

verl 0.9.1 calls a custom reward as
``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)``
from an executor thread (``verl/experimental/reward_loop/reward_manager/naive.py``) and accepts a
float or a dict with ``"score"``; every other key becomes per-sample ``reward_extra_info``
(``acc`` is averaged in validation metrics, the string ``pred`` feeds majority voting). So
:func:`compute_score` returns ``{"score": float, "acc": float, "pred": str}`` with the same keys
for every sample.

Pipeline per call:
  1. extract the final answer: last ``\\boxed{}``/``\\fbox{}`` (GSM8K: else ``#### N``; the last
     number only with ``gsm8k_last_number=True``); no answer -> 0;
  2. exact string match, then match after MATH normalisation (:func:`normalize_answer`), then
     exact number comparison -- all in-process, microseconds;
  3. otherwise math-verify (symbolic) in a worker process under a hard ``timeout``
     (:mod:`dsv3_rl.reward.verifier`), only for answers under ``MAX_VERIFY_CHARS`` characters and
     ``MAX_VERIFY_DEPTH`` brace levels; definite verdicts are cached per (gold, answer).

Never raises on model output and never blocks longer than about ``timeout`` once a worker is free.
Configuration mistakes (an unknown keyword in ``reward_kwargs``, a data source this reward does
not know) do raise, at the first call, naming the key and the allowed values.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

from dsv3_rl.reward.answer import (
    brace_depth,
    compare_numbers,
    gsm8k_hash_answer,
    last_boxed_answer,
    last_number,
    normalize_answer,
)
from dsv3_rl.reward.verifier import get_pool

logger = logging.getLogger(__name__)

MATH_DATA_SOURCES = frozenset(
    {
        "DigitalLearningGmbH/MATH-lighteval",
        "AI-ModelScope/MATH-lighteval",
        "lighteval/MATH",
        "hendrycks/competition_math",
        "HuggingFaceH4/MATH-500",
        "math",
        "MATH",
    }
)
GSM8K_DATA_SOURCES = frozenset({"openai/gsm8k", "gsm8k", "AI-ModelScope/gsm8k", "modelscope/gsm8k"})
ALLOWED_DATA_SOURCES = tuple(sorted(MATH_DATA_SOURCES | GSM8K_DATA_SOURCES))

DEFAULT_TIMEOUT_S = 5.0
# Answers longer / deeper than this are never handed to sympy (they can only match exactly).
MAX_VERIFY_CHARS = 512
MAX_VERIFY_DEPTH = 32
PRED_REPORT_CHARS = 200

# kwargs verl may pass that this reward does not use (reward router / sandbox plumbing).
_VERL_PASSTHROUGH_KWARGS = frozenset(
    {"reward_router_address", "reward_model_tokenizer", "sandbox_fusion_url", "concurrent_semaphore", "memory_limit_mb"}
)

_warned: set[str] = set()
_warn_lock = threading.Lock()

# math-verify verdicts by (gold, pred): GRPO samples many responses per prompt and they often
# share a final answer. Only definite verdicts are cached, never timeouts or worker failures.
VERDICT_CACHE_SIZE = 8192
_verdicts: OrderedDict[tuple[str, str], bool] = OrderedDict()
_verdicts_lock = threading.Lock()


def clear_verdict_cache() -> None:
    with _verdicts_lock:
        _verdicts.clear()


def _cached_verdict(key: tuple[str, str]) -> bool | None:
    with _verdicts_lock:
        v = _verdicts.get(key)
        if v is not None:
            _verdicts.move_to_end(key)
        return v


def _store_verdict(key: tuple[str, str], equal: bool) -> None:
    with _verdicts_lock:
        _verdicts[key] = equal
        if len(_verdicts) > VERDICT_CACHE_SIZE:
            _verdicts.popitem(last=False)


def _warn_once(key: str, msg: str, *args) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(msg, *args)


def dataset_kind(data_source: str) -> str:
    """Return "math" or "gsm8k" for a known data source; ValueError naming the allowed values otherwise."""
    if data_source in MATH_DATA_SOURCES:
        return "math"
    if data_source in GSM8K_DATA_SOURCES:
        return "gsm8k"
    raise ValueError(
        f"math_reward.compute_score: unknown data_source {data_source!r}; allowed: {', '.join(ALLOWED_DATA_SOURCES)}"
    )


def _as_text(x) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, bytes | bytearray):
        return bytes(x).decode("utf-8", "replace")
    return str(x)


def _gold_list(ground_truth) -> list[str]:
    if ground_truth is None:
        return []
    if isinstance(ground_truth, str | bytes | bytearray):
        return [_as_text(ground_truth)]
    if isinstance(ground_truth, Iterable):  # list / tuple / numpy array of accepted answers
        return [_as_text(g) for g in ground_truth]
    return [_as_text(ground_truth)]


def _gold_answer(gold: str, kind: str) -> str:
    """Ground truth as stored by our data prep is the bare answer; tolerate a full solution."""
    g = gold.strip()
    if "\\boxed" in g or "\\fbox" in g:
        return last_boxed_answer(g) or g
    if kind == "gsm8k" and "####" in g:
        return gsm8k_hash_answer(g) or g
    return g


def extract_answer(solution_str: str, kind: str, gsm8k_last_number: bool = False) -> str | None:
    """The model's final answer for ``kind`` ("math" / "gsm8k"), or None."""
    ans = last_boxed_answer(solution_str)
    if ans is not None or kind != "gsm8k":
        return ans
    ans = gsm8k_hash_answer(solution_str)
    if ans is None and gsm8k_last_number:
        ans = last_number(solution_str)
    return ans


def answers_match(gold: str, pred: str, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """(equal, how) where how is exact | normalised | number | math_verify | <verifier status> | too_long."""
    if gold == pred:
        return True, "exact"
    ng, npred = normalize_answer(gold), normalize_answer(pred)
    if ng == npred and ng:
        return True, "normalised"
    num = compare_numbers(ng, npred)
    if num is not None:
        return num, "number"
    if len(pred) > MAX_VERIFY_CHARS or brace_depth(pred) > MAX_VERIFY_DEPTH:
        return False, "too_long"
    if len(gold) > MAX_VERIFY_CHARS * 4:
        return False, "too_long"
    cached = _cached_verdict((gold, pred))
    if cached is not None:
        return cached, "math_verify"
    v = get_pool().verify(gold, pred, timeout)
    if v.status == "ok":
        _store_verdict((gold, pred), v.equal)
        return v.equal, "math_verify"
    if v.status in ("timeout", "crash"):
        _warn_once("verify-" + v.status, "math-verify %s after %.1fs (scored 0): %s", v.status, v.seconds, v.detail)
    return False, v.status


def score_answer(
    solution_str,
    ground_truth,
    kind: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    format_score: float = 0.0,
    gsm8k_last_number: bool = False,
) -> dict:
    """Score one response; see :func:`compute_score`. Adds ``how`` (the deciding step)."""
    _check_format_score(format_score)
    text = _as_text(solution_str)
    pred = extract_answer(text, kind, gsm8k_last_number=gsm8k_last_number)
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "pred": "", "how": "no_answer"}
    deadline = time.monotonic() + timeout
    how = "no_gold"
    correct = False
    for gold in _gold_list(ground_truth):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            how = "timeout"
            break
        correct, how = answers_match(_gold_answer(gold, kind), pred, timeout=remaining)
        if correct:
            break
    score = 1.0 if correct else float(format_score)
    return {"score": score, "acc": 1.0 if correct else 0.0, "pred": pred[:PRED_REPORT_CHARS], "how": how}


def _check_format_score(format_score) -> None:
    """A wrong answer may earn a format score in [0, 1): never as much as a right one (1.0), never less than
    no answer (0.0)."""
    if not (isinstance(format_score, int | float) and not isinstance(format_score, bool)
            and 0.0 <= format_score < 1.0):
        raise ValueError(f"math_reward: format_score must be in [0, 1) (a wrong answer scores below a right one, "
                         f"1.0), got {format_score!r}")


def compute_score(
    data_source,
    solution_str,
    ground_truth,
    extra_info=None,  # noqa: ARG001 - part of verl's signature
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    format_score: float = 0.0,
    gsm8k_last_number: bool = False,
    **kwargs,
) -> dict:
    """verl custom reward: ``{"score", "acc", "pred"}`` for MATH and GSM8K data sources.

    Args:
        data_source: one of ``ALLOWED_DATA_SOURCES`` (what our data prep writes:
            ``DigitalLearningGmbH/MATH-lighteval``, ``openai/gsm8k``).
        solution_str: the decoded response.
        ground_truth: the reference answer (bare, as our data prep stores it), or a list of them.
        extra_info: unused.
        timeout: seconds allowed for the symbolic check (``reward_kwargs.timeout``).
        format_score: score for a response with a final answer that is wrong (default 0.0;
            correct is 1.0, no final answer is 0.0). ``acc`` is 0/1 either way.
        gsm8k_last_number: GSM8K only: with no ``\\boxed{}`` and no ``#### N``, take the last
            number in the response (off by default: the prompt asks for ``\\boxed{}``).
    """
    unknown = set(kwargs) - _VERL_PASSTHROUGH_KWARGS
    if unknown:
        raise TypeError(
            f"math_reward.compute_score: unknown keyword(s) {sorted(unknown)} (from "
            f"custom_reward_function.reward_kwargs?); allowed: timeout, format_score, gsm8k_last_number"
        )
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"math_reward.compute_score: timeout must be a positive number of seconds, got {timeout!r}")
    _check_format_score(format_score)
    kind = dataset_kind(_as_text(data_source))
    try:
        res = score_answer(
            solution_str,
            ground_truth,
            kind,
            timeout=float(timeout),
            format_score=format_score,
            gsm8k_last_number=gsm8k_last_number,
        )
    except Exception as e:  # noqa: BLE001 - a reward must never take the trainer down
        _warn_once("score-error-" + type(e).__name__, "math_reward: scoring failed (%r); scored 0", e)
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    res.pop("how", None)
    return res
