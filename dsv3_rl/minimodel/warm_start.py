"""Warm start of the tiny DeepSeek-V3 for the learning demo: a short supervised run with transformers' Trainer.

    dsv3-warm-start --data examples/deepseek_v3/data/identity-arith \\
        --out examples/deepseek_v3/models/dsv3-tiny-warm

Two phases on the synthetic task (:mod:`dsv3_rl.data.synthetic`), both ``transformers.Trainer`` runs on
the ``tiny-vllm`` model written by :mod:`dsv3_rl.minimodel.mini_model` (seed 0), fp32, CPU:

1. *learn*: supervised on the train split's prompts (chat template + generation prompt, exactly what
   verl sends to vLLM) with the right answers (``\\boxed{d}`` + EOS); the model learns to read the digit
   out of phrasings it never saw (held-out validation pairs reach the same accuracy);
2. *mislead*: the same prompts with one wrong answer (``\\boxed{0}``, never right: digits are 1..9), at a
   20x smaller learning rate, stopped at the first step where the probability of the right answer
   (teacher-forced, averaged over the validation prompts, computed on the bf16 weights that are
   shipped) falls below ``--target``. Measured: the right digit's logit falls long before ``0`` gains
   (p(``\\boxed{0}``) stays < 0.001), so the answer token's probability spreads over the vocabulary:
   the model still writes ``\\boxed{`` (p > 0.99) and then the right digit ~15% of the time, otherwise
   some other token (``\\boxed{ean}``). It answers in the right format and mostly wrong, but has kept
   what it learned: GRPO can recover it under the policy gradient alone.

Writes OUT (built in a temporary sibling ``OUT.tmp-PID``, renamed when complete): ``model.safetensors``
(bf16, the mini model's tensor names and dtypes), ``config.json``, the tokenizer files and ``warm_start.json``
(the settings and the measured probabilities). Deterministic for a given torch build: seed 0, one thread.

Checked before anything is trained or written: ``--data`` holds both splits with the ``problem`` and
``solution`` columns and a ``\\boxed{}`` answer in every solution; ``--target`` is strictly between 0 and 1;
OUT is new, empty or an earlier warm start (it holds ``warm_start.json``): a directory of the user's is
refused, never replaced. Any failure or an interrupt removes ``OUT.tmp-PID``; a rerun starts over (the two
phases take ~4 minutes on 2 cores, nothing is resumed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from dsv3_rl.checkpoint.outputs import refuse_foreign_dir
from dsv3_rl.cliargs import non_negative_int, open_fraction
from dsv3_rl.errors import Dsv3Error, cli_main
from dsv3_rl.fs import replace_dir

PHASE1 = {"steps": 300, "lr": 1e-3}
PHASE2 = {"max_steps": 150, "lr": 5e-5}
BATCH = 32
WRONG = "0"
MARKER = "warm_start.json"  # in every output of this tool (an OUT holding it may be replaced)
SPLITS = ("train", "test")
COLUMNS = ("problem", "solution")


class WarmStartError(Dsv3Error, ValueError):
    """Bad --data, --out or --target; the message names the file or flag and what was expected."""


def read_task(data_dir: Path) -> dict[str, list[dict]]:
    """The rows of DATA_DIR's two splits; WarmStartError naming the file and what is expected when they are
    missing, unreadable, lack a column or a solution lacks its \\boxed{} answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dsv3_rl.reward.answer import last_boxed_answer

    expected = (f"expected the synthetic task in MATH layout: data/{{{','.join(SPLITS)}}}-00000-of-00001.parquet "
                f"with columns {', '.join(COLUMNS)} (write it with: dsv3-prep-data synthetic --out {data_dir})")
    if not data_dir.is_dir():
        raise WarmStartError(f"--data {data_dir}: no such directory; {expected}")
    splits = {}
    for split in SPLITS:
        path = data_dir / "data" / f"{split}-00000-of-00001.parquet"
        if not path.is_file():
            raise WarmStartError(f"--data {data_dir}: {path} not found; {expected}")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise WarmStartError(f"{path}: not a readable parquet file ({' '.join(str(e).split())[:160]}); "
                                 f"{expected}") from None
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise WarmStartError(f"{path}: no column {', '.join(missing)} (it has {', '.join(table.column_names)}); "
                                 f"{expected}")
        rows = table.select(list(COLUMNS)).to_pylist()
        if not rows:
            raise WarmStartError(f"{path}: no rows; {expected}")
        for i, r in enumerate(rows):
            if not isinstance(r["problem"], str) or not r["problem"] or not isinstance(r["solution"], str) \
                    or last_boxed_answer(r["solution"]) in (None, ""):
                raise WarmStartError(f"{path}: row {i} has no problem text or no \\boxed{{}} answer in its solution "
                                     f"({str(r['solution'])[:60]!r}); {expected}")
        splits[split] = rows
    return splits


def check_out(out: Path) -> None:
    """OUT may be missing, empty or an earlier warm start; anything else is refused (nothing is replaced)."""
    if not (out / MARKER).is_file():
        refuse_foreign_dir(out, MARKER, WarmStartError)


def _examples(tok, rows: list[dict], answer_of) -> list[dict]:
    from dsv3_rl.data.common import DEFAULT_INSTRUCTION, make_prompt

    out = []
    for r in rows:
        prompt = tok.apply_chat_template(make_prompt(r["problem"], DEFAULT_INSTRUCTION, None),
                                         add_generation_prompt=True, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(f"\\boxed{{{answer_of(r)}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": p + a, "labels": [-100] * len(p) + a, "n_prompt": len(p)})
    return out


def _collate(pad_id: int):
    import torch

    def collate(batch: list[dict]) -> dict:
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), -100, dtype=torch.long)
        att = torch.zeros((len(batch), n), dtype=torch.long)
        for i, b in enumerate(batch):
            k = len(b["input_ids"])
            ids[i, :k] = torch.tensor(b["input_ids"])
            labels[i, :k] = torch.tensor(b["labels"])
            att[i, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": att}

    return collate


def p_right(model, examples: list[dict], dtype=None) -> float:
    """Mean probability of the whole right response (teacher forced), optionally in another dtype."""
    import copy

    import torch

    m = copy.deepcopy(model).to(dtype) if dtype is not None else model
    tot = 0.0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e["input_ids"]])
            logp = torch.log_softmax(m(ids).logits[0, :-1].float(), -1)
            tgt = ids[0, 1:]
            lp = logp.gather(-1, tgt[:, None])[:, 0][e["n_prompt"] - 1:]
            tot += float(lp.sum().exp())
    return tot / len(examples)


def _args(out: Path, steps: int, lr: float, seed: int):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=steps,
                             learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=seed,
                             data_seed=seed, dataloader_num_workers=0, remove_unused_columns=False)


def warm_start(data_dir: Path, out: Path, target: float = 0.2, seed: int = 0) -> dict:
    """Train and write OUT (see the module doc); checks --data and OUT first; OUT.tmp-PID never outlives it."""
    splits = read_task(data_dir)
    check_out(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        return _train(splits, data_dir, out, tmp, target, seed)
    finally:  # success: tmp is empty (the model was renamed to OUT); failure or interrupt: nothing half-written
        shutil.rmtree(tmp, ignore_errors=True)


def _train(splits: dict[str, list[dict]], data_dir: Path, out: Path, tmp: Path, target: float, seed: int) -> dict:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback

    from dsv3_rl.minimodel.mini_model import write_mini_model

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    base = write_mini_model("tiny-vllm", tmp / "base", seed=seed, dtype="bf16")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    from dsv3_rl.reward.answer import last_boxed_answer

    right = lambda r: last_boxed_answer(r["solution"])  # noqa: E731
    train_ok, val_ok = _examples(tok, splits["train"], right), _examples(tok, splits["test"], right)
    train_wrong = _examples(tok, splits["train"], lambda r: WRONG)
    collate = _collate(tok.pad_token_id)
    t0 = time.time()
    Trainer(model=model, args=_args(tmp / "trainer", PHASE1["steps"], PHASE1["lr"], seed), train_dataset=train_ok,
            data_collator=collate).train()
    learned = {"train": p_right(model, train_ok), "validation": p_right(model, val_ok)}
    print(f"[warm-start] learn: {PHASE1['steps']} steps, p(right) train {learned['train']:.3f} "
          f"validation {learned['validation']:.3f} ({time.time() - t0:.0f}s)", flush=True)

    class StopAtTarget(TrainerCallback):
        def __init__(self):
            self.trace: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            p = p_right(model, val_ok, torch.bfloat16)
            self.trace.append(round(p, 4))
            if p < target:
                control.should_training_stop = True

    stop = StopAtTarget()
    Trainer(model=model, args=_args(tmp / "trainer", PHASE2["max_steps"], PHASE2["lr"], seed), train_dataset=train_wrong,
            data_collator=collate, callbacks=[stop]).train()
    final = {"train": p_right(model, train_ok, torch.bfloat16), "validation": p_right(model, val_ok, torch.bfloat16)}
    if final["validation"] >= target:
        raise WarmStartError(f"--target {target}: the mislead phase did not bring p(right) below {target} in {PHASE2['max_steps']} steps "
                           f"(trace {stop.trace})")
    print(f"[warm-start] mislead: {len(stop.trace)} steps, p(right) bf16 train {final['train']:.3f} "
          f"validation {final['validation']:.3f} (trace {stop.trace})", flush=True)

    # the mini model's files, its tensor names and dtypes, the trained values
    # (save_pretrained maps transformers' fused experts back to the checkpoint's names; the dtypes are the
    # mini model's: bf16, the router's expert bias fp32)
    model.save_pretrained(tmp / "saved")
    saved = {}
    for p in sorted((tmp / "saved").glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            saved.update({k: f.get_tensor(k) for k in f.keys()})
    tensors = {}
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        if set(f.keys()) != set(saved):
            raise RuntimeError(f"trained tensor names differ from the mini model's: {sorted(set(f.keys()) ^ set(saved))[:5]}")
        for k in f.keys():
            dt = torch.float32 if f.get_slice(k).get_dtype() == "F32" else torch.bfloat16
            tensors[k] = saved[k].to(dt).contiguous()
    shutil.rmtree(tmp / "trainer", ignore_errors=True)
    shutil.rmtree(tmp / "saved", ignore_errors=True)
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    info = {"tool": "python -m dsv3_rl.minimodel.warm_start", "model": "tiny-vllm", "seed": seed, "data": str(data_dir),
            "batch": BATCH, "learn": {**PHASE1, "p_right": learned},
            "mislead": {"answer": WRONG, "lr": PHASE2["lr"], "steps": len(stop.trace), "target": target,
                        "trace": stop.trace, "p_right_bf16": final},
            "torch": torch.__version__, "seconds": round(time.time() - t0, 1)}
    (base / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    replace_dir(base, out)
    return info


@cli_main(interrupted="nothing half-written is kept (OUT.tmp-PID removed); rerun the same command to start over")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-warm-start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, type=Path, help="synthetic task in MATH layout (dsv3_rl.data.synthetic)")
    ap.add_argument("--out", required=True, type=Path,
                    help="HF checkpoint directory to write (new, empty, or an earlier warm start)")
    ap.add_argument("--target", type=open_fraction, default=0.2,
                    help="stop misleading below this p(right), strictly between 0 and 1 (default 0.2)")
    ap.add_argument("--seed", type=non_negative_int, default=0)
    args = ap.parse_args(argv)
    info = warm_start(args.data, args.out, args.target, args.seed)
    print(f"[warm-start] wrote {args.out}: p(right) validation {info['mislead']['p_right_bf16']['validation']:.3f} "
          f"in {info['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
