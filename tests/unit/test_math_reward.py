"""Math reward (issue #6): extraction, normalisation, equivalence, verl integration, rates.

Adversarial inputs and the time limit are in test_math_reward_adversarial.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from dsv3_rl.reward import check
from dsv3_rl.reward.answer import (
    compare_numbers,
    gsm8k_hash_answer,
    last_boxed_answer,
    last_number,
    normalize_answer,
)
from dsv3_rl.reward.math_reward import ALLOWED_DATA_SOURCES, compute_score, score_answer

REPO = Path(__file__).resolve().parents[2]
REWARD_FILE = REPO / "toolkits" / "reward" / "math_reward.py"
MATH_MINI = REPO / "tests" / "assets" / "math_lighteval_mini"
DEMO_MATH = REPO / "examples" / "deepseek_v3" / "data" / "MATH-lighteval-sample"
MATH = "DigitalLearningGmbH/MATH-lighteval"
GSM = "openai/gsm8k"


# ---------------------------------------------------------------------------------------------
# extraction


@pytest.mark.parametrize(
    "text, want",
    [
        ("so the answer is $\\boxed{5}$.", "5"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} and finally \\fbox{4}", "4"),
        ("$\\boxed 42$ done", "42"),
        ("\\boxed {8}", "8"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{\\left\\{ 3 \\right.}", "\\left\\{ 3 \\right."),
        ("\\boxed{a}\\boxedtext", "a"),  # \boxedtext is not \boxed
        ("\\boxed{}", None),
        ("\\boxed{1} ... \\boxed{2", None),  # last box unbalanced: no fallback to an earlier one
        ("no box here, 5", None),
        ("", None),
    ],
)
def test_last_boxed_answer(text, want):
    assert last_boxed_answer(text) == want


def test_gsm8k_fallback_extractors():
    assert gsm8k_hash_answer("blah\n#### 1,234") == "1234"
    assert gsm8k_hash_answer("#### $18.50.") == "18.50"
    assert gsm8k_hash_answer("#### -3") == "-3"
    assert gsm8k_hash_answer("#### none") is None
    assert last_number("It costs 3 then 4,500 dollars.") == "4500"
    assert last_number("nothing") is None


# ---------------------------------------------------------------------------------------------
# normalisation (MATH's standard steps) and exact numbers


@pytest.mark.parametrize(
    "a, b",
    [
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("10,\\!000", "10000"),
        ("\\$32,\\!348", "32348"),
        ("30^\\circ", "30"),
        ("30^{\\circ}", "30"),
        ("\\dfrac{3}{4}", "\\frac34"),
        ("\\tfrac{3}{4}", "\\frac{3}{4}"),
        ("864 \\mbox{ inches}^2", "864"),
        ("15\\text{ cm}^2", "15"),
        ("5.4 \\text{ cents}", "5.4"),
        ("12 square units", "12"),
        ("\\text{Navin}", "Navin"),
        ("x = 5", "5"),
        ("x \\in [-2,7]", "[-2,7]"),
        ("\\frac 59", "\\frac{5}{9}"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("5.", "5"),
        (".35625", "0.35625"),
        ("50\\%", "50"),
        ("3/4", "\\frac{3}{4}"),
        ("{7}", "7"),
        ("1\\,000", "1000"),
    ],
)
def test_normalize_equal(a, b):
    assert normalize_answer(a) == normalize_answer(b)


@pytest.mark.parametrize(
    "a, b",
    [
        ("\\sqrt 51", "\\sqrt{51}"),  # TeX reads \sqrt 51 as sqrt(5)*1
        ("1,2", "12"),  # a list, not a thousands separator
        ("(3,4]", "(3,4)"),
        ("15cm", "15"),  # no space: could be 15*c*m
        ("\\text{(C)}", "\\text{(D)}"),
        ("x+y=5", "5"),  # not a single-variable "x = ..."
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\ 2 \\end{pmatrix}"),
    ],
)
def test_normalize_keeps_different_answers_apart(a, b):
    assert normalize_answer(a) != normalize_answer(b)


@pytest.mark.parametrize(
    "gold, pred, want",
    [
        ("5", "5.0", True),
        ("5", "005", True),
        ("-0", "0", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1.25", "1.250", True),
        ("5", "6", False),
        ("0.15", "0.16", False),
        ("\\frac{1}{3}", "0.333333", None),  # 6+ decimals: math-verify's rounding decides
        ("9" * 5000, "9" * 5000, True),  # no int() conversion (4300-digit limit)
        ("9" * 5000, "9" * 4999 + "8", False),
        ("x", "5", None),
    ],
)
def test_compare_numbers(gold, pred, want):
    assert compare_numbers(normalize_answer(gold), normalize_answer(pred)) is want


# ---------------------------------------------------------------------------------------------
# scoring


@pytest.mark.parametrize(
    "gold, pred, correct",
    [
        ("15x - 80", "15x-80", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}", True),  # needs sympy
        ("1,-2", "-2, 1", True),  # solution sets
        ("\\{1\\pm\\sqrt{5},-2\\}", "-2, 1+\\sqrt5, 1-\\sqrt5", True),
        ("(2,\\infty)", "(2, \\infty)", True),
        ("(3,4]", "(3,4)", False),
        ("\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", "\\begin{pmatrix} 0.2 \\\\ -3.6 \\end{pmatrix}", True),
        ("137 \\frac{1}{2}", "137.5", True),
        ("x^3+3x-6", "-6+3x+x^3", True),
        ("x^3+3x-6", "x^3+3x+6", False),
        ("2 \\sqrt{5}", "\\sqrt{20}", True),
        ("\\text{even}", "\\text{odd}", False),
        ("30^\\circ", "30", True),
        ("15x - 80", "15x - 81", False),
    ],
)
def test_math_equivalence(gold, pred, correct):
    res = compute_score(MATH, f"Reasoning... so the answer is $\\boxed{{{pred}}}$.", gold)
    assert res == {"score": float(correct), "acc": float(correct), "pred": pred}


def test_gsm8k_scoring_and_options():
    assert compute_score(GSM, "... \\boxed{1,234}", "1234")["score"] == 1.0
    assert compute_score(GSM, "... \\boxed{\\$18.00}", "18")["score"] == 1.0
    assert compute_score(GSM, "... \\boxed{18 dollars}", "18")["score"] == 1.0
    assert compute_score(GSM, "so\n#### 72", "72")["score"] == 1.0  # GSM8K's own format
    assert compute_score(GSM, "so\n#### 71", "72")["score"] == 0.0
    # the last number only counts when asked for
    assert compute_score(GSM, "The answer is 72.", "72")["score"] == 0.0
    assert compute_score(GSM, "The answer is 72.", "72", gsm8k_last_number=True)["score"] == 1.0
    # a boxed answer wins over #### and over the last number
    assert compute_score(GSM, "\\boxed{5} #### 72", "72", gsm8k_last_number=True) == {
        "score": 0.0,
        "acc": 0.0,
        "pred": "5",
    }
    # gold stored as a full GSM8K answer is tolerated
    assert compute_score(GSM, "\\boxed{374}", "300-36+110=374 miles\n#### 374")["score"] == 1.0
    # MATH ignores #### (the prompt asks for \boxed{})
    assert compute_score(MATH, "#### 72", "72")["score"] == 0.0


def test_format_score_option_off_by_default():
    wrong, none = "\\boxed{6}", "I think 6"
    assert compute_score(MATH, wrong, "5") == {"score": 0.0, "acc": 0.0, "pred": "6"}
    assert compute_score(MATH, wrong, "5", format_score=0.1) == {"score": 0.1, "acc": 0.0, "pred": "6"}
    assert compute_score(MATH, none, "5", format_score=0.1) == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert compute_score(MATH, "\\boxed{5}", "5", format_score=0.1)["score"] == 1.0


def test_multiple_ground_truths():
    assert compute_score(MATH, "\\boxed{4}", ["3", "4"])["score"] == 1.0
    assert compute_score(MATH, "\\boxed{4}", np.array(["3", "5"], dtype=object))["score"] == 0.0


def test_return_contract_is_uniform():
    """verl builds reward_extra_info from the first sample's keys: every outcome has the same ones."""
    outs = [
        compute_score(MATH, "\\boxed{5}", "5"),
        compute_score(MATH, "\\boxed{6}", "5"),
        compute_score(MATH, "nothing", "5"),
        compute_score(GSM, "#### 5", "5"),
        compute_score(MATH, None, None),
    ]
    for o in outs:
        assert set(o) == {"score", "acc", "pred"}
        assert type(o["score"]) is float and type(o["acc"]) is float and isinstance(o["pred"], str)


def test_configuration_errors_raise():
    with pytest.raises(TypeError, match="format_scor"):
        compute_score(MATH, "\\boxed{5}", "5", format_scor=0.1)
    with pytest.raises(ValueError, match="unknown data_source 'codecontests'.*allowed: .*openai/gsm8k"):
        compute_score("codecontests", "\\boxed{5}", "5")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        compute_score(MATH, "\\boxed{5}", "5", timeout=0)
    assert "DigitalLearningGmbH/MATH-lighteval" in ALLOWED_DATA_SOURCES
    # kwargs verl's reward loop may add are accepted
    assert (
        compute_score(MATH, "\\boxed{5}", "5", reward_router_address=None, reward_model_tokenizer=None)["score"] == 1.0
    )


# ---------------------------------------------------------------------------------------------
# verl integration: loaded and called exactly as verl 0.9.1 does


def test_loads_through_verl_loader_by_path():
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path=str(REWARD_FILE), object_name="compute_score")
    assert fn(data_source=MATH, solution_str="\\boxed{\\dfrac{1}{2}}", ground_truth="0.5", extra_info={"index": 0}) == {
        "score": 1.0,
        "acc": 1.0,
        "pred": "\\dfrac{1}{2}",
    }


def test_get_custom_reward_fn_with_reward_kwargs():
    from omegaconf import OmegaConf

    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": str(REWARD_FILE),
                    "name": "compute_score",
                    "reward_kwargs": {"format_score": 0.25, "timeout": 3.0},
                }
            }
        }
    )
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source=MATH, solution_str="\\boxed{7}", ground_truth="8", extra_info={})["score"] == 0.25
    assert fn(data_source=GSM, solution_str="#### 8", ground_truth="8", extra_info={})["score"] == 1.0


class _CharTokenizer:
    """Decodes ids as unicode code points: enough for NaiveRewardManager.run_single."""

    def decode(self, ids, skip_special_tokens=True):  # noqa: ARG002
        return "".join(chr(int(i)) for i in ids if int(i) > 0)


def _reward_batch(response: str, gold: str, data_source: str, prompt_len: int = 4, resp_len: int = 64):
    import torch

    from verl import DataProto

    ids = [ord(c) for c in response][:resp_len]
    responses = torch.zeros((1, resp_len), dtype=torch.long)
    responses[0, : len(ids)] = torch.tensor(ids)
    attn = torch.zeros((1, prompt_len + resp_len), dtype=torch.long)
    attn[0, : prompt_len + len(ids)] = 1
    return DataProto.from_dict(
        tensors={
            "prompts": torch.ones((1, prompt_len), dtype=torch.long),
            "responses": responses,
            "attention_mask": attn,
        },
        non_tensors={
            "data_source": np.array([data_source], dtype=object),
            "reward_model": np.array([{"style": "rule", "ground_truth": gold}], dtype=object),
            "extra_info": np.array([{"index": 0, "split": "test"}], dtype=object),
        },
    )


def test_verl_naive_reward_manager_end_to_end():
    """verl's NaiveRewardManager calls the loaded function from an executor thread."""
    from omegaconf import OmegaConf

    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(REWARD_FILE), "name": "compute_score"}}})
    fn = get_custom_reward_fn(cfg)

    async def run():
        mgr = NaiveRewardManager(config=cfg, tokenizer=_CharTokenizer(), compute_score=fn)
        good = await mgr.run_single(_reward_batch("so $\\boxed{\\frac{\\sqrt3}{3}}$", "\\frac{1}{\\sqrt{3}}", MATH))
        bad = await mgr.run_single(_reward_batch("so $\\boxed{2}$", "3", MATH))
        gsm = await mgr.run_single(_reward_batch("#### 1,000", "1000", GSM))
        return good, bad, gsm

    good, bad, gsm = asyncio.run(run())
    assert good["reward_score"] == 1.0 and good["reward_extra_info"]["acc"] == 1.0
    assert good["reward_extra_info"]["pred"] == "\\frac{\\sqrt3}{3}"
    assert bad["reward_score"] == 0.0 and bad["reward_extra_info"]["acc"] == 0.0
    assert gsm["reward_score"] == 1.0


def test_math_verify_own_timeout_fails_in_threads():
    """Why the worker pool exists: math-verify's signal timeouts refuse to run off the main thread."""
    from concurrent.futures import ThreadPoolExecutor

    from math_verify import parse

    with ThreadPoolExecutor(1) as ex:
        with pytest.raises(ValueError, match="threaded"):
            ex.submit(parse, "$\\frac12$").result()
    # ... while ours works from the same kind of thread
    with ThreadPoolExecutor(1) as ex:
        assert (
            ex.submit(compute_score, MATH, "\\boxed{\\frac{1}{\\sqrt{3}}}", "\\frac{\\sqrt3}{3}").result()["score"]
            == 1.0
        )


# ---------------------------------------------------------------------------------------------
# rates on the shipped samples: reference solutions score 1, changed answers score 0


def _rates(path: Path) -> check.RateReport:
    cases = check.build_cases(check.load_rows(path))
    return check.run_cases(cases, lambda s, g, kind: score_answer(s, g, kind))


def _assert_perfect(rep: check.RateReport) -> None:
    assert rep.misses == [], rep.misses
    for kind in ("reference", "rewritten", "shifted", "swapped"):
        assert rep.n[kind] > 0 and rep.rate(kind) == 1.0, (kind, rep.summary())


def test_rates_on_fixture_sample():
    rep = _rates(MATH_MINI)
    assert rep.n["reference"] == 42
    _assert_perfect(rep)


@pytest.mark.parametrize(
    "planted, kind",
    [
        (lambda s, g, kind: {"score": 1.0}, "shifted"),  # a reward that always says yes
        (lambda s, g, kind: {"score": float(last_boxed_answer(s) == g)}, "rewritten"),  # raw string match
        (
            lambda s, g, kind: {"score": float(normalize_answer(last_boxed_answer(s) or "")[:1] == normalize_answer(g)[:1])},
            "swapped",
        ),  # first-character match
    ],
)
def test_rate_check_catches_planted_faults(planted, kind):
    cases = check.build_cases(check.load_rows(MATH_MINI))
    rep = check.run_cases(cases, planted)
    assert rep.rate(kind) < 1.0, rep.summary()


def test_rates_on_in_repo_demo_sample():
    """250 rows (examples/deepseek_v3/data), always present: every case as expected."""
    rep = _rates(DEMO_MATH)
    assert rep.n["reference"] == 250
    _assert_perfect(rep)


def test_rates_on_full_shared_math_sample(shared_data):
    rep = _rates(shared_data / "MATH-lighteval-sample")
    assert rep.n["reference"] == 400
    _assert_perfect(rep)


def test_check_cli_strict(tmp_path, capsys):
    out = tmp_path / "rep.json"
    assert check.main(["--input", str(MATH_MINI), "--strict", "--json", str(out)]) == 0
    assert "reference=42/42" in capsys.readouterr().out
    assert '"misses": []' in out.read_text()


# GSM8K: the same rates on the '#### N' answer, scored as GSM8K ------------------------------------

DEMO_GSM8K = REPO / "examples" / "deepseek_v3" / "data" / "gsm8k-sample"


def _gsm8k_rates(path: Path, score=None) -> check.RateReport:
    cases = check.build_cases(check.load_rows(path))
    assert cases and {c.source for c in cases} == {"gsm8k"}
    return check.run_cases(cases, score or (lambda s, g, kind: score_answer(s, g, kind)))


def test_gsm8k_rates_on_samples():
    for path, n in ((REPO / "tests" / "assets" / "gsm8k_mini", 30), (DEMO_GSM8K, 250)):
        rep = _gsm8k_rates(path)
        assert rep.n["reference"] == n and rep.misses == [], rep.summary()
        assert rep.rate("reference") == rep.rate("shifted") == rep.rate("swapped") == 1.0, rep.summary()


def test_gsm8k_rates_catch_planted_faults():
    """Twins: a reward that always says yes fails 'shifted'; scoring GSM8K as MATH (no boxed answer in
    a GSM8K reference, so every reference scores 0) fails 'reference'."""
    yes = _gsm8k_rates(DEMO_GSM8K, lambda s, g, kind: {"score": 1.0})
    assert yes.rate("shifted") == 0.0
    as_math = _gsm8k_rates(DEMO_GSM8K, lambda s, g, kind: score_answer(s, g, "math"))
    assert as_math.rate("reference") == 0.0


def test_gsm8k_rl_parquet_rows_are_gsm8k(tmp_path):
    """Our RL parquet of GSM8K: rows are recognised by data_source and checked on '#### N'."""
    from dsv3_rl.data import gsm8k

    assert gsm8k.main(["--input-dir", str(DEMO_GSM8K), "--out", str(tmp_path)]) == 0
    rows = check.load_rows(tmp_path / "test.parquet")
    assert len(rows) == 50 and {r[2] for r in rows} == {"gsm8k"}
    assert check.main(["--input", str(tmp_path / "test.parquet"), "--strict"]) == 0


def test_check_cli_refuses_input_without_answers(tmp_path, capsys):
    import pandas as pd

    pd.DataFrame({"problem": ["p"], "solution": ["no boxed answer here"]}).to_parquet(tmp_path / "x.parquet")
    assert check.main(["--input", str(tmp_path / "x.parquet")]) == 2
    assert "none of 1 rows has a reference answer" in capsys.readouterr().err


def test_check_rl_parquet_with_unknown_data_source_names_the_file(tmp_path):
    import pandas as pd

    f = tmp_path / "train.parquet"
    pd.DataFrame({"data_source": ["my/dataset"], "extra_info": [{"solution": "\\boxed{1}"}]}).to_parquet(f)
    with pytest.raises(ValueError, match=r"train\.parquet: .*unknown data_source 'my/dataset'"):
        check.load_rows(f)
