"""FP8 rollout refit of MLA's absorbed weights (verl patch 0040), against vLLM's own code on CPU.

vLLM's MLA attention layer splits a dequantized ``kv_b_proj`` into ``W_UV`` / ``W_UK_T`` in its post-load hook
(``MLAAttention.process_weights_after_loading``). With an FP8 ``kv_b_proj`` those are new tensors, not views, and
verl's quantized refit re-ran only the linear layers' quant methods: decode attention kept the start-up (dummy)
weights (H100, 2026-12-07: pearson of sampled-token probabilities 0.001-0.005 under rollout.quantization=fp8).

The engine here is vLLM's own: DeepseekV3ForCausalLM and its DeepSeekMTP drafter, loaded with load_format dummy
and verl's FP8 quantization_config (kv_b_proj FP8, dequantized by vLLM's get_and_maybe_dequant_weights), then
refitted through verl's worker extension (update_weights_from_ipc: verl's bucketed sender -> receiver, the FP8
branch). This CPU has no FP8 GEMM kernel and no FP8 MoE backend: the linear kernel's own post-load step is a no-op
and the routed experts stay BF16; neither changes what the MLA layer derives. The GPU path (vLLM 0.24, CUDA graphs)
needs an H100 run. See docs/refit.md.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from types import SimpleNamespace

import pytest
import torch

from dsv3_rl.minimodel.mini_model import tensor_specs
from dsv3_rl.models.presets import preset_kwargs

# Dims on the 128 grid where vLLM's block-FP8 code needs them (fused q_a/kv_a and gate/up scales, and the
# dequant of kv_b_proj: scaled_dequantize asserts whole blocks); kv_b_proj is (4 * 32) x 256, two scale blocks.
CFG = {**preset_kwargs("tiny", {"hidden_size": 320, "q_lora_rank": 128, "kv_lora_rank": 256, "intermediate_size": 384,
                                "moe_intermediate_size": 128, "num_nextn_predict_layers": 1}),
       "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
N_LAYERS = CFG["num_hidden_layers"]
ABSORBED = ("W_UV", "W_UK_T")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """vLLM's engine start-up on CPU (get_model_loader(load_format=dummy).load_model, for the model and for the MTP
    drafter of speculative_config method=mtp) under verl's FP8 quantization, and verl's vLLM worker extension
    around them."""
    import verl.utils.kernel.fp8_kernel as fk
    import verl.workers.rollout.vllm_rollout.vllm_async_server as server
    import vllm.model_executor.layers.quantization.fp8 as vllm_fp8
    from verl.plugin.platform import platform_manager as pm
    from verl.plugin.platform.platform_cpu import PlatformCPU
    from verl.utils.vllm import vllm_quant_utils as quant
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    from vllm.model_executor.model_loader import get_model_loader

    from dsv3_rl.ports import free_port

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERL_PLATFORM", "cpu")
        mp.setattr(pm, "_current_platform", PlatformCPU())
        mp.setattr(fk, "_DISABLE_TRITON_FP8", True)  # verl's PyTorch quantizer (Triton imports here, no GPU)
        mp.setattr(server, "apply_vllm_quant_patches", lambda: None)  # started below, stopped at the end
        mp.setenv("VERL_VLLM_FP8_QUANT_ENABLED", "0")  # restored after verl's method sets it
        fake = SimpleNamespace(config=SimpleNamespace(quantization="fp8", qat={}, quantization_config_file=None),
                               model_config=SimpleNamespace(hf_config=SimpleNamespace(**CFG)))
        quantization, overrides = server.vLLMHttpServer._apply_quantization(fake)
        # no FP8 MoE backend on CPU ("Unsupported FP8 MoE backend: NONE"): the routed experts stay BF16
        overrides["quantization_config"]["ignored_layers"] += [f"model.layers.{i}.mlp.experts"
                                                               for i in range(1, N_LAYERS + 1)]
        # no FP8 GEMM kernel on CPU: its post-load repacking is a no-op (the dequant reads weight + scale)
        mp.setattr(vllm_fp8, "init_fp8_linear_kernel",
                   lambda *a, **k: SimpleNamespace(process_weights_after_loading=lambda layer: None))
        # a CPU with native BF16 (AVX512-BF16: the dev box of 2026-12-07, not the earlier ones) packs each unquantized
        # linear's weight for oneDNN and empties the parameter; the refit then loads the router gate into a 0-element
        # parameter. Keep the weights, as on a GPU (no packing there): the MLA layer's derivation is unchanged
        import vllm.model_executor.layers.utils as vllm_layer_utils
        keep = vllm_layer_utils.dispatch_cpu_unquantized_gemm
        mp.setattr(vllm_layer_utils, "dispatch_cpu_unquantized_gemm",
                   lambda layer, remove_weight: keep(layer, remove_weight=False))
        d = tmp_path_factory.mktemp("dsv3_fp8_mla")
        (d / "config.json").write_text(json.dumps(CFG))
        mc = ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="bfloat16", quantization=quantization,
                         hf_overrides=overrides, enforce_eager=True)
        load = LoadConfig(load_format="dummy")
        base = VllmConfig(model_config=mc, load_config=load)
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=mc,
                                 target_parallel_config=base.parallel_config)
        vc = VllmConfig(model_config=mc, load_config=load, speculative_config=spec)
        quant.apply_vllm_quant_patches()  # verl's rollout does this before the engine starts
        try:
            with set_current_vllm_config(vc):
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
                try:
                    initialize_model_parallel(1, 1)
                    model = get_model_loader(load).load_model(vc, mc)
                    drafter = get_model_loader(load).load_model(vc, spec.draft_model_config)
                    # verl's FP8 loader reads packed_modules_mapping, which vLLM's DeepSeekMTP (0.24 and 0.31) does
                    # not define (AttributeError); and verl's is_fp8_weight finds no module for the MTP layer's
                    # names, so the drafter's kv_b_proj is not the trainer's after the refit either. Both are
                    # problems of their own: here the drafter is checked against its own live kv_b_proj only.
                    drafter.packed_modules_mapping = model.packed_modules_mapping
                    worker = object.__new__(vLLMColocateWorkerExtension)  # its methods, without a vLLM worker
                    worker._is_qat_model = worker._is_modelopt_qat = False
                    worker.device, worker.local_rank = torch.device("cpu"), 0
                    worker.model_runner = SimpleNamespace(model=model, drafter=SimpleNamespace(model=drafter),
                                                          vllm_config=vc)
                    handle = f"ipc:///tmp/dsv3-fp8-mla-{uuid.uuid4().hex[:12]}.sock"
                    worker._get_zmq_handle = lambda: handle
                    yield SimpleNamespace(model=model, drafter=drafter, worker=worker, handle=handle,
                                          dtype=mc.dtype)
                finally:
                    destroy_model_parallel()
                    destroy_distributed_environment()
        finally:
            for p in quant.fp8_state.vllm_patches:
                p.stop()
            quant.fp8_state.vllm_patches.clear()


def _mla_layers(engine):
    """(name, layer) of every vLLM MLA attention layer of the model and the drafter."""
    from vllm.model_executor.layers.attention import MLAAttention

    return [(f"{who}:{n}", m) for who, root in (("model", engine.model), ("drafter", engine.drafter))
            for n, m in root.named_modules() if isinstance(m, MLAAttention)]


def _snapshot(engine):
    return {n: {a: (getattr(m, a), getattr(m, a).data_ptr(), getattr(m, a).clone()) for a in ABSORBED}
            for n, m in _mla_layers(engine)}


def _vllm_split(layer, dtype):
    """W_UV and W_UK_T as vLLM's hook derives them from the layer's live kv_b_proj (split_kv_b_proj)."""
    from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

    w_uk, w_uv = split_kv_b_proj(layer.kv_b_proj, dtype, layer.kv_lora_rank, layer.num_heads,
                                 layer.qk_nope_head_dim, layer.v_head_dim)
    return {"W_UV": w_uv.transpose(0, 1), "W_UK_T": w_uk.permute(1, 2, 0)}


def _stream(seed):
    """HF-named BF16 tensors of the model and its MTP layer, as the trainer's export sends them."""
    g = torch.Generator().manual_seed(seed)
    return [(s.name, (torch.randn(s.shape, generator=g) * 0.05).to(torch.float32 if s.kind == "bias" else
                                                                     torch.bfloat16))
            for s in tensor_specs(CFG, mtp_layers=1)]


def _refit(engine, stream):
    """verl's BucketedWeightSender -> the worker extension's update_weights_from_ipc (its FP8 branch)."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    errors: list[BaseException] = []

    def receive():
        try:
            engine.worker.update_weights_from_ipc(use_shm=True)
        except BaseException as e:  # noqa: BLE001 (whatever the receiver raises is the refit's result)
            errors.append(e)

    def send():
        asyncio.run(BucketedWeightSender(engine.handle, bucket_size_mb=4, use_shm=True).async_send_weights(
            iter(stream)))

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    threading.Thread(target=send, daemon=True).start()  # left waiting (daemon) if the receiver fails
    receiver.join(timeout=120)
    assert not receiver.is_alive(), "receiver hung"
    if errors:
        raise errors[0]


def _problems(engine, before):
    """What differs, per MLA layer, from what the refit must leave: W_UV / W_UK_T equal to vLLM's split of the live
    (refitted) kv_b_proj, in the tensors that were there before the refit (same object, same data_ptr)."""
    out = []
    for n, m in _mla_layers(engine):
        want = _vllm_split(m, engine.dtype)
        for a in ABSORBED:
            old, ptr, _values = before[n][a]
            now = getattr(m, a)
            if not torch.equal(now, want[a]):
                out.append(f"{n}.{a} stale")
            if now is not old or now.data_ptr() != ptr:
                out.append(f"{n}.{a} moved")
    return out


def _refitted(engine, seed):
    """Refit with a new stream; return (snapshot before, stream), after checking the refit changed every kv_b_proj
    (so a stale W_UV / W_UK_T differs from the split of the refitted one)."""
    before = _snapshot(engine)
    stream = _stream(seed)
    _refit(engine, stream)
    for n, m in _mla_layers(engine):
        want = _vllm_split(m, engine.dtype)
        assert all(not torch.equal(want[a], before[n][a][2]) for a in ABSORBED), n
    return before, stream


def test_fp8_engine_holds_copies_not_views(engine):
    """The precondition of the bug on vLLM's own start-up: kv_b_proj is FP8 and the MLA layers of the model and the
    drafter hold W_UV / W_UK_T in storage of their own (unquantized they would be views of kv_b_proj.weight)."""
    layers = _mla_layers(engine)
    assert [n.split(":")[0] for n, _ in layers] == ["model"] * N_LAYERS + ["drafter"]
    for n, m in layers:
        assert m.kv_b_proj.weight.dtype == torch.float8_e4m3fn, n
        for a in ABSORBED:
            t = getattr(m, a)
            assert t.dtype == torch.bfloat16, (n, a)
            assert t.untyped_storage().data_ptr() != m.kv_b_proj.weight.untyped_storage().data_ptr(), (n, a)


def test_fp8_refit_refreshes_mla_absorbed_weights_in_place(engine):
    """After verl's FP8 refit every MLA layer (model and MTP drafter) holds vLLM's split of the refitted kv_b_proj,
    in the same tensors (what a captured CUDA graph reads); the model's are the trainer's kv_b_proj within FP8
    rounding (DeepSeek's layout: kv_b_proj rows are heads x [nope | v], columns the KV latent)."""
    before, stream = _refitted(engine, seed=1)
    assert _problems(engine, before) == []
    sent = dict(stream)
    p, v = CFG["qk_nope_head_dim"], CFG["v_head_dim"]
    model_layers = [(n, m) for n, m in _mla_layers(engine) if n.startswith("model:")]
    for n, m in model_layers:
        i = int(n.split(".")[2])  # model:model.layers.<i>.self_attn.mla_attn.mla_attn
        w = sent[f"model.layers.{i}.self_attn.kv_b_proj.weight"].float().view(CFG["num_attention_heads"], p + v, -1)
        ref = {"W_UV": w[:, p:, :].transpose(1, 2), "W_UK_T": w[:, :p, :]}
        for a in ABSORBED:
            err = ((getattr(m, a).float() - ref[a]).norm() / ref[a].norm()).item()
            start_up = ((before[n][a][2].float() - ref[a]).norm() / ref[a].norm()).item()
            assert err < 0.05 < start_up, (n, a, err, start_up)


def test_planted_fault_no_refresh_keeps_start_up_weights(engine, monkeypatch):
    """Twin: the FP8 branch as before the patch (no refresh): every MLA layer keeps the W_UV / W_UK_T it had before
    the refit, and the check above names each of them stale."""
    from verl.utils.vllm import vllm_quant_utils as quant

    monkeypatch.setattr(quant, "refresh_mla_absorbed_weights", lambda model, act_dtype: None)
    before, _stream = _refitted(engine, seed=2)
    layers = _mla_layers(engine)
    assert _problems(engine, before) == [f"{n}.{a} stale" for n, _m in layers for a in ABSORBED]
    assert all(torch.equal(getattr(m, a), before[n][a][2]) for n, m in layers for a in ABSORBED)


def _hook_assigns_new_tensors(monkeypatch):
    """vLLM 0.24's hook: ``self.W_UV = W_UV.transpose(0, 1)``, a new tensor on every call (0.31's copies into the
    old one through replace_parameter(prefer_copy=True)). vLLM's replace_parameter without prefer_copy does that."""
    import vllm.model_executor.layers.attention.mla_attention as mla
    from vllm.model_executor.utils import replace_parameter

    monkeypatch.setattr(mla, "replace_parameter",
                        lambda layer, name, new, prefer_copy=False: replace_parameter(layer, name, new))


def test_refresh_keeps_storage_when_vllms_hook_assigns(engine, monkeypatch):
    """With vLLM 0.24's assigning hook the refresh still leaves vLLM's split in the tensors a CUDA graph captured."""
    _hook_assigns_new_tensors(monkeypatch)
    before, _stream = _refitted(engine, seed=3)
    assert _problems(engine, before) == []


def test_planted_fault_refresh_that_assigns_moves_the_tensors(engine, monkeypatch):
    """Twin: a refresh that only re-runs the hook (vLLM 0.24's, which assigns) has the right values in new tensors:
    a captured CUDA graph would go on reading the old ones. The check names every tensor moved."""
    from verl.utils.vllm import vllm_quant_utils as quant

    _hook_assigns_new_tensors(monkeypatch)

    def rerun_hook_only(model, act_dtype):
        for m in model.modules():
            if quant._is_mla_attention_layer(m):
                m.process_weights_after_loading(act_dtype)

    monkeypatch.setattr(quant, "refresh_mla_absorbed_weights", rerun_hook_only)
    before, _stream = _refitted(engine, seed=4)
    assert _problems(engine, before) == [f"{n}.{a} moved" for n, _m in _mla_layers(engine) for a in ABSORBED]
