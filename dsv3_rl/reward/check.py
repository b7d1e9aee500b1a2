"""Self-consistency check of the math reward on reference solutions (``dsv3-reward-check``).

For every MATH row: the reference solution must score 1 ("reference"); the same solution with
its last boxed answer changed must score 0 ("shifted": a number + 1, anything else ``+1``
appended; "swapped": another row's answer whose normalised form differs). Rates and every miss
are reported; a miss names the row, the answers and the step that decided (``how``). GSM8K rows
(raw ``question``/``answer`` files or our RL parquet with ``data_source`` openai/gsm8k) are checked
the same way on their ``#### N`` line, scored as GSM8K.

    python -m dsv3_rl.reward.check --input DIR_OR_PARQUET [--limit N] [--json OUT] [--strict]

``--input`` is a raw MATH-lighteval or GSM8K directory/parquet (columns problem, solution /
question, answer) or our RL parquet (``reward_model.ground_truth`` + ``extra_info.solution``). ``--strict`` exits 1 unless
reference = 100 % and shifted = 0 %.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from dsv3_rl.reward.answer import _INT, _match_braced, gsm8k_hash_answer, last_boxed_answer, normalize_answer
from dsv3_rl.cliargs import UsageError
from dsv3_rl.errors import cli_main


def replace_last_boxed(solution: str, new_answer: str) -> str:
    """``solution`` with the content of its last ``\\boxed{}``/``\\fbox{}`` replaced."""
    start = max(solution.rfind("\\boxed"), solution.rfind("\\fbox"))
    if start < 0:
        raise ValueError("solution has no \\boxed{} / \\fbox{}")
    open_idx = solution.find("{", start)
    close = _match_braced(solution, open_idx, len(solution)) if open_idx >= 0 else None
    if close is None:
        raise ValueError("last \\boxed{} in solution is unbalanced")
    return solution[: open_idx + 1] + new_answer + solution[close:]


def shift_answer(answer: str) -> str:
    """An answer that is certainly not equivalent: numbers + 1, anything else with ``+1`` appended."""
    n = normalize_answer(answer)
    if _INT.match(n) and len(n) < 50:
        return str(int(n) + 1)
    try:
        if len(n) < 50 and n.replace(".", "", 1).lstrip("-").isdigit():
            return str(Decimal(n) + 1)
    except InvalidOperation:
        pass
    return answer + "+1"


_FRAC_INTS = re.compile(r"^(-?)\\d?frac\{(\d+)\}\{(\d+)\}$")
_TEXT = re.compile(r"\\(?:text|mbox)\{\s*([^{}]*?)\s*\}")


def rewrite_answer(answer: str) -> str | None:
    """The same answer written differently (value-preserving), or None if no rule applies.

    Rules, all applied: a whole answer ``\\frac{a}{b}`` -> ``a/b`` (integer a, b); ``\\dfrac`` ->
    ``\\frac``; ``^\\circ`` dropped; ``\\text{X}`` -> ``X``; ``\\sqrt{d}`` -> ``\\sqrt d`` (one digit);
    a space after each comma (outside ``\\begin``, not in ``58,500``); a bare list ``a, b, c``
    reversed; ``N\\pi`` -> ``N \\cdot \\pi``; a plain integer N -> ``N.0``; ``\\left``/``\\right`` dropped.
    """
    s = answer
    s = _FRAC_INTS.sub(lambda m: f"{m.group(1)}{m.group(2)}/{m.group(3)}", s.strip())
    s = s.replace("\\dfrac", "\\frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = _TEXT.sub(lambda m: " " + m.group(1), s).strip()  # keep "15 cm^2" apart: "15cm^2" is 15*c*m^2
    s = re.sub(r"\\sqrt\{(\d)\}", r"\\sqrt \1", s)  # one digit only: TeX reads "\\sqrt 51" as sqrt(5)*1
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    if "\\begin" not in s and "," in normalize_answer(answer):  # not "58,500" (one number)
        s = re.sub(r",\s*", ", ", s)
        if "," in s and not re.search(r"[()\[\]{}=]", s):  # a bare list of solutions is a set
            s = ", ".join(reversed(s.split(", ")))
    s = re.sub(r"^(\d+)\s*\\pi$", r"\1 \\cdot \\pi", s)
    if _INT.match(s.strip()):
        s = s.strip() + ".0"
    return s if s != answer else None


def replace_hash_answer(solution: str, new_answer: str) -> str:
    """GSM8K: ``solution`` with the number after its last ``####`` replaced."""
    pos = solution.rfind("####")
    if pos < 0:
        raise ValueError("solution has no #### line")
    line_end = solution.find("\n", pos)
    return solution[:pos] + f"#### {new_answer}" + (solution[line_end:] if line_end >= 0 else "")


@dataclass
class Case:
    row: str  # "split:index"
    kind: str  # reference | shifted | swapped
    gold: str
    pred: str
    expect: float
    solution: str
    source: str = "math"  # the reward's dataset kind: math | gsm8k


@dataclass
class RateReport:
    n: dict = field(default_factory=dict)
    hits: dict = field(default_factory=dict)
    misses: list = field(default_factory=list)
    seconds: float = 0.0

    def rate(self, kind: str) -> float:
        return self.hits.get(kind, 0) / max(1, self.n.get(kind, 0))

    def summary(self) -> str:
        parts = []
        for kind in ("reference", "rewritten", "shifted", "swapped"):
            if kind in self.n:
                # reference/rewritten expect 1, shifted/swapped expect 0
                parts.append(f"{kind}={self.hits[kind]}/{self.n[kind]} ({100 * self.rate(kind):.1f}% as expected)")
        total = sum(self.n.values())
        rate = total / max(self.seconds, 1e-9)
        return f"reward check: {', '.join(parts)}; {total} scores in {self.seconds:.1f}s ({rate:.0f}/s)"


def build_cases(
    rows: Sequence[tuple[str, str]], seed: int = 0, swapped: bool = True, rewrite: bool = True
) -> list[Case]:
    """rows: (row id, reference solution[, source]); source ``math`` (default; rows without a boxed
    answer are skipped) or ``gsm8k`` (the ``#### N`` answer; rows without one are skipped)."""
    answers = []
    for row in rows:
        rid, sol, src = (*row, "math") if len(row) == 2 else row
        gold = gsm8k_hash_answer(sol) if src == "gsm8k" else last_boxed_answer(sol)
        if gold is not None:
            answers.append((rid, sol, gold, src))
    rng = random.Random(seed)
    cases: list[Case] = []
    for rid, sol, gold, src in answers:
        put = replace_hash_answer if src == "gsm8k" else replace_last_boxed
        cases.append(Case(rid, "reference", gold, sol, 1.0, sol, src))
        cases.append(Case(rid, "shifted", gold, put(sol, shift_answer(gold)), 0.0, sol, src))
        rewritten = rewrite_answer(gold) if rewrite and src == "math" else None
        if rewritten is not None:
            cases.append(Case(rid, "rewritten", gold, put(sol, rewritten), 1.0, sol, src))
        if swapped and len(answers) > 1:
            for _ in range(20):
                other = answers[rng.randrange(len(answers))]
                if other[3] == src and normalize_answer(other[2]) != normalize_answer(gold):
                    cases.append(Case(rid, "swapped", gold, put(sol, other[2]), 0.0, sol, src))
                    break
    return cases


def run_cases(cases: Sequence[Case], score: Callable[[str, str, str], dict]) -> RateReport:
    """``score(solution_str, ground_truth, kind) -> {"score", "pred", "how"?}``; kind is the case's
    source, ``math`` or ``gsm8k`` (``math_reward.score_answer``'s kinds)."""
    rep = RateReport()
    t0 = time.monotonic()
    for c in cases:
        res = score(c.pred, c.gold, c.source)
        rep.n[c.kind] = rep.n.get(c.kind, 0) + 1
        ok = float(res["score"]) == c.expect
        rep.hits[c.kind] = rep.hits.get(c.kind, 0) + int(ok)
        if not ok:
            rep.misses.append(
                {
                    "row": c.row,
                    "kind": c.kind,
                    "gold": c.gold,
                    "pred": res.get("pred", ""),
                    "score": res["score"],
                    "how": res.get("how", ""),
                }
            )
    rep.seconds = time.monotonic() - t0
    return rep


def load_rows(path: str | Path) -> list[tuple[str, str, str]]:
    """(row id, solution, source) from a raw MATH-lighteval / GSM8K dir or parquet, or one of our RL
    parquet files; source is ``gsm8k`` for GSM8K rows, else ``math``."""
    import pandas as pd

    from dsv3_rl.reward.math_reward import dataset_kind

    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.parquet")) + sorted(p.glob("data/*.parquet")) + sorted(
        p.glob("main/*.parquet"))
    if not files:
        raise FileNotFoundError(f"no parquet files at {p} (looked in {p}, {p}/data and {p}/main)")
    rows = []
    for f in files:
        df = pd.read_parquet(f)
        split = f.name.split("-")[0].split(".")[0]
        if "solution" in df.columns:
            sols, srcs = df["solution"].tolist(), ["math"] * len(df)
        elif {"question", "answer"} <= set(df.columns):  # raw GSM8K
            sols, srcs = df["answer"].tolist(), ["gsm8k"] * len(df)
        elif "extra_info" in df.columns:
            sols = [ei.get("solution") for ei in df["extra_info"]]
            try:  # the reward's own data_source routing
                srcs = [dataset_kind(d) for d in df["data_source"]] if "data_source" in df.columns else ["math"] * len(df)
            except ValueError as e:
                raise ValueError(f"{f}: {e}") from None
        else:
            raise ValueError(f"{f}: neither a 'solution' column (MATH), 'question'/'answer' (GSM8K) nor "
                             f"extra_info.solution; columns: {list(df.columns)}")
        rows += [(f"{split}:{i}", s, src) for i, (s, src) in enumerate(zip(sols, srcs)) if isinstance(s, str)]
    return rows


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dsv3-reward-check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--input", required=True, help="MATH-lighteval dir / parquet, or our RL parquet")
    ap.add_argument("--limit", type=int, default=0, help="use the first N rows (0 = all)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the 'swapped' pairing")
    ap.add_argument("--timeout", type=float, default=5.0, help="per-call math-verify limit, seconds")
    ap.add_argument("--json", default=None, help="write the full report (rates + misses) here")
    ap.add_argument("--strict", action="store_true", help="exit 1 unless reference=100%% and shifted=0%%")
    args = ap.parse_args(argv)
    if args.limit < 0:
        ap.error(f"--limit {args.limit}: expected a number of rows >= 0 (0 = all)")
    if args.timeout <= 0:
        ap.error(f"--timeout {args.timeout}: expected seconds > 0")

    from dsv3_rl.reward.math_reward import score_answer

    rows = load_rows(args.input)
    if args.limit > 0:
        rows = rows[: args.limit]
    cases = build_cases(rows, seed=args.seed)
    if not cases:
        raise UsageError(f"{args.input}: none of {len(rows)} rows has a reference answer to check "
                         f"(MATH: a \\boxed{{}} in the solution; GSM8K: a '#### N' line)")
    rep = run_cases(cases, lambda s, g, kind: score_answer(s, g, kind, timeout=args.timeout))
    for m in rep.misses:
        print(f"MISS {m['row']} {m['kind']}: gold={m['gold']!r} pred={m['pred']!r} score={m['score']} how={m['how']}")
    print(rep.summary())
    if args.json:
        from dsv3_rl.fs import write_text_atomic

        write_text_atomic(Path(args.json), json.dumps(asdict(rep), indent=1))
    if args.strict and (rep.rate("reference") < 1.0 or rep.rate("shifted") < 1.0):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
