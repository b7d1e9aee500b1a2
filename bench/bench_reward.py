"""Math reward throughput on one CPU core, and its rates on a MATH sample. One summary line.

    python bench/bench_reward.py [--input DIR] [--core 0] [--repeat 3] [--compare-verl] [--json OUT]

The process and its one math-verify worker are pinned to ``--core`` (children inherit the
affinity), so "scores/s" is single-core throughput. Cases per MATH row (see
dsv3_rl/reward/check.py): the reference solution (expect 1), its answer rewritten in an
equivalent form (expect 1), shifted (+1) and swapped with another row's answer (expect 0).
``mixed`` is all of them; ``symbolic`` is the subset that reached math-verify. ``hang`` is the
latency of adversarial calls that need the time limit (``--timeout``, default 1 s here).
Every pass starts cold: no cached verdicts, no cached gold parses in the worker
(``symbolic_gold_cached`` keeps the gold parses, as when a GRPO group shares one gold answer).
``--compare-verl`` adds verl 0.9.1's built-in MATH reward (Hendrycks string match) on the same cases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _throughput(cases, fn, repeat: int, clear=lambda: None) -> tuple[float, list]:
    best = float("inf")
    results = []
    for _ in range(repeat):
        clear()  # uncached numbers: every pass re-verifies
        t0 = time.perf_counter()
        results = [fn(c.pred, c.gold) for c in cases]
        best = min(best, time.perf_counter() - t0)
    return len(cases) / best if best > 0 else float("inf"), results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default=str(REPO / "examples/deepseek_v3/data/MATH-lighteval-sample"))
    ap.add_argument("--core", type=int, default=0, help="CPU core to pin to (-1: no pinning)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N passes")
    ap.add_argument("--timeout", type=float, default=1.0, help="per-call limit for the hang cases")
    ap.add_argument("--compare-verl", action="store_true", help="also time verl's built-in MATH reward")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args(argv)

    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    sys.path.insert(0, str(REPO))
    from dsv3_rl.reward import check, verifier
    from dsv3_rl.reward.math_reward import clear_verdict_cache, score_answer

    pool = verifier.configure_pool(max_workers=1)
    assert pool.verify("1", "1", timeout=60).equal  # start-up is not part of the timing

    cases = check.build_cases(check.load_rows(args.input))
    rep = check.run_cases(cases, lambda s, g, kind: score_answer(s, g, kind))  # warm pass + rates

    def score(s, g):
        return score_answer(s, g, "math")

    def cold():  # empty verdict cache in this process and parsed-gold cache in the worker
        clear_verdict_cache()
        assert pool.request({"op": "clear_cache"}, 10.0).status == "ok"

    out: dict = {
        "input": args.input,
        "cases": len(cases),
        "rates": {k: rep.rate(k) for k in rep.n},
        "misses": rep.misses,
    }
    groups = {
        "reference": [c for c in cases if c.kind == "reference"],
        "rewritten": [c for c in cases if c.kind == "rewritten"],
        "wrong": [c for c in cases if c.kind in ("shifted", "swapped")],
        "mixed": cases,
    }
    tput = {}
    for name, cs in groups.items():
        tput[name], res = _throughput(cs, score, args.repeat, cold)
        if name == "mixed":
            sym = [c for c, r in zip(cs, res, strict=True) if r["how"] == "math_verify"]
            out["symbolic_share"] = len(sym) / len(cs)
            tput["symbolic"], _ = _throughput(sym, score, args.repeat, cold)
            # as in GRPO, where a group's responses share one gold: gold parses cached
            tput["symbolic_gold_cached"], _ = _throughput(sym, score, args.repeat, clear_verdict_cache)
    out["scores_per_s"] = tput

    hangs = ["9^{9^{9^{9}}}", "10^{10^{10}}", "2^{2^{2^{2^{2^{2}}}}}"]
    lat = []
    for h in hangs:
        t0 = time.perf_counter()
        r = score_answer(f"\\boxed{{{h}}}", "5", "math", timeout=args.timeout)
        lat.append(time.perf_counter() - t0)
        assert r["score"] == 0.0
    out["hang_latency_s"] = {"timeout": args.timeout, "max": max(lat), "median": statistics.median(lat)}
    out["pool_stats"] = vars(pool.stats)

    verl_part = ""
    if args.compare_verl:
        from verl.utils.reward_score import math_reward as verl_math

        vrep = check.run_cases(cases, lambda s, g, kind: {"score": float(verl_math.compute_score(s, g))})
        vt, _ = _throughput(cases, lambda s, g: verl_math.compute_score(s, g), args.repeat)
        out["verl_math_reward"] = {"rates": {k: vrep.rate(k) for k in vrep.n}, "scores_per_s": vt}
        verl_part = (
            f" | verl math_reward: rewritten={100 * vrep.rate('rewritten'):.1f}% "
            f"shifted={100 * vrep.rate('shifted'):.1f}% {vt:,.0f}/s"
        )

    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    r = out["rates"]
    print(
        f"reward bench ({len(cases)} cases, core {args.core}): reference={100 * r['reference']:.1f}% "
        f"rewritten={100 * r.get('rewritten', 0):.1f}% shifted={100 * r['shifted']:.1f}% "
        f"swapped={100 * r.get('swapped', 0):.1f}% as expected, misses={len(rep.misses)}; scores/s "
        f"reference={tput['reference']:,.0f} wrong={tput['wrong']:,.0f} mixed={tput['mixed']:,.0f} "
        f"symbolic={tput['symbolic']:,.0f} ({100 * out['symbolic_share']:.0f}% of mixed; "
        f"{tput['symbolic_gold_cached']:,.0f} with gold parses cached); "
        f"hang max {out['hang_latency_s']['max']:.2f}s at timeout {args.timeout:g}s{verl_part}"
    )
    return 0 if not rep.misses else 1


if __name__ == "__main__":
    sys.exit(main())
