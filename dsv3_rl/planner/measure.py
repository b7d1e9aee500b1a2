"""Measure the peak memory of real megatron-core training steps of a DeepSeek-V3-shaped proxy.

What it runs, per config (one process, one device, TP=PP=EP=1):

* a megatron-core ``GPTModel`` built from an HF DeepSeek-V3 config through
  ``dsv3_rl.models.config_map.hf_to_mcore_config`` and megatron's *local* layer spec
  (``get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")``:
  no Transformer Engine). Core attention is megatron's local ``DotProductAttention``, which with
  patch 0012 runs torch SDPA when TE is absent (``attention_backend`` auto; fused flash / cuDNN /
  memory-efficient kernel on GPU) or the matmul + softmax path (``--attention unfused``). The row
  records what the built model really ran: ``impl.attention`` = ``sdpa`` | ``unfused`` (from
  ``core_attention.use_sdpa``), ``impl.attention_kernel`` (the SDPA kernel, read off the autograd
  node of the attention output: cudnn, flash, efficient, flash_cpu or math) and ``impl.moe_experts``
  (patch 0013's grouped_mm or the per-expert loop);
* wrapped in megatron's ``DistributedDataParallel`` (``grad_reduce_in_fp32=True``, verl's default)
  with megatron's ``DistributedOptimizer`` (Adam; without apex/TE megatron falls back to
  ``torch.optim.Adam``; fp32 main params + exp_avg + exp_avg_sq, sharded over DP=1);
* ``--steps`` optimizer steps, each = forward+backward over ``num_microbatches`` micro-batches
  through megatron's own schedule (``get_forward_backward_func``) with megatron's vocab-parallel
  cross entropy (``GPTModel(labels=...)``), then ``optimizer.step()``.

It reports for the *last* step (after the first step created the Adam states):
``peak_allocated`` (CUDA: ``torch.cuda.max_memory_allocated``), ``static_allocated`` (allocated
just before the step: weights + grad buffer + optimizer states) and the exact byte counts of
weights, grads and optimizer states read from the tensors.

On CPU (no CUDA) the same step runs, and ``peak_allocated``/``static_allocated`` are *emulated*:
a ``TorchDispatchMode`` counts the bytes of every storage an op creates until it is freed (rounded
to 512 B like the CUDA caching allocator's blocks). That is not a measurement of a GPU, and the
JSON says so (``"device": "cpu-emulated"``); the planner tests accept only ``"cuda"`` rows as
measurements.

Prints one JSON line per config and a summary line; ``--out FILE`` also writes the JSON lines
(atomically) for ``tests/assets/planner/``. ``bench/measure_train_memory.py`` is this module's ``main``
(and ``python -m dsv3_rl.planner.measure`` the same).

    python bench/measure_train_memory.py                   # the built-in GPU set (CUDA)
    python bench/measure_train_memory.py --set cpu-smoke   # tiny, runs on CPU in seconds
    python bench/measure_train_memory.py --list
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
import weakref
from pathlib import Path

from dsv3_rl.cliargs import UsageError
from dsv3_rl.errors import Dsv3Error, cli_main
from dsv3_rl.fs import write_text_atomic


class MeasureError(Dsv3Error, RuntimeError):
    """A measured configuration failed in its own process (the message says how to rerun it alone)."""


# --- configs ---------------------------------------------------------------------------------

#: DeepSeek-V3-shaped proxy (MLA with q/kv LoRA, 1 dense layer then MoE with a shared expert,
#: sigmoid top-k router) small enough for one GPU. Every measured row records the full dict.
PROXY_BASE = dict(
    model_type="deepseek_v3",
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=1,
    n_routed_experts=16,
    routed_scaling_factor=2.5,
    kv_lora_rank=128,
    q_lora_rank=384,
    qk_rope_head_dim=32,
    v_head_dim=64,
    qk_nope_head_dim=64,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    rope_interleave=True,
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    num_nextn_predict_layers=0,
)


def _cfg(name, layers, experts, seq, mbs=1, nmb=2, recompute=None, attention=None, **hf):
    """``attention``: megatron ``attention_backend`` for the config (None: auto, i.e. SDPA without TE)."""
    model = dict(PROXY_BASE, num_hidden_layers=layers, n_routed_experts=experts, **hf)
    cfg = dict(name=name, hf_config=model, seq_length=seq, micro_batch_size=mbs, num_microbatches=nmb,
               recompute=recompute or {"granularity": None})
    if attention:
        cfg["attention_backend"] = attention
    return cfg


SEL = "selective"
#: The set to run on one H100/H200 (about a minute in all). Varies layers, experts, sequence
#: length, micro-batch and recompute granularity. Not "layernorm"/"moe_act": without Transformer
#: Engine megatron-core 0.16.1's CheckpointWithoutOutput() takes its fp8 path
#: (tensor_parallel/random.py:655 sets ``self.fp8 = fp8 is not None``, True for the default False)
#: and fails on FP8GlobalStateManager (random.py:608).
GPU_SET = [
    _cfg("L4-E16-s2048-none", 4, 16, 2048),
    _cfg("L8-E16-s2048-full", 8, 16, 2048, recompute={"granularity": "full", "method": "uniform", "num_layers": 1}),
    _cfg("L4-E64-s4096-coreattn", 4, 64, 4096, recompute={"granularity": SEL, "modules": ["core_attn"]}),
    _cfg("L6-E32-s1024x2-selheavy", 6, 32, 1024, mbs=2,
         recompute={"granularity": SEL, "modules": ["core_attn", "mla_up_proj", "mlp", "shared_experts"]}),
    _cfg("L4-E64-s2048-selmoe", 4, 64, 2048, recompute={"granularity": SEL, "modules": ["mla_up_proj", "moe"]}),
    _cfg("L4-E16-s4096-none", 4, 16, 4096),
    _cfg("L12-E32-s2048-full", 12, 32, 2048, nmb=4, recompute={"granularity": "full", "method": "uniform", "num_layers": 1}),
    # DeepSeek-V3's real layer dims (hidden 7168, 128 heads, q/kv LoRA 1536/512, 2048-wide experts, vocab
    # 129280): 1 dense + 1 MoE layer with 8 experts; ~3.2B params, ~54 GiB of weights+grads+Adam states
    _cfg("dsv3dims-L2-E8-s1024-coreattn", 2, 8, 1024, recompute={"granularity": SEL, "modules": ["core_attn"]},
         vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
         num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
         v_head_dim=128, qk_nope_head_dim=128, num_experts_per_tok=8),
]

#: Rows whose peak is dominated by activations and logits (long sequences, micro-batch 2), so the
#: 15% check on the total peak also pins the planner's per-layer activation model: in GPU_SET the
#: activations are <= 1.1 GiB of a 4-66 GiB peak, which a 15% bound on the total cannot tell apart.
#: One per recompute choice the 671B presets use (none, selective MLA up-proj, selective heavy,
#: selective MoE) plus a 32k sequence where the logits are as large as the activations.
GPU_ACT_SET = [
    _cfg("act-L16-E16-s16384-none", 16, 16, 16384),
    _cfg("act-L16-E16-s16384-mlaup", 16, 16, 16384, recompute={"granularity": SEL, "modules": ["mla_up_proj"]}),
    _cfg("act-L12-E32-s8192x2-selheavy", 12, 32, 8192, mbs=2,
         recompute={"granularity": SEL, "modules": ["core_attn", "mla_up_proj", "mlp", "shared_experts"]}),
    _cfg("act-L12-E16-s8192x2-selmoe", 12, 16, 8192, mbs=2, recompute={"granularity": SEL, "modules": ["mla_up_proj", "moe"]}),
    _cfg("act-L4-E16-s32768-none", 4, 16, 32768),
    # the 671b_512xH100 preset's recompute list, and layernorm alone (megatron-core 0.16.1 could not
    # recompute it without TE before patch 0015: CheckpointWithoutOutput's fp8 path). Not moe_act:
    # megatron allows it only with moe_grouped_gemm (TE's grouped experts).
    _cfg("act-L12-E16-s8192x2-preset512", 12, 16, 8192, mbs=2,
         recompute={"granularity": SEL, "modules": ["core_attn", "mla_up_proj", "layernorm", "moe", "mlp"]}),
    _cfg("act-L12-E16-s8192x2-layernorm", 12, 16, 8192, mbs=2, recompute={"granularity": SEL, "modules": ["layernorm"]}),
]

_TINY = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64,
             qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32)
#: The same kinds of configs at a size a 2-core CPU runs in seconds (emulated accounting). Pinned to
#: the unfused attention path: on CPU, torch SDPA runs MLA's unequal q/k and v head dims through its
#: math kernel (S x S tensors, not modelled), and tests/assets/planner/cpu_emulated_smoke.jsonl was
#: recorded on the unfused path (before patch 0012).
CPU_SMOKE_SET = [
    _cfg("tiny-L3-E8-s256-none", 3, 8, 256, attention="unfused", **_TINY),
    _cfg("tiny-L4-E8-s256-full", 4, 8, 256, recompute={"granularity": "full", "method": "uniform", "num_layers": 1},
         attention="unfused", **_TINY),
    _cfg("tiny-L3-E16-s512-coreattn", 3, 16, 512, recompute={"granularity": SEL, "modules": ["core_attn"]},
         attention="unfused", **_TINY),
    _cfg("tiny-L3-E8-s128x2-selheavy", 3, 8, 128, mbs=2,
         recompute={"granularity": SEL, "modules": ["core_attn", "mla_up_proj", "mlp", "shared_experts"]},
         attention="unfused", **_TINY),
    _cfg("tiny-L3-E16-s256-selmoe", 3, 16, 256, recompute={"granularity": SEL, "modules": ["mla_up_proj", "moe"]},
         attention="unfused", **_TINY),
]

SETS = {"gpu": GPU_SET, "gpu-act": GPU_ACT_SET, "cpu-smoke": CPU_SMOKE_SET}


# --- CPU allocation emulation ----------------------------------------------------------------

def _live_bytes_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        """Bytes of storages created by ops while active and not yet freed (512 B blocks)."""

        def __init__(self):
            super().__init__()
            self.live = 0
            self.peak = 0
            self._sizes: dict[int, int] = {}

        def reset_peak(self):
            self.peak = self.live

        def _track(self, t):
            s = t.untyped_storage()
            key = s._cdata
            if key in self._sizes:
                return
            n = (s.nbytes() + 511) // 512 * 512
            self._sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            ref = weakref.ref(self)

            def _free(key=key, n=n):
                me = ref()
                if me is not None and me._sizes.pop(key, None) is not None:
                    me.live -= n

            weakref.finalize(s, _free)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in ins:
                    self._track(t)
            return out

    return LiveBytes()


# --- model construction ----------------------------------------------------------------------

def _mcore_config(hf_config: dict, recompute: dict, dtype, on_cuda: bool = False, attention: str | None = None):
    """megatron MLATransformerConfig for the proxy, TP=PP=EP=1, with the requested recompute and
    attention_backend (None: megatron's default, auto)."""
    rc = {}
    if attention:
        from megatron.core.transformer.enums import AttnBackend

        if attention not in AttnBackend.__members__:
            raise ValueError(f"attention_backend={attention!r}; allowed: {sorted(AttnBackend.__members__)}")
        rc["attention_backend"] = AttnBackend[attention]
    if recompute.get("granularity"):
        rc["recompute_granularity"] = recompute["granularity"]
        if recompute["granularity"] == "full":
            rc["recompute_method"] = recompute.get("method", "uniform")
            rc["recompute_num_layers"] = recompute.get("num_layers", 1)
        else:
            rc["recompute_modules"] = list(recompute.get("modules", ["core_attn"]))
    from dsv3_rl.models.config_map import hf_to_mcore_config
    from dsv3_rl.layout import Layout

    return hf_to_mcore_config(hf_config, Layout(tp=1, pp=1, ep=1, etp=1), dtype=dtype,
                              use_cpu_initialization=not on_cuda, **rc)


def _init_single_process(on_cuda: bool):
    """Process group + megatron parallel state for one process; returns the undo for what it set up
    (``main`` is also called in-process by the tests, which must not inherit an initialized group)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from dsv3_rl.mcore.runtime import init_single_process_group

    made_group = init_single_process_group(backend="nccl" if on_cuda else "gloo")
    made_state = not ps.model_parallel_is_initialized()
    if made_state:
        ps.initialize_model_parallel(1, 1)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    own_fork = vars(tracker).get("fork")
    if on_cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    else:
        # CPU ONLY: megatron's dropout RNG tracker needs CUDA RNG states; the proxy has no dropout
        # (attention_dropout = hidden_dropout = 0), so forking is a no-op here.
        tracker.fork = lambda *a, **k: contextlib.nullcontext()
        torch.manual_seed(1234)

    def undo():
        if own_fork is None:
            vars(tracker).pop("fork", None)
        else:
            tracker.fork = own_fork
        if made_state:
            ps.destroy_model_parallel()
        if made_group:
            dist.destroy_process_group()

    return undo


_SDPA_NODES = (("Cudnn", "cudnn"), ("FlashAttentionForCpu", "flash_cpu"), ("Flash", "flash"),
               ("Efficient", "efficient"))


def _attention_kernel(out) -> str | None:
    """The SDPA kernel behind a core-attention output, from its autograd nodes (None: no graph,
    e.g. a no-grad checkpoint forward)."""
    stack, seen = [getattr(out, "grad_fn", None)], 0
    while stack and seen < 8:  # output <- reshape <- permute <- SDPA node
        fn = stack.pop(0)
        if fn is None:
            continue
        seen += 1
        name = type(fn).__name__
        if name.startswith("ScaledDotProduct"):
            return next((k for pat, k in _SDPA_NODES if pat in name), name)
        if "Softmax" in name or name.startswith("Bmm") or name.startswith("Baddbmm"):
            return "math"
        stack += [f for f, _ in fn.next_functions]
    return None


def attention_used(model) -> dict:
    """What the built model's core attention and experts run (patches 0012 / 0013), as the row's
    impl fields; the SDPA kernel is filled in by the hook ``watch_attention_kernel`` installs."""
    att = model.decoder.layers[0].self_attention.core_attention
    sdpa = getattr(att, "use_sdpa", None)  # None: patch 0012 absent, the unfused path
    moe = [layer.mlp.experts for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]
    grouped = getattr(moe[0], "grouped_mm", None) if moe else None
    return dict(attention="sdpa" if sdpa else "unfused", attention_reason=getattr(att, "sdpa_reason", None),
                attention_kernel=None if sdpa else "unfused",
                moe_experts=None if not moe else ("grouped_mm" if grouped else "loop"))


def watch_attention_kernel(model, impl: dict):
    """Forward hook on the first layer's core attention: records the SDPA kernel of the first call
    that builds a graph (the recompute of a checkpointed one counts too). Returns the handle."""
    att = model.decoder.layers[0].self_attention.core_attention

    def hook(_mod, _inp, out):
        if impl.get("attention") == "sdpa" and impl.get("attention_kernel") is None:
            impl["attention_kernel"] = _attention_kernel(out[0] if isinstance(out, tuple) else out)

    return att.register_forward_hook(hook)


class _CpuDistOptEmulation:
    """CPU ONLY: megatron's DistributedOptimizer allocates CUDA tensors in __init__, so on CPU this
    mirrors its memory at DP=1: an fp32 main copy of every bf16 param, torch Adam (exp_avg,
    exp_avg_sq in fp32) on the main copies, grads taken from the DDP fp32 ``main_grad`` buffer
    without a copy, and the bf16 params refreshed from the main copies after the step."""

    def __init__(self, model):
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.Adam(self.main, lr=1e-6)
        self.shard_fp32_from_float16_groups = [self.main]

    def zero_grad(self):
        for m in self.main:
            m.grad = None

    def step(self):
        import torch

        for p, m in zip(self.params, self.main):
            m.grad = p.main_grad.view_as(m)
        torch.nn.utils.clip_grad_norm_(self.main, 1.0)
        self.optimizer.step()
        for p, m in zip(self.params, self.main):
            p.data.copy_(m)
            m.grad = None
        return True, None, None


def run_one(cfg: dict, steps: int, on_cuda: bool) -> dict:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dtype = torch.bfloat16
    dev = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    hf = cfg["hf_config"]
    tracker = None if on_cuda else _live_bytes_mode()
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_alloc = torch.cuda.memory_allocated() if on_cuda else 0

    # GPTModel exports NVTE_{FLASH,FUSED,UNFUSED}_ATTN for its attention_backend and asserts that a
    # previous model's values agree; they only steer TE (absent here), so configs of one run may differ
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(var, None)
    config = _mcore_config(hf, cfg["recompute"], dtype, on_cuda, cfg.get("attention_backend"))
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    with tracker if tracker is not None else contextlib.nullcontext():
        model = GPTModel(config, spec, vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
                         position_embedding_type="rope", share_embeddings_and_output_weights=False).to(dev)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True), model)
        if on_cuda:
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, bf16=True, params_dtype=dtype,
                                                         use_distributed_optimizer=True, clip_grad=1.0), [ddp])
        else:
            opt = _CpuDistOptEmulation(model)
    used = attention_used(model)
    watch = watch_attention_kernel(model, used)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers + ddp.expert_parallel_buffers)

    s, b, nmb = cfg["seq_length"], cfg["micro_batch_size"], cfg["num_microbatches"]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, hf["vocab_size"], (b, s + 1), generator=g) for _ in range(nmb)]
    pos = torch.arange(s, device=dev).expand(b, s).contiguous()

    def forward_step(it, m):
        tok = next(it).to(dev)
        out = m(tok[:, :-1].contiguous(), pos, None, labels=tok[:, 1:].contiguous())

        def loss_func(o):
            loss = o.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    fb = get_forward_backward_func()
    losses, static, peak = [], 0, 0
    t0 = time.time()
    for _ in range(steps):
        with tracker if tracker is not None else contextlib.nullcontext():
            if on_cuda:
                torch.cuda.synchronize()
                static = torch.cuda.memory_allocated() - base_alloc
                torch.cuda.reset_peak_memory_stats()
            else:
                tracker.reset_peak()
                static = tracker.live
            ddp.zero_grad_buffer()
            opt.zero_grad()
            res = fb(forward_step_func=forward_step, data_iterator=iter(batches), model=ddp, num_microbatches=nmb,
                     seq_length=s, micro_batch_size=b, forward_only=False)
            ok, _, _ = opt.step()
            if on_cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base_alloc
            else:
                peak = tracker.peak
        losses.append(float(sum(r["loss"] for r in res) / len(res)))
    elapsed = time.time() - t0
    watch.remove()
    opt_bytes = 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        for grp in o.shard_fp32_from_float16_groups if hasattr(o, "shard_fp32_from_float16_groups") else []:
            opt_bytes += sum(t.numel() * t.element_size() for t in grp)
        for st in o.optimizer.state.values():
            opt_bytes += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    row = dict(
        name=cfg["name"], device="cuda" if on_cuda else "cpu-emulated",
        gpu=torch.cuda.get_device_name() if on_cuda else None,
        hf_config=hf, seq_length=s, micro_batch_size=b, num_microbatches=nmb, recompute=cfg["recompute"],
        impl=dict(transformer_impl="local", **used, attention_backend=cfg.get("attention_backend") or "auto",
                  loss="megatron_ce", optimizer=("megatron DistributedOptimizer(adam, torch fallback)" if on_cuda
                                              else "cpu emulation of DistributedOptimizer at DP=1 (fp32 main + torch Adam)"),
                  grad_reduce_in_fp32=True, dtype="bf16", moe_grouped_gemm=False, dispatcher="alltoall"),
        params=n_params, weight_bytes=weight_bytes, grad_bytes=grad_bytes, optimizer_bytes=opt_bytes,
        static_allocated=int(static), peak_allocated=int(peak), losses=losses, seconds=round(elapsed, 2),
        torch=torch.__version__,
    )
    del opt, ddp, model
    if on_cuda:
        torch.cuda.empty_cache()
    return row


def _add_prediction(row: dict) -> None:
    """The planner's prediction for this row, for a quick look;
    tests/unit/test_planner_validation.py recomputes it from the row."""
    from dsv3_rl.planner.validation import predict_row

    try:
        row["planner_predicted_allocated"] = int(predict_row(row))
        if row.get("peak_allocated"):
            row["planner_error"] = round(row["planner_predicted_allocated"] / row["peak_allocated"] - 1, 4)
    except Exception as e:  # noqa: BLE001 - a prediction failure must not lose a measurement
        row["planner_error"] = f"prediction failed: {e}"


def _measure(cfgs, steps: int, on_cuda: bool) -> list:
    """One row per config (an OOM is recorded as a row), printed as it completes."""
    import torch

    rows = []
    from tqdm import tqdm

    for cfg in tqdm(cfgs, desc="configs", file=sys.stderr):
        try:
            row = run_one(copy.deepcopy(cfg), steps, on_cuda)
        except torch.cuda.OutOfMemoryError as e:  # record it and go on with the next config
            row = dict(name=cfg["name"], device="cuda", oom=True, error=str(e).splitlines()[0], hf_config=cfg["hf_config"],
                       seq_length=cfg["seq_length"], micro_batch_size=cfg["micro_batch_size"],
                       num_microbatches=cfg["num_microbatches"], recompute=cfg["recompute"], peak_allocated=None)
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        _add_prediction(row)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _measure_isolated(cfgs, args, device: str = "cuda") -> list:
    """One child process per config (CUDA). megatron-core keeps a finished config's parameters
    reachable after ``run_one`` returns (H100: 1.6, 4.3, 8.0 GiB still allocated after the first
    three GPU-set configs): the rows stay right, since each subtracts what was allocated before it
    started, but the last, largest config then ran out of memory on an 80 GB card."""
    import subprocess
    import tempfile

    from dsv3_rl.ports import free_port

    rows = []
    set_name = args.set or ("gpu" if device == "cuda" else "cpu-smoke")
    with tempfile.TemporaryDirectory(prefix="measure-mem-") as tmp:
        for i, c in enumerate(cfgs):
            out = Path(tmp) / f"{i}.jsonl"
            cmd = [sys.executable, "-m", "dsv3_rl.planner.measure", "--set", set_name, "--only", c["name"],
                   "--steps", str(args.steps), "--device", device, "--in-process", "--out", str(out)]
            if args.attention:
                cmd += ["--attention", args.attention]
            print(f"[{i + 1}/{len(cfgs)}] {c['name']} (own process)", file=sys.stderr, flush=True)
            # a rendezvous port of its own (an inherited MASTER_PORT may still be held by this process)
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
            if proc.returncode != 0 or not out.exists():
                raise MeasureError(f"config {c['name']!r} failed in its process (exit {proc.returncode}); "
                                 f"rerun it alone: python {' '.join(cmd[1:-2])}")
            row = json.loads(out.read_text().splitlines()[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


@cli_main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-measure-memory", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=sorted(SETS), default=None, help="config set (default: gpu on CUDA, cpu-smoke on CPU)")
    ap.add_argument("--only", default=None, help="comma-separated config names from the set")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps; the last one is reported (default 2)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines here (atomic)")
    ap.add_argument("--attention", choices=["auto", "sdpa", "unfused"], default=None,
                    help="megatron attention_backend for every config (default: each config's own; GPU set: auto = "
                         "SDPA without TE, patch 0012; cpu-smoke: unfused)")
    ap.add_argument("--in-process", action="store_true",
                    help="CUDA: run every config in this process (default: one child process per config, since "
                         "memory of a finished config stays allocated and a later large config can run out)")
    ap.add_argument("--isolate", action="store_true", help="one child process per config on CPU too")
    ap.add_argument("--list", action="store_true", help="list the configs of every set and exit")
    ap.add_argument("--predict-only", action="store_true",
                    help="run nothing: write the planner's predictions for the set with measured: null")
    args = ap.parse_args(argv)

    if args.list:
        for name, cfgs in SETS.items():
            for c in cfgs:
                print(json.dumps({"set": name, "name": c["name"], "layers": c["hf_config"]["num_hidden_layers"],
                                  "experts": c["hf_config"]["n_routed_experts"], "seq": c["seq_length"],
                                  "mbs": c["micro_batch_size"], "num_microbatches": c["num_microbatches"],
                                  "recompute": c["recompute"]}))
        return 0
    if args.predict_only:
        rows = []
        for c in SETS[args.set or "gpu"]:
            if args.only and c["name"] not in args.only.split(","):
                continue
            backend = args.attention or c.get("attention_backend") or "auto"
            # what a GPU without TE runs: SDPA's fused kernel unless unfused is asked for
            row = dict(copy.deepcopy(c), device=None, measured=None, peak_allocated=None, static_allocated=None,
                       impl=dict(transformer_impl="local", attention="unfused" if backend == "unfused" else "sdpa",
                                 attention_backend=backend, attention_kernel=None),
                       note="planner prediction only; replace with `python bench/measure_train_memory.py --out ...` "
                            "run on a GPU")
            _add_prediction(row)
            rows.append(row)
            print(json.dumps(row))
        if args.out:
            write_text_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
        print(f"summary: {len(rows)} predictions, measured: null")
        return 0
    import torch

    on_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch.cuda.is_available() is False")
    cfgs = SETS[args.set or ("gpu" if on_cuda else "cpu-smoke")]
    if args.only:
        want = args.only.split(",")
        unknown = sorted(set(want) - {c["name"] for c in cfgs})
        if unknown:
            raise UsageError(f"--only {unknown} not in set; known: {[c['name'] for c in cfgs]}")
        cfgs = [c for c in cfgs if c["name"] in want]
    if args.attention:
        cfgs = [dict(c, attention_backend=args.attention) for c in cfgs]
    if args.steps < 1:
        raise UsageError("--steps must be >= 1")

    t0 = time.time()
    if (on_cuda or args.isolate) and len(cfgs) > 1 and not args.in_process:
        rows = _measure_isolated(cfgs, args, "cuda" if on_cuda else "cpu")
    else:
        undo = _init_single_process(on_cuda)
        try:
            rows = _measure(cfgs, args.steps, on_cuda)
        finally:
            undo()
    if args.out:
        write_text_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    gib = 2**30
    where = rows[0]["device"] if rows else "-"
    if rows and rows[0]["gpu"]:
        where += f" ({rows[0]['gpu']})"
    peaks = ", ".join(f"{r['name']}=" + ("OOM" if r.get("oom") else f"{r['peak_allocated'] / gib:.2f}GiB") for r in rows)
    errs = [abs(r["planner_error"]) for r in rows if isinstance(r.get("planner_error"), float)]
    worst = f"; planner worst error {max(errs):.1%}" if errs else ""
    print(f"summary: {len(rows)} configs on {where}, peak {peaks}{worst}; {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
