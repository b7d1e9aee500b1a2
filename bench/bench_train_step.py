#!/usr/bin/env python
"""One training step (forward + backward) of a DeepSeek-V3-shaped proxy: megatron-core's
Transformer-Engine-free fast path (patches 0012 SDPA attention, 0013 grouped-GEMM experts) and its
Transformer Engine spec against transformers' DeepseekV3ForCausalLM (sdpa), same config, same tokens,
bf16, in one process.

    python bench/bench_train_step.py --grouped auto,off               # 1 GPU: transformers vs megatron-core
    python bench/bench_train_step.py --spec te,local                  # 1 GPU: TE spec vs local spec vs transformers
    torchrun --nproc-per-node 2 bench/bench_train_step.py --layout tp=2,etp=1 --layout ep=2,etp=1
                          # megatron TP2 (+SP) and EP2 (DP2 for dense params); transformers on rank 0
    python bench/bench_train_step.py --cpu-smoke                      # tiny preset, 64 tokens, CPU: code path only

The proxy (``--model proxy``, dsv3_rl/models/presets.py): DeepSeek-V3's real layer dims (hidden
7168, 128 heads, MLA q/k 192 / v 128, vocab 129280, yarn rope), 4 layers (1 dense + 3 MoE),
16 routed experts top-8 (group-limited 8/4) + 1 shared, 5.2B parameters.

``--spec`` picks megatron-core's layer spec (comma list, each run in turn): ``te`` (Transformer Engine
modules: TELayerNormColumnParallelLinear, TEDotProductAttention with the backend TE selects, TEGroupedMLP
experts), ``local`` (the TE-free path as it runs on a machine without TE: SDPA attention and grouped-GEMM
experts are forced on when TE is installed, since megatron would otherwise pick its unfused/loop paths), or
``auto`` (te when Transformer Engine is installed, else local; the default). With CUDA the one-cuDNN check
(dsv3_rl.mcore.te_env) runs before any GPU work: a second cuDNN (TE's) beside torch's is one error line.

Each engine: build (random init on the GPU), ``--warmup`` steps (first one compiles megatron's
jit-fused kernels and picks the SDPA/grouped-GEMM kernels), then ``--iters`` timed steps, each
``torch.cuda.synchronize()``-bracketed; step time is the median. A step is forward, token-mean
cross entropy over all tokens and backward, with gradients into fresh bf16 ``.grad`` tensors
(megatron single GPU; transformers). With more than one GPU megatron runs in its
DistributedDataParallel (bf16 grad buffer) and the step includes ``finalize_model_grads`` (the
data-parallel/SP gradient all-reduces). Peak memory: ``torch.cuda.max_memory_allocated`` over
warmup + timed steps (max over ranks), weights and grads included. tokens/s counts the global
batch (data-parallel ranks x ``--seq``).

megatron-core runs with its GPU fusions on (bias_activation_fusion, bias_dropout_fusion,
cross_entropy_loss_fusion native; ``--no-fusions`` turns them off) and
``moe_sequential_grouped_mm`` from ``--grouped`` (a comma list runs several variants:
``--grouped auto,off`` compares grouped GEMM with the per-expert loop). transformers runs its
defaults (``attn_implementation="sdpa"``, its default experts implementation).

Prints one summary line; ``--json FILE`` also writes every number (atomically).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

from dsv3_rl import cliargs
from dsv3_rl.errors import run_main
from dsv3_rl.fs import write_json_atomic

GiB = 1024**3


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="bench/bench_train_step.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", dest="preset", default="proxy", help="dsv3_rl.models.presets preset (default: proxy)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (micro-batch 1)")
    ap.add_argument("--engines", default="hf,mcore", help="comma list: hf, mcore")
    ap.add_argument("--layout", dest="layouts", action="append", type=cliargs.layout, default=None,
                    metavar="tp=..,ep=..,etp=..",
                    help="a megatron layout to run in this process (repeatable; dsv3_rl.layout.Layout fields: tp, ep, "
                         "etp, ...; default tp=1,etp=1)")
    ap.add_argument("--grouped", default="auto", help="moe_sequential_grouped_mm variants: comma list of auto,on,off")
    ap.add_argument("--spec", default="auto", help="megatron layer spec(s): comma list of auto, te, local")
    ap.add_argument("--attention-backend", default="auto", help="megatron attention_backend (auto: SDPA without TE)")
    ap.add_argument("--no-fusions", action="store_true", help="megatron without its jit-fused swiglu/bda/cross-entropy")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="also profile one step and print the top N kernels")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny preset, 64 tokens, CPU allowed (checks the code path)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.preset, args.seq, args.warmup, args.iters = "tiny", 64, 1, 2
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engines if e not in ("hf", "mcore")]
    if bad:
        ap.error(f"--engines: unknown {bad}; allowed: hf, mcore")
    if args.layouts is None:
        args.layouts = [cliargs.layout("tp=1,etp=1")]
    args.specs = [x.strip() for x in args.spec.split(",") if x.strip()]
    bad = [x for x in args.specs if x not in ("auto", "te", "local")]
    if bad or not args.specs:
        ap.error(f"--spec: unknown {bad or args.spec!r}; allowed: auto, te, local")
    args.grouped = [g.strip() for g in args.grouped.split(",") if g.strip()]
    bad = [g for g in args.grouped if g not in ("auto", "on", "off")]
    if bad:
        ap.error(f"--grouped: unknown {bad}; allowed: auto, on, off")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and (ARGS.cpu_smoke or os.environ.get("CUDA_VISIBLE_DEVICES") == ""):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # compile buys nothing on a tiny CPU run

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# --------------------------------------------------------------------------- helpers


def on_cuda() -> bool:
    return torch.cuda.is_available()


def sync():
    if on_cuda():
        torch.cuda.synchronize()


def reset_peak():
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if on_cuda() else 0


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def reduce_max(x: float) -> float:
    if world() == 1:
        return x
    t = torch.tensor([float(x)], device="cuda" if on_cuda() else "cpu", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def log(msg: str):
    if rank() == 0:
        print(f"[bench_train_step] {msg}", file=sys.stderr, flush=True)


def tokens_for(vocab: int, seq: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (1, seq + 1), generator=g)
    return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)


def time_steps(step, warmup: int, iters: int, collective: bool = True) -> dict:
    """Median step time and peak memory; ``collective``: max over ranks (every rank must call)."""
    red = reduce_max if collective else (lambda x: x)
    reset_peak()
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = red(statistics.median(times))
    return {"step_ms": step_s * 1e3, "step_ms_all": [t * 1e3 for t in times], "peak_gib": red(peak_bytes()) / GiB}


def profile_step(step, top: int) -> list:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda() else [])
    with profile(activities=acts) as prof:
        step()
        sync()
    key = "self_device_time_total" if on_cuda() else "self_cpu_time_total"
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:top]:
        rows.append({"name": e.key[:90], "count": e.count, "ms": getattr(e, key, 0) / 1e3})
    return rows


def sdpa_kernel_name(q_shape, qk: int, v: int, dtype, prefer: bool) -> str:
    """Which SDPA kernel torch picks for the attention shapes (informative)."""
    if not on_cuda():
        return "cpu"
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    try:
        q = torch.empty(*q_shape[:-1], qk, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.empty_like(q)
        vv = torch.empty(*q_shape[:-1], v, device="cuda", dtype=dtype).transpose(1, 2)
        ctx = __import__("contextlib").nullcontext()
        if prefer:
            from megatron.core.transformer.dot_product_attention import _sdpa_kernel_context, sdpa_backend_order

            ctx = _sdpa_kernel_context(sdpa_backend_order(q, False))
        with ctx:
            c = int(torch._fused_sdp_choice(q.requires_grad_(), k.requires_grad_(), vv.requires_grad_(), is_causal=True))
        return names.get(c, str(c))
    except Exception as e:  # noqa: BLE001 - informative only
        return f"unknown ({type(e).__name__})"


# --------------------------------------------------------------------------- engines


def run_hf(cfg, args, device) -> dict:
    import transformers
    from transformers import DeepseekV3ForCausalLM

    dtype = torch.bfloat16
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = None
        for kw in ({"dtype": dtype}, {"torch_dtype": dtype}):
            try:
                model = DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="sdpa", **kw)
                break
            except TypeError:
                continue
        if model is None:
            cfg._attn_implementation = "sdpa"
            model = DeepseekV3ForCausalLM(cfg).to(dtype)
    model = model.to(device=device, dtype=dtype)
    model.train()
    build_s = time.perf_counter() - t0
    tokens, labels = tokens_for(cfg.vocab_size, args.seq, args.seed, device)
    ntok = tokens.numel()

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        return loss

    res = time_steps(step, args.warmup, args.iters, collective=False)  # rank 0 only
    loss = float(step().detach())
    info = {
        "engine": "transformers", "version": transformers.__version__, "tokens": ntok, "loss": loss,
        "attn": getattr(model.config, "_attn_implementation", "?"),
        "sdpa_kernel": sdpa_kernel_name((1, args.seq, cfg.num_attention_heads, 0),
                                        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, dtype, prefer=False),
        "experts": getattr(model.config, "_experts_implementation", "?"),
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9, "build_s": build_s, **res,
    }
    if args.profile:
        info["profile"] = profile_step(step, args.profile)
    model = tokens = labels = None  # free them before the next engine (step() shares these cells)
    reset_peak()
    return info


def mcore_overrides(spec: str, grouped: str, attention_backend: str, te_installed: bool) -> dict:
    """TransformerConfig overrides of one spec. local: the TE-free path as it runs without TE (SDPA core
    attention, grouped-GEMM experts; forced on where TE is installed, where megatron would pick its unfused
    attention and per-expert loop); te: TE's attention backend selection and TEGroupedMLP experts (the
    megatron recipes' --moe-grouped-gemm; grouped=off: SequentialMLP of TE linears)."""
    from megatron.core.transformer.enums import AttnBackend

    if spec == "te":
        return {"attention_backend": AttnBackend[attention_backend], "moe_grouped_gemm": grouped != "off"}
    att = "sdpa" if (attention_backend == "auto" and te_installed) else attention_backend
    want = {"auto": True if te_installed else None, "on": True, "off": False}[grouped]
    return {"attention_backend": AttnBackend[att], "moe_sequential_grouped_mm": want}


def run_mcore(cfg, args, device, grouped: str, parallel, spec: str = "local") -> dict:
    from megatron.core import parallel_state as ps

    from dsv3_rl.models.config_map import GPU_FUSIONS
    from dsv3_rl.mcore import runtime
    from dsv3_rl.mcore.te_attention_probe import te_selected_backend

    tp, ep = parallel.tp, parallel.ep
    runtime.init_distributed(parallel)
    overrides = mcore_overrides(spec, grouped, args.attention_backend, runtime.have_te())
    if on_cuda():
        overrides["use_cpu_initialization"] = False  # initialise on the GPU: seconds, not minutes
        if not args.no_fusions:
            overrides.update(GPU_FUSIONS)
    for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(k, None)
    t0 = time.perf_counter()
    chunks = runtime.build_model(cfg, parallel, dtype=torch.bfloat16, use_te=spec == "te", config_overrides=overrides)
    model = chunks[0]
    build_s = time.perf_counter() - t0
    use_ddp = world() > 1
    if use_ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
        model = DistributedDataParallel(model.config, ddp_cfg, model)
    inner = runtime.unwrap(model)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tokens, labels = tokens_for(cfg.vocab_size, args.seq, args.seed + dp_rank, device)
    pos = torch.arange(args.seq, device=device).unsqueeze(0)

    def step():
        if use_ddp:
            model.zero_grad_buffer()
        else:
            model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        if use_ddp:
            finalize_model_grads([model])
        return loss

    res = time_steps(step, args.warmup, args.iters)
    loss = float(step().detach())
    att = inner.decoder.layers[0].self_attention.core_attention
    moe = [layer.mlp.experts for layer in inner.decoder.layers if hasattr(layer.mlp, "experts")]
    if moe and type(moe[0]).__name__ == "TEGroupedMLP":
        used_grouped = "te_grouped_gemm"
    else:
        used_grouped = bool(moe) and getattr(moe[0], "grouped_mm", False) and moe[0]._use_grouped_forward(
            torch.empty(0, cfg.hidden_size, device=device, dtype=torch.bfloat16))
        used_grouped = "grouped_mm" if used_grouped else "loop"
    q_heads = inner.decoder.layers[0].self_attention.num_attention_heads_per_partition
    info = {
        "engine": "megatron-core", "spec": spec, "tokens": args.seq * dp, "loss": loss, "tp": tp, "ep": ep, "dp": dp,
        "ddp": use_ddp, "fusions": on_cuda() and not args.no_fusions,
        "attn": "sdpa" if getattr(att, "use_sdpa", False) else type(att).__name__,
        "te_attention": te_selected_backend() if spec == "te" else "-",
        "sdpa_kernel": sdpa_kernel_name((1, args.seq, q_heads, 0), cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                                        cfg.v_head_dim, torch.bfloat16, prefer=True) if getattr(att, "use_sdpa", False)
                       else te_selected_backend() if spec == "te" else "-",
        "grouped_setting": grouped, "experts": used_grouped,
        "experts_reason": getattr(moe[0], "grouped_mm_reason", "") if moe else "",
        "params_b_rank0": sum(p.numel() for p in inner.parameters()) / 1e9, "build_s": build_s, **res,
    }
    if args.profile:
        info["profile"] = profile_step(step, args.profile)
    model = inner = chunks = moe = att = None  # free them before the next engine (step() shares these cells)
    reset_peak()
    return info


# --------------------------------------------------------------------------- main


def gpu_name() -> str:
    return torch.cuda.get_device_name() if on_cuda() else "cpu"


def _gib(r) -> str:
    return f"{r['peak_gib']:.1f} GiB" if on_cuda() else "n/a (cpu)"


def summary(results: list, args, cfg) -> str:
    hf = next((r for r in results if r["engine"] == "transformers"), None)
    head = (f"bench_train_step: {args.preset} ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts "
            f"top-{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared, hidden {cfg.hidden_size}), seq {args.seq}, "
            f"bf16, {world()}x {gpu_name()}, torch {torch.__version__}"
            + (f" cuDNN {torch.backends.cudnn.version()}" if on_cuda() and torch.backends.cudnn.is_available() else ""))
    parts = [head]
    for r in results:
        tps = r["tokens"] / (r["step_ms"] / 1e3)
        r["tokens_per_s"] = tps
        if r["engine"] == "transformers":
            parts.append(f"transformers {r['version']} (attn={r['attn']}/{r['sdpa_kernel']}, experts={r['experts']}): {r['step_ms']:.1f} ms, "
                         f"{tps / 1e3:.1f}k tok/s, peak {_gib(r)}")
        else:
            s = (f"megatron-core spec={r.get('spec', 'local')} TP{r['tp']} EP{r['ep']} DP{r['dp']} (attn={r['attn']}/{r['sdpa_kernel']}, "
                 f"experts={r['experts']}, fusions={'on' if r['fusions'] else 'off'}): {r['step_ms']:.1f} ms, "
                 f"{tps / 1e3:.1f}k tok/s ({tps / world() / 1e3:.1f}k/GPU), peak {_gib(r)}/GPU")
            if hf:
                hf_tps = hf["tokens"] / (hf["step_ms"] / 1e3)
                r["speedup_vs_hf"] = tps / hf_tps
                r["speedup_per_gpu_vs_hf"] = tps / world() / hf_tps
                r["memory_vs_hf"] = r["peak_gib"] / hf["peak_gib"] if hf["peak_gib"] else float("nan")
                s += (f" -> {r['speedup_vs_hf']:.2f}x transformers tok/s"
                      + (f" ({r['speedup_per_gpu_vs_hf']:.2f}x per GPU)" if world() > 1 else "")
                      + f", {r['memory_vs_hf']:.2f}x its memory")
            if r.get("spec") == "te":  # the TE spec against the TE-free path of the same layout, same run
                loc = next((x for x in results if x.get("spec") == "local" and (x["tp"], x["ep"]) == (r["tp"], r["ep"])), None)
                if loc:
                    r["speedup_vs_local"] = loc["step_ms"] / r["step_ms"]
                    s += f"; {r['speedup_vs_local']:.2f}x the local spec's speed"
            parts.append(s)
    return " | ".join(parts)


def main() -> int:
    args = ARGS if ARGS is not None else parse_args()
    if not on_cuda() and not args.cpu_smoke:
        raise cliargs.UsageError("no CUDA device; run with --cpu-smoke for a CPU check of the code path")
    if on_cuda():
        try:  # a jit-fused kernel that cannot compile (no compiler, no triton) runs eagerly instead
            import torch._dynamo

            torch._dynamo.config.suppress_errors = True
        except (ImportError, AttributeError):
            pass
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime, te_env
    from dsv3_rl.models.presets import hf_config

    if on_cuda():
        te_env.check_cudnn()  # before any GPU work: TE's cuDNN beside torch's is one error line (exit 2)
    specs = [("te" if runtime.have_te() else "local") if x == "auto" else x for x in args.specs]
    if "te" in specs and not runtime.have_te():
        raise cliargs.UsageError("--spec te: Transformer Engine is not installed (or does not import); "
                                 "docs/gpu-setup.md#transformer-engine")
    specs = list(dict.fromkeys(specs))

    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    cfg = hf_config(args.preset, overrides)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    for lay in args.layouts if "mcore" in args.engines else []:
        if not lay.dp(world_env) or not lay.edp(world_env):
            raise cliargs.UsageError(f"WORLD_SIZE={world_env} does not fit layout {lay.short()}")
    if "mcore" in args.engines or world_env > 1:
        runtime.init_distributed(Parallel())  # process group (+ trivial megatron groups); layouts re-init below
    device = runtime.device()
    results = []
    if "hf" in args.engines:
        if rank() == 0:
            log(f"transformers: building {args.preset} on {device}")
            results.append(run_hf(cfg, args, device))
            log(f"transformers: {results[-1]['step_ms']:.1f} ms, peak {results[-1]['peak_gib']:.1f} GiB")
        if world() > 1:
            dist.barrier()
    if "mcore" in args.engines:
        for spec in specs:
            for lay in args.layouts:
                for g in args.grouped:
                    log(f"megatron-core: building {args.preset} spec={spec} {lay.short()} (grouped={g})")
                    r = run_mcore(cfg, args, device, g, lay, spec)
                    results.append(r)
                    log(f"megatron-core spec={spec} {lay.short()} ({r['experts']}, attn {r['attn']}/{r['sdpa_kernel']}): "
                        f"{r['step_ms']:.1f} ms, peak {r['peak_gib']:.1f} GiB")
    line = summary(results, args, cfg)
    if rank() == 0:
        print(line, flush=True)
        if args.profile:
            for r in results:
                print(f"# top kernels, {r['engine']} {r.get('experts', '')}:", file=sys.stderr)
                for row in r.get("profile", []):
                    print(f"#   {row['ms']:8.2f} ms  x{row['count']:<5d} {row['name']}", file=sys.stderr)
        if args.json_out:
            out = Path(args.json_out)
            write_json_atomic(out, {"summary": line, "args": dict(vars(args), layouts=[lay.short() for lay in args.layouts]),
                                    "specs": specs,
                                    "results": results}, indent=1,
                              ensure_ascii=True)
    if dist.is_initialized():
        runtime.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(lambda argv: main()))  # a UsageError: one `error: ...` line, exit 2
