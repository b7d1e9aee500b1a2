#!/usr/bin/env python
"""MLA/MoE correctness: Megatron-core vs HuggingFace, per layer, forward and gradients (seed-compatible).

    python examples/deepseek_v3/test_mla_moe_correctness.py --hf-model-path /path/to/hf/model \
        --test-tp 2 --test-pp 1 [--test-ep 1] [--test-etp 1] --test-batch-size 2 --test-seq-length 512 [--debug]

Compares megatron-core at the given layout (all processes of one node: NCCL on GPUs, gloo on CPU)
against transformers' DeepseekV3ForCausalLM on the same checkpoint: MLA output, router scores and
top-k, MoE routed and shared-expert outputs, layer outputs, logits, loss and every parameter's
gradient. Prints the report of docs/correctness.md and exits 1 on FAIL. Without --hf-model-path a
random tiny DeepSeek-V3 is written first. Everything else: ``python -m dsv3_rl.correctness --help``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main(argv: list[str] | None = None) -> int:
    from dsv3_rl.errors import run_main

    return run_main(_main, argv)  # bad input: one `error: ...` line, exit 2


def _main(argv: list[str]) -> int:
    from dsv3_rl.cliargs import usage_errors
    from dsv3_rl.correctness.cli import quiet

    quiet()
    from dsv3_rl.correctness import faults, layouts
    from dsv3_rl.correctness.runner import Options, run_suite

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-model-path", help="HF DeepSeek-V3 checkpoint (default: a random tiny model)")
    ap.add_argument("--test-tp", type=int, default=1)
    ap.add_argument("--test-pp", type=int, default=1)
    ap.add_argument("--test-ep", type=int, default=1)
    ap.add_argument("--test-etp", type=int, default=1)
    ap.add_argument("--test-vpp", type=int, default=None)
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="default: on when TP > 1 (megatron requires it to train MoE + TP)")
    ap.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "allgather"])
    ap.add_argument("--nproc", type=int, help="processes (default: the smallest world the layout fits)")
    ap.add_argument("--test-batch-size", type=int, default=2)
    ap.add_argument("--test-seq-length", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--with-single-process", action="store_true", help="also run the TP1 layout")
    ap.add_argument("--plant-fault", choices=list(faults.FAULTS))
    ap.add_argument("--model", dest="preset", default="tiny", help="model preset of the random model when no --hf-model-path")
    ap.add_argument("--weights", help="already converted megatron dist checkpoint")
    ap.add_argument("--calibrate", action="store_true", help="also report transformers-bf16 vs fp32")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--work")
    ap.add_argument("--keep-work", action="store_true")
    ap.add_argument("--debug", action="store_true")
    a = ap.parse_args(argv)
    lay = layouts.from_sizes(a.test_tp, a.test_pp, a.test_ep, a.test_etp, a.test_vpp, a.sequence_parallel,
                             a.dispatcher, a.nproc)
    lays = ([layouts.get("tp1")] if a.with_single_process and lay.name != "tp1" else []) + [lay]
    o = Options(hf_model_path=a.hf_model_path, layouts=lays, dtype=a.dtype, batch_size=a.test_batch_size,
                seq_length=a.test_seq_length, micro_batch_size=a.micro_batch_size, fault=a.plant_fault,
                work=a.work, keep_work=a.keep_work, debug=a.debug, json_out=a.json_out, weights=a.weights,
                preset=a.preset, calibrate=a.calibrate)
    print(f"Validating the MLA/MoE implementation: megatron-core at {lay.describe()} vs HuggingFace ...", flush=True)
    with usage_errors(ValueError):
        return run_suite(o, out=lambda s: print(s, flush=True))


if __name__ == "__main__":
    sys.exit(main())
