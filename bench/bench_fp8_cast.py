#!/usr/bin/env python3
"""Benchmark the DeepSeek-V3 FP8 -> BF16 cast: kernel bandwidth and end-to-end throughput.

Two parts, on CPU and (where present) on the GPU:

1. Kernel: dequant of one [M, N] matrix against the device's copy bandwidth (``dst.copy_(src)``,
   counted as read + write). Effective dequant bandwidth counts 1 byte read + 2 bytes written per
   element. Backends: ``reference`` (the formula in eager torch), ``fast`` (ours: CPU bit trick /
   Triton on CUDA), ``compiled`` (torch.compile of the formula; CUDA only, skipped when
   TORCHDYNAMO_DISABLE=1). Every backend's output is checked bit-for-bit against the reference.
   Target: fast >= 70% of copy bandwidth on GPU.
2. End to end on an FP8-release checkpoint (written with the mini-model factory unless ``--input``):
   ``io-copy`` (read every shard, write the same bytes: the disk's limit), ``naive`` (per shard:
   safetensors load_file, per-tensor formula, save_file: what DeepSeek's script does), and ``ours``
   (dsv3_rl.checkpoint.fp8) on each device. Each runs in its own process (peak RSS: its VmHWM) with
   the input evicted from the page cache first (posix_fadvise DONTNEED). Outputs are compared
   tensor by tensor between naive and ours. Targets: ours limited by I/O (close to io-copy), peak RSS
   below 2x the largest shard.

    python bench/bench_fp8_cast.py                       # CPU (+ GPU if present), proxy preset
    python bench/bench_fp8_cast.py --set num_hidden_layers=2 --set n_routed_experts=8   # smaller
    python bench/bench_fp8_cast.py --input /data/DeepSeek-V3-0324 --skip-naive          # real weights

Prints a table, then one summary line; ``--json FILE`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


# ------------------------------------------------------------------------------------ kernel


def _timeit(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up (and compile)
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def bench_kernel(device: torch.device, m: int, n: int, iters: int) -> dict:
    from dsv3_rl.checkpoint import fp8_kernels as K

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 0x7E, (m, n), dtype=torch.uint8, generator=g)
    codes |= torch.randint(0, 2, (m, n), dtype=torch.uint8, generator=g) << 7  # signs
    w_cpu = codes.view(K.FP8)
    s_cpu = torch.rand(K.scale_shape((m, n)), generator=g) * 1e-3 + 1e-4
    w, s = w_cpu.to(device), s_cpu.to(device)
    ref = K.dequant_reference(w_cpu, s_cpu) if device.type == "cpu" else K.dequant_reference(w, s).cpu()
    moved = m * n * 3 + s.numel() * 4
    src = torch.empty(m * n * 3 // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timeit(lambda: dst.copy_(src), device, iters)
    result = {"device": str(device), "shape": [m, n], "copy_GBps": 2 * src.numel() / copy_s / 1e9, "backends": {}}
    out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    backends = {"reference": lambda: K.dequant(w, s, out, backend="reference")}
    if device.type == "cpu":
        backends["fast"] = lambda: K.dequant(w, s, out, backend="cpu")
    else:
        if K._get_triton_kernel() is not None:
            backends["fast"] = lambda: K.dequant(w, s, out, backend="triton")
            # tile sweep, to pick fp8_kernels.TRITON_BLOCK_M / TRITON_NUM_WARPS on this GPU
            for bm, nw in ((16, 2), (32, 4), (64, 4), (64, 8), (128, 8), (128, 16)):
                def tiled(bm=bm, nw=nw):
                    old = K.TRITON_BLOCK_M, K.TRITON_NUM_WARPS
                    K.TRITON_BLOCK_M, K.TRITON_NUM_WARPS = bm, nw
                    try:
                        K.dequant(w, s, out, backend="triton")
                    finally:
                        K.TRITON_BLOCK_M, K.TRITON_NUM_WARPS = old
                backends[f"triton-m{bm}-w{nw}"] = tiled
        if os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("1", "true", "True"):
            compiled = torch.compile(K.dequant_reference)
            backends["compiled"] = lambda: out.copy_(compiled(w, s))
    for name, fn in backends.items():
        out.zero_()  # a backend that writes nothing must not inherit the previous one's result
        try:
            t = _timeit(fn, device, iters)
        except Exception as e:  # noqa: BLE001 - a compile failure is a result, not a crash
            result["backends"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        exact = torch.equal(out.cpu().view(torch.int16), ref.view(torch.int16))
        bw = moved / t / 1e9
        result["backends"][name] = {"seconds": t, "GBps": bw, "pct_of_copy": 100 * bw / result["copy_GBps"],
                                    "bit_exact": exact}
    return result


# ----------------------------------------------------------------------------- end to end


def _evict(paths) -> None:
    """Drop the files from the page cache (clean pages only; no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def run_io_copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in _shards(src):
        with open(f, "rb") as fi, open(dst / f.name, "wb") as fo:
            while block := fi.read(64 << 20):
                fo.write(block)
            fo.flush()
            os.fsync(fo.fileno())


def run_naive(src: Path, dst: Path, device: str) -> None:
    """The straightforward per-tensor cast: whole shard in memory, formula per tensor, save_file."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from dsv3_rl.checkpoint.fp8_kernels import dequant_reference

    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for f in _shards(src):
        sd = load_file(f, device=device)
        out = {}
        for name, t in sd.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                sname = name + "_scale_inv"
                if sname in sd:
                    s = sd[sname]
                else:
                    with safe_open(src / index[sname], "pt", device=device) as h:
                        s = h.get_tensor(sname)
                out[name] = dequant_reference(t, s).cpu()
            else:
                out[name] = t.cpu()
        save_file(out, dst / f.name, metadata={"format": "pt"})
        del sd, out


def run_ours(src: Path, dst: Path, device: str, workers: int | None) -> None:
    from dsv3_rl.checkpoint.fp8 import cast_checkpoint

    s = cast_checkpoint(src, dst, drop_mtp=False, device=device, workers=workers, progress=False,
                        log=lambda *_: None)
    print(s.line(), file=sys.stderr)


def child(argv: list[str]) -> int:
    mode, src, dst, device, workers = argv
    import dsv3_rl.checkpoint.fp8  # noqa: F401  (imports count as baseline, not as work)

    t0 = time.perf_counter()
    if mode == "baseline":
        if device.startswith("cuda"):
            torch.zeros(1, device=device)
    elif mode == "io-copy":
        run_io_copy(Path(src), Path(dst))
    elif mode == "naive":
        run_naive(Path(src), Path(dst), device)
    elif mode == "ours":
        run_ours(Path(src), Path(dst), device, int(workers) or None)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_bytes": _peak_rss()}))
    return 0


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM: reset at exec, unlike wait4's ru_maxrss, which inherits the
    parent's high-water mark through fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(mode: str, src: Path, dst: Path, device: str, workers: int = 0) -> dict:
    if dst.exists():
        shutil.rmtree(dst)
    _evict(_shards(src))
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen([sys.executable, str(HERE), "_child", mode, str(src), str(dst), device,
                                 str(workers)], stdout=out_f, stderr=err_f, text=True)
        proc.wait()
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} on {device} failed ({proc.returncode}):\n{err[-3000:]}")
    child_result = json.loads(out.strip().splitlines()[-1])
    seconds = child_result["seconds"]
    bytes_in = sum(f.stat().st_size for f in _shards(src))
    bytes_out = sum(f.stat().st_size for f in _shards(dst)) if dst.exists() else 0
    return {"mode": mode, "device": device, "seconds": seconds, "GB_in": bytes_in / 1e9, "GB_out": bytes_out / 1e9,
            "GBps_in": bytes_in / seconds / 1e9 if seconds else 0.0,
            "GBps_out": bytes_out / seconds / 1e9 if seconds else 0.0,
            "peak_rss_GB": child_result["peak_rss_bytes"] / 1e9}


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    for f in _shards(a):
        with safe_open(f, "pt") as ha, safe_open(b / f.name, "pt") as hb:
            if set(ha.keys()) != set(hb.keys()):
                return False
            for k in ha.keys():
                x, y = ha.get_tensor(k), hb.get_tensor(k)
                if x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                    return False
    return True


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return child(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", type=Path, help="an existing FP8 checkpoint (default: write one from --model)")
    p.add_argument("--model", dest="preset", default="proxy", help="model preset of the FP8 checkpoint written")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="preset override (default: vocab_size=2048 so FP8 weights dominate, as in the release)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--workdir", type=Path, help="where to write checkpoints (default: a temp dir, removed after)")
    p.add_argument("--devices", default="auto", help="comma list of cpu,cuda (default: cpu + cuda if present)")
    p.add_argument("--workers", type=int, default=0, help="ours: parallel shards (0 = default)")
    p.add_argument("--kernel-shape", default=None, help="M,N for the kernel part (default 2048,7168 CPU; "
                                                        "16384,16384 GPU)")
    p.add_argument("--iters", type=int, default=0, help="kernel timing iterations (default 5 CPU, 50 GPU)")
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--json", type=Path, help="write all results here")
    args = p.parse_args(argv)

    from dsv3_rl.cliargs import parse_set
    from dsv3_rl.minimodel.mini_model import write_mini_model

    devices = (["cpu"] + (["cuda"] if torch.cuda.is_available() else [])) if args.devices == "auto" \
        else args.devices.split(",")
    results: dict = {"kernel": [], "e2e": [], "host": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                                                       else None}}
    print(f"# host: {os.cpu_count()} CPUs, torch {torch.__version__}, GPU: {results['host']['gpu']}")
    default_threads = torch.get_num_threads()
    for dev in devices:
        m, n = map(int, (args.kernel_shape or ("2048,7168" if dev == "cpu" else "16384,16384")).split(","))
        # CPU: one intra-op thread (what each cast worker uses) and all of them
        for threads in (sorted({1, default_threads}) if dev == "cpu" else [default_threads]):
            torch.set_num_threads(threads)
            k = bench_kernel(torch.device(dev), m, n, args.iters or (5 if dev == "cpu" else 50))
            k["threads"] = threads
            results["kernel"].append(k)
            print(f"kernel {dev} [{m}x{n}] {threads} thread(s): copy {k['copy_GBps']:.1f} GB/s")
            for name, r in k["backends"].items():
                if "error" in r:
                    print(f"  {name:10s} error: {r['error']}")
                else:
                    print(f"  {name:10s} {r['GBps']:8.2f} GB/s  {r['pct_of_copy']:5.1f}% of copy  "
                          f"bit-exact={r['bit_exact']}")
    torch.set_num_threads(default_threads)

    workdir_ctx = tempfile.TemporaryDirectory(prefix="bench_fp8_") if args.workdir is None else None
    work = Path(workdir_ctx.name) if workdir_ctx else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        if not args.skip_e2e:
            src = args.input
            if src is None:
                src = work / "fp8"
                overrides = parse_set(args.set if args.set is not None else ["vocab_size=2048"])
                t0 = time.perf_counter()
                if not (src / "model.safetensors.index.json").exists():
                    write_mini_model(args.preset, src, fmt="fp8-release", shards=args.shards, overrides=overrides,
                                     overwrite=True)
                print(f"# wrote {args.preset} {overrides} in FP8 release format in {time.perf_counter() - t0:.0f} s")
            shard_sizes = [f.stat().st_size for f in _shards(src)]
            results["input"] = {"path": str(src), "shards": len(shard_sizes), "GB": sum(shard_sizes) / 1e9,
                                "largest_shard_GB": max(shard_sizes) / 1e9}
            print(f"# input: {len(shard_sizes)} shards, {sum(shard_sizes) / 1e9:.2f} GB, largest "
                  f"{max(shard_sizes) / 1e9:.2f} GB")
            runs = [("baseline", "cpu"), ("io-copy", "cpu")]
            for dev in devices:
                if dev != "cpu":
                    runs.append(("baseline", dev))
                if not args.skip_naive:
                    runs.append(("naive", dev))
                runs.append(("ours", dev))
            for mode, dev in runs:
                r = run_child(mode, src, work / f"out-{mode}-{dev}", dev, args.workers)
                results["e2e"].append(r)
                if mode == "baseline":  # python + torch + dsv3_rl imported (and a CUDA context), no work
                    print(f"{mode:9s} {dev:5s} peak RSS {r['peak_rss_GB']:.2f} GB")
                    continue
                print(f"{mode:9s} {dev:5s} {r['seconds']:8.2f} s  in {r['GBps_in']:6.2f} GB/s  "
                      f"out {r['GBps_out']:6.2f} GB/s  peak RSS {r['peak_rss_GB']:.2f} GB")
                # outputs go as soon as they are compared: every row writes a whole checkpoint
                if mode == "ours":
                    if not args.skip_naive:
                        same = same_tensors(work / f"out-naive-{dev}", work / f"out-ours-{dev}")
                        results.setdefault("naive_equals_ours", {})[dev] = same
                        print(f"# {dev}: naive and ours outputs bit-identical: {same}")
                        shutil.rmtree(work / f"out-naive-{dev}", ignore_errors=True)
                    shutil.rmtree(work / f"out-ours-{dev}", ignore_errors=True)
                elif mode == "io-copy":
                    shutil.rmtree(work / f"out-{mode}-{dev}", ignore_errors=True)
    finally:
        if workdir_ctx:
            workdir_ctx.cleanup()

    # one summary line
    parts = []
    for k in results["kernel"]:
        fast = k["backends"].get("fast", {})
        if "GBps" in fast:
            parts.append(f"{k['device']}x{k['threads']}t dequant {fast['GBps']:.2f} GB/s "
                         f"({fast['pct_of_copy']:.0f}% of copy {k['copy_GBps']:.1f}; "
                         f"eager {k['backends']['reference'].get('GBps', 0):.2f})")
    by = {(r["mode"], r["device"]): r for r in results["e2e"]}
    for dev in devices:
        ours = by.get(("ours", dev))
        if ours:
            base = by.get(("baseline", dev), {"peak_rss_GB": 0})
            s = (f"{dev} e2e {ours['GBps_in']:.2f}/{ours['GBps_out']:.2f} GB/s in/out, "
                 f"RSS {ours['peak_rss_GB']:.2f} GB (+{ours['peak_rss_GB'] - base['peak_rss_GB']:.2f} over import)")
            if ("naive", dev) in by:
                s += f", naive {by[('naive', dev)]['GBps_in']:.2f} GB/s RSS {by[('naive', dev)]['peak_rss_GB']:.2f} GB"
            parts.append(s)
    if ("io-copy", "cpu") in by:
        parts.append(f"io-copy {by[('io-copy', 'cpu')]['GBps_in']:.2f} GB/s")
    if "input" in results:
        parts.append(f"largest shard {results['input']['largest_shard_GB']:.2f} GB")
    print("fp8 cast bench: " + "; ".join(parts))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
