"""The synthetic checkpoints' tokenizer has exactly config.json's vocab_size entries, and the launcher's hf_config
stage checks it.

Why: verl's vLLM rollout masks the logits of ids >= len(tokenizer), Megatron's log-probs normalise over all
vocab_size rows. The proxy GPU run of 2026-12-07 had the 2048-entry offline tokenizer in a 129280-vocab checkpoint:
rollout minus trainer log-prob 4.147 nats on every sequence (ln(129280/2048) = 4.145). The references here: the
config's vocab_size (for the length) and the committed 2048-entry asset tokenizer (for the ids of every text)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from dsv3_rl.errors import Dsv3Error
from dsv3_rl.minimodel import mini_model
from dsv3_rl.minimodel.mini_model import write_mini_model
from dsv3_rl.models import presets, tokenizer

PROXY_VOCAB = 129280
CHAT = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is $17^2$?"},
        {"role": "assistant", "content": "<think>17*17</think> $\\boxed{289}$"}, {"role": "user", "content": "Why?"}]
# text the tokenizers must split alike: math, GSM8K markup, non-ASCII, special tokens, and the placeholder names
# themselves (a literal filler string in a prompt must stay bytes, as in the 2048-entry tokenizer)
SAMPLES = [*tokenizer.embedded_corpus()[:40], "héllo wörld ½ ≤ ∑ 你好 🙂", "".join(tokenizer.SPECIAL_TOKENS),
           "x " + tokenizer.PLACEHOLDER.format(0) + tokenizer.PLACEHOLDER.format(5000) + " y"]


def _auto(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def _problems(d: Path, ref_dir: Path = tokenizer.ASSET_DIR) -> list[str]:
    """What is wrong with the tokenizer in D: its length against D's config.json vocab_size, and the ids of every
    sample text (plain and through the chat template) and their decoding against the tokenizer in REF_DIR."""
    tok, ref = _auto(d), _auto(ref_dir)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    out = [] if len(tok) == vocab else [f"len(tokenizer) {len(tok)} != vocab_size {vocab}"]
    ids, ref_ids = tok(SAMPLES)["input_ids"], ref(SAMPLES)["input_ids"]
    out += [f"{t[:30]!r} encodes to other ids" for t, a, b in zip(SAMPLES, ids, ref_ids) if a != b]
    out += [f"{t[:30]!r} decodes differently" for t, a in zip(SAMPLES, ref_ids) if tok.decode(a) != ref.decode(a)]
    if tok.apply_chat_template(CHAT, add_generation_prompt=True) != ref.apply_chat_template(CHAT, add_generation_prompt=True):
        out.append("the chat template gives other ids")
    if (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) != (0, 1, 2):
        out.append("BOS/EOS/PAD are not ids 0/1/2")
    names = tok.convert_ids_to_tokens(list(range(len(tok))))
    if None in names or len(set(names)) != len(names):
        out.append("the ids 0..len-1 do not map to distinct tokens")
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """config.json (vocab_size 129280, as the proxy presets) + tokenizer, no weights: the 671B preset is config-only
    and mini_model writes its tokenizer exactly as for the proxies (``_write``)."""
    assert presets.PRESETS["deepseek-v3"]["vocab_size"] == PROXY_VOCAB
    assert all(presets.PRESETS[p]["vocab_size"] == PROXY_VOCAB for p in ("proxy",))
    return write_mini_model("deepseek-v3", tmp_path_factory.mktemp("tok") / "ds")


@pytest.fixture(scope="module")
def old(tmp_path_factory, big) -> Path:
    """The planted fault: what mini_model wrote before, the 2048-entry tokenizer beside a 129280-vocab config."""
    d = tmp_path_factory.mktemp("tok") / "old"
    shutil.copytree(big, d)
    tokenizer.copy_tokenizer_files(d)  # no vocab_size: the offline tokenizer as it is
    return d


# ------------------------------------------------------------------------------------------ the tokenizer


def test_proxy_vocab_checkpoint_tokenizer_has_vocab_size_entries_and_the_same_ids(big):
    assert _problems(big) == []
    tok = _auto(big)
    assert tok.convert_ids_to_tokens([2047, 2048, PROXY_VOCAB - 1]) == [
        _auto(tokenizer.ASSET_DIR).convert_ids_to_tokens(2047), tokenizer.PLACEHOLDER.format(0),
        tokenizer.PLACEHOLDER.format(PROXY_VOCAB - 2049)]


def test_twin_old_2048_tokenizer_with_129280_config_fails(old):
    assert _problems(old) == [f"len(tokenizer) 2048 != vocab_size {PROXY_VOCAB}"]


def test_twin_fillers_as_added_special_tokens_change_the_ids(tmp_path, big):
    """DeepSeek's own way (placeholders among the added tokens) makes a literal filler string in the text one id:
    the ids check bites (and such a tokenizer loads in ~5 s instead of ~0.5 s)."""
    d = tmp_path / "added"
    shutil.copytree(big, d)
    data = json.loads(tokenizer.ASSET_DIR.joinpath("tokenizer.json").read_text())
    data["added_tokens"] += [{"id": i, "content": tokenizer.PLACEHOLDER.format(i - 2048), "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False, "special": True}
                             for i in range(2048, 2048 + 6000)]  # enough to hold placeholder 5000; short of 129280
    (d / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    got = _problems(d)
    assert f"len(tokenizer) 8048 != vocab_size {PROXY_VOCAB}" in got
    assert any("encodes to other ids" in p and "place" in p for p in got), got


def test_embedded_build_pads_after_its_own_placeholders(tmp_path):
    """The embedded-corpus build (an installed wheel, no asset) ends in placeholders among its added tokens; the
    padding numbers on from them and keeps every id (a BPE vocab with holes would be renumbered by tokenizers)."""
    src = tokenizer.build_tokenizer(tmp_path / "e")
    text = (src / "tokenizer.json").read_text()
    added = json.loads(text)["added_tokens"]
    assert added[-1] == {**added[-1], "id": 2047, "content": tokenizer.PLACEHOLDER.format(len(added) - 20)}
    padded = json.loads(tokenizer.pad_tokenizer_json(text, 4096))
    d = tmp_path / "p"
    shutil.copytree(src, d)
    (d / "tokenizer.json").write_text(tokenizer._dump(padded))
    (d / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    assert _problems(d, ref_dir=src) == []
    assert _auto(d).convert_ids_to_tokens(2048) == tokenizer.PLACEHOLDER.format(len(added) - 19)
    # twin: the same file with the hole left in its BPE vocab (the added placeholders' ids 1196.. not in it)
    holes = json.loads(tokenizer._dump(padded))
    holes["model"]["vocab"] = {k: v for k, v in holes["model"]["vocab"].items() if v < 2048 - len(added) + 19 or v >= 2048}
    (d / "tokenizer.json").write_text(tokenizer._dump(holes))
    assert "the ids 0..len-1 do not map to distinct tokens" in _problems(d, ref_dir=src)


def test_tiny_vocab_copies_the_asset_byte_for_byte(tmp_path):
    for vocab in (None, tokenizer.VOCAB_SIZE):
        names = tokenizer.copy_tokenizer_files(tmp_path / str(vocab), vocab)
        assert [(tmp_path / str(vocab) / n).read_bytes() for n in names] == \
            [(tokenizer.ASSET_DIR / n).read_bytes() for n in names]
    tokenizer.copy_tokenizer_files(tmp_path / "more", tokenizer.VOCAB_SIZE + 1)  # twin: one more entry, other bytes
    assert (tmp_path / "more" / "tokenizer.json").read_bytes() != (tokenizer.ASSET_DIR / "tokenizer.json").read_bytes()


def test_vocab_size_below_the_tokenizer_is_refused(tmp_path, capsys):
    with pytest.raises(tokenizer.VocabSizeError, match=r"vocab_size is 1000 but .* has 2048 entries"):
        tokenizer.copy_tokenizer_files(tmp_path / "t", 1000)
    assert issubclass(tokenizer.VocabSizeError, Dsv3Error)  # a CLI says `error: ...`, exit 2
    assert mini_model.main(["tiny", str(tmp_path / "m"), "--set", "vocab_size=1000"]) == 2
    err = capsys.readouterr().err
    assert "1000" in err and "2048" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m").exists()  # nothing half-written
    assert mini_model.main(["tiny", str(tmp_path / "m2"), "--set", "vocab_size=2048", "--set",  # twin: equal is fine
                            "num_hidden_layers=1"]) == 0


# ------------------------------------------------------------------------------ the launcher's hf_config stage


def _hf_config_stage(preset: str, d: Path, tmp: Path):
    from dsv3_rl.launch.run import Paths
    from dsv3_rl.launch.stages import build_stages
    from dsv3_rl.recipes.presets import load_preset

    paths = Paths(tmp, d, d, tmp / "mc", tmp / "raw", tmp / "data", tmp / "ck", tmp / "lg")
    st = {s.name: s for s in build_stages(load_preset(preset), paths, max_prompt_length=2048, model_cfg={})}["hf_config"]
    st.argv = [sys.executable, "-c", "pass"]  # the fix-up tool, which cannot change a tokenizer (seconds saved)
    return st


def test_hf_config_stage_passes_the_padded_tokenizer(tmp_path, big):
    from dsv3_rl.launch.stages import StageError

    assert _hf_config_stage("proxy_1xH100", big, tmp_path).status() == \
        ("done", "verified (config.json acceptable to verl and vLLM)")
    st = _hf_config_stage("proxy_1xH100", big, tmp_path)
    st.run({}, log=lambda *_: None)  # verified: nothing runs, nothing raised
    assert not st.ran
    assert issubclass(StageError, Dsv3Error)  # what the twin raises: `error: ...`, exit 2


def test_twin_hf_config_stage_fails_on_the_old_tokenizer_of_synthetic_weights(tmp_path, old):
    from dsv3_rl.launch.stages import StageError

    st = _hf_config_stage("proxy_1xH100", old, tmp_path)
    status, detail = st.status()
    assert status == "run" and "2048 entries" in detail and f"vocab_size is {PROXY_VOCAB}" in detail, detail
    with pytest.raises(StageError, match=rf"stage hf_config .*has 2048 entries but config.json vocab_size is "
                                         rf"{PROXY_VOCAB}.*ln\({PROXY_VOCAB}/2048\) = 4.145 nats.*synthetic") as e:
        st.run({}, log=lambda *_: None)
    assert "\n" not in str(e.value)


def test_hf_config_stage_real_weights_short_tokenizer_is_an_info(tmp_path, big):
    """DeepSeek-V3's own tokenizer: 128815 entries for vocab_size 129280. Trained weights: one info, the run goes on;
    the same directory as synthetic weights is the error (the twin)."""
    d = tmp_path / "real"
    shutil.copytree(big, d)
    tokenizer.copy_tokenizer_files(d, 128815)
    status, detail = _hf_config_stage("671b_512xH100", d, tmp_path).status()
    assert status == "done" and detail.startswith("verified (config.json acceptable to verl and vLLM; info: "), detail
    assert f"has 128815 entries but config.json vocab_size is {PROXY_VOCAB}" in detail and "\n" not in detail
    assert _hf_config_stage("proxy_1xH100", d, tmp_path).status()[0] == "run"
