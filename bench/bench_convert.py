"""Benchmark the DeepSeek-V3 HF <-> megatron-core converter, and verl's own converter on the same model.

    python bench/bench_convert.py [--model proxy] [--work DIR] [--nproc 1] [--keep]

Writes the preset's HF checkpoint (``write_mini_model``, BF16, not timed), then times, each in a
fresh process (``python -m dsv3_rl.convert``, under torchrun with ``--nproc`` > 1):

* hf->mcore, mcore->hf: GB/s (tensor bytes / wall time incl. start-up), peak RSS of the process
  tree (max over ranks), and whether the round trip is bit-identical;
* verl 0.9.1's ``scripts/converter_hf_to_mcore.py`` on the same HF directory: GB/s and peak RSS when it
  runs, else the reason it does not (its first error line). Without CUDA it is run with
  ``VERL_PLATFORM=cpu``, then retried with gloo and CPU-safe config flags (unless holding its two
  full models would not fit in RAM) so that every blocker shows.

Ends with one summary line; ``--json`` also writes the numbers to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_measured(cmd: list[str], env: dict, timeout: int) -> dict:
    """Run ``cmd``; wall seconds, peak RSS (GB, largest process of the tree: GNU time's max RSS
    covers the waited-for descendants), return code, output tail."""
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB=%M", *cmd], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=REPO)
    wall = time.perf_counter() - t0
    m = re.findall(r"MAXRSS_KB=(\d+)", p.stderr)
    return {"rc": p.returncode, "seconds": wall, "peak_rss_gb": int(m[-1]) / (1 << 20) if m else None,
            "stdout": p.stdout, "stderr": p.stderr}


def first_error(text: str) -> str:
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("MAXRSS_KB=")]
    for ln in reversed(lines):
        if re.match(r"^(\w+\.)*\w*(Error|Exception|error)\b", ln) or ln.startswith("error:"):
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


VERL_SCRIPT = REPO / "backends" / "verl-0.9.1" / "scripts" / "converter_hf_to_mcore.py"
# On a machine without CUDA: gloo instead of its hard-coded NCCL, and the config flags that need CUDA
# or extra kernels off (persist_layer_norm: TE/apex; grouped GEMM: the grouped_gemm package; shared
# expert overlap: a CUDA stream), so the next blocker shows.
CPU_SHIM = """import runpy, sys, torch.distributed as d
_i = d.init_process_group
d.init_process_group = lambda *a, **k: _i("gloo")
import verl.models.mcore as vm
_c = vm.hf_to_mcore_config
def _cfg(*a, **k):
    c = _c(*a, **k)
    c.persist_layer_norm = c.moe_grouped_gemm = c.moe_shared_expert_overlap = False
    return c
vm.hf_to_mcore_config = _cfg
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def fused_experts_note() -> str | None:
    """verl's DeepSeek-V3 converter iterates ``hf_layer.mlp.experts`` per expert; transformers 5 holds
    them fused in one module (not iterable), so the script cannot work with it on any device."""
    try:
        import torch
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        import transformers
    except ImportError:
        return None
    moe = getattr(m, "DeepseekV3NaiveMoe", None)
    if moe is None or issubclass(moe, torch.nn.ModuleList) or hasattr(moe, "__iter__"):
        return None
    return (f"and transformers {transformers.__version__} fuses the experts (DeepseekV3NaiveMoe is not iterable), "
            "which the script iterates one by one")


def run_verl(py: list[str], hf: Path, out: Path, env: dict, nbytes: int, timeout: int) -> dict:
    """verl 0.9.1's own converter on the same HF dir: GB/s and peak RSS if it runs, else why not."""
    import torch

    argv = [str(VERL_SCRIPT), "--hf_model_path", str(hf), "--output_path", str(out), "--use_cpu_initialization"]
    cpu = not torch.cuda.is_available()
    venv = dict(env, VERL_PLATFORM="cpu") if cpu else env
    shutil.rmtree(out, ignore_errors=True)
    r = run_measured(py + argv, venv, timeout)
    ok = r["rc"] == 0 and (out / "metadata.json").exists()
    err = None if ok else first_error(r["stderr"] + r["stdout"])
    if not ok and cpu:
        # it materialises the megatron model and the whole HF model: ~2x the checkpoint in RAM
        need, avail = 2.2 * nbytes / 1e9, _available_gb()
        if avail is not None and need > 0.8 * avail:
            err += f"; CPU retry not attempted: it holds both models (~{need:.1f} GB) and {avail:.1f} GB are available"
        else:
            shutil.rmtree(out, ignore_errors=True)
            r = run_measured(py + ["-c", CPU_SHIM.format(argv=["converter_hf_to_mcore.py", *argv[1:]], script=str(VERL_SCRIPT))],
                             venv, timeout)
            ok = r["rc"] == 0 and (out / "metadata.json").exists()
            err += "; with gloo and CPU-safe config flags: " + ("ran" if ok else first_error(r["stderr"] + r["stdout"]))
            if not ok and "layer_norm_weight" in err:
                err += " (it writes Transformer Engine's fused-norm names only)"
    if not ok and (note := fused_experts_note()):
        err += "; " + note
    return {"ran": ok, "seconds": r["seconds"], "peak_rss_gb": r["peak_rss_gb"],
            "gb_per_s": nbytes / 1e9 / r["seconds"] if ok else None, "error": None if ok else err}


def _available_gb() -> float | None:
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemAvailable:"):
                return int(ln.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", dest="preset", default="proxy", help="tiny | tiny-vllm | proxy (default proxy: DeepSeek-V3 layer dims, 10.5 GB)")
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir, removed unless --keep)")
    ap.add_argument("--nproc", type=int, default=1, help="converter ranks (torchrun)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip-verl", action="store_true")
    ap.add_argument("--timeout", type=int, default=7200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    py = [sys.executable]
    conv = (py + ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", "-m", "dsv3_rl.convert"]
            if args.nproc > 1 else py + ["-m", "dsv3_rl.convert"])
    results: dict = {"preset": args.preset, "nproc": args.nproc}
    try:
        from dsv3_rl.minimodel.mini_model import write_mini_model

        hf = work / "hf"
        if not (hf / "config.json").exists():
            write_mini_model(args.preset, hf)
        nbytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        results["hf_gb"] = nbytes / 1e9
        for name, cmd in (("hf->mcore", ["hf-to-mcore", "--hf-dir", str(hf), "--out", str(work / "mcore"), "--force"]),
                          ("mcore->hf", ["mcore-to-hf", "--mcore-dir", str(work / "mcore"), "--out", str(work / "back"), "--force"])):
            r = run_measured(conv + cmd + ["--no-progress"], env, args.timeout)
            if r["rc"] != 0:
                print(r["stderr"][-3000:], file=sys.stderr)
                raise SystemExit(f"{name} failed (rc {r['rc']})")
            m = re.search(r"\[convert\] .*?: (\d+) tensors, ([\d.]+) GB in ([\d.]+) s", r["stdout"])
            results[name] = {"seconds": r["seconds"], "gb": float(m.group(2)) if m else nbytes / 1e9,
                             "convert_seconds": float(m.group(3)) if m else None, "peak_rss_gb": r["peak_rss_gb"]}
            results[name]["gb_per_s"] = results[name]["gb"] / r["seconds"]
        from dsv3_rl.convert.weights import compare_hf

        diffs = compare_hf(hf, work / "back")
        results["bit_exact"] = not diffs
        if not args.skip_verl:
            results["verl"] = run_verl(py, hf, work / "verl_mcore", env, nbytes, args.timeout)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    a, b = results["hf->mcore"], results["mcore->hf"]
    v = results.get("verl")
    verl = ("verl converter: skipped" if v is None else
            f"verl converter: {v['gb_per_s']:.3f} GB/s, peak RSS {v['peak_rss_gb']:.2f} GB" if v["ran"] else
            f"verl converter: did not run ({v['error']})")
    print(f"bench_convert {args.preset} ({results['hf_gb']:.2f} GB bf16, {args.nproc} rank(s)): "
          f"hf->mcore {a['gb_per_s']:.3f} GB/s peak RSS {a['peak_rss_gb']:.2f} GB; "
          f"mcore->hf {b['gb_per_s']:.3f} GB/s peak RSS {b['peak_rss_gb']:.2f} GB; "
          f"round trip {'bit-identical' if results['bit_exact'] else 'DIFFERS'}; {verl}")
    return 0 if results["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
