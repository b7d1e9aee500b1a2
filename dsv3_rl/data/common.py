"""Shared machinery for turning a raw math dataset into verl's RL parquet schema.

Output schema (identical for every dataset, so MATH and GSM8K files can be passed together as
``data.train_files=[...]``; ``datasets.concatenate_datasets`` needs identical features)::

    data_source   string                      e.g. "DigitalLearningGmbH/MATH-lighteval"
    prompt        list<struct<role, content>> chat messages; verl applies the chat template
    ability       string                      "math"
    reward_model  struct<style, ground_truth> style "rule"; ground_truth = the bare final answer
    extra_info    struct<split, index, level, type, question, solution>
    prompt_text   string                      only with --apply-chat-template (see below)

``extra_info.index`` is the row's position in the source split (before filtering/sampling),
so every output row can be traced back to its input row.

Input: the dataset directory as downloaded (``{split}-*.parquet`` directly in ``--input-dir``
or in its dataset-specific subfolder, ``data/`` for MATH-lighteval, ``main/`` for GSM8K), or,
without ``--input-dir`` and with network access, the Hugging Face Hub by name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from dsv3_rl.cliargs import add_out, alias, fraction, positive_int
from dsv3_rl.errors import Dsv3Error, env_flag
from dsv3_rl.fs import atomic_path, replace_dir, sha256_file, write_text_atomic

SPLITS = ("train", "test")
DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
EXTRA_INFO_FIELDS = ("split", "index", "level", "type", "question", "solution")


class DataPrepError(Dsv3Error, RuntimeError):
    """Bad input or options; the message names the file / row / option."""


class BadRow(Exception):
    """A row that cannot be converted; ``reason`` is a short code used in the report."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Converted:
    question: str
    ground_truth: str
    level: str = ""
    type: str = ""
    solution: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    data_source: str
    hub_name: str
    hub_config: str | None
    subdirs: tuple[str, ...]
    required_columns: tuple[str, ...]
    convert: Callable[[dict], Converted]
    default_local_dir: str
    download_hint: str


@dataclass
class SplitReport:
    files: list[str] = field(default_factory=list)
    read: int = 0
    bad: dict = field(default_factory=dict)  # reason -> count
    bad_examples: list = field(default_factory=list)  # "file:row reason"
    too_long: int = 0
    max_prompt_tokens: int = 0
    sampled_out: int = 0
    written: int = 0


# ---------------------------------------------------------------------------------------------
# small utilities


def _output_schema(with_prompt_text: bool):
    import pyarrow as pa

    fields = [
        pa.field("data_source", pa.string()),
        pa.field("prompt", pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))),
        pa.field("ability", pa.string()),
        pa.field("reward_model", pa.struct([pa.field("style", pa.string()), pa.field("ground_truth", pa.string())])),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    pa.field("split", pa.string()),
                    pa.field("index", pa.int64()),
                    pa.field("level", pa.string()),
                    pa.field("type", pa.string()),
                    pa.field("question", pa.string()),
                    pa.field("solution", pa.string()),
                ]
            ),
        ),
    ]
    if with_prompt_text:
        fields.append(pa.field("prompt_text", pa.string()))
    return pa.schema(fields)


def write_records_atomic(path: Path, records: list[dict], with_prompt_text: bool = False) -> None:
    """Write RL records to ``path`` via a temporary file in the same directory + os.replace."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(records, schema=_output_schema(with_prompt_text))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


# ---------------------------------------------------------------------------------------------
# input discovery and reading


def find_split_files(input_dir: str | Path, spec: DatasetSpec, splits: Sequence[str]) -> dict[str, list[Path]]:
    """``{split: [parquet files]}`` from ``input_dir`` or its dataset subfolder (``data/``, ``main/``)."""
    root = Path(input_dir).expanduser()
    if not root.exists():
        raise DataPrepError(f"--input-dir {root} does not exist. {spec.download_hint}")
    if not root.is_dir():
        raise DataPrepError(
            f"--input-dir {root} is not a directory (expected the dataset folder). {spec.download_hint}"
        )
    for d in [root] + [root / s for s in spec.subdirs]:
        found = {sp: sorted(d.glob(f"{sp}-*.parquet")) for sp in splits}
        if all(found.values()):
            return found
        if any(found.values()):
            missing = [sp for sp, fs in found.items() if not fs]
            raise DataPrepError(
                f"{d}: found {', '.join(sp for sp in splits if found[sp])} parquet files but no "
                f"{' / '.join(f'{sp}-*.parquet' for sp in missing)}; pass --splits "
                f"{','.join(sp for sp in splits if found[sp])} to convert only those"
            )
    present = sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet"))[:10]
    where = ", ".join([str(root)] + [str(root / s) for s in spec.subdirs])
    hint = f" Parquet files present: {present}." if present else " No parquet files under it."
    raise DataPrepError(
        f"no {'/'.join(f'{sp}-*.parquet' for sp in splits)} files in {where}.{hint} "
        f"Expected the {spec.name} layout {spec.subdirs[0]}/{{train,test}}-*.parquet. {spec.download_hint}"
    )


def read_parquet_rows(path: Path, spec: DatasetSpec) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise DataPrepError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from e
    missing = [c for c in spec.required_columns if c not in table.column_names]
    if missing:
        raise DataPrepError(
            f"{path}: missing column(s) {missing}; found {table.column_names}; "
            f"{spec.name} needs {list(spec.required_columns)}"
        )
    return table.select(list(spec.required_columns)).to_pylist()


def fetch_from_hub(spec: DatasetSpec, splits: Sequence[str], hub_name: str | None) -> dict[str, list[dict]]:
    """Rows per split from the Hugging Face Hub (needs network; cached by ``datasets``)."""
    name = hub_name or spec.hub_name
    if env_flag("HF_HUB_OFFLINE"):
        raise DataPrepError(
            f"no --input-dir given and HF_HUB_OFFLINE is set, so {name} cannot be fetched. {spec.download_hint}"
        )
    try:
        import datasets

        ds = datasets.load_dataset(name, spec.hub_config) if spec.hub_config else datasets.load_dataset(name)
    except Exception as e:  # noqa: BLE001 - network / hub errors come in many types
        raise DataPrepError(
            f"cannot fetch {name} from the Hugging Face Hub ({type(e).__name__}: {str(e)[:300]}). "
            f"Offline? {spec.download_hint}"
        ) from e
    out = {}
    for sp in splits:
        if sp not in ds:
            raise DataPrepError(f"hub dataset {name} has no split {sp!r}; it has {list(ds)}")
        missing = [c for c in spec.required_columns if c not in ds[sp].column_names]
        if missing:
            raise DataPrepError(f"hub dataset {name}[{sp}]: missing column(s) {missing}; found {ds[sp].column_names}")
        out[sp] = ds[sp].select_columns(list(spec.required_columns)).to_list()
    return out


# ---------------------------------------------------------------------------------------------
# tokenizer length filter


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """A tokenizer from a local directory / hub id, or a bare ``tokenizer.json`` file."""
    p = Path(path).expanduser()
    try:
        if p.is_file() and p.suffix == ".json":
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=str(p))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p) if p.exists() else path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise DataPrepError(f"--tokenizer {path}: cannot load a tokenizer ({type(e).__name__}: {e})") from e


def _token_ids(out) -> list:
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"] if isinstance(out, dict) else out.input_ids
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, list) and len(out) == 1 and isinstance(out[0], list):
        out = out[0]
    return list(out)


def prompt_length(tokenizer, messages: list[dict]) -> int:
    """Prompt tokens as verl's ``RLHFDataset`` counts them (chat template + generation prompt)."""
    if getattr(tokenizer, "chat_template", None):
        return len(_token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)))
    text = "\n".join(m["content"] for m in messages)
    return len(_token_ids(tokenizer(text, add_special_tokens=True)))


# ---------------------------------------------------------------------------------------------
# the pipeline


def make_prompt(question: str, instruction: str, system_prompt: str | None) -> list[dict]:
    content = f"{question} {instruction}" if instruction else question
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": content})
    return msgs


def convert_split(
    split: str,
    labelled_rows: list[tuple[str, dict]],
    spec: DatasetSpec,
    args: argparse.Namespace,
    tokenizer,
    report: SplitReport,
) -> list[dict]:
    """Rows (with "file:row" labels) -> RL records, counting bad / too long / sampled-out rows."""
    from tqdm import tqdm

    records: list[dict] = []
    report.read = len(labelled_rows)
    for index, (label, row) in enumerate(tqdm(labelled_rows, desc=f"{spec.name} {split}", unit="row", leave=False)):
        try:
            c = spec.convert(row)
        except BadRow as e:
            report.bad[e.reason] = report.bad.get(e.reason, 0) + 1
            if len(report.bad_examples) < 10:
                report.bad_examples.append(f"{label} {e.reason}{': ' + e.detail if e.detail else ''}")
            continue
        rec = {
            "data_source": args.data_source or spec.data_source,
            "prompt": make_prompt(c.question, args.instruction, args.system_prompt),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": c.ground_truth},
            "extra_info": {
                "split": split,
                "index": index,
                "level": c.level,
                "type": c.type,
                "question": c.question,
                "solution": c.solution,
            },
        }
        records.append(rec)

    n_bad = sum(report.bad.values())
    if report.read and n_bad / report.read > args.max_bad_frac:
        raise DataPrepError(
            f"{split}: {n_bad}/{report.read} rows unusable ({report.bad}), above --max-bad-frac "
            f"{args.max_bad_frac}; first: {'; '.join(report.bad_examples[:5])}"
        )

    if tokenizer is not None:
        kept = []
        for rec in tqdm(records, desc=f"{spec.name} {split} tokens", unit="row", leave=False):
            n = prompt_length(tokenizer, rec["prompt"])
            report.max_prompt_tokens = max(report.max_prompt_tokens, n)
            if args.max_prompt_length and n > args.max_prompt_length:
                report.too_long += 1
                continue
            if args.apply_chat_template:
                rec["prompt_text"] = tokenizer.apply_chat_template(
                    rec["prompt"], add_generation_prompt=True, tokenize=False
                )
            kept.append(rec)
        records = kept

    size = getattr(args, f"{split}_size", None)
    if size is not None and size < len(records):
        import numpy as np

        rng = np.random.default_rng(args.seed)
        pick = rng.choice(len(records), size=size, replace=False)
        if not args.shuffle:
            pick = np.sort(pick)
        report.sampled_out = len(records) - size
        records = [records[i] for i in pick.tolist()]
    elif args.shuffle:
        import numpy as np

        order = np.random.default_rng(args.seed).permutation(len(records))
        records = [records[i] for i in order.tolist()]
    if not records:
        raise DataPrepError(f"{split}: no rows left to write (read {report.read}, see the counts above)")
    report.written = len(records)
    return records


def validate_rl_parquet(path: str | Path, data_source: str | None = None, require_boxed: bool = True) -> int:
    """Check an output file against the schema above; returns its row count.

    ``require_boxed``: the user turn must ask for a ``\\boxed{}`` answer (what the reward reads).

    Raises DataPrepError naming the file, row and field of the first problem.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001
        raise DataPrepError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from e
    if not rows:
        raise DataPrepError(f"{path}: no rows")
    for i, r in enumerate(rows):
        where = f"{path} row {i}"
        for key in ("data_source", "prompt", "ability", "reward_model", "extra_info"):
            if key not in r or r[key] is None:
                raise DataPrepError(f"{where}: missing {key!r}")
        if data_source is not None and r["data_source"] != data_source:
            raise DataPrepError(f"{where}: data_source {r['data_source']!r}, expected {data_source!r}")
        if r["ability"] != "math":
            raise DataPrepError(f"{where}: ability {r['ability']!r}, expected 'math'")
        msgs = r["prompt"]
        if not isinstance(msgs, list) or not msgs or msgs[-1].get("role") != "user":
            raise DataPrepError(f"{where}: prompt must be a non-empty message list ending with a user turn")
        if any(not m.get("content") or m.get("role") not in ("system", "user", "assistant") for m in msgs):
            raise DataPrepError(f"{where}: prompt has an empty message or an unknown role")
        if require_boxed and "\\boxed" not in msgs[-1]["content"]:
            raise DataPrepError(f"{where}: user turn does not ask for a \\boxed{{}} answer")
        rm = r["reward_model"]
        if rm.get("style") != "rule" or not (rm.get("ground_truth") or "").strip():
            raise DataPrepError(f"{where}: reward_model must be style 'rule' with a non-empty ground_truth, got {rm}")
        ei = r["extra_info"]
        missing = [k for k in EXTRA_INFO_FIELDS if k not in ei]
        if missing:
            raise DataPrepError(f"{where}: extra_info lacks {missing}")
        if ei["split"] not in SPLITS or not isinstance(ei["index"], int) or ei["index"] < 0:
            raise DataPrepError(f"{where}: extra_info split/index invalid: {ei['split']!r}/{ei['index']!r}")
    return len(rows)


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(ap: argparse.ArgumentParser, spec: DatasetSpec) -> None:
    ap.add_argument(
        "--input-dir",
        dest="input_dir",
        default=None,
        help=f"dataset folder as downloaded ({spec.subdirs[0]}/{{train,test}}-*.parquet); omit to fetch "
        f"{spec.hub_name} from the Hugging Face Hub (needs network)",
    )
    add_out(ap, "--local_dir", dest="local_dir", metavar="DIR", default=spec.default_local_dir,
            help=f"output folder (train.parquet, test.parquet; default {spec.default_local_dir})")
    ap.add_argument(
        "--hub-name", default=None, help=f"hub dataset to fetch without --input-dir (default {spec.hub_name})"
    )
    ap.add_argument("--splits", default="train,test", help="comma-separated splits to convert (default train,test)")
    ap.add_argument("--train-size", type=positive_int, default=None, help="sample this many train rows (default: all)")
    ap.add_argument("--test-size", type=positive_int, default=None, help="sample this many test rows (default: all)")
    ap.add_argument("--seed", type=int, default=42, help="seed for sampling / shuffling")
    ap.add_argument("--shuffle", action="store_true", help="shuffle output rows (default: source order)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir / hub id / tokenizer.json for length filtering")
    ap.add_argument("--trust-remote-code", action="store_true", help="passed to AutoTokenizer.from_pretrained")
    ap.add_argument(
        "--max-prompt-length",
        type=positive_int,
        default=None,
        help="drop prompts longer than this many tokens (chat template applied, as verl counts); needs --tokenizer",
    )
    ap.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="also store the templated prompt string in a 'prompt_text' column (verl itself always "
        "templates 'prompt' at rollout); needs --tokenizer with a chat template",
    )
    ap.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each problem (after a space)")
    ap.add_argument("--system-prompt", default=None, help="optional system message")
    ap.add_argument("--data-source", default=None, help=f"data_source to write (default {spec.data_source})")
    ap.add_argument(
        "--max-bad-frac",
        type=fraction,
        default=0.01,
        help="fail if more than this fraction of a split is unusable (e.g. no boxed answer); default 0.01",
    )
    # the seed's spellings (toolkits/verl_data_preprocessing, README): parse, not listed in --help
    alias(ap, "--input-dir", "--input_dir")


def check_args(args: argparse.Namespace) -> list[str]:
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    bad = [s for s in splits if s not in SPLITS]
    if not splits or bad:
        raise DataPrepError(f"--splits {args.splits!r}: allowed values are {', '.join(SPLITS)}")
    if (args.max_prompt_length or args.apply_chat_template) and not args.tokenizer:
        raise DataPrepError("--max-prompt-length / --apply-chat-template need --tokenizer")
    if "\\boxed" not in (args.instruction or ""):
        print(
            "warning: --instruction does not ask for \\boxed{}; the reward (toolkits/reward/math_reward.py) "
            "scores the last \\boxed{} answer (GSM8K also '#### N')",
            file=sys.stderr,
        )
    return splits


def run(spec: DatasetSpec, args: argparse.Namespace) -> dict:
    """Convert, write atomically, validate; return the summary that is also saved as JSON."""
    t0 = time.monotonic()
    splits = check_args(args)
    tokenizer = None
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code)
        if args.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataPrepError(f"--apply-chat-template: tokenizer {args.tokenizer} has no chat template")
        if not getattr(tokenizer, "chat_template", None):
            print(
                f"warning: tokenizer {args.tokenizer} has no chat template; lengths are counted on the raw "
                "text, and verl's data.filter_overlong_prompts will fail on it",
                file=sys.stderr,
            )

    reports = {sp: SplitReport() for sp in splits}
    labelled: dict[str, list[tuple[str, dict]]] = {}
    inputs: list[dict] = []
    if args.input_dir:
        files = find_split_files(args.input_dir, spec, splits)
        for sp in splits:
            labelled[sp] = []
            for f in files[sp]:
                rows = read_parquet_rows(f, spec)
                labelled[sp] += [(f"{f}:{i}", r) for i, r in enumerate(rows)]
                reports[sp].files.append(str(f))
                inputs.append({"file": str(f), "rows": len(rows), "sha256": sha256_file(f)})
            if not labelled[sp]:
                raise DataPrepError(f"{sp}: {', '.join(map(str, files[sp]))} contain no rows")
    else:
        hub = fetch_from_hub(spec, splits, args.hub_name)
        for sp in splits:
            name = args.hub_name or spec.hub_name
            labelled[sp] = [(f"hub:{name}[{sp}]:{i}", r) for i, r in enumerate(hub[sp])]
            reports[sp].files.append(f"hub:{name}[{sp}]")
            inputs.append({"file": f"hub:{name}[{sp}]", "rows": len(hub[sp])})
            if not labelled[sp]:
                raise DataPrepError(f"hub dataset {name}[{sp}] is empty")

    out_dir = Path(args.local_dir).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise DataPrepError(f"--out {out_dir} exists and is not a directory")
    records = {sp: convert_split(sp, labelled[sp], spec, args, tokenizer, reports[sp]) for sp in splits}
    # Every output of the run is written to a staging sibling and swapped in at once (commit_staged):
    # a failure (bad row, disk full, read-only, interrupt) leaves the previous run as it was, never a mix.
    staging = make_staging(out_dir)
    try:
        for sp in splits:
            path = staging / f"{sp}.parquet"
            write_records_atomic(path, records[sp], with_prompt_text=bool(args.apply_chat_template))
            validate_rl_parquet(
                path, args.data_source or spec.data_source, require_boxed="\\boxed" in (args.instruction or "")
            )
        summary = _summary(spec, args, out_dir, inputs, reports, t0)
        write_text_atomic(staging / SUMMARY, json.dumps(summary, indent=1, default=str) + "\n")
        commit_staged(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _report(spec, args, out_dir, reports, summary)
    return summary


SUMMARY = "prep_summary.json"
#: What one run of data prep writes; a new run replaces all of them (a split it does not write is removed).
OUTPUTS = tuple(f"{sp}.parquet" for sp in SPLITS) + (SUMMARY,)


def make_staging(out_dir: Path) -> Path:
    """A new empty staging directory beside OUT_DIR (creating OUT_DIR's parent), with the permissions a plain
    ``mkdir`` gives (mkdtemp's 0700 would become OUT_DIR's when it is swapped in)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(staging, 0o777 & ~mask)
    return staging


def commit_staged(staging: Path, out_dir: Path, outputs: Sequence[str] = OUTPUTS) -> None:
    """Make STAGING's outputs the contents of OUT_DIR, replacing the previous run's OUTPUTS (the names a
    run of the tool writes; every data tool, ``synthetic`` included, commits through here).

    An OUTPUTS name in OUT_DIR that is not a file (a directory of the user's) is refused before anything
    moves. OUT_DIR absent or holding only OUTPUTS: one directory swap. Otherwise (the user keeps other files
    there, which are left untouched) the previous outputs are moved aside, then the new ones moved in:
    renames only, nothing to write, so it cannot run out of space half-way."""
    for name in outputs:
        p = out_dir / name
        if p.exists() and not p.is_file():
            raise DataPrepError(f"{p}: not a file, so this run's {name} cannot replace it; nothing was replaced "
                                f"(move it away, or choose another --out)")
    if not out_dir.exists() or all(p.name in outputs for p in out_dir.iterdir()):
        replace_dir(staging, out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    old.mkdir()
    for name in outputs:
        if (out_dir / name).exists():
            os.replace(out_dir / name, old / name)
    for p in staging.iterdir():
        os.replace(p, out_dir / p.name)
    shutil.rmtree(old, ignore_errors=True)


def _summary(spec, args, out_dir, inputs, reports, t0) -> dict:
    return {
        "dataset": spec.name,
        "data_source": args.data_source or spec.data_source,
        "output_dir": str(out_dir),
        "inputs": inputs,
        "splits": {sp: vars(r) for sp, r in reports.items()},
        "options": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "seconds": round(time.monotonic() - t0, 2),
    }


def _report(spec, args, out_dir, reports, summary) -> None:
    for sp, r in reports.items():
        if r.bad:
            print(
                f"warning: {spec.name} {sp}: dropped {sum(r.bad.values())} unusable row(s) {r.bad}; "
                f"e.g. {'; '.join(r.bad_examples[:3])}",
                file=sys.stderr,
            )
    parts = []
    for sp, r in reports.items():
        p = f"{sp} {r.read} read"
        if r.bad:
            p += f", {sum(r.bad.values())} unusable"
        if args.max_prompt_length:
            p += f", {r.too_long} over {args.max_prompt_length} tokens"
        if r.sampled_out:
            p += f", {r.sampled_out} sampled out"
        parts.append(p + f", {r.written} written")
    print(f"{spec.name}: {'; '.join(parts)} -> {out_dir} in {summary['seconds']:.1f}s")


def main_for(spec: DatasetSpec, argv: list[str] | None = None, prog: str | None = None, doc: str | None = None) -> int:
    """The CLI of one dataset; errors are mapped to one line and exit 2 by the caller's ``@cli_main``."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, spec)
    args = ap.parse_args(argv)
    run(spec, args)
    return 0
