#!/usr/bin/env python3
"""Log-prob + entropy from the logits: verl's unfused path against patch 0041's chunked path (issue 40, item 2).

verl's Megatron engine turns the last stage's logits (tokens x vocab/TP) into log-probs and entropy in its logits
processor (``MegatronEngineWithLMHead._lm_head_logits_processor``). Upstream clones the logits for the entropy,
keeps the entropy's softmax and megatron's fp32 copy of the logits for the cross entropy; with
``log_prob_chunk_size`` > 0 (patch 0041) both come from one pass over CHUNK tokens at a time in fp32. This script
runs that very function both ways on one rank (TP1, gloo) for TOKENS x VOCAB logits in DTYPE, in the two phases
verl runs it: the log-prob phase (no grad: the old and reference log-probs) and the update (forward + backward
of log-probs and entropy). Per path and phase: seconds (best of --repeat) and the peak of memory allocated
above the logits themselves (CUDA: torch.cuda.max_memory_allocated; CPU: the allocator's total in torch.profiler's
memory events), and the largest difference from the unfused path's numbers.

    python bench/bench_logprob.py                                  # CPU: 4096 tokens x 32320 (129280 / TP4), bf16
    python bench/bench_logprob.py --device cuda --tokens 8192      # a GPU

Prints one summary line; ``--json FILE`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run from a bare checkout

from dsv3_rl.cliargs import positive_int  # noqa: E402
from dsv3_rl.errors import Dsv3Error, cli_main  # noqa: E402
from dsv3_rl.fs import write_json_atomic  # noqa: E402
from dsv3_rl.ports import free_port  # noqa: E402


def _peak_cpu_bytes(fn) -> int:
    """Peak of bytes allocated by FN above what was allocated before it: the largest "Total Allocated" of
    torch.profiler's memory events (the CPU allocator's running total) less the total before FN's first one."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    before = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]  # what was allocated when FN began
    return max(e["args"]["Total Allocated"] for e in mem) - before


def _peak_bytes(fn, device: str) -> int:
    if device == "cpu":
        return _peak_cpu_bytes(fn)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@cli_main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, default=4096)
    ap.add_argument("--vocab", type=positive_int, default=32320, help="the vocabulary on one TP rank (129280 / TP4)")
    ap.add_argument("--chunk", type=positive_int, default=1024, help="log_prob_chunk_size of the chunked path")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--repeat", type=positive_int, default=3)
    ap.add_argument("--direct", action="store_true",
                    help="call verl's tensor_parallel functions as the logits processor does (its three lines), "
                         "importing that one module only (dsv3_rl.refit.verl_export): a GPU box without verl's "
                         "engine dependencies (tensordict, Ray)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise Dsv3Error("--device cuda: no CUDA device visible (allowed: cpu, cuda)")

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("VERL_PLATFORM", "cpu" if a.device == "cpu" else "nvidia")  # verl's platform names: nvidia, amd, huawei, cpu
    dist.init_process_group("gloo" if a.device == "cpu" else "nccl", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu

    if a.direct:
        from dsv3_rl.refit import verl_export

        tp = verl_export.import_module("verl.utils.megatron.tensor_parallel")
    else:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    mpu.initialize_model_parallel(tensor_model_parallel_size=1)
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(1, a.tokens, a.vocab, generator=g) * 3).to(dtype).to(dev)
    labels = torch.randint(0, a.vocab, (1, a.tokens), generator=g).to(dev)
    temperature = torch.ones(1, a.tokens, device=dev)

    def direct(chunk: int, logits: torch.Tensor) -> dict:
        """What _lm_head_logits_processor runs with calculate_entropy (patch 0041's branch or upstream's)."""
        logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))
        if chunk > 0:
            lp, ent = tp.vocab_parallel_log_probs_and_entropy_chunked(logits, labels, chunk, True)
            return {"log_probs": lp, "entropy": ent}
        bak = logits.clone()
        ent = tp.vocab_parallel_entropy(logits)
        return {"entropy": ent, "log_probs": tp.vocab_parallel_log_probs_from_logits(bak, labels)}

    def processor(chunk: int, logits: torch.Tensor, grad: bool) -> dict:
        with torch.set_grad_enabled(grad):
            if a.direct:
                ret = direct(chunk, logits)
            else:
                cfg = types.SimpleNamespace(engine_config=types.SimpleNamespace(
                    log_prob_chunk_size=chunk, entropy_from_logits_with_chunking=False,
                    entropy_from_logits_chunk_size=2048))
                ret = MegatronEngineWithLMHead._lm_head_logits_processor(
                    cfg, logits, labels, temperature.clone(), calculate_sum_pi_squared=False, calculate_entropy=True,
                    distillation_use_topk=False, distillation_only=False, logits_processor_func=None, batch=None,
                    data_format="thd")
            if grad:
                (ret["log_probs"].float().sum() + ret["entropy"].float().sum()).backward()
        return ret

    def phase(chunk: int, grad: bool):
        leaf = base.clone().requires_grad_(grad)
        logits = leaf.clone() if grad else leaf  # the model's output is not a leaf (divided in place)

        def go():
            out = processor(chunk, logits, grad)
            return {k: v.detach().float() for k, v in out.items()}
        return go

    rows, results = {}, {}
    for name, chunk in (("unfused", 0), ("chunked", a.chunk)):
        for ph, grad in (("log_prob", False), ("update", True)):
            secs = []
            for _ in range(a.repeat):
                fn = phase(chunk, grad)
                if a.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                results[(name, ph)] = fn()
                if a.device == "cuda":
                    torch.cuda.synchronize()
                secs.append(time.perf_counter() - t0)
            peak = _peak_bytes(phase(chunk, grad), a.device)
            rows[f"{name}/{ph}"] = {"seconds": round(min(secs), 4), "peak_bytes": int(peak),
                                    "peak_bytes_per_token_per_vocab": round(peak / (a.tokens * a.vocab), 2)}
    for ph in ("log_prob", "update"):
        u, c = results[("unfused", ph)], results[("chunked", ph)]
        rows[f"chunked/{ph}"]["max_abs_diff_vs_unfused"] = {k: float((u[k] - c[k]).abs().max()) for k in u}
    logits_bytes = base.numel() * base.element_size()
    out = {"tokens": a.tokens, "vocab_per_rank": a.vocab, "chunk": a.chunk, "dtype": a.dtype, "device": a.device,
           "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "path": "direct" if a.direct else "logits processor", "logits_bytes": logits_bytes, "rows": rows}
    if a.json:
        write_json_atomic(a.json, out, indent=1)
    for k, r in rows.items():
        print(f"  {k:18s} {r['seconds']:8.3f} s  peak {r['peak_bytes'] / 2**20:9.1f} MiB "
              f"({r['peak_bytes_per_token_per_vocab']:.2f} B per token x vocab)", flush=True)
    gib = 2**30
    print(f"[bench_logprob] {a.device} {a.dtype} {a.tokens} tokens x {a.vocab} vocab (logits {logits_bytes / gib:.2f} "
          f"GiB), chunk {a.chunk}: log-prob peak {rows['unfused/log_prob']['peak_bytes'] / gib:.2f} -> "
          f"{rows['chunked/log_prob']['peak_bytes'] / gib:.2f} GiB, {rows['unfused/log_prob']['seconds']:.2f} -> "
          f"{rows['chunked/log_prob']['seconds']:.2f} s; update peak {rows['unfused/update']['peak_bytes'] / gib:.2f} "
          f"-> {rows['chunked/update']['peak_bytes'] / gib:.2f} GiB, {rows['unfused/update']['seconds']:.2f} -> "
          f"{rows['chunked/update']['seconds']:.2f} s; log-probs equal to "
          f"{rows['chunked/update']['max_abs_diff_vs_unfused']['log_probs']:.1e}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
