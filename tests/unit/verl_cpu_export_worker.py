"""Worker for tests/unit/test_verl_cpu_megatron.py (run under torchrun, gloo, VERL_PLATFORM=cpu).

Builds the tiny DeepSeek-V3 the way verl's Megatron engine does with ``use_mbridge=False`` (verl's
``hf_to_mcore_config`` + ``make_megatron_module`` without a bridge -> ``init_mcore_model``), loads the
converter's dist checkpoint with verl's ``load_mcore_dist_weights``, exports HF-named full tensors with
verl's ``per_tensor_generator`` (what the trainer sends to vLLM) and compares them, on every rank,
with the HF safetensors the checkpoint was converted from. Prints one JSON line (rank 0): each mode's list of
per-rank results.

    torchrun --nproc-per-node N verl_cpu_export_worker.py HF_DIR DIST_DIR TP EP [MODE[,MODE...]]

Each MODE (``MODES``; default ``clean``) runs in turn on the one model this launch built and loaded (a launch is
most of a test's time); a mode undoes its planted fault before the next one runs.

``EXPORT_PP=2`` in the environment adds pipeline stages (N = PP x max(TP, EP)); the result then counts the
object collectives (``all_gather_object`` / ``broadcast_object_list``) and tensor broadcasts the export made.
"""

import json
import os
import sys

import torch

MODES = ("clean", "swap_experts", "per_tensor_exchange", "bshd_forward", "bshd_forward_no_causal")


def main():
    hf_dir, dist_dir, tp, ep = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    modes = sys.argv[5].split(",") if len(sys.argv) > 5 else ["clean"]
    if set(modes) - set(MODES):
        sys.exit(f"unknown mode(s) {sorted(set(modes) - set(MODES))}; allowed: {', '.join(MODES)}")
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    from verl.models.mcore import hf_to_mcore_config
    from verl.models.mcore.registry import MODEL_WEIGHT_CONVERTER_REGISTRY, get_supported_model
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module
    from verl.utils.model import load_mcore_dist_weights

    pp = int(os.environ.get("EXPORT_PP", "1"))
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                  expert_tensor_parallel_size=1, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)
    hf = AutoConfig.from_pretrained(hf_dir)
    cpu = dict(attention_backend="local", use_cpu_initialization=True, moe_grouped_gemm=False,
               moe_shared_expert_overlap=False, apply_rope_fusion=False, bias_activation_fusion=False,
               bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
               gradient_accumulation_fusion=False)
    from megatron.core.transformer.enums import AttnBackend

    cpu["attention_backend"] = AttnBackend.local
    tf = hf_to_mcore_config(hf, torch.bfloat16, **cpu)
    if not tf.mtp_num_layers:  # as verl's engine without a bridge does (patch 0014): None = no MTP
        tf.mtp_num_layers = None
    module, tf = make_megatron_module(McoreModuleWrapperConfig(wrap_with_ddp=False), tf, hf)
    te_modules = sorted({type(m).__name__ for m in module[0].modules() if type(m).__name__.startswith("TE")})
    load_mcore_dist_weights(module, dist_dir)
    conv = MODEL_WEIGHT_CONVERTER_REGISTRY[get_supported_model(hf.architectures[0])](hf, tf)
    out = {}
    for mode in modes:
        if mode.startswith("bshd_forward"):
            result = _bshd_forward(module[0], hf, mode)
        else:
            swap = mode == "swap_experts" and mpu.get_pipeline_model_parallel_rank() == 0
            if swap:
                _swap_experts(module)
            result = _export(module, hf, tf, conv, hf_dir, te_modules, mode)
            if swap:
                _swap_experts(module)  # back: the next mode sees the loaded weights
        results = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(results, result)
        out[mode] = results
    if torch.distributed.get_rank() == 0:
        print(json.dumps(out))
    torch.distributed.destroy_process_group()


def _swap_experts(module) -> None:
    """The planted fault: two routed experts of the first MoE layer trade weights (twice: undone)."""
    from verl.utils.megatron_utils import unwrap_model

    experts = unwrap_model(module[0]).decoder.layers[1].mlp.experts.local_experts
    a, b = experts[0].linear_fc1.weight, experts[1].linear_fc1.weight
    tmp = a.data.clone()
    a.data.copy_(b.data)
    b.data.copy_(tmp)


def _export(module, hf, tf, conv, hf_dir: str, te_modules: list[str], mode: str) -> dict:
    """verl's per-tensor export of the model against the HF checkpoint, with the object collectives it made."""
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file

    from verl.utils.megatron_utils import per_tensor_generator

    mapping = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}
    calls = {"all_gather_object": 0, "broadcast_object_list": 0, "broadcast": 0}
    dist = torch.distributed
    originals = {fn: getattr(dist, fn) for fn in calls}

    def counted(fn):
        def call(*a, **k):
            calls[fn] += 1
            return originals[fn](*a, **k)
        return call

    for fn in calls:
        setattr(dist, fn, counted(fn))
    try:
        exported = {n: t.detach().to(torch.bfloat16) for n, t in per_tensor_generator(module, hf, conv, tf, mapping)}
        n_exported = dict(calls)
        if mode == "per_tensor_exchange":  # the counter's twin: verl's per-tensor helpers, once, are seen
            from verl.utils.megatron_utils import broadcast_str_from_megatron_pp

            broadcast_str_from_megatron_pp("decoder.final_layernorm.weight" if mpu.is_pipeline_last_stage() else None)
            n_exported = dict(calls)
    finally:
        for fn, f in originals.items():
            setattr(dist, fn, f)
    ref = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            ref.update(load_file(os.path.join(hf_dir, f)))
    missing = sorted(set(ref) - set(exported))
    extra = sorted(set(exported) - set(ref))
    wrong = sorted(n for n in set(ref) & set(exported)
                   if ref[n].shape != exported[n].shape or not torch.equal(ref[n].to(torch.bfloat16), exported[n]))
    return {"rank": torch.distributed.get_rank(), "n": len(exported), "missing": missing[:5], "extra": extra[:5],
            "wrong": wrong[:10], "n_wrong": len(wrong), "te_modules": te_modules, "collectives": n_exported}


def _bshd_forward(model, hf, mode: str) -> dict:
    """verl patch 0017: verl's padded (bshd) engine forward of two sequences of different lengths vs the
    same model on each sequence alone (megatron's own causal mask, no padding). mode
    ``bshd_forward_no_causal`` plants a fault: a padding-only mask without the causal part."""
    import verl.models.mcore.model_forward as mf

    real_mask = mf._local_attention_mask
    if mode == "bshd_forward_no_causal":
        mf._local_attention_mask = lambda m: ~m.bool()[:, None, None, :].expand(-1, 1, m.shape[1], -1)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, hf.vocab_size, (n,), generator=g) for n in (13, 6)]
    model.eval()
    with torch.no_grad():
        nested = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
        batched = mf.gptmodel_forward_model_engine(model, nested, {}, data_format="bshd")
        diffs = []
        tp = torch.distributed.get_world_size()  # sequence parallel off; pad to the TP alignment anyway
        for i, s in enumerate(seqs):
            n = len(s)
            pad = (-n) % tp
            ids = torch.cat([s, torch.zeros(pad, dtype=s.dtype)])[None]
            alone = model(input_ids=ids, position_ids=torch.arange(n + pad)[None], attention_mask=None)
            alone = _gather_vocab(alone[0, :n].float())
            got = _gather_vocab(batched[i].float())
            diffs.append((got - alone).abs().max().item() / max(alone.abs().max().item(), 1e-6))
    mf._local_attention_mask = real_mask
    return {"rank": torch.distributed.get_rank(), "rel_diff": diffs, "uses_local": mf._uses_local_core_attention(model)}


def _gather_vocab(x):
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    torch.distributed.all_gather(parts, x.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


if __name__ == "__main__":
    main()
