"""Scenarios for the TE-free fast path (megatron-core patches 0012 SDPA attention, 0013 grouped-GEMM
experts), run in a subprocess by tests/unit/test_mcore_fastpath.py and tests/gpu/test_mcore_fastpath_gpu.py.

    python tests/unit/mcore_fastpath_scenarios.py NAME [--key value ...]

Each prints one line ``RESULT {json}``. With PYTHONPATH pointing at a megatron tree with one patch
reversed, a scenario shows what that patch changes (the planted-fault twins).

The HF reference: transformers' DeepseekV3ForCausalLM with the same weights, mapped to megatron's
TP1 local-spec names by :func:`hf_to_mcore` below. That mapping is test-only (it exists because
the project's converter, dsv3_rl.convert, has not landed yet); every step is a rename or a
concatenation, so gradients map back the same way (:func:`mcore_grad_to_hf`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- HF <-> megatron names


ATTN_NAMES = {"q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj",
              "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
              "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}


def hf_to_mcore(hf_sd: dict, cfg) -> dict:
    """HF DeepSeek-V3 state dict -> megatron-core TP1 local-spec state dict (no _extra_state)."""
    out = {"embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_sd["model.norm.weight"],
           "output_layer.weight": hf_sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf_sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_sd[h + "post_attention_layernorm.weight"]
        for a, b in ATTN_NAMES.items():
            out[f"{m}self_attention.{b}.weight"] = hf_sd[f"{h}self_attn.{a}.weight"]
        if h + "mlp.gate_proj.weight" in hf_sd:  # dense
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf_sd[h + "mlp.gate_proj.weight"], hf_sd[h + "mlp.up_proj.weight"]])
            out[m + "mlp.linear_fc2.weight"] = hf_sd[h + "mlp.down_proj.weight"]
            continue
        out[m + "mlp.router.weight"] = hf_sd[h + "mlp.gate.weight"]
        out[m + "mlp.router.expert_bias"] = hf_sd[h + "mlp.gate.e_score_correction_bias"]
        for e in range(cfg.n_routed_experts):
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = hf_sd[h + "mlp.experts.gate_up_proj"][e]
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf_sd[h + "mlp.experts.down_proj"][e]
        s = h + "mlp.shared_experts."
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf_sd[s + "gate_proj.weight"], hf_sd[s + "up_proj.weight"]])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = hf_sd[s + "down_proj.weight"]
    return out


def hf_grads(model) -> dict:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def mcore_grads_as_hf(model, cfg) -> dict:
    """megatron grads under HF names: the inverse of hf_to_mcore (renames, splits, stacks)."""
    g = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad) for n, p in model.named_parameters()}
    g = {n: t.detach().float().clone() for n, t in g.items() if t is not None}
    out = {"model.embed_tokens.weight": g["embedding.word_embeddings.weight"],
           "model.norm.weight": g["decoder.final_layernorm.weight"],
           "lm_head.weight": g["output_layer.weight"]}
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = g[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = g[m + "pre_mlp_layernorm.weight"]
        for a, b in ATTN_NAMES.items():
            out[f"{h}self_attn.{a}.weight"] = g[f"{m}self_attention.{b}.weight"]
        if m + "mlp.linear_fc1.weight" in g:
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = g[m + "mlp.linear_fc1.weight"].chunk(2)
            out[h + "mlp.down_proj.weight"] = g[m + "mlp.linear_fc2.weight"]
            continue
        out[h + "mlp.gate.weight"] = g[m + "mlp.router.weight"]
        for hf_name, mc in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
            out[f"{h}mlp.experts.{hf_name}"] = torch.stack(
                [g[f"{m}mlp.experts.local_experts.{e}.{mc}.weight"] for e in range(cfg.n_routed_experts)])
        s = m + "mlp.shared_experts."
        gate, up = g[s + "linear_fc1.weight"].chunk(2)
        out[h + "mlp.shared_experts.gate_proj.weight"], out[h + "mlp.shared_experts.up_proj.weight"] = gate, up
        out[h + "mlp.shared_experts.down_proj.weight"] = g[s + "linear_fc2.weight"]
    return out


# --------------------------------------------------------------------------- model construction


def _pop_nvte():
    for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(k, None)


def build_mcore(cfg, dtype, attention_backend="auto", grouped=None, state_dict=None, extra=None):
    from megatron.core.transformer.enums import AttnBackend

    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime

    _pop_nvte()
    overrides = {"attention_backend": AttnBackend[attention_backend], **(extra or {})}
    try:
        import dataclasses

        from megatron.core.transformer.transformer_config import TransformerConfig

        if "moe_sequential_grouped_mm" in {f.name for f in dataclasses.fields(TransformerConfig)}:
            overrides["moe_sequential_grouped_mm"] = grouped
    except ImportError:
        pass
    m = runtime.build_model(cfg, Parallel(), dtype=dtype, use_te=False, config_overrides=overrides)[0]
    if state_dict is not None:
        own = m.state_dict()
        missing = [k for k in own if not k.endswith("_extra_state") and k not in state_dict]
        if missing:
            raise KeyError(f"mapped state dict lacks {missing[:5]}")
        with torch.no_grad():
            for k, v in state_dict.items():
                own[k].copy_(v.to(own[k].dtype))
    return m


def fast_paths_used(model) -> dict:
    """Which paths the built model takes (None where the attribute does not exist: patch absent)."""
    att = model.decoder.layers[0].self_attention.core_attention
    moe = [layer.mlp.experts for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]
    return {"sdpa": getattr(att, "use_sdpa", None),
            "sdpa_reason": getattr(att, "sdpa_reason", None),
            "grouped": getattr(moe[0], "grouped_mm", None) if moe else None,
            "grouped_reason": getattr(moe[0], "grouped_mm_reason", None) if moe else None}


def count_grouped_calls():
    """Patch SequentialMLP to count grouped-GEMM forwards; returns the counter list."""
    calls = []
    try:
        import megatron.core.transformer.moe.experts as E
    except ImportError:
        return calls
    if hasattr(E.SequentialMLP, "_grouped_forward"):
        orig = E.SequentialMLP._grouped_forward

        def counted(self, *a, **k):
            calls.append(1)
            return orig(self, *a, **k)

        E.SequentialMLP._grouped_forward = counted
    return calls


def batch(cfg, b=2, s=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    return toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)


def mcore_step(model, tokens, labels):
    """logits [b, s, V] (fp32) and the token-mean CE, backward done."""
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = model(tokens, pos, None)
    logits = logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return logits.detach(), float(loss)


def hf_step(model, tokens, labels):
    logits = model(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return logits.detach(), float(loss)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def plant(fault: str | None):
    """Deliberate breakages of the fast paths (for the planted-fault twins)."""
    if not fault:
        return
    if fault == "sdpa-scale":  # SDPA with the plain 1/sqrt(d) scale: loses MLA's yarn mscale
        import megatron.core.transformer.dot_product_attention as D

        orig = D.DotProductAttention._sdpa_forward

        def wrong(self, *a, **k):
            saved = self.softmax_scale
            self.softmax_scale = self.k_channels ** -0.5
            try:
                return orig(self, *a, **k)
            finally:
                self.softmax_scale = saved

        D.DotProductAttention._sdpa_forward = wrong
    elif fault == "grouped-expert-order":  # grouped GEMM with the experts' weights in reverse order
        import megatron.core.transformer.moe.experts as E

        orig_apply, orig_forward, on = E._GroupedLinear.apply, E.SequentialMLP._grouped_forward, [False]

        def apply(x, offs, empty, *weights):  # only inside the layer's grouped forward, not in the probe
            return orig_apply(x, offs, empty, *(reversed(weights) if on[0] else weights))

        def grouped_forward(self, *a, **k):
            on[0] = True
            try:
                return orig_forward(self, *a, **k)
            finally:
                on[0] = False

        E._GroupedLinear.apply = staticmethod(apply)
        E.SequentialMLP._grouped_forward = grouped_forward
    else:
        raise ValueError(f"unknown fault {fault!r}")


# --------------------------------------------------------------------------- scenarios


def _init(device):
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime

    runtime.init_distributed(Parallel())


def _cfg(preset, overrides):
    from dsv3_rl.models.presets import hf_config

    return hf_config(preset, overrides or None)


def hf_vs_mcore(args) -> dict:
    """transformers' model (fp32) vs megatron-core with the chosen paths, same weights."""
    from transformers import DeepseekV3ForCausalLM

    cfg = _cfg(args.preset, json.loads(args.overrides))
    dev = torch.device(args.device)
    _init(dev)
    torch.manual_seed(args.seed)
    cfg._attn_implementation = "sdpa" if args.device == "cuda" else "eager"
    hf = DeepseekV3ForCausalLM(cfg).float().to(dev)
    hf.train()
    plant(args.fault)
    calls = count_grouped_calls()
    m = build_mcore(cfg, DTYPES[args.dtype], args.attention_backend, _grouped(args.grouped),
                    state_dict=hf_to_mcore(hf.state_dict(), cfg))
    tokens, labels = batch(cfg, args.batch, args.seq, device=dev)
    hl, hloss = hf_step(hf, tokens, labels)
    ml, mloss = mcore_step(m, tokens, labels)
    hg, mg = hf_grads(hf), mcore_grads_as_hf(m, cfg)
    errs = {k: rel(mg[k], hg[k]) for k in hg if k in mg}
    worst = max(errs, key=errs.get)
    return {"paths": fast_paths_used(m), "grouped_calls": len(calls), "loss_hf": hloss, "loss_mcore": mloss,
            "logits_rel": rel(ml, hl), "grad_worst": worst, "grad_worst_rel": errs[worst],
            "grad_rel": {k: v for k, v in sorted(errs.items(), key=lambda kv: -kv[1])[:8]}}


def _grouped(s):
    return {"auto": None, "on": True, "off": False}[s]


def paths_equal(args) -> dict:
    """megatron-core fast paths vs its old paths (unfused attention, per-expert loop), same weights."""
    cfg = _cfg(args.preset, json.loads(args.overrides))
    dev = torch.device(args.device)
    _init(dev)
    dtype = DTYPES[args.dtype]
    tokens, labels = batch(cfg, args.batch, args.seq, device=dev)
    ref = build_mcore(cfg, dtype, "unfused", False)
    sd = {k: v.clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    rl, rloss = mcore_step(ref, tokens, labels)
    rg = {n: p.grad.float().clone() for n, p in ref.named_parameters()}
    del ref
    plant(args.fault)
    calls = count_grouped_calls()
    fast = build_mcore(cfg, dtype, args.attention_backend, _grouped(args.grouped), state_dict=sd)
    fl, floss = mcore_step(fast, tokens, labels)
    fg = {n: p.grad.float().clone() for n, p in fast.named_parameters()}
    errs = {k: rel(fg[k], rg[k]) for k in rg}
    worst = max(errs, key=errs.get)
    return {"paths": fast_paths_used(fast), "grouped_calls": len(calls), "loss_ref": rloss, "loss_fast": floss,
            "logits_rel": rel(fl, rl), "grad_worst": worst, "grad_worst_rel": errs[worst],
            "expert_grad_rel": max((v for k, v in errs.items() if "local_experts" in k), default=None),
            "attn_grad_rel": max((v for k, v in errs.items() if "linear_kv_up_proj" in k), default=None)}


def ckpt_roundtrip(args) -> dict:
    """Save a dist checkpoint from one expert path, load it into the other: same tensors, same output."""
    from dsv3_rl.mcore.layout_check import load, save, sharded_state_dict

    cfg = _cfg(args.preset, json.loads(args.overrides))
    _init(torch.device("cpu"))
    work = Path(args.work)
    src_grouped, dst_grouped = (True, False) if args.direction == "grouped-to-loop" else (False, True)
    torch.manual_seed(1)
    a = build_mcore(cfg, torch.float32, "auto", src_grouped)
    save([a], work / "ckpt")
    keys_a = sorted(sharded_state_dict([a]).keys())
    b = build_mcore(cfg, torch.float32, "auto", dst_grouped, extra={"init_method_std": 0.5})
    keys_b = sorted(sharded_state_dict([b]).keys())
    differ_before = any(not torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items() if torch.is_tensor(v))
    load([b], work / "ckpt")
    sa, sb = a.state_dict(), b.state_dict()
    mism = [k for k, v in sa.items() if torch.is_tensor(v) and not torch.equal(v, sb[k])]
    tokens, labels = batch(cfg)
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        out_a, out_b = a(tokens, pos, None), b(tokens, pos, None)
    return {"paths_src": fast_paths_used(a), "paths_dst": fast_paths_used(b), "same_sharded_keys": keys_a == keys_b,
            "n_keys": len(keys_a), "differed_before_load": differ_before, "mismatched_after_load": mism[:5],
            "output_rel": rel(out_b, out_a)}


def attention_unit(args) -> dict:
    """DotProductAttention's SDPA path against an independent softmax(q k^T * scale + mask) v, with
    MLA head dims (q/k 24, v 16), a softmax scale that is not 1/sqrt(d), causal and explicit
    masks, GQA, and dropout (train vs eval)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    _init(torch.device(args.device))
    model_parallel_cuda_manual_seed(3)
    out = {}
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    H, DQK, DV, S = args.heads, args.qk_dim, args.v_dim, args.seq

    def ref(q, k, v, scale, mask=None, causal=False):
        qh, kh, vh = (t.permute(1, 2, 0, 3).float() for t in (q, k, v))  # [b, h, s, d]
        if kh.shape[1] != qh.shape[1]:
            r = qh.shape[1] // kh.shape[1]
            kh, vh = kh.repeat_interleave(r, 1), vh.repeat_interleave(r, 1)
        scores = qh @ kh.transpose(-1, -2) * scale
        if causal:
            s = scores.shape[-1]
            scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool, device=scores.device), 1),
                                        float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(mask, -10000.0)
        o = torch.softmax(scores, -1) @ vh
        return o.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)

    def make(heads, groups, backend, dropout=0.0, mask_type=AttnMaskType.causal, scale=0.37):
        _pop_nvte()
        cfg = TransformerConfig(num_layers=1, hidden_size=heads * DV, num_attention_heads=heads, num_query_groups=groups,
                                kv_channels=DV, attention_dropout=dropout, attention_backend=AttnBackend[backend],
                                bf16=dtype == torch.bfloat16, params_dtype=dtype)
        return DotProductAttention(cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self",
                                   softmax_scale=scale, k_channels=DQK, v_channels=DV).to(dev), scale

    g = torch.Generator().manual_seed(0)
    s, b, h = S, 2 if S <= 64 else 1, H
    q = (torch.randn(s, b, h, DQK, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    k = (torch.randn(s, b, h, DQK, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    v = torch.randn(s, b, h, DV, generator=g).to(dev, dtype).requires_grad_()
    att, scale = make(h, h, args.attention_backend)
    out["sdpa"] = getattr(att, "use_sdpa", None)
    if dev.type == "cuda":
        from megatron.core.transformer.dot_product_attention import sdpa_backend_order

        order = sdpa_backend_order(q, False) if hasattr(att, "use_sdpa") else None
        qb, kb, vb = (t.detach().permute(1, 2, 0, 3) for t in (q, k, v))
        try:
            from megatron.core.transformer.dot_product_attention import _sdpa_kernel_context

            with _sdpa_kernel_context(order):
                out["kernel"] = int(torch._fused_sdp_choice(qb, kb, vb, is_causal=True, scale=scale))
        except Exception as e:  # noqa: BLE001 - informative only
            out["kernel"] = f"unknown ({type(e).__name__})"
    o = att(q, k, v, None)
    r = ref(q, k, v, scale, causal=True)
    out["causal_rel"] = rel(o, r)
    gq = torch.autograd.grad(o.float().sum(), q)[0]
    gr = torch.autograd.grad(r.sum(), q)[0]
    out["causal_grad_rel"] = rel(gq, gr)
    out["finite"] = bool(torch.isfinite(o).all() and torch.isfinite(gq).all())
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool, device=dev)
    pad[0, :, :, -3:] = True  # first sequence: last 3 keys are padding
    att_p, _ = make(h, h, args.attention_backend, mask_type=AttnMaskType.padding)
    out["mask_rel"] = rel(att_p(q, k, v, pad), ref(q, k, v, scale, mask=pad))
    # GQA: 4 query heads over 2 key/value groups
    kg, vg = k[:, :, : h // 2].detach(), v[:, :, : h // 2].detach()
    att_g, _ = make(h, h // 2, args.attention_backend)
    out["gqa_rel"] = rel(att_g(q, kg, vg, None), ref(q, kg, vg, scale, causal=True))
    # dropout: active in training, off in eval
    att_d, _ = make(h, h, args.attention_backend, dropout=0.5)
    att_d.train()
    d1 = att_d(q, k, v, None)
    att_d.eval()
    out["dropout_eval_rel"] = rel(att_d(q, k, v, None), r)
    out["dropout_train_rel"] = rel(d1, r)
    return out


def experts_unit(args) -> dict:
    """SequentialMLP grouped GEMM vs its per-expert loop on hand-made uneven routing (empty experts
    included): outputs, input grads and every expert's weight grads."""
    cfg = _cfg(args.preset, json.loads(args.overrides))
    _init(torch.device(args.device))
    dtype = DTYPES[args.dtype]
    m = build_mcore(cfg, dtype, "auto", _grouped(args.grouped))
    plant(args.fault)
    calls = count_grouped_calls()
    experts = m.decoder.layers[1].mlp.experts
    E = experts.num_local_experts
    counts = torch.tensor([5, 0, 3, 0, 7, 1, 0, 4] * (E // 8 or 1))[:E]
    g = torch.Generator().manual_seed(0)
    n = int(counts.sum())
    x = torch.randn(n, cfg.hidden_size, generator=g).to(args.device, dtype).requires_grad_()
    probs = torch.rand(n, generator=g).to(args.device)
    res = {}
    for mode in ("loop", "grouped"):
        if hasattr(experts, "grouped_mm"):
            experts.grouped_mm = mode == "grouped"
        for p in experts.parameters():
            p.grad = None
        x.grad = None
        y, _ = experts(x, counts, probs)
        y.float().pow(2).sum().backward()
        res[mode] = (y.detach().float(), x.grad.float().clone(),
                     {n_: p.grad.float().clone() for n_, p in experts.named_parameters()})
    (yl, xl, wl), (yg, xg, wg) = res["loop"], res["grouped"]
    werr = {k: rel(wg[k], wl[k]) for k in wl if wl[k].norm() > 0}
    zero_ok = all(float(wg[k].abs().max()) == 0.0 for k in wl if wl[k].norm() == 0)
    return {"grouped_calls": len(calls), "out_rel": rel(yg, yl), "dx_rel": rel(xg, xl),
            "dw_rel": max(werr.values()), "empty_expert_grads_zero": zero_ok,
            "probe": {str(k): v for k, v in getattr(__import__("megatron.core.transformer.moe.experts",
                                                               fromlist=["x"]), "_GROUPED_MM_PROBES", {}).items()}}


SCENARIOS = {f.__name__: f for f in (hf_vs_mcore, paths_equal, ckpt_roundtrip, attention_unit, experts_unit)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("name", choices=list(SCENARIOS))
    ap.add_argument("--model", dest="preset", default="tiny", help="model preset")
    ap.add_argument("--overrides", default="{}", help="JSON dict of HF config overrides")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--grouped", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--fault", default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16, help="sequence length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=".")
    ap.add_argument("--direction", default="grouped-to-loop", choices=["grouped-to-loop", "loop-to-grouped"])
    ap.add_argument("--heads", type=int, default=4, help="attention_unit: heads")
    ap.add_argument("--qk-dim", type=int, default=24, help="attention_unit: q/k head dim (MLA: 192)")
    ap.add_argument("--v-dim", type=int, default=16, help="attention_unit: v head dim (MLA: 128)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    res = SCENARIOS[args.name](args)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
