#!/usr/bin/env python3
"""Benchmark the trainer side of a refit: verl's Megatron-engine export of DeepSeek-V3 weights to HF names.

Runs the path verl's Megatron engine takes without a bridge (patch 0014): ``per_tensor_generator`` over the
megatron-core model with verl's DeepSeek-V3 weight converter, packed into one preallocated bucket buffer of
``--bucket-mb`` exactly as verl's colocated sender packs it (dsv3_rl.refit.buckets), on one device. verl is
imported without Ray (dsv3_rl.refit.verl_export), so this runs where only torch + megatron-core are.

Measures, in the same process:
* copy bandwidth: ``dst.copy_(src)`` of one bucket, as bytes copied per second (each byte counted once);
* export: HF-named BF16 bytes produced per second (bucket allocation + stream + bucket fill, device
  synchronised per bucket as verl does before handing a bucket over; verl's sender allocates and frees its
  bucket on every refit, so the allocation is counted and also reported alone), best of ``--iters``, and its
  ratio to the copy bandwidth (target >= 0.5 on GPU);
* the bucket fill alone: the same tensors, produced beforehand, copied into the buckets (the floor the
  export's own work adds to);
* peak extra memory: ``torch.cuda.max_memory_allocated`` during the export minus the allocation before it,
  bucket buffer included (target: no more than one bucket); not measured on CPU;
* ``--manifest``: the trainer-side checksum manifest (dsv3_rl.refit.manifest) over the stream and its
  receiver-side check over every bucket, and their cost;
* ``--fp8``: the same export through verl's FP8 quantizer (``verl.utils.fp8_utils``, rollout.quantization=fp8)
  and the quantize kernel (``scaled_fp8_blockwise``) on one ``--kernel-shape`` matrix against the copy
  bandwidth (bytes read + written; target >= 0.8 on H100/H200).

    python bench/bench_refit.py                                  # proxy preset on GPU (tiny on CPU)
    python bench/bench_refit.py --fp8 --manifest --json out.json
    python bench/bench_refit.py --model tiny --device cpu        # CPU smoke test

Prints one summary line (``refit bench: ...``); ``--json FILE`` writes every number.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run from a bare checkout

from dsv3_rl.cliargs import positive_int  # noqa: E402
from dsv3_rl.errors import Dsv3Error, cli_main  # noqa: E402
from dsv3_rl.fs import write_json_atomic  # noqa: E402

KERNEL_REPS = 10  # back-to-back calls per timed sample of the copy and the quantize kernel (GPU)
LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timeit(fn, dev: torch.device, iters: int, reps: int = 1) -> float:
    """Best of ITERS samples of the seconds per call of FN; each sample runs FN REPS times back to back between
    two synchronisations, so that a sub-millisecond kernel is not timed against the host's sync latency."""
    fn()
    _sync(dev)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(dev)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def copy_bandwidth(dev: torch.device, nbytes: int, iters: int) -> float:
    """Bytes copied per second by ``dst.copy_(src)`` (each byte counted once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / _timeit(lambda: dst.copy_(src), dev, iters, reps=KERNEL_REPS if dev.type == "cuda" else 1)


def _sync_iter(agen):
    """Drive an async generator (verl's FP8 quantizer) from synchronous code."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()


def model_config(args):
    """The HF config of ``--model`` with ``--set`` (validated: an unknown key or an unusable value is refused)."""
    from dsv3_rl.cliargs import parse_set
    from dsv3_rl.models import presets

    try:
        return presets.hf_config(args.preset, parse_set(args.set or []))
    except (KeyError, ValueError) as e:
        raise Dsv3Error(f"--model/--set: {e.args[0]}") from None


def build(hf, dev: torch.device):
    from megatron.core.transformer.enums import AttnBackend

    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime

    runtime.init_distributed(Parallel())
    overrides = {"attention_backend": AttnBackend.local}
    if dev.type == "cuda":
        overrides["use_cpu_initialization"] = False  # initialise on the GPU: seconds, not minutes
    chunks = runtime.build_model(hf, Parallel(), dtype=torch.bfloat16, config_overrides=overrides)
    return hf, chunks


def export_stream(v, hf, chunks, fp8: bool):
    conv = v.DeepseekV3Converter(hf, chunks[0].config)
    stream = v.per_tensor_generator(chunks, hf, conv, chunks[0].config, LAYER_NAME_MAPPING)
    if fp8:
        q = v.FP8QuantizerHelper({"weight_block_size": [128, 128]})
        stream = _sync_iter(q.quant_weights_by_name(stream))
    return stream


def run_export(v, hf, chunks, dev, bucket_bytes: int, iters: int, fp8: bool, manifest: bool,
               preset: str = "", overrides: list[str] | None = None) -> dict:
    from dsv3_rl.refit.buckets import fill_buckets
    from dsv3_rl.refit.manifest import Manifest

    result = {}
    best = None
    by_dtype: dict[str, list[int]] = {}
    layout: dict[str, torch.Tensor] = {}

    def count(stream):  # bookkeeping, on the warm-up pass only
        for name, t in stream:
            if fp8:
                layout[name] = t.new_empty(t.shape, device="meta")
            c = by_dtype.setdefault(str(t.dtype).removeprefix("torch."), [0, 0])
            c[0] += t.numel()
            c[1] += t.nbytes
            yield name, t

    for it in range(iters + 1):  # the first pass warms up (allocator, Triton compile) and is not counted
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=dev)  # verl allocates it per refit too
        _sync(dev)
        alloc_seconds = time.perf_counter() - t0
        sent = Manifest() if manifest else None
        buckets = []

        def on_bucket(bucket, buf, sent=sent, buckets=buckets):
            _sync(dev)  # verl synchronises before handing the bucket over
            buckets.append(bucket.nbytes)
            if sent is not None:  # the receiver's check, over what is in the bucket now
                for name, t in bucket.tensors(buf):
                    sent.check(name, t)

        stream = export_stream(v, hf, chunks, fp8)
        if it == 0:
            stream = count(stream)
        if sent is not None:
            stream = sent.tap(stream)
        ntensors, nbytes = fill_buckets(stream, buffer, on_bucket)
        _sync(dev)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None
        del buffer
        if it == 0:
            if fp8:  # the set and layout of what verl hands to vLLM vs DeepSeek's FP8 release
                from dsv3_rl.cliargs import parse_set
                from dsv3_rl.models import presets
                from dsv3_rl.refit.fp8_layout import layout_differences, reference_layout, stream_layout

                cfg = presets.preset_kwargs(preset, parse_set(overrides))
                diffs = layout_differences(reference_layout(cfg), stream_layout(layout.items()), limit=0,
                                           float_equivalent=True)
                result["fp8_layout_differences"] = len(diffs)
                result["fp8_layout_first_differences"] = diffs[:10]
            continue
        if best is None or seconds < best["seconds"]:
            best = {"seconds": seconds, "alloc_seconds": alloc_seconds, "tensors": ntensors, "bytes": nbytes,
                    "buckets": len(buckets),
                    "elements_by_dtype": {k: c[0] for k, c in by_dtype.items()},
                    "bytes_by_dtype": {k: c[1] for k, c in by_dtype.items()},
                    "GBps": nbytes / seconds / 1e9, "peak_extra_bytes": peak}
    result.update(best)
    if not fp8 and not manifest:  # the same tensors, already produced, through the same bucket fill: the floor
        items = list(export_stream(v, hf, chunks, False))
        buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=dev)
        result["fill_only_seconds"] = _timeit(lambda: fill_buckets(items, buffer, lambda b, buf: _sync(dev)), dev,
                                              iters)
        del items, buffer
    return result


def fp8_kernel(v, dev: torch.device, shape: tuple[int, int], iters: int, copy_Bps: float) -> dict:
    x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    s = _timeit(lambda: v.scaled_fp8_blockwise(x, weight_block_size=[128, 128]), dev, iters,
                reps=KERNEL_REPS if dev.type == "cuda" else 1)
    m, n = shape
    moved = m * n * 3 + -(-m // 128) * -(-n // 128) * 4  # bf16 read + fp8 write + fp32 scales
    return {"shape": list(shape), "seconds": s, "GBps": moved / s / 1e9,
            "ratio_to_copy": (moved / s) / (2 * copy_Bps)}  # copy moves 2 bytes (read + write) per byte copied


def _shape(text: str) -> tuple[int, int]:
    """argparse ``type=`` of ``--kernel-shape``: ``M,N``, both integers >= 1."""
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(text)
        return positive_int(parts[0]), positive_int(parts[1])
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not M,N (two integers >= 1)") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", dest="preset", default=None, help="model preset (default: proxy on GPU, tiny on CPU)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="preset override (repeatable)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--bucket-mb", type=positive_int, default=None,
                   help="bucket size in MiB, >= 1 (default: verl's 2048 on GPU, 64 on CPU)")
    p.add_argument("--iters", type=positive_int, default=10,
                   help="timed export passes after one warm-up, >= 1 (best is reported)")
    p.add_argument("--manifest", action="store_true", help="also time the export with the checksum manifest")
    p.add_argument("--fp8", action="store_true", help="also time the FP8 export and the quantize kernel")
    p.add_argument("--kernel-shape", type=_shape, default="16384,16384", help="M,N of the FP8 kernel measurement")
    p.add_argument("--json", type=Path, help="write all numbers here")
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise Dsv3Error("--device cuda: no CUDA device visible (allowed: auto, cpu, cuda)")
    dev = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                       else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    args.preset = args.preset or ("proxy" if dev.type == "cuda" else "tiny")
    hf = model_config(args)  # before anything heavy is imported or built
    bucket_bytes = (2048 if dev.type == "cuda" else 64) << 20 if args.bucket_mb is None else args.bucket_mb << 20
    kshape = args.kernel_shape

    if dev.type == "cpu":
        os.environ.setdefault("VERL_PLATFORM", "cpu")  # verl's device helpers: cpu, not "nvidia, unavailable"
        # verl's FP8 quantizer picks Triton whenever it imports; without a GPU driver each tensor then fails and
        # verl's except-branch silently sends it in BF16: use verl's PyTorch fallback on CPU
        os.environ.setdefault("VERL_DISABLE_TRITON_FP8", "1")
    from dsv3_rl.mcore import runtime
    from dsv3_rl.refit import verl_export

    v = verl_export.load(light=True)  # no Ray: the GPU box has none
    hf, chunks = build(hf, dev)
    try:
        params = sum(t.numel() for t in chunks[0].parameters())
        copy_Bps = copy_bandwidth(dev, min(bucket_bytes, 1 << 30), max(args.iters, 3))
        res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "preset": args.preset, "set": args.set or [], "params": params,
               "bucket_bytes": bucket_bytes, "verl_light_import": v.light, "copy_GBps": copy_Bps / 1e9}
        res["export"] = run_export(v, hf, chunks, dev, bucket_bytes, args.iters, fp8=False, manifest=False)
        res["export"]["ratio_to_copy"] = res["export"]["GBps"] * 1e9 / copy_Bps
        if args.manifest:
            res["export_manifest"] = run_export(v, hf, chunks, dev, bucket_bytes, args.iters, fp8=False, manifest=True)
        if args.fp8:
            res["export_fp8"] = run_export(v, hf, chunks, dev, bucket_bytes, args.iters, fp8=True, manifest=False,
                                           preset=args.preset, overrides=args.set or [])
            res["fp8_kernel"] = fp8_kernel(v, dev, kshape if dev.type == "cuda" else (512, 1024), max(args.iters, 10),
                                           copy_Bps)
    finally:
        runtime.destroy()

    e = res["export"]
    peak = "n/a (CPU)" if e["peak_extra_bytes"] is None else (
        f"{e['peak_extra_bytes'] / 2**20:.0f} MiB = {e['peak_extra_bytes'] / bucket_bytes:.2f} bucket")
    line = (f"refit bench: {res['device']} {args.preset} {e['bytes'] / 1e9:.2f} GB in {e['tensors']} HF tensors "
            f"({e['buckets']} buckets of {bucket_bytes >> 20} MiB) in {e['seconds'] * 1e3:.1f} ms "
            f"(bucket allocation {e['alloc_seconds'] * 1e3:.1f} ms, bucket fill alone {e['fill_only_seconds'] * 1e3:.1f} ms) = "
            f"{e['GBps']:.1f} GB/s, {e['ratio_to_copy']:.2f}x copy {res['copy_GBps']:.1f} GB/s; peak extra {peak}")
    if "export_manifest" in res:
        line += f"; with manifest {res['export_manifest']['GBps']:.1f} GB/s"
    if "export_fp8" in res:
        k = res["fp8_kernel"]
        nd = res["export_fp8"]["fp8_layout_differences"]
        line += (f"; fp8 export {res['export_fp8']['GBps']:.1f} GB/s out, "
                 f"{'DeepSeek FP8 layout' if nd == 0 else f'{nd} tensors off DeepSeek FP8 layout'}, "
                 f"quantize kernel {k['GBps']:.0f} GB/s = {k['ratio_to_copy']:.2f}x copy")
    print(line)
    if args.json:
        write_json_atomic(args.json, res, ensure_ascii=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main)())
