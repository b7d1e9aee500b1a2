"""Data preparation (issue #6): MATH-lighteval and GSM8K -> verl RL parquet.

Fixtures: tests/assets/{math_lighteval_mini,gsm8k_mini} (rows copied from the full samples);
the in-repo demo sample examples/deepseek_v3/data/MATH-lighteval-sample; the full samples
themselves (not in the repo; the ``shared_data`` fixture of tests/conftest.py finds them, or the test fails).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv3_rl.data import common, gsm8k, math_lighteval
from dsv3_rl.data.common import DataPrepError, validate_rl_parquet
from dsv3_rl.reward.answer import last_boxed_answer

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "tests" / "assets"
MATH_MINI = ASSETS / "math_lighteval_mini"
GSM8K_MINI = ASSETS / "gsm8k_mini"
DEMO_MATH = REPO / "examples" / "deepseek_v3" / "data" / "MATH-lighteval-sample"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with a chat template, built offline from the fixture text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for f in sorted(MATH_MINI.rglob("*.parquet")):
        t = pq.read_table(f).to_pydict()
        texts += t["problem"] + t["solution"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    fast.save_pretrained(out)
    return out


def _prep(mod, *args: str) -> int:
    return mod.main([str(a) for a in args])


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _verl_dataset(files, tokenizer_dir: Path, tmp_path: Path, max_prompt_length: int = 4096):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = OmegaConf.create(
        {
            "max_prompt_length": max_prompt_length,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 1,
            "cache_dir": str(tmp_path / "verl_cache"),
            "truncation": "error",
        }
    )
    return RLHFDataset(data_files=[str(f) for f in files], tokenizer=tok, config=cfg)


def _copy_math(tmp_path: Path) -> Path:
    dst = tmp_path / "MATH-lighteval"
    shutil.copytree(MATH_MINI, dst)
    return dst


def _write_raw(path: Path, rows: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)


# Hand-checked ground truths for fixture rows with awkward answers (train split, fixture order).
EXPECTED_MATH_GT = {
    0: "15x - 80",
    3: "x \\in [-2,7]",
    7: "864 \\mbox{ inches}^2",
    9: "143",  # two boxed answers in the solution: the last one counts
    29: "\\frac{2}{3}",  # ditto
    14: "\\frac{270}7\\text{ degrees}",
    18: "\\left( 3, \\frac{\\pi}{2} \\right)",
    21: "\\{1\\pm\\sqrt{5},-2\\}",  # escaped braces inside
    22: "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}",
    24: "\\$32,\\!348",
    26: "\\frac 59",
}


def _check_math_ground_truths(rows: list[dict]) -> list[str]:
    errs = []
    for i, want in EXPECTED_MATH_GT.items():
        got = rows[i]["reward_model"]["ground_truth"]
        if got != want:
            errs.append(f"row {i}: got {got!r}, want {want!r}")
    return errs


# ---------------------------------------------------------------------------------------------
# conversion of the shipped samples


def test_math_fixture_converts_to_verl_schema(tmp_path):
    out = tmp_path / "out"
    assert _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", out) == 0
    assert validate_rl_parquet(out / "train.parquet", math_lighteval.DATA_SOURCE) == 30
    assert validate_rl_parquet(out / "test.parquet", math_lighteval.DATA_SOURCE) == 12
    rows = _rows(out / "train.parquet")
    src = pq.read_table(MATH_MINI / "data" / "train-00000-of-00001.parquet").to_pylist()
    r = rows[0]
    assert r["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert r["ability"] == "math"
    assert r["prompt"] == [{"role": "user", "content": src[0]["problem"] + " " + common.DEFAULT_INSTRUCTION}]
    assert r["reward_model"] == {"style": "rule", "ground_truth": "15x - 80"}
    assert r["extra_info"] == {
        "split": "train",
        "index": 0,
        "level": src[0]["level"],
        "type": src[0]["type"],
        "question": src[0]["problem"],
        "solution": src[0]["solution"],
    }
    assert [x["extra_info"]["index"] for x in rows] == list(range(30))
    assert _check_math_ground_truths(rows) == []
    # every ground truth is what the reward extracts from the reference solution
    assert all(
        x["reward_model"]["ground_truth"] == last_boxed_answer(s["solution"]) for x, s in zip(rows, src, strict=True)
    )
    summary = (out / "prep_summary.json").read_text()
    assert '"written": 30' in summary and "sha256" in summary


def test_ground_truth_check_catches_naive_extractor(tmp_path):
    """Planted fault: a first-``}`` regex extractor (no nesting, first box) must fail the check."""
    out = tmp_path / "out"
    assert _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", out, "--splits", "train") == 0
    rows = _rows(out / "train.parquet")
    src = pq.read_table(MATH_MINI / "data" / "train-00000-of-00001.parquet").to_pylist()
    for r, s in zip(rows, src, strict=True):
        m = re.search(r"\\boxed\{(.*?)\}", s["solution"])
        r["reward_model"]["ground_truth"] = m.group(1) if m else ""
    errs = _check_math_ground_truths(rows)
    assert len(errs) >= 3, errs


def test_gsm8k_fixture_converts(tmp_path):
    out = tmp_path / "out"
    assert _prep(gsm8k, "--input-dir", GSM8K_MINI, "--out", out) == 0
    assert validate_rl_parquet(out / "train.parquet", "openai/gsm8k") == 20
    assert validate_rl_parquet(out / "test.parquet", "openai/gsm8k") == 10
    rows = _rows(out / "train.parquet")
    src = pq.read_table(GSM8K_MINI / "main" / "train-00000-of-00001.parquet").to_pylist()
    for r, s in zip(rows, src, strict=True):
        want = s["answer"].split("####")[-1].strip().replace(",", "")
        assert r["reward_model"]["ground_truth"] == want
        assert re.fullmatch(r"-?\d+(\.\d+)?", want)
        assert r["extra_info"]["solution"] == s["answer"]
        assert "\\boxed{}" in r["prompt"][-1]["content"]
    assert rows[0]["reward_model"]["ground_truth"] == "374"


def test_demo_sample_in_repo_converts(tmp_path):
    out = tmp_path / "out"
    assert _prep(math_lighteval, "--input-dir", DEMO_MATH, "--out", out) == 0
    assert validate_rl_parquet(out / "train.parquet") == 200
    assert validate_rl_parquet(out / "test.parquet") == 50


def test_full_shared_samples_convert(tmp_path, shared_data):
    assert _prep(math_lighteval, "--input-dir", shared_data / "MATH-lighteval-sample", "--out", tmp_path / "m") == 0
    assert _prep(gsm8k, "--input-dir", shared_data / "gsm8k-sample", "--out", tmp_path / "g") == 0
    assert validate_rl_parquet(tmp_path / "m" / "train.parquet") == 300
    assert validate_rl_parquet(tmp_path / "m" / "test.parquet") == 100
    assert validate_rl_parquet(tmp_path / "g" / "train.parquet") == 800
    assert validate_rl_parquet(tmp_path / "g" / "test.parquet") == 200


# ---------------------------------------------------------------------------------------------
# verl reads the output


def test_verl_rlhf_dataset_reads_math_and_gsm8k_together(tmp_path, tiny_tokenizer):
    import torch

    from verl.utils.dataset.rl_dataset import collate_fn

    m, g = tmp_path / "m", tmp_path / "g"
    assert _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", m) == 0
    assert _prep(gsm8k, "--input-dir", GSM8K_MINI, "--out", g) == 0
    ds = _verl_dataset([m / "train.parquet", g / "train.parquet"], tiny_tokenizer, tmp_path)
    assert len(ds) == 50
    item = ds[0]
    assert item["raw_prompt"][-1]["role"] == "user" and "\\boxed{}" in item["raw_prompt"][-1]["content"]
    assert item["reward_model"]["ground_truth"] == "15x - 80"
    assert item["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert item["index"] == 0
    last = ds[len(ds) - 1]
    assert last["data_source"] == "openai/gsm8k"
    loader = torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate_fn)
    batch = next(iter(loader))
    assert batch["dummy_tensor"].shape == (8, 1)
    assert len(batch["reward_model"]) == 8 and batch["reward_model"][3]["style"] == "rule"


def test_length_filter_matches_verl_count(tmp_path, tiny_tokenizer):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", full, "--tokenizer", tiny_tokenizer) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    lengths = sorted(common.prompt_length(tok, r["prompt"]) for r in _rows(full / "train.parquet"))
    limit = lengths[len(lengths) // 2]
    assert (
        _prep(
            math_lighteval,
            "--input-dir",
            MATH_MINI,
            "--out",
            cut,
            "--tokenizer",
            tiny_tokenizer,
            "--max-prompt-length",
            limit,
        )
        == 0
    )
    kept = len(_rows(cut / "train.parquet"))
    assert 0 < kept < 30
    import json

    rep = json.loads((cut / "prep_summary.json").read_text())["splits"]["train"]
    assert rep["too_long"] == 30 - kept and rep["max_prompt_tokens"] == lengths[-1]
    # verl's own filter with the same limit keeps exactly the same number of rows
    ds = _verl_dataset([full / "train.parquet"], tiny_tokenizer, tmp_path, max_prompt_length=limit)
    assert len(ds) == kept
    # and everything we kept survives verl's filter untouched
    assert len(_verl_dataset([cut / "train.parquet"], tiny_tokenizer, tmp_path, max_prompt_length=limit)) == kept


def test_length_filter_check_bites_with_wrong_count(tmp_path, tiny_tokenizer, monkeypatch):
    """Planted fault: counting the raw user text (no chat template) must disagree with verl."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", full, "--splits", "train") == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    lengths = sorted(common.prompt_length(tok, r["prompt"]) for r in _rows(full / "train.parquet"))
    limit = lengths[len(lengths) // 2]
    monkeypatch.setattr(
        common, "prompt_length", lambda t, msgs: len(t(msgs[-1]["content"], add_special_tokens=False)["input_ids"]) // 2
    )
    assert (
        _prep(
            math_lighteval,
            "--input-dir",
            MATH_MINI,
            "--out",
            cut,
            "--splits",
            "train",
            "--tokenizer",
            tiny_tokenizer,
            "--max-prompt-length",
            limit,
        )
        == 0
    )
    ds = _verl_dataset([full / "train.parquet"], tiny_tokenizer, tmp_path, max_prompt_length=limit)
    assert len(_rows(cut / "train.parquet")) != len(ds)


def test_apply_chat_template_column(tmp_path, tiny_tokenizer):
    out = tmp_path / "out"
    assert (
        _prep(
            math_lighteval,
            "--input-dir",
            MATH_MINI,
            "--out",
            out,
            "--tokenizer",
            tiny_tokenizer,
            "--apply-chat-template",
        )
        == 0
    )
    rows = _rows(out / "test.parquet")
    assert rows[0]["prompt_text"] == "<|user|>" + rows[0]["prompt"][0]["content"] + "\n<|assistant|>"
    assert isinstance(rows[0]["prompt"], list)  # verl still gets messages
    assert len(_verl_dataset([out / "test.parquet"], tiny_tokenizer, tmp_path)) == 12


def test_system_prompt_and_instruction_options(tmp_path):
    out = tmp_path / "out"
    assert (
        _prep(
            gsm8k,
            "--input-dir",
            GSM8K_MINI,
            "--out",
            out,
            "--system-prompt",
            "You are careful.",
            "--instruction",
            "Put the answer in \\boxed{}.",
        )
        == 0
    )
    msgs = _rows(out / "test.parquet")[0]["prompt"]
    assert msgs[0] == {"role": "system", "content": "You are careful."}
    assert msgs[1]["content"].endswith(" Put the answer in \\boxed{}.")


def test_instruction_without_boxed_warns(tmp_path, capsys):
    out = tmp_path / "out"
    assert _prep(gsm8k, "--input-dir", GSM8K_MINI, "--out", out, "--instruction", "End with #### N.") == 0
    assert "does not ask for \\boxed{}" in capsys.readouterr().err
    assert _rows(out / "test.parquet")[0]["prompt"][0]["content"].endswith(" End with #### N.")
    with pytest.raises(DataPrepError, match="boxed"):  # the default check still wants \boxed{}
        validate_rl_parquet(out / "test.parquet")
    assert validate_rl_parquet(out / "test.parquet", require_boxed=False) == 10


def test_sampling_is_seeded_and_traceable(tmp_path):
    def run(seed, name, *extra):
        out = tmp_path / name
        assert (
            _prep(
                gsm8k,
                "--input-dir",
                GSM8K_MINI,
                "--out",
                out,
                "--train-size",
                7,
                "--test-size",
                3,
                "--seed",
                seed,
                *extra,
            )
            == 0
        )
        return [r["extra_info"]["index"] for r in _rows(out / "train.parquet")], len(_rows(out / "test.parquet"))

    a, na = run(1, "a")
    b, _ = run(1, "b")
    c, _ = run(2, "c")
    d, _ = run(1, "d", "--shuffle")
    assert a == b and len(a) == 7 and na == 3
    assert a != c
    assert a == sorted(a) and sorted(d) == a and d != a  # same sample, shuffled order
    src = pq.read_table(GSM8K_MINI / "main" / "train-00000-of-00001.parquet").to_pylist()
    rows = _rows(tmp_path / "a" / "train.parquet")
    for r in rows:  # extra_info.index points back at the source row
        assert r["extra_info"]["question"] == src[r["extra_info"]["index"]]["question"].strip()


# ---------------------------------------------------------------------------------------------
# bad input: clear errors naming the file / row, non-zero exit


def test_missing_column_names_file_and_column(tmp_path, capsys):
    d = tmp_path / "ds"
    _write_raw(d / "data" / "train-00000-of-00001.parquet", {"problem": ["p"], "level": ["L"], "type": ["t"]})
    _write_raw(d / "data" / "test-00000-of-00001.parquet", {"problem": ["p"], "level": ["L"], "type": ["t"]})
    assert _prep(math_lighteval, "--input-dir", d, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "train-00000-of-00001.parquet" in err and "'solution'" in err


def test_empty_split_names_file(tmp_path, capsys):
    d = _copy_math(tmp_path)
    f = d / "data" / "test-00000-of-00001.parquet"
    pq.write_table(pq.read_table(f).slice(0, 0), f)
    assert _prep(math_lighteval, "--input-dir", d, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "test" in err and str(f) in err and "no rows" in err


def test_unreadable_file_names_file(tmp_path, capsys):
    d = _copy_math(tmp_path)
    f = d / "data" / "train-00000-of-00001.parquet"
    f.write_bytes(b"not a parquet file at all")
    assert _prep(math_lighteval, "--input-dir", d, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert str(f) in err and "cannot read as parquet" in err


def test_no_boxed_answer_counted_then_fails_above_threshold(tmp_path, capsys):
    d = _copy_math(tmp_path)
    f = d / "data" / "train-00000-of-00001.parquet"
    t = pq.read_table(f).to_pydict()
    t["solution"][5] = "We compute and get 12."  # no \boxed
    pq.write_table(pa.table(t), f)
    # 1/30 = 3.3 % > default 1 %: fail, naming the row
    assert _prep(math_lighteval, "--input-dir", d, "--out", tmp_path / "o1") == 2
    err = capsys.readouterr().err
    assert "no_boxed_answer" in err and f"{f}:5" in err and "--max-bad-frac" in err
    assert not (tmp_path / "o1" / "train.parquet").exists()
    # a looser threshold: converted, the row dropped and reported
    assert _prep(math_lighteval, "--input-dir", d, "--out", tmp_path / "o2", "--max-bad-frac", "0.05") == 0
    cap = capsys.readouterr()
    assert "1 unusable" in cap.out and f"{f}:5" in cap.err
    rows = _rows(tmp_path / "o2" / "train.parquet")
    assert len(rows) == 29 and 5 not in [r["extra_info"]["index"] for r in rows]


def test_gsm8k_bad_answers(tmp_path, capsys):
    d = tmp_path / "g"
    shutil.copytree(GSM8K_MINI, d)
    f = d / "main" / "train-00000-of-00001.parquet"
    t = pq.read_table(f).to_pydict()
    t["answer"][2] = "no final marker"
    t["answer"][3] = "blah\n#### seven"
    pq.write_table(pa.table(t), f)
    assert _prep(gsm8k, "--input-dir", d, "--out", tmp_path / "o", "--max-bad-frac", "0.2") == 0
    err = capsys.readouterr().err
    assert "no_hash_answer" in err and "answer_not_numeric" in err
    assert len(_rows(tmp_path / "o" / "train.parquet")) == 18


@pytest.mark.parametrize(
    "layout, needle, hint",
    [
        ("missing_dir", "does not exist", True),
        ("no_parquet", "No parquet files", True),
        ("train_only", "--splits train", False),
        ("subset_folder", "algebra/train-00000-of-00001.parquet", True),
    ],
)
def test_bad_layouts(tmp_path, capsys, layout, needle, hint):
    d = tmp_path / "ds"
    if layout == "no_parquet":
        d.mkdir()
    elif layout == "train_only":
        (d / "data").mkdir(parents=True)
        shutil.copy(MATH_MINI / "data" / "train-00000-of-00001.parquet", d / "data")
    elif layout == "subset_folder":  # only a per-subject folder, as in the HF repo's configs
        (d / "algebra").mkdir(parents=True)
        shutil.copy(MATH_MINI / "data" / "train-00000-of-00001.parquet", d / "algebra")
    assert _prep(math_lighteval, "--input-dir", d, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert needle in err
    assert ("modelscope download --dataset AI-ModelScope/MATH-lighteval" in err) == hint


def test_train_only_with_splits_option(tmp_path):
    d = tmp_path / "ds" / "data"
    d.mkdir(parents=True)
    shutil.copy(MATH_MINI / "data" / "train-00000-of-00001.parquet", d)
    assert _prep(math_lighteval, "--input-dir", d.parent, "--out", tmp_path / "o", "--splits", "train") == 0
    assert (tmp_path / "o" / "train.parquet").exists() and not (tmp_path / "o" / "test.parquet").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--max-prompt-length", "100"], "need --tokenizer"),
        (["--splits", "train,dev"], "allowed values are train, test"),
        (["--train-size", "0"], "argument --train-size: '0' is not an integer >= 1"),  # argparse type (cliargs)
        (["--max-bad-frac", "2"], "argument --max-bad-frac: '2' is not a number within 0..1"),
        (["--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: cannot load"),
    ],
)
def test_bad_options(tmp_path, capsys, args, needle):
    try:
        rc = _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", tmp_path / "o", *args)
    except SystemExit as e:  # argparse
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_offline_without_input_dir_explains(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _prep(math_lighteval, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE" in err and "--input-dir" in err and "modelscope download" in err


def test_hub_fetch_path_uses_datasets(tmp_path, monkeypatch):
    """Without --input-dir the rows come from datasets.load_dataset(name, config) (stubbed: no network)."""
    import datasets

    src = pq.read_table(GSM8K_MINI / "main" / "train-00000-of-00001.parquet").to_pylist()
    seen = {}

    def fake_load(name, config=None):
        seen["args"] = (name, config)
        ds = datasets.Dataset.from_list(src)
        return datasets.DatasetDict({"train": ds, "test": ds.select(range(4))})

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert _prep(gsm8k, "--out", tmp_path / "o") == 0
    assert seen["args"] == ("openai/gsm8k", "main")
    assert len(_rows(tmp_path / "o" / "train.parquet")) == 20 and len(_rows(tmp_path / "o" / "test.parquet")) == 4


# ---------------------------------------------------------------------------------------------
# atomic output, seed compatibility, validation


def test_failed_run_leaves_previous_output_intact(tmp_path, monkeypatch):
    out = tmp_path / "o"
    assert _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", out) == 0
    before = (out / "train.parquet").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(pq, "write_table", boom)
    assert math_lighteval.main(["--input-dir", str(MATH_MINI), "--out", str(out), "--train-size", "5"]) == 2
    assert (out / "train.parquet").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["prep_summary.json", "test.parquet", "train.parquet"]


def test_seed_wrapper_same_input_and_output_dir(tmp_path):
    """The seed's own usage: --input_dir and --local_dir are the same folder."""
    d = _copy_math(tmp_path)
    script = REPO / "toolkits" / "verl_data_preprocessing" / "math_lighteval.py"
    r = subprocess.run(
        [sys.executable, str(script), "--input_dir", str(d), "--local_dir", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "30 written" in r.stdout
    assert validate_rl_parquet(d / "train.parquet") == 30
    # a rerun does not pick up its own output as input
    r = subprocess.run(
        [sys.executable, str(script), "--input_dir", str(d), "--local_dir", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "train 30 read" in r.stdout


def test_module_and_cli_entry_points(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv3_rl.data.cli",
            "gsm8k",
            "--input-dir",
            str(GSM8K_MINI),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "dsv3_rl.data.cli", "validate", str(tmp_path / "train.parquet")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "20 rows ok" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "dsv3_rl.data.cli", "nonsense"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "allowed: math_lighteval" in r.stderr


@pytest.mark.parametrize(
    "corrupt, needle",
    [
        (lambda r: r["reward_model"].update(ground_truth=""), "non-empty ground_truth"),
        (lambda r: r["prompt"][0].update(content="What is 1+1?"), "\\boxed"),
        (lambda r: r.update(ability="code"), "ability"),
        (lambda r: r["extra_info"].update(split="dev"), "split/index"),
        (lambda r: r.update(prompt=[]), "non-empty message list"),
    ],
)
def test_validator_catches_corrupted_output(tmp_path, corrupt, needle):
    """Planted faults for validate_rl_parquet: each corruption of one row must be reported."""
    out = tmp_path / "o"
    assert _prep(math_lighteval, "--input-dir", MATH_MINI, "--out", out, "--splits", "test") == 0
    rows = _rows(out / "test.parquet")
    corrupt(rows[3])
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), bad)
    with pytest.raises(DataPrepError, match="row 3") as ei:
        validate_rl_parquet(bad)
    assert needle in str(ei.value)
