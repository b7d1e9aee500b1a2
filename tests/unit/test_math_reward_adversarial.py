"""Math reward under adversarial model output: always a score, never raises, hangs cut by the reward's own
timeout (asserted through its result, never by wall clock: latency is bench/bench_reward.py's job).
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dsv3_rl.reward import math_reward, verifier
from dsv3_rl.reward.math_reward import compute_score, score_answer

MATH = "DigitalLearningGmbH/MATH-lighteval"
GSM = "openai/gsm8k"


@pytest.fixture(scope="module", autouse=True)
def _restore_default_pool():
    yield
    verifier.configure_pool()


@pytest.fixture(autouse=True)
def _empty_verdict_cache():
    math_reward.clear_verdict_cache()


@pytest.fixture
def pool():
    """The process pool with 2 workers, warmed up (start-up is not part of a call's time limit).

    Shared across this module's tests (workers take ~1 s to start); tests that kill workers
    leave the pool to replace them, which is part of what they check.
    """
    p = verifier.get_pool()
    if p.max_workers != 2 or p.start_timeout != verifier.DEFAULT_START_TIMEOUT:
        p = verifier.configure_pool(max_workers=2)
    assert p.verify("1", "1", timeout=30).equal
    return p


def _timed(fn, *a, **k):
    t0 = time.monotonic()
    out = fn(*a, **k)
    return out, time.monotonic() - t0


ZERO = {"score": 0.0, "acc": 0.0, "pred": ""}


# ---------------------------------------------------------------------------------------------
# size and structure


def test_enormous_output_is_fast(pool):
    big = "lorem ipsum " * 4_500_000  # ~54 MB
    res, dt = _timed(compute_score, MATH, big + "\\boxed{42}", "42")
    assert res["score"] == 1.0
    res, dt = _timed(compute_score, MATH, big, "42")
    assert res == ZERO
    res, dt = _timed(compute_score, GSM, big + "#### 42", "42")
    assert res["score"] == 1.0
    res, dt = _timed(compute_score, GSM, big + " 42", "42", gsm8k_last_number=True)
    assert res["score"] == 1.0


def test_many_unbalanced_boxes_are_fast(pool):
    res, dt = _timed(compute_score, MATH, "\\boxed{" * 2_000_000, "3")
    assert res == ZERO
    res, dt = _timed(compute_score, MATH, "\\boxed{" + "x" * 5_000_000, "3")
    assert res == ZERO
    res, dt = _timed(compute_score, MATH, "}" * 1_000_000 + "\\boxed{3}", "3")
    assert res["score"] == 1.0


def test_deeply_nested_braces(pool):
    deep = "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"
    res, dt = _timed(score_answer, deep, "1", "math", timeout=2.0)
    assert res["score"] == 0.0  # longer than any answer we extract
    mid = "\\boxed{" + "a^{" * 40 + "1" + "}" * 40 + "}"  # a power tower 40 deep
    res, dt = _timed(score_answer, mid, "2", "math", timeout=2.0)
    assert res["score"] == 0.0 and res["how"] == "too_long"  # never handed to sympy
    fracs = "\\frac{1}{" * 30 + "2" + "}" * 30
    res, dt = _timed(score_answer, "\\boxed{" + fracs + "}", "3", "math", timeout=2.0)
    assert res["score"] == 0.0
    parens = "\\left(" * 3000 + "1" + "\\right)" * 3000
    res, dt = _timed(score_answer, "\\boxed{" + parens[:9000] + "}", "1", "math", timeout=2.0)
    assert res["score"] == 0.0


PATHOLOGICAL_ANSWERS = {  # each ~10k characters: the in-process steps must stay linear
    "nested_braces": "{" * 4990 + "1" + "}" * 4990,
    "space_run": "1" + " " * 9990 + "x",
    "space_run_text": "1" + " " * 5000 + "\\text" * 800,
    "many_fracs": "\\frac{1}{2}" * 900,
    "bare_fracs": "\\frac" * 1990,
    "many_texts": "\\text{a}" * 1200,
    "many_equals": "x=" * 4990,
    "backslashes": "\\" * 9990,
    "many_sqrt": "\\sqrt" * 1990,
    "many_units": "5 cm" * 2000,
    "many_left": "\\left(" * 1600,
    "many_degrees": "^\\circ" * 1600,
    "digit_groups": "1,000" * 1990,
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL_ANSWERS))
def test_pathological_answers_are_linear(name):
    ans = PATHOLOGICAL_ANSWERS[name]
    res, dt = _timed(score_answer, "\\boxed{" + ans + "}", "5", "math", timeout=1.0)
    assert res["score"] == 0.0, (name, res["how"], dt)


def test_many_lookalike_commands_are_linear():
    res, dt = _timed(compute_score, MATH, "\\boxed{7}" + "\\boxedx" * 2_000_000, "7")
    assert res["score"] == 1.0
    res, dt = _timed(compute_score, MATH, "\\fboxy" * 2_000_000, "7")
    assert res == ZERO


def test_no_boxed_answer():
    assert compute_score(MATH, "The answer is 5.", "5") == ZERO
    assert compute_score(MATH, "\\boxed", "5") == ZERO
    assert compute_score(MATH, "\\boxed{   }", "5") == ZERO


@pytest.mark.parametrize("pred", ["1/0", "\\frac{1}{0}", "0^0", "\\infty - \\infty", "\\log(0)", "\\sqrt{-1}", "0/0"])
def test_undefined_values_score_zero(pool, pred):
    res, dt = _timed(compute_score, MATH, f"\\boxed{{{pred}}}", "5", timeout=2.0)
    assert res["score"] == 0.0 and res["pred"] == pred


def test_5000_digit_numbers(pool):
    n = "9" * 5000
    res, dt = _timed(score_answer, f"\\boxed{{{n}}}", n, "math")
    assert res["score"] == 1.0
    res, dt = _timed(score_answer, f"\\boxed{{{n}}}", "9" * 4999 + "8", "math")
    assert res["score"] == 0.0 and res["how"] == "number"
    res, dt = _timed(score_answer, f"\\boxed{{{n}}}", "5", "math")
    assert res["score"] == 0.0
    res, dt = _timed(score_answer, f"\\boxed{{0.{n}}}", "1", "math")
    assert res["score"] == 0.0 and res["how"] == "too_long"
    res, dt = _timed(score_answer, f"#### {n}", n, "gsm8k")
    assert res["score"] == 1.0
    res, dt = _timed(score_answer, f"\\boxed{{{n}^{{{n}}}}}", "5", "math")
    assert res["score"] == 0.0
    assert len(compute_score(MATH, f"\\boxed{{{n}}}", n)["pred"]) <= math_reward.PRED_REPORT_CHARS


@pytest.mark.parametrize(
    "solution, gold",
    [
        (None, "5"),
        (b"\\boxed{5}", "5"),
        (12345, "5"),
        ("\\boxed{\ud800}", "5"),  # lone surrogate
        ("\\boxed{5\x00}", "5"),
        ("\\boxed{5}", None),
        ("\\boxed{5}", 5),
        ("\\boxed{\\text{\\\\}}", "5"),
        ("\\boxed{\\begin{pmatrix}", "5"),
        ("\\boxed{\\frac{}{}}", "5"),
        ("\\boxed{%s}" % ("^" * 400), "5"),
    ],
)
def test_garbage_inputs_never_raise(pool, solution, gold):
    res, dt = _timed(compute_score, MATH, solution, gold, timeout=2.0)
    assert set(res) == {"score", "acc", "pred"} and res["score"] in (0.0, 1.0)
    if solution in (b"\\boxed{5}",) and gold == "5":
        assert res["score"] == 1.0
    if solution == "\\boxed{5}" and gold == 5:
        assert res["score"] == 1.0


def test_internal_error_is_contained(monkeypatch):
    """Planted fault: a bug inside scoring must give 0, not an exception in the trainer."""

    def boom(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(math_reward, "score_answer", boom)
    assert compute_score(MATH, "\\boxed{5}", "5") == ZERO


# ---------------------------------------------------------------------------------------------
# time limits: sympy hangs, uninterruptible hangs, crashes, threads


def test_sympy_hang_is_cut_at_the_limit(pool):
    """9^{9^{9^9}} makes sympy/math-verify run for hours; the soft SIGALRM stops it.

    The verdict says it was cut by the limit (``how == "timeout"``); how long that takes depends on the
    machine's load, so it is measured in bench/bench_reward.py (hang latency), not asserted here."""
    res = score_answer("\\boxed{9^{9^{9^{9}}}}", "5", "math", timeout=1.0)
    assert res["score"] == 0.0 and res["how"] == "timeout"
    res = compute_score(MATH, "\\boxed{10^{10^{10}}}", "5", timeout=1.0)
    assert res["score"] == 0.0
    # the worker survived and still answers correctly
    assert pool.verify("\\frac{\\sqrt3}{3}", "\\frac{1}{\\sqrt{3}}", timeout=30).equal


def test_verdict_cache_skips_repeats_but_not_timeouts(pool):
    calls = pool.stats.calls
    for _ in range(3):
        assert score_answer("\\boxed{\\frac{1}{\\sqrt{3}}}", "\\frac{\\sqrt3}{3}", "math")["score"] == 1.0
    assert pool.stats.calls == calls + 1
    for _ in range(2):
        assert score_answer("\\boxed{9^{9^{9^{9}}}}", "5", "math", timeout=0.5)["how"] == "timeout"
    assert pool.stats.calls == calls + 3


def test_uninterruptible_hang_is_killed(pool):
    """A hang that ignores SIGALRM (as in C code): the caller's hard deadline kills the worker."""
    before = pool.stats.timeouts_hard
    v, dt = _timed(pool.request, {"op": "hang", "seconds": 600}, 0.5)
    assert v.status == "timeout" and not v.equal
    assert pool.stats.timeouts_hard == before + 1 and pool.stats.workers_killed >= 1
    # the pool replaces the killed worker and keeps working
    v = pool.verify("\\frac{1}{2}", "0.5", timeout=30)
    assert v.status == "ok" and v.equal


def test_worker_crash_is_survived(pool):
    v = pool.request({"op": "crash"}, 5.0)
    assert v.status == "crash" and not v.equal
    v = pool.verify("x^2-1", "(x-1)(x+1)", timeout=30)
    assert v.status == "ok" and v.equal


def test_hard_deadline_is_what_stops_the_uninterruptible_hang(pool):
    """Planted-fault twin: with a long hard deadline the same hang really does block the caller."""
    v, dt = _timed(pool.request, {"op": "hang", "seconds": 2.0}, 10.0)
    assert v.status == "ok" and dt >= 1.9  # the soft alarm alone did not stop it


def test_threads_all_return_within_bound(pool):
    """verl calls the reward from executor threads; 6 concurrent hangs on 2 workers all return."""
    timeout = 1.0
    hang = "\\boxed{9^{9^{9^{9}}}}"
    good = "\\boxed{\\frac{1}{\\sqrt{3}}}"
    jobs = [(hang, "5")] * 6 + [(good, "\\frac{\\sqrt3}{3}")] * 2
    main_ident = threading.get_ident()

    def one(job):
        assert threading.get_ident() != main_ident
        t0 = time.monotonic()
        r = compute_score(MATH, job[0], job[1], timeout=timeout)
        return r["score"], time.monotonic() - t0

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, jobs))
    assert [s for s, _ in results] == [0.0] * 6 + [1.0] * 2  # every call returned (none hung); latency: bench/


def test_workers_unavailable_degrades_to_exact_matching(monkeypatch):
    """If no worker can start (broken env), scoring still answers: exact/normalised/number only."""
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    verifier.configure_pool(max_workers=1, start_timeout=5)
    try:
        res, dt = _timed(score_answer, "\\boxed{\\frac{1}{\\sqrt{3}}}", "\\frac{\\sqrt3}{3}", "math")
        assert res["score"] == 0.0 and res["how"] == "unavailable"
        assert score_answer("\\boxed{\\dfrac12}", "0.5", "math")["score"] == 1.0  # no sympy needed
        res, dt = _timed(score_answer, "\\boxed{x+1}", "1+x", "math")  # fails fast while broken
        assert res["how"] == "unavailable"
    finally:
        monkeypatch.undo()
        verifier.configure_pool()


def test_pool_rejects_bad_size():
    with pytest.raises(ValueError, match="max_workers"):
        verifier.VerifierPool(max_workers=0)
