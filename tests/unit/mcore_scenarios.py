"""Small megatron-core scenarios run in a subprocess by the patch tests.

    python tests/unit/mcore_scenarios.py NAME HF_CONFIG_DIR [WORK_DIR]

Run with PYTHONPATH pointing at a megatron tree with one patch reversed, a scenario shows the
failure that patch exists for (the planted-fault twins in test_mcore_patches.py); against the
patched tree it must succeed. Exit status 0 means the scenario ran through.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402


def _config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def build_and_train(cfg_dir: str, work: str) -> None:
    """A DeepSeek-V3 GPTModel with the local (non-TE) spec: build, forward, backward (1 process)."""
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime
    from dsv3_rl.mcore.layout_check import make_batches

    cfg = _config(cfg_dir)
    runtime.init_distributed(Parallel())
    chunks = runtime.wrap_ddp(runtime.build_model(cfg, Parallel(), use_te=False))
    result = runtime.forward_backward(chunks, make_batches(cfg.vocab_size, 1, 2, 8), 1, 8, 2)
    loss = float(result[0]["loss"])
    grads = [p.main_grad for p in chunks[0].parameters()]
    assert torch.isfinite(torch.tensor(loss)) and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    print(f"scenario build_and_train: loss {loss:.4f}")


def rng_seed(cfg_dir: str, work: str) -> None:
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime

    runtime.init_distributed(Parallel())  # calls model_parallel_cuda_manual_seed
    print("scenario rng_seed: ok")


def sp_norm(cfg_dir: str, work: str) -> None:
    """WrappedTorchNorm under sequence parallelism (what every norm of a TP>1 MoE model is)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from dsv3_rl.models.config_map import Parallel, hf_to_mcore_config

    cfg = hf_to_mcore_config(_config(cfg_dir), Parallel(tp=2, etp=1, sp=True), dtype=torch.float32)
    norm = WrappedTorchNorm(cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon)
    assert getattr(norm.weight, "sequence_parallel", False), "norm weight is not marked sequence_parallel"
    print("scenario sp_norm: ok")


def dist_ckpt_save(cfg_dir: str, work: str) -> None:
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime
    from dsv3_rl.mcore.layout_check import save

    cfg = _config(cfg_dir)
    runtime.init_distributed(Parallel())
    save(runtime.build_model(cfg, Parallel(), use_te=False), Path(work) / "ckpt")
    print("scenario dist_ckpt_save: ok")


def te_spec(cfg_dir: str, work: str) -> None:
    """The TE layer spec builds MLA down-projections column-parallel (inspected; TE not needed)."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    # Without TE installed the spec module skips importing the provider; its classes are then
    # distinct MagicMock stand-ins, which is all an identity check needs.
    specs.TESpecProvider = TESpecProvider
    for mod in list(sys.modules.values()):  # version gates would compare against "no TE"
        if getattr(mod, "__name__", "").startswith("megatron.core") and hasattr(mod, "is_te_min_version"):
            mod.is_te_min_version = lambda *a, **k: True
    spec = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=8, qk_layernorm=True, multi_latent_attention=True)
    sub = spec.submodules.self_attention.submodules
    assert sub.linear_q_down_proj is TEColumnParallelLinear, f"linear_q_down_proj is {sub.linear_q_down_proj}"
    assert sub.linear_kv_down_proj is TEColumnParallelLinear, f"linear_kv_down_proj is {sub.linear_kv_down_proj}"
    print("scenario te_spec: ok")


def recompute_selective(cfg_dir: str, work: str) -> None:
    """Selective recompute of the norms without TE (CheckpointWithoutOutput);
    gradients must equal those of the same step without recompute."""
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime
    from dsv3_rl.mcore.layout_check import make_batches

    cfg = _config(cfg_dir)
    runtime.init_distributed(Parallel())
    grads = []
    for overrides in ({}, {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}):
        torch.manual_seed(0)
        chunks = runtime.wrap_ddp(runtime.build_model(cfg, Parallel(), use_te=False, config_overrides=overrides))
        runtime.forward_backward(chunks, make_batches(cfg.vocab_size, 1, 2, 8), 1, 8, 2)
        grads.append({n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()})
    worst = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])
    assert worst < 1e-6, f"recompute changed gradients by {worst}"
    print(f"scenario recompute_selective: ok (max grad diff {worst:.1e})")


def bf16_optimizer_step(cfg_dir: str, work: str) -> None:
    """A bf16 GPTModel on CPU takes one step of megatron-core's own mixed-precision optimizer, built the way verl
    builds it (get_megatron_optimizer over the DDP chunks): fp32 main params, grad-norm clipping, copy back to bf16."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import runtime
    from dsv3_rl.mcore.layout_check import make_batches

    cfg = _config(cfg_dir)
    runtime.init_distributed(Parallel())
    chunks = runtime.wrap_ddp(runtime.build_model(cfg, Parallel(), dtype=torch.bfloat16, use_te=False))
    params = dict(chunks[0].module.named_parameters())
    bf16 = [n for n, p in params.items() if p.dtype == torch.bfloat16]  # the torch norms' weights stay fp32
    assert len(bf16) > len(params) // 2, f"only {len(bf16)} of {len(params)} params are bf16"
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                                 use_distributed_optimizer=False), chunks)
    before = {n: params[n].detach().clone() for n in bf16}
    runtime.forward_backward(chunks, make_batches(cfg.vocab_size, 1, 2, 8), 1, 8, 2)
    expected_norm = float(torch.stack([p.main_grad.double().norm() for p in params.values()]).norm())
    with_grad = [n for n in bf16 if params[n].main_grad.abs().sum() > 0]  # an expert without tokens has none
    assert len(with_grad) > len(bf16) // 2, f"only {len(with_grad)} of {len(bf16)} bf16 params have a gradient"
    ok, grad_norm, _ = opt.step()
    assert ok, "optimizer step was skipped (inf/nan found in the grads)"
    assert grad_norm is not None and abs(float(grad_norm) - expected_norm) <= 1e-4 * expected_norm, \
        f"optimizer grad norm {grad_norm}, the grads' own norm {expected_norm}"
    # Adam's first step moves each element with a gradient by ~lr, visible in bf16 for weights of |w| < ~0.25
    unchanged = [n for n in with_grad if torch.equal(params[n], before[n])]
    assert not unchanged, f"the step left {len(unchanged)} bf16 params with a gradient unchanged: {unchanged[:3]}"
    print(f"scenario bf16_optimizer_step: grad norm {float(grad_norm):.4f}, {len(with_grad)}/{len(bf16)} bf16 params "
          f"stepped")


#: what `import megatron.core` used to load without using it (patch 0016): torch.compile's dynamo through jit_fuser,
#: wandb through the inference context and the timers, tensorboard through the timers
NOT_AT_IMPORT = ("torch._dynamo", "wandb", "tensorboard")


def light_import(cfg_dir: str, work: str) -> None:
    """A training process's megatron-core imports (GPTModel and its local spec, optimizer, dist checkpointing, the
    pipeline schedules, timers) load none of NOT_AT_IMPORT; all are installed here, so their absence is the patch's."""
    import importlib.util

    missing = [m for m in NOT_AT_IMPORT if importlib.util.find_spec(m) is None]
    assert not missing, f"{missing} not installed: this scenario cannot show what patch 0016 keeps out"
    import megatron.core  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.timers  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401

    loaded = [m for m in NOT_AT_IMPORT if m in sys.modules]
    assert not loaded, f"importing megatron-core loaded {loaded}"
    print("scenario light_import: ok")


SCENARIOS = {f.__name__: f for f in (build_and_train, rng_seed, sp_norm, dist_ckpt_save, te_spec, recompute_selective,
                                     bf16_optimizer_step, light_import)}

if __name__ == "__main__":
    name, cfg_dir = sys.argv[1], sys.argv[2]
    work = sys.argv[3] if len(sys.argv) > 3 else "."
    SCENARIOS[name](cfg_dir, work)
