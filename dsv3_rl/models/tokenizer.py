"""An offline DeepSeek-V3-style tokenizer for the mini models (tests, the CPU demo, benchmarks).

A small byte-level BPE with DeepSeek-V3's special tokens (same strings, ids 0/1/2 for
BOS/EOS/PAD as in the real tokenizer) and a DeepSeek-V3-style chat template. Built with the
`tokenizers` library only, so nothing is downloaded. Training is deterministic: the same corpus
gives the same files, byte for byte.

The built files are cached in ``tests/assets/tokenizer/`` (about 100 KB), trained on the train
splits of the full MATH-lighteval and GSM8K samples the test fixtures were cut from (not in the
repo; ``build_info.json`` there names the files and their hashes). Where that cache is absent (an
installed wheel), ``tokenizer_dir()`` builds the same-sized tokenizer from a small embedded corpus
instead.

A model whose vocab_size is larger (the proxy presets: 129280) gets the same tokenizer padded with DeepSeek-style
placeholders to exactly vocab_size entries (``copy_tokenizer_files(dst, vocab_size)``): verl's vLLM rollout never
samples ids >= len(tokenizer), while Megatron's log-probs normalise over all vocab_size rows.

CLI::

    dsv3-tokenizer --out OUT_DIR [--data-dir DIR] [--vocab-size 2048]   # or python -m dsv3_rl.models.tokenizer;
                                                                        # OUT_DIR may also come positionally
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from dsv3_rl.cliargs import add_out, one_path, usage_errors
from dsv3_rl.errors import Dsv3Error, cli_main
from dsv3_rl.fs import sha256_file, write_text_atomic

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"

# In id order. BOS/EOS/PAD get ids 0/1/2 like DeepSeek-V3's tokenizer (bos_token_id 0, eos 1).
SPECIAL_TOKENS = [
    BOS,
    EOS,
    PAD,
    USER,
    ASSISTANT,
    THINK,
    END_THINK,
    "<｜fim▁hole｜>",
    "<｜fim▁begin｜>",
    "<｜fim▁end｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]
# Added as single tokens but not "special": decode(skip_special_tokens=True) keeps them, as in R1.
NOT_SPECIAL = {THINK, END_THINK}
PLACEHOLDER = "<｜place▁holder▁no▁{}｜>"  # DeepSeek's own filler name; pads the vocab to size
_PLACEHOLDER_RE = re.compile(re.escape(PLACEHOLDER).replace(re.escape("{}"), r"(\d+)"))

VOCAB_SIZE = 2048  # the "tiny" presets' vocab_size; keep the two equal

# DeepSeek-V3's template for system / user / assistant / tool turns (tool calls omitted).
CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = false -%}{%- endif -%}"
    "{%- set ns = namespace(system_prompt='', is_first_sp=true) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if ns.is_first_sp -%}{%- set ns.system_prompt = message['content'] -%}{%- set ns.is_first_sp = false -%}"
    "{%- else -%}{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
    "{%- elif message['role'] != 'system' -%}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSET_DIR = REPO_ROOT / "tests" / "assets" / "tokenizer"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Text columns of the shipped data samples (MATH-lighteval, GSM8K).
_TEXT_COLUMNS = ("problem", "solution", "question", "answer")

_EMBEDDED = [
    "Let $x$ be a real number such that $x^2 - 5x + 6 = 0$. Find the sum of all possible values of $x$.",
    "By Vieta's formulas, the sum of the roots is $5$, so the answer is $\\boxed{5}$.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May. Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72",
    "Compute $\\dbinom{8}{4}$. We have $\\dbinom{8}{4} = \\frac{8!}{4!4!} = 70$, so the answer is $\\boxed{70}$.",
    "What is the greatest common divisor of $1729$ and $1768$? The Euclidean algorithm gives $\\gcd = 13$.",
    "A rectangle has a perimeter of 30 units and its length is twice its width. What is its area?",
    "Let the width be $w$. Then $2(w + 2w) = 30$, so $w = 5$ and the area is $5 \\cdot 10 = \\boxed{50}$.",
    "Simplify $\\sqrt{50} + \\sqrt{18}$. We get $5\\sqrt{2} + 3\\sqrt{2} = \\boxed{8\\sqrt{2}}$.",
    "If $f(x) = 3x + 2$ and $g(x) = x^2 - 1$, what is $f(g(2))$? Since $g(2) = 3$, $f(3) = \\boxed{11}$.",
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
    "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per egg.",
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day. She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18",
    "How many positive divisors does $6!$ have? $6! = 720 = 2^4 \\cdot 3^2 \\cdot 5$, so it has "
    "$(4+1)(2+1)(1+1) = \\boxed{30}$ divisors.",
    "The probability of rolling a sum of 7 with two fair six-sided dice is $\\frac{6}{36} = \\boxed{\\frac{1}{6}}$.",
    "Find the value of $\\log_2 64$. Since $2^6 = 64$, the answer is $\\boxed{6}$.",
    "A train travels 120 miles in 2 hours. At the same rate, how far will it travel in 5 hours? "
    "Its speed is 120/2 = <<120/2=60>>60 mph, so it travels 60 * 5 = <<60*5=300>>300 miles.\n#### 300",
    "Solve for $y$: $\\frac{y}{3} - 4 = 2$. Adding 4 and multiplying by 3 gives $y = \\boxed{18}$.",
    "In triangle $ABC$, $\\angle A = 50^\\circ$ and $\\angle B = 60^\\circ$. Find $\\angle C$. "
    "The angles sum to $180^\\circ$, so $\\angle C = \\boxed{70^\\circ}$.",
]


def embedded_corpus() -> list[str]:
    """A few KB of math text (written for this file), repeated with numbers so BPE has pairs."""
    texts = list(_EMBEDDED)
    for i in range(400):
        a, b = 3 * i + 7, 11 * i + 2
        texts.append(f"Compute ${a} + {b}$. We have ${a} + {b} = \\boxed{{{a + b}}}$. The answer is {a + b}.")
        texts.append(f"Tom has {a} apples and buys {b} more. He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}")
    return texts


def corpus_from_parquet(paths: Iterable[Path]) -> Iterator[str]:
    """Text of every known text column of each parquet file, in file then row order."""
    import pyarrow.parquet as pq

    for path in paths:
        table = pq.read_table(path)
        cols = [c for c in _TEXT_COLUMNS if c in table.column_names]
        if not cols:
            raise ValueError(f"{path}: no text column (looked for {', '.join(_TEXT_COLUMNS)}; has {table.column_names})")
        for row in table.select(cols).to_pylist():
            for c in cols:
                if row[c]:
                    yield row[c]


def parquet_files(data_dir: Path) -> list[Path]:
    """The train splits under DATA_DIR, sorted (so the corpus order does not depend on the file system)."""
    files = sorted(p for p in Path(data_dir).rglob("train-*.parquet"))
    if not files:
        raise FileNotFoundError(f"no train-*.parquet files under {data_dir}")
    return files


def placeholders(start: int, stop: int) -> list[str]:
    """DeepSeek-style filler names number START..STOP-1 (``<｜place▁holder▁no▁N｜>``)."""
    return [PLACEHOLDER.format(i) for i in range(start, stop)]


def _train(texts: Iterable[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    n = tok.get_vocab_size()
    if n > vocab_size:
        raise RuntimeError(f"BPE produced {n} tokens, more than the requested {vocab_size}")
    # Fill up to exactly vocab_size with DeepSeek-style placeholders, so the model's vocab_size is fixed.
    fillers = placeholders(0, vocab_size - n)
    if fillers:
        tok.add_special_tokens(fillers)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, 0)],
    )
    return tok


def _tokenizer_json(tok) -> str:
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        if added["content"] in NOT_SPECIAL:
            added["special"] = False
    return _dump(data)


def _dump(data: dict) -> str:
    """tokenizer.json text as this module writes it."""
    return json.dumps(data, ensure_ascii=False, indent=2, sort_keys=False) + "\n"


class VocabSizeError(Dsv3Error, ValueError):
    """A model's vocab_size smaller than the tokenizer (a tokenizer cannot shrink)."""


def pad_tokenizer_json(text: str, vocab_size: int, what: str = "the tokenizer") -> str:
    """tokenizer.json TEXT with exactly VOCAB_SIZE entries (``len(AutoTokenizer)`` == VOCAB_SIZE): the missing ids
    ``len .. VOCAB_SIZE-1`` become DeepSeek-style placeholders numbered on from the ones :func:`_train` added. TEXT
    itself where it already has VOCAB_SIZE entries; :class:`VocabSizeError` where it has more.

    The fillers go into the BPE model's vocab, not among the added tokens: no merge and no byte-level piece ever
    produces ``｜``/``▁``, so every text encodes to the same ids as before (a literal placeholder string in the text
    too), and ``AutoTokenizer.from_pretrained`` of 129280 entries takes 0.55 s where 127k added special tokens take
    4.9 s (2026-12-07, 2-core dev box; the 2048-entry asset 0.02 s). They decode to their own text (not special:
    ``skip_special_tokens`` keeps them). Why pad at all: verl's vLLM rollout never samples ids >= len(tokenizer),
    while Megatron's log-probs normalise over all vocab_size rows."""
    data = json.loads(text)
    vocab, added = data["model"]["vocab"], data["added_tokens"]
    ids = set(vocab.values()) | {a["id"] for a in added}
    n = len(ids)
    if ids != set(range(n)):
        raise VocabSizeError(f"{what} has {n} entries whose ids are not 0..{n - 1}; cannot pad it")
    if vocab_size < n:
        raise VocabSizeError(f"the model's vocab_size is {vocab_size} but {what} has {n} entries: a tokenizer "
                             f"cannot shrink; use vocab_size >= {n}")
    if vocab_size == n:
        return text
    taken = [int(m.group(1)) for t in [*vocab, *(a["content"] for a in added)]
             if (m := _PLACEHOLDER_RE.fullmatch(t))]
    start = max(taken, default=-1) + 1
    for a in added:  # the vocab gets no holes (tokenizers renumbers a vocab with holes): added ids in it too,
        vocab.setdefault(a["content"], a["id"])  # as the trainer does for the special tokens (added tokens match first)
    for i, name in enumerate(placeholders(start, start + vocab_size - n)):
        vocab[name] = n + i
    return _dump(data)


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 16384,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(out_dir: str | os.PathLike, texts: Iterable[str] | None = None, vocab_size: int = VOCAB_SIZE,
                    corpus_note: str = "embedded corpus") -> Path:
    """Train and write tokenizer.json, tokenizer_config.json, special_tokens_map.json, build_info.json."""
    import tokenizers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train(embedded_corpus() if texts is None else texts, vocab_size)
    files = {
        "tokenizer.json": _tokenizer_json(tok),
        "tokenizer_config.json": json.dumps(_tokenizer_config(), ensure_ascii=False, indent=2) + "\n",
        "special_tokens_map.json": json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
                                              ensure_ascii=False, indent=2) + "\n",
    }
    for name, text in files.items():
        write_text_atomic(out / name, text)
    info = {
        "vocab_size": vocab_size,
        "corpus": corpus_note,
        "tokenizers_version": tokenizers.__version__,
        "sha256": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()},
    }
    write_text_atomic(out / "build_info.json", json.dumps(info, indent=2) + "\n")
    return out


def build_from_data_dir(out_dir: str | os.PathLike, data_dir: str | os.PathLike, vocab_size: int = VOCAB_SIZE) -> Path:
    files = parquet_files(Path(data_dir))
    note = "train splits: " + ", ".join(
        f"{p.relative_to(data_dir)} (sha256 {sha256_file(p)[:16]})" for p in files
    )
    return build_tokenizer(out_dir, corpus_from_parquet(files), vocab_size, corpus_note=note)


def tokenizer_dir() -> Path:
    """Directory holding the mini-model tokenizer files: the cached asset, else a build from the embedded corpus."""
    if all((ASSET_DIR / f).is_file() for f in FILES):
        return ASSET_DIR
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv3_rl" / f"tokenizer-embedded-{VOCAB_SIZE}"
    if not all((cache / f).is_file() for f in FILES):
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        build_tokenizer(tmp)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race; its files are identical
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


def copy_tokenizer_files(dst: str | os.PathLike, vocab_size: int | None = None) -> list[str]:
    """Copy the mini-model tokenizer files into DST (a checkpoint directory); returns the names copied.

    VOCAB_SIZE (the model's ``config.vocab_size``): the copy gets exactly that many entries, padded with
    placeholders (:func:`pad_tokenizer_json`) where the model's vocab is larger than the tokenizer's
    :data:`VOCAB_SIZE` (the proxy presets' 129280); the same files byte for byte where it is equal."""
    src = tokenizer_dir()
    dst = Path(dst)
    for name in FILES:
        text = (src / name).read_text(encoding="utf-8")
        if name == "tokenizer.json" and vocab_size is not None:
            text = pad_tokenizer_json(text, vocab_size, f"the offline tokenizer ({src / name})")
        write_text_atomic(dst / name, text)
    return list(FILES)


def tokenizer_length(model_dir: str | os.PathLike) -> int | None:
    """``len(AutoTokenizer.from_pretrained(MODEL_DIR))``, the ids verl's vLLM rollout may sample (it masks the
    logits of the ids from there on); None where MODEL_DIR holds no tokenizer files."""
    d = Path(model_dir).resolve()
    files = [f for f in sorted(d.glob("*")) if f.is_file() and (f.name.startswith("tokenizer") or f.name in
                                                                ("special_tokens_map.json", "added_tokens.json"))]
    if not any(f.name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model") for f in files):
        return None
    # the launcher asks once per status() (validation, plan, run): 0.55 s each at 129280; a changed file reloads
    return _loaded_length(str(d), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=16)
def _loaded_length(model_dir: str, files: tuple) -> int:  # noqa: ARG001 - FILES (name, size, mtime) keys the cache
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir))


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv3-tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", nargs="?", help="same as --out")
    add_out(p, metavar="DIR", help="where to write tokenizer.json, tokenizer_config.json, ...")
    p.add_argument("--data-dir", help="train on train-*.parquet under this dir (MATH/GSM8K columns); "
                                      "default: the embedded corpus")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = p.parse_args(argv)
    out_dir = one_path("OUT_DIR", args.out_dir, "--out", args.out)
    if args.data_dir:
        with usage_errors(ValueError):
            out = build_from_data_dir(out_dir, args.data_dir, args.vocab_size)
    else:
        out = build_tokenizer(out_dir, vocab_size=args.vocab_size)
    print(f"wrote tokenizer ({args.vocab_size} tokens) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
