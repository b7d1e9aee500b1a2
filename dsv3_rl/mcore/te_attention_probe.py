"""Which Transformer Engine attention backend runs DeepSeek-V3's MLA shapes (q/k 192, v 128) on this GPU, and
is it right: forward and backward in bf16, against transformers' DeepseekV3 ``eager_attention_forward`` (fp32,
same q/k/v) as the independent reference.

    python -m dsv3_rl.mcore.te_attention_probe                 # auto, fused, flash, unfused; thd, sbhd, bshd-padded
    python -m dsv3_rl.mcore.te_attention_probe --backends fused --formats thd --json out.json

Each backend runs in its own process (TE reads NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN once, at
import): ``auto`` leaves them unset (TE's own choice), ``fused`` / ``flash`` / ``unfused`` enable that one only.
A child first runs the one-cuDNN check (:mod:`dsv3_rl.mcore.te_env`), then for each layout:

* ``thd``: a sequence-packed batch as verl's megatron workers feed it (remove-padding: sequences of different
  lengths back to back, ``cu_seqlens``, ``padding_causal``);
* ``sbhd``: megatron's own layout, equal lengths, ``causal``;
* ``bshd-padded``: right-padded sequences with a padding mask (``padding_causal``), compared on real tokens.

TE's ``DotProductAttention`` runs forward + backward; the backend TE selected is read from TE's own record
(``dot_product_attention._attention_backends``). Output and q/k/v gradients are compared, per real token,
with the reference (norm-relative error, ``--tol``, default 1e-2; bf16 rounding gives ~3e-3).

Then the MLA attention guard (``dsv3_rl.mcore.mla_attention_guard``, patch 0011) is held to what TE did with the
box's real TE/cuDNN/GPU: the case it must pass (fused attention where TE ran it correctly) and the cases it must
catch (a backend TE had none of: flash without FlashAttention 3, fused in fp32). A guard that refuses what ran,
or allows what had no backend, FAILS the probe.

Prints one summary line (``--json FILE``: every number); exit 1 on a FAIL, 2 when TE is absent or the process
has two cuDNNs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from dsv3_rl.errors import Dsv3Error, cli_main

HEAD_DIM_QK, HEAD_DIM_V = 192, 128
BACKENDS = ("auto", "fused", "flash", "unfused")
FORMATS = ("thd", "sbhd", "bshd-padded")
NVTE = ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN", "NVTE_UNFUSED_ATTN")
BACKEND_ENV = {
    "auto": {},
    "fused": {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "flash": {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
}


def mla_softmax_scale(factor: float = 40.0, mscale_all_dim: float = 1.0) -> float:
    """DeepSeek-V3's softmax scale (yarn factor 40, mscale_all_dim 1: mscale^2 / sqrt(192), as transformers'
    DeepseekV3Attention.scaling), not the plain 1/sqrt(d) a backend would default to."""
    from dsv3_rl.models.config_map import _get_mscale

    return _get_mscale(factor, mscale_all_dim) ** 2 / math.sqrt(HEAD_DIM_QK)


class ProbeError(Dsv3Error):
    pass


def _csv(allowed: Sequence[str], what: str):
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what}: unknown {bad or s!r}; allowed: {', '.join(allowed)}")
        return items

    return parse


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--seqlens: want a comma list of positive integers, got {s!r}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dsv3_rl.mcore.te_attention_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", type=_csv(BACKENDS, "--backends"), default=list(BACKENDS), help="comma list")
    ap.add_argument("--formats", type=_csv(FORMATS, "--formats"), default=list(FORMATS), help="comma list")
    ap.add_argument("--heads", type=int, default=16, help="attention heads (DeepSeek-V3: 128 over TP ranks)")
    ap.add_argument("--seqlens", type=_ints, default=[512, 200, 96, 1],
                    help="sequence lengths of the packed/padded batch (default 512,200,96,1)")
    ap.add_argument("--seq", type=int, default=512, help="sequence length of the sbhd case (batch = len(--seqlens))")
    ap.add_argument("--tol", type=float, default=1e-2, help="norm-relative error allowed for output and grads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per backend process")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--child", choices=BACKENDS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.heads < 1 or args.seq < 1:
        ap.error("--heads and --seq must be positive")
    return args


# --------------------------------------------------------------------------- reference and comparison


def make_case(fmt: str, seqlens: Sequence[int], seq: int, heads: int, seed: int):
    """Per-sequence q/k/v/dout (bf16, CPU) of one layout: sbhd uses len(seqlens) sequences of ``seq``."""
    import torch

    lens = [seq] * len(seqlens) if fmt == "sbhd" else list(seqlens)
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lens:
        q, k = (torch.randn(n, heads, HEAD_DIM_QK, generator=g) for _ in range(2))
        v = torch.randn(n, heads, HEAD_DIM_V, generator=g)
        dout = torch.randn(n, heads, HEAD_DIM_V, generator=g)
        seqs.append(tuple(t.to(torch.bfloat16) for t in (q, k, v, dout)))
    return seqs


def reference(seqs, scale: float):
    """transformers' DeepseekV3 eager attention in fp32, one causal sequence at a time: outputs and q/k/v grads."""
    import types

    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=1, training=False)
    outs, grads = [], []
    for q, k, v, dout in seqs:
        n = q.shape[0]
        leaves = [t.float().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v)]  # [1, h, n, d]
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        out, _ = eager_attention_forward(module, *leaves, mask, scaling=scale)  # [1, n, h, dv]
        out = out[0]
        (out * dout.float()).sum().backward()
        outs.append(out.detach())
        grads.append(tuple(t.grad[0].transpose(0, 1) for t in leaves))
    return outs, grads


def pack(fmt: str, seqs, device):
    """Inputs of one layout from per-sequence tensors: (q, k, v, dout, extra kwargs for the attention)."""
    import torch

    lens = [s[0].shape[0] for s in seqs]
    if fmt == "thd":
        cat = [torch.cat([s[i] for s in seqs]).to(device) for i in range(4)]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        kw = {"qkv_format": "thd", "attn_mask_type": "padding_causal", "cu_seqlens_q": cu, "cu_seqlens_kv": cu,
              "max_seqlen_q": max(lens), "max_seqlen_kv": max(lens)}
        return (*cat, kw)
    smax = max(lens)
    padded = []
    for i in range(4):
        t = torch.zeros(len(seqs), smax, *seqs[0][i].shape[1:], dtype=seqs[0][i].dtype)
        for b, s in enumerate(seqs):
            t[b, : lens[b]] = s[i]
        padded.append(t.to(device))
    if fmt == "sbhd":
        return (*[t.transpose(0, 1).contiguous() for t in padded], {"qkv_format": "sbhd", "attn_mask_type": "causal"})
    mask = torch.ones(len(seqs), 1, 1, smax, dtype=torch.bool)  # True = masked out (TE's convention)
    for b, n in enumerate(lens):
        mask[b, ..., :n] = False
    return (*padded, {"qkv_format": "bshd", "attn_mask_type": "padding_causal", "attention_mask": mask.to(device)})


def unpack(fmt: str, t, lens: Sequence[int], heads: int):
    """Per-sequence [n, h, d] tensors (fp32, CPU) from a tensor in layout ``fmt`` (heads possibly flattened)."""
    t = t.detach().float().cpu()
    if fmt == "thd":
        t = t.reshape(t.shape[0], heads, -1)
        return list(t.split(list(lens)))
    if fmt == "sbhd":
        t = t.transpose(0, 1)
    t = t.reshape(t.shape[0], t.shape[1], heads, -1)
    return [t[b, :n] for b, n in enumerate(lens)]


def rel_err(got: Sequence, ref: Sequence) -> float:
    import torch

    a = torch.cat([x.reshape(-1) for x in got]).double()
    b = torch.cat([x.reshape(-1) for x in ref]).double()
    if a.shape != b.shape:
        return math.inf
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


AttentionFn = Callable[..., object]
"""attn(q, k, v, **kw) -> output in the layout of kw['qkv_format'] (TE's DotProductAttention call convention)."""


def run_case(attn: AttentionFn, fmt: str, seqs, ref, heads: int, scale: float, device, tol: float) -> dict:
    """Forward + backward of ``attn`` on one layout against the reference: errors of out, dq, dk, dv."""
    lens = [s[0].shape[0] for s in seqs]
    q, k, v, dout, kw = pack(fmt, seqs, device)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, **kw)
    dout = dout.reshape(out.shape)
    (out.float() * dout.float()).sum().backward()
    errs = {"out": rel_err(unpack(fmt, out, lens, heads), ref[0])}
    for i, name in enumerate(("dq", "dk", "dv")):
        errs[name] = rel_err(unpack(fmt, (q, k, v)[i].grad, lens, heads), [g[i] for g in ref[1]])
    worst = max(errs.values())
    return {"format": fmt, "errors": errs, "max_err": worst, "ok": worst <= tol}


def sdpa_attention(scale: float, fault: str | None = None) -> AttentionFn:
    """torch SDPA one sequence at a time, in TE's call convention: a backend for CPU tests (independent of the
    eager reference), with planted faults: 'no-causal', 'one-sequence' (ignores cu_seqlens / the padding
    mask), 'scale' (the plain 1/sqrt(d) instead of the model's scale)."""
    import torch
    import torch.nn.functional as F

    def attn(q, k, v, qkv_format, attn_mask_type, cu_seqlens_q=None, attention_mask=None, **_):
        s = 1 / math.sqrt(q.shape[-1]) if fault == "scale" else scale
        causal = fault != "no-causal"

        def one(qq, kk, vv):  # [n, h, d] -> [n, h, dv]
            o = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (qq, kk, vv)), is_causal=causal, scale=s)
            return o.transpose(0, 1)

        if qkv_format == "thd":
            bounds = [0, q.shape[0]] if fault == "one-sequence" else cu_seqlens_q.tolist()
            return torch.cat([one(q[a:b], k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])])
        if qkv_format == "sbhd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        outs = []
        for b in range(q.shape[0]):
            n = q.shape[1] if attention_mask is None or fault == "one-sequence" else int((~attention_mask[b]).sum())
            o = one(q[b, :n], k[b, :n], v[b, :n])
            outs.append(torch.cat([o, o.new_zeros(q.shape[1] - n, *o.shape[1:])]))
        out = torch.stack(outs)
        return out.transpose(0, 1) if qkv_format == "sbhd" else out

    return attn


# --------------------------------------------------------------------------- one backend, on the GPU (child)


def te_selected_backend() -> str:
    """The attention backend TE selected for its latest DotProductAttention call, from TE's own record
    ('-' when TE is not loaded, 'none' when it found none)."""
    if "transformer_engine.pytorch" not in sys.modules:
        return "-"
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    b = dpa._attention_backends
    if b.get("use_flash_attention"):
        return f"flash ({b.get('flash_attention_backend')})"
    if b.get("use_fused_attention"):
        return f"fused (sub-backend {int(b.get('fused_attention_backend'))})"
    if b.get("use_unfused_attention"):
        return "unfused"
    return "none"


def child(args) -> dict:
    from dsv3_rl.mcore import te_env

    report = te_env.check_cudnn()  # pins torch's cuDNN for TE, imports TE; a second cuDNN: exit 2, one line
    import torch
    import transformer_engine
    import transformer_engine.pytorch as tep

    from dsv3_rl.mcore.mla_attention_guard import runtime_versions

    dev = torch.device("cuda")
    scale = mla_softmax_scale()
    versions = runtime_versions()
    res = {"backend_requested": args.child, "env": {k: os.environ.get(k) for k in NVTE},
           "te_version": transformer_engine.__version__, "torch": torch.__version__,
           "cudnn_te": list(tep.get_cudnn_version()), "cudnn_torch": torch.backends.cudnn.version(),
           "cudnn_check": report.line, "gpu": torch.cuda.get_device_name(),
           "compute_capability": list(torch.cuda.get_device_capability()),
           "flash_attn_3": versions["flash_attn_3"], "cases": []}
    cases = [(f, torch.bfloat16) for f in args.formats]
    if args.child == "fused":
        cases.append(("sbhd", torch.float32))  # TE fuses fp16/bf16 only: the guard must refuse this one
    for fmt, dtype in cases:
        seqs = make_case(fmt, args.seqlens, args.seq, args.heads, args.seed)
        ref = reference(seqs, scale)
        if dtype != torch.bfloat16:
            seqs = [tuple(t.to(dtype) for t in s) for s in seqs]
        mask = "padding_causal" if fmt != "sbhd" else "causal"
        dpa = tep.DotProductAttention(args.heads, (HEAD_DIM_QK, HEAD_DIM_V), attention_dropout=0.0,
                                      qkv_format="thd" if fmt == "thd" else fmt[:4], attn_mask_type=mask,
                                      softmax_scale=scale).to(dev)
        name = fmt if dtype == torch.bfloat16 else f"{fmt}-fp32"
        try:
            r = run_case(dpa, fmt, seqs, ref, args.heads, scale, dev, args.tol)
            r["selected"] = te_selected_backend()
        except Exception as e:  # noqa: BLE001 - no backend for this case is a result ("none"), not a crash
            r = {"format": fmt, "selected": "none", "ok": None, "error": " ".join(str(e).split())[:300]}
        r["case"] = name
        res["cases"].append(r)
        torch.cuda.synchronize()
    return res


# --------------------------------------------------------------------------- the parent


def run_children(args) -> dict:
    out = {}
    for backend in args.backends:
        env = {k: v for k, v in os.environ.items() if k not in NVTE}
        env.update(BACKEND_ENV[backend])
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, "-m", "dsv3_rl.mcore.te_attention_probe", "--child", backend, "--child-out", path,
               "--formats", ",".join(args.formats), "--heads", str(args.heads),
               "--seqlens", ",".join(map(str, args.seqlens)), "--seq", str(args.seq), "--tol", str(args.tol),
               "--seed", str(args.seed)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired:
            rc, err = 124, f"timed out after {args.timeout}s"
        try:
            with open(path) as f:
                out[backend] = json.load(f) if rc == 0 else None
        except (OSError, ValueError):
            out[backend] = None
        finally:
            if os.path.exists(path):
                os.unlink(path)
        if out[backend] is None:
            lines = [x for x in err.strip().splitlines() if x.strip()]
            if rc == 2 and lines and lines[-1].startswith("error: "):  # the cuDNN check: the whole probe stops
                raise ProbeError(lines[-1][len("error: "):])
            out[backend] = {"backend_requested": backend, "crashed": True, "rc": rc,
                            "stderr_tail": "\n".join(lines[-5:])}
    return out


def guard_verdicts(results: dict) -> list[dict]:
    """Hold the MLA attention guard to what TE did: for each forced backend that was tried (fused, flash; and fused
    in fp32), the guard must allow it exactly when TE ran it; 'must' says which way this box's case goes."""
    from dsv3_rl.mcore.mla_attention_guard import MLAAttentionBackendError, decide_mla_attention_backend

    out = []
    for backend in ("fused", "flash"):
        r = results.get(backend)
        if not r or r.get("crashed"):
            continue
        for case in r["cases"]:
            if case["format"] != "sbhd":
                continue
            dtype = "fp32" if case["case"].endswith("fp32") else "bf16"
            ran = case["selected"].startswith(backend)
            try:
                decide_mla_attention_backend(r["te_version"], tuple(r["cudnn_te"]), tuple(r["compute_capability"]),
                                             HEAD_DIM_QK, HEAD_DIM_V, dtype, training=True, requested=backend, env={},
                                             flash_attn_3=r["flash_attn_3"])
                allowed, why = True, "allowed"
            except MLAAttentionBackendError as e:
                allowed, why = False, str(e).split(". ")[0]
            good = ran and bool(case.get("ok"))
            out.append({"case": f"{backend} {dtype}", "te_ran": ran, "te_correct": case.get("ok"), "guard_allows": allowed,
                        "must": "pass" if good else "catch", "ok": allowed == good, "guard_says": why})
    return out


def summarize(results: dict, verdicts: list[dict], args) -> tuple[str, bool]:
    first = next((r for r in results.values() if r and not r.get("crashed")), None)
    head = "te_mla_attention: "
    if first:
        c = first["cudnn_te"]
        head += (f"TE {first['te_version']}, {first['gpu']}, cuDNN {'.'.join(map(str, c))} (torch "
                 f"{first['cudnn_torch']}), MLA {HEAD_DIM_QK}/{HEAD_DIM_V} bf16 h{args.heads}, fwd+bwd vs transformers eager: ")
    parts, ok = [], True
    for backend, r in results.items():
        if r.get("crashed"):
            parts.append(f"{backend}: CRASHED rc={r['rc']}")
            ok = False
            continue
        cs = []
        for case in r["cases"]:
            if case["ok"] is None:  # TE had no backend: fine for a forced one (the guard verdicts judge it)
                ok &= backend in ("fused", "flash")
                cs.append(f"{case['case']} no backend" + ("" if backend in ("fused", "flash") else " FAIL"))
                continue
            # a backend that runs must be right; with one backend forced, TE running another is a FAIL too
            right = bool(case["ok"]) and (backend == "auto" or case["selected"].startswith(backend))
            ok &= right
            cs.append(f"{case['case']} {case['selected']} {'ok' if right else 'FAIL'} {case['max_err']:.1e}")
        parts.append(f"{backend}: " + ", ".join(cs))
    if verdicts:
        ok &= all(v["ok"] for v in verdicts)
        parts.append("guard: " + ", ".join(
            f"{v['case']} must {v['must']} -> {'allowed' if v['guard_allows'] else 'refused'} {'ok' if v['ok'] else 'FAIL'}"
            for v in verdicts))
    return head + " | ".join(parts) + f" | {'PASS' if ok else 'FAIL'}", ok


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        res = child(args)
        from dsv3_rl.fs import write_json_atomic

        write_json_atomic(args.child_out, res)
        return 0
    from dsv3_rl.mcore import te_env

    te = te_env.installed_te_version()
    if te is None:
        raise ProbeError("Transformer Engine is not installed: this probe runs TE's attention backends "
                         "(GPU box: `bash .gpu-te/install_te.sh /tmp`, docs/gpu-setup.md#transformer-engine)")
    import torch

    if not torch.cuda.is_available():
        raise ProbeError("no CUDA device: TE's attention backends run on the GPU only")
    results = run_children(args)
    verdicts = guard_verdicts(results)
    line, ok = summarize(results, verdicts, args)
    print(line, flush=True)
    if args.json_out:
        from dsv3_rl.fs import write_json_atomic

        write_json_atomic(args.json_out, {"summary": line, "ok": ok, "args": {k: v for k, v in vars(args).items()
                                                                              if not k.startswith("child")},
                                          "results": results, "guard": verdicts}, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
