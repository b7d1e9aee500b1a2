#!/usr/bin/env python3
"""Benchmark the actor side of one GRPO step through verl's own Megatron training engine (no Ray, no vLLM).

What runs is what ``main_ppo`` runs in the actor worker of our presets (``trainer.use_v1``: verl 0.9.1 has
only the new engine; ``verl/workers/engine_workers.py`` ActorRolloutRefWorker -> TrainingWorker ->
``verl/workers/engine/megatron/transformer_impl.py`` MegatronEngineWithLMHead), minus the Ray worker shell:

* the engine: ``EngineRegistry.new("language_model", "megatron", ...)`` with verl's own config dataclasses
  (HFModelConfig, McoreEngineConfig, McoreOptimizerConfig, McoreActorConfig), ``engine.initialize()`` (verl's
  ``hf_to_mcore_config`` with our patched DeepSeek-V3 mapping, megatron-core GPTModel, DDP, megatron's
  optimizer: the DistributedOptimizer as the presets set ``use_distributed_optimizer``);
* the batch: ``--prompts`` x ``--n`` responses, prompt and response lengths drawn (seeded) from
  ``--prompt-len`` / ``--resp-len``, padded left/right as the rollout hands it over and converted by verl's
  ``left_right_2_no_padding``; split over the data-parallel ranks as verl's dispatch splits it; verl's
  dynamic batch sizing (``use_dynamic_bsz``, ``--max-token-len`` tokens per GPU per micro-batch);
* R3: random routes that respect DeepSeek-V3's group limit (``topk_group`` of ``n_group`` groups, standing
  in for vLLM's ``routed_experts``), replayed by verl's router replay in both phases;
* phase ``log_prob``: ``engine.infer_batch`` as ``compute_log_prob`` runs it (old log-probs, entropy);
* phase ``update``: rewards drawn at random, advantages from verl's GRPO estimator
  (``core_algos.get_adv_estimator_fn("grpo")``), ``engine.train_batch`` with verl's ``ppo_loss`` per
  mini-batch (forward, backward, megatron optimizer step), then the LR scheduler step;
* phase ``export``: the refit's trainer side, ``engine.get_per_tensor_param()`` (verl's per-tensor generator
  and DeepSeek-V3 converter) into one bucket buffer as verl's sender fills it (dsv3_rl.refit.buckets).

The weights are megatron-core's random initialisation (verl's dist-checkpoint load is replaced by a no-op:
timing does not depend on the values). The TrainingWorker lines that this replaces (injecting the engine's
micro-batching keys, ``train_mode``/``eval_mode``, the LR step) are restated here, nothing else.

Per phase: seconds (best of ``--steps`` after ``--warmup``), tokens/s per GPU, model TFLOP/s per GPU and MFU
(docs/planner.md, "GRPO update bench": 6 x active matmul params x tokens + attention for the update, 2 x for
the log-prob), peak allocated/reserved memory per GPU. Self-checks: loss finite, weights changed by the
update, exported tensors == the model's weights (checksums), tokens counted == tokens sampled; exit 1 when
one fails. ``--precision fp8`` also reports |log p(FP8) - log p(BF16)| on the same weights and tokens.

    torchrun --nproc-per-node 2 bench/bench_grpo_update.py --model tiny --layout ep=2       # CPU smoke test (gloo)
    torchrun --nproc-per-node 4 bench/bench_grpo_update.py --model proxy --layout tp=2,ep=2 --json out.json

One summary line (``grpo update bench: ...``); ``--json FILE`` writes every number and the config.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run from a bare checkout

from dsv3_rl.cliargs import UsageError, parse_set  # noqa: E402
from dsv3_rl.models.config_map import GPU_FUSIONS  # noqa: E402
from dsv3_rl.errors import cli_main  # noqa: E402
from dsv3_rl.fs import write_json_atomic  # noqa: E402

PHASES = ("log_prob", "update", "export")
RECIPES = ("delayed", "tensorwise", "blockwise")
FAULTS = ("export",)  # planted: one exported element corrupted -> the export checksum check must FAIL
SAMPLE = 1024  # elements per parameter kept to measure how far the update moved the weights
# what the CPU presets (examples/deepseek_v3/presets/_tiny.yaml + tiny_cpu.yaml) pass to verl's engine
CPU_OVERRIDES = dict(attention_backend="local", use_cpu_initialization=True, moe_grouped_gemm=False,
                     moe_shared_expert_overlap=False, moe_permute_fusion=False, apply_rope_fusion=False,
                     bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                     persist_layer_norm=False, gradient_accumulation_fusion=False)


# verl's DeepSeek-V3 config (verl/models/mcore/config_converter.py) turns on what only TE (or apex) provides:
# persist_layer_norm (megatron's local spec builds WrappedTorchNorm, which asserts it off: every row of the first GPU
# run, 2026-11-26, died on "persist_layer_norm not supported by torch LayerNorm"), the shared-expert overlap and
# the fused masked softmax. The local spec on GPU turns them off, as bench/bench_train_step.py runs it.
GPU_LOCAL_SPEC = dict(GPU_FUSIONS, moe_grouped_gemm=False,  # SequentialMLP (+ grouped mm, patch 0013)
                      persist_layer_norm=False, moe_shared_expert_overlap=False, masked_softmax_fusion=False,
                      attention_backend="auto")  # megatron's local attention: SDPA (patch 0012) without TE


def spec_overrides(spec: str, cuda: bool) -> dict:
    """override_transformer_config for verl's engine: the CPU presets' settings on CPU; on GPU, for the local
    spec, the TE-only options verl turns on switched off."""
    if not cuda:
        return dict(CPU_OVERRIDES)
    return dict(use_cpu_initialization=False, **(GPU_LOCAL_SPEC if spec == "local" else {}))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (dsv3_rl.errors), not argparse's usage block
        raise UsageError(message)


# ------------------------------------------------------------------------------------------- the batch


def parse_dist(text: str, flag: str) -> tuple[str, tuple[float, ...]]:
    """``fixed:N`` | ``uniform:LO:HI`` | ``lognormal:MEDIAN:SIGMA:MAX`` (lengths in tokens, integers >= 1)."""
    kind, *vals = text.split(":")
    want = {"fixed": 1, "uniform": 2, "lognormal": 3}
    try:
        nums = tuple(float(v) for v in vals)
    except ValueError:
        nums = ()
    if kind not in want or len(nums) != want[kind]:
        raise UsageError(f"{flag} {text!r}: expected fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA:MAX")
    if kind == "uniform" and not 1 <= nums[0] <= nums[1]:
        raise UsageError(f"{flag} {text!r}: need 1 <= LO <= HI")
    if kind == "fixed" and nums[0] < 1 or kind == "lognormal" and (nums[0] < 1 or nums[1] < 0 or nums[2] < 1):
        raise UsageError(f"{flag} {text!r}: lengths must be >= 1 and SIGMA >= 0")
    return kind, nums


def dist_max(dist: tuple[str, tuple[float, ...]]) -> int:
    """The longest length DIST can draw (:func:`draw_lengths`)."""
    kind, p = dist
    return int(p[0]) if kind == "fixed" else int(p[1]) if kind == "uniform" else int(p[2])


def draw_lengths(dist: tuple[str, tuple[float, ...]], count: int, g: torch.Generator) -> list[int]:
    kind, p = dist
    if kind == "fixed":
        return [int(p[0])] * count
    if kind == "uniform":
        return torch.randint(int(p[0]), int(p[1]) + 1, (count,), generator=g).tolist()
    x = torch.exp(math.log(p[0]) + p[1] * torch.randn(count, generator=g, dtype=torch.float64))
    return x.round().clamp(1, p[2]).long().tolist()


def sample_batch(args, hf, seed: int) -> dict:
    """The rollout's hand-over: P prompts x N responses, left-padded prompts, right-padded responses, random
    tokens, 0/1 rewards, and R3 routes for every token and layer that respect the group limit."""
    g = torch.Generator().manual_seed(seed)
    p_lens = draw_lengths(args.prompt_dist, args.prompts, g)
    r_lens = draw_lengths(args.resp_dist, args.prompts * args.n, g)
    p_lens = [p for p in p_lens for _ in range(args.n)]
    b, pmax, rmax = len(r_lens), max(p_lens), max(r_lens)
    prompts = torch.zeros(b, pmax, dtype=torch.long)
    responses = torch.zeros(b, rmax, dtype=torch.long)
    pmask = torch.zeros(b, pmax, dtype=torch.long)
    rmask = torch.zeros(b, rmax, dtype=torch.long)
    vocab = hf.vocab_size
    for i, (pl, rl) in enumerate(zip(p_lens, r_lens)):
        prompts[i, pmax - pl:] = torch.randint(3, vocab, (pl,), generator=g)
        pmask[i, pmax - pl:] = 1
        responses[i, :rl] = torch.randint(3, vocab, (rl,), generator=g)
        rmask[i, :rl] = 1
    attention_mask = torch.cat([pmask, rmask], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    routes = random_routes(hf, b * (pmax + rmax), g).view(b, pmax + rmax, hf.num_hidden_layers, -1)
    routes = routes * attention_mask[:, :, None, None]  # padding rows: expert 0 (never read)
    return dict(prompt_lens=p_lens, resp_lens=r_lens, input_ids=torch.cat([prompts, responses], 1),
                prompts=prompts, responses=responses, attention_mask=attention_mask, position_ids=position_ids,
                response_mask=rmask, rewards=rewards, routed_experts=routes,
                uid=[f"p{i // args.n}" for i in range(b)])


def random_routes(hf, tokens: int, g: torch.Generator) -> torch.Tensor:
    """[tokens, layers, top_k] expert ids: per token and layer, ``topk_group`` random groups of the ``n_group``,
    then ``num_experts_per_tok`` distinct random experts inside them (what DeepSeek-V3's router can pick)."""
    e, k = hf.n_routed_experts, hf.num_experts_per_tok
    ng, tg = max(1, getattr(hf, "n_group", 1) or 1), max(1, getattr(hf, "topk_group", 1) or 1)
    layers = hf.num_hidden_layers
    groups = torch.rand(tokens * layers, ng, generator=g).topk(tg, dim=-1).indices
    allowed = torch.zeros(tokens * layers, ng, dtype=torch.bool).scatter_(1, groups, True)
    allowed = allowed.repeat_interleave(e // ng, dim=1)
    score = torch.rand(tokens * layers, e, generator=g).masked_fill(~allowed, -1.0)
    return score.topk(k, dim=-1).indices.view(tokens, layers, k)


def verl_batch(tu, padding, fields: dict, rows: slice, extra: dict | None = None):
    """A TensorDict of rows ROWS in the padded layout, converted to verl's no-padding layout."""
    from tensordict import TensorDict

    keys = ("input_ids", "prompts", "responses", "attention_mask", "position_ids", "response_mask", "routed_experts")
    tensors = {k: fields[k][rows] for k in keys}
    tensors.update({k: v[rows] for k, v in (extra or {}).items()})
    td = TensorDict(tensors, batch_size=[tensors["input_ids"].shape[0]])
    return padding.left_right_2_no_padding(td)


# ------------------------------------------------------------------------------------------- FLOPs


def model_flops(hf, seqlens: list[int], passes: int) -> float:
    """Model FLOPs of PASSES passes (1 = forward, 3 = forward + backward) over sequences of SEQLENS: the planner's
    one count (dsv3_rl.planner.comm.batch_flops; per token 2 x active matmul params, no embedding lookup, lm_head
    counted, + causal MLA attention 2 x heads x (qk_head_dim + v_head_dim) x s^2 / 2 per layer and sequence)."""
    from dsv3_rl.planner.comm import batch_flops
    from dsv3_rl.planner.model import load_model

    return passes * batch_flops(load_model(hf), seqlens)


def verl_flops(hf, seqlens: list[int], passes: int) -> float | None:
    """verl's own estimate (verl.utils.flops_counter, what its workers turn into ``perf/mfu``), scaled to PASSES."""
    from verl.utils.flops_counter import FlopsCounter

    fc = FlopsCounter(hf)
    est, _ = fc.estimate_flops(seqlens, 1.0)  # TFLOP at delta_time 1 s = TFLOPs of fwd + bwd (3 passes)
    return est * 1e12 * passes / 3


def peak_tflops(dev: torch.device, fp8: bool) -> float | None:
    """Dense peak of the GPU (planner's GPU table for H100/H200, else verl's table); None on CPU."""
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    from dsv3_rl.planner.spec import GPUS

    keys = sorted((k for k in GPUS if k in name), key=len, reverse=True)  # "H200" before "H20"
    if keys:
        return GPUS[keys[0]].bf16_tflops * (2 if fp8 else 1)
    from verl.utils.flops_counter import get_device_flops

    return get_device_flops("T", name) * (2 if fp8 else 1)


# ------------------------------------------------------------------------------------------- checks


def weight_sample(engine) -> list[torch.Tensor]:
    return [p.detach().reshape(-1)[:SAMPLE].float().clone() for c in engine.module for p in c.parameters()]


def weight_change(before: list[torch.Tensor], engine) -> float:
    after = weight_sample(engine)
    d = torch.tensor([sum(float((a - b).square().sum()) for a, b in zip(after, before)),
                      sum(float(b.square().sum()) for b in before)], dtype=torch.float64)
    d = d.to(_dev())
    torch.distributed.all_reduce(d)
    return math.sqrt(d[0].item() / max(d[1].item(), 1e-30))


def model_checksum(engine, vocab: int) -> list[float]:
    """[elements, sum, sum of squares] (float64) over the model's distinct weights, every shard counted once
    (TP/EP shards summed, replicas skipped), padded vocabulary rows left out: what a full export must hold."""
    from megatron.core import parallel_state as mpu

    tp_rank, etp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_expert_tensor_parallel_rank()
    dp_first = mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    edp_first = mpu.get_expert_data_parallel_rank() == 0
    acc = torch.zeros(3, dtype=torch.float64)
    for chunk in engine.module:
        # the router's score-correction bias is a buffer (not trained, exported as e_score_correction_bias)
        buffers = [(n, b) for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
        for name, p in [*chunk.named_parameters(), *buffers]:
            expert = not getattr(p, "allreduce", True)
            tp_split = getattr(p, "tensor_model_parallel", False)
            if expert and not (edp_first and (tp_split or etp_rank == 0)):
                continue
            if not expert and not (dp_first and (tp_split or tp_rank == 0)):
                continue
            w = p.detach()
            if name.endswith(("embedding.word_embeddings.weight", "output_layer.weight")) and tp_split:
                rows = w.shape[0]
                keep = max(0, min(rows, vocab - tp_rank * rows))
                w = w[:keep]
            acc += _moments(w)
    acc = acc.to(_dev())
    torch.distributed.all_reduce(acc)
    return acc.tolist()


def _moments(t: torch.Tensor) -> torch.Tensor:
    """[elements, sum, sum of squares] of T in float64, in chunks (no float64 copy of a whole embedding)."""
    acc = torch.zeros(3, dtype=torch.float64, device=t.device)
    for c in t.reshape(-1).split(1 << 24):
        c = c.double()
        acc[1] += c.sum()
        acc[2] += c.square().sum()
    acc[0] = t.numel()
    return acc.cpu()


def _have_te() -> bool:
    from dsv3_rl.mcore.runtime import have_te

    return have_te()


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- engine


def build_engine(args, hf, model_dir: Path, layout, fp8: bool):
    """verl's MegatronEngineWithLMHead from verl's config dataclasses, as the actor worker builds it."""
    import verl.models.mcore.model_initializer as mi
    import verl.workers.engine.megatron.transformer_impl as ti
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreActorConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine import EngineRegistry

    if args.spec == "local":  # verl builds with TE's spec whenever TE imports
        mi._use_transformer_engine = lambda: False
    ti.load_mcore_dist_weights = lambda *a, **k: None  # random init: the bench's weights (see the module doc)

    otc: dict = spec_overrides(args.spec, torch.cuda.is_available())
    if layout.dispatcher:
        otc["moe_token_dispatcher_type"] = layout.dispatcher
    for key, field in (("first_stage_layers", "num_layers_in_first_pipeline_stage"),
                       ("last_stage_layers", "num_layers_in_last_pipeline_stage"),
                       ("pipeline_layout", "pipeline_model_parallel_layout")):
        if getattr(layout, key) is not None:
            otc[field] = getattr(layout, key)
    otc["account_for_embedding_in_pipeline_split"] = layout.account_for_embedding
    otc["account_for_loss_in_pipeline_split"] = layout.account_for_loss
    rc = args.recompute or layout.recompute
    if rc == "selective":
        otc.update(recompute_granularity="selective", recompute_modules=list(layout.recompute_modules or ["core_attn"]))
    elif rc == "full":
        otc.update(recompute_granularity="full", recompute_method=layout.recompute_method,
                   recompute_num_layers=layout.recompute_num_layers)
    if fp8:
        otc.update(fp8="e4m3", fp8_recipe=args.fp8_recipe)
    engine_cfg = McoreEngineConfig(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sp_, use_distributed_optimizer=args.dist_opt,
        use_dist_checkpointing=True, dist_checkpointing_path=str(model_dir), use_mbridge=False,
        dtype="bfloat16", seed=args.seed, override_transformer_config=otc,
        router_replay=EngineRouterReplayConfig(mode="R3"),
        use_dynamic_bsz=True, max_token_len_per_gpu=args.max_token_len, infer_max_token_len_per_gpu=args.max_token_len,
        use_remove_padding=args.spec == "te")
    optim_cfg = McoreOptimizerConfig(lr=args.lr, clip_grad=1.0, weight_decay=0.1, lr_warmup_steps=0,
                                     total_training_steps=1000)  # the trainer sets it from the data (constant LR here)
    model_cfg = HFModelConfig(path=str(model_dir), use_remove_padding=args.spec == "te")
    actor_cfg = McoreActorConfig(
        rollout_n=args.n, ppo_mini_batch_size=args.prompts // args.mini_batches, use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=args.max_token_len, clip_ratio_low=0.2, clip_ratio_high=0.28,
        loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False, megatron=engine_cfg, optim=optim_cfg)
    engine = EngineRegistry.new(model_type="language_model", backend="megatron", model_config=model_cfg,
                                engine_config=engine_cfg, optimizer_config=optim_cfg,
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    if fp8:
        # verl's builder (utils/megatron_utils.py get_model, "config.fp8 = None" after the model is built) turns FP8
        # off on the use_mbridge=False path the presets take; megatron-core reads config.fp8 at every forward (its
        # fp8 autocast, verl's FP8 padding), so setting it back on the built model's configs runs FP8
        _set_fp8(engine, "e4m3")
    return engine, actor_cfg


def _model_configs(engine) -> list:
    seen = {}
    for c in engine.module:
        for m in c.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "fp8"):
                seen.setdefault(id(cfg), cfg)
    if getattr(engine, "tf_config", None) is not None:
        seen.setdefault(id(engine.tf_config), engine.tf_config)
    return list(seen.values())


def _set_fp8(engine, value) -> list:
    """Set fp8 on every TransformerConfig of the model; returns the previous values."""
    cfgs = _model_configs(engine)
    old = [c.fp8 for c in cfgs]
    for c in cfgs:
        c.fp8 = value
    return old


def fp8_modules_used(engine) -> int:
    """Transformer Engine modules whose FP8 state was initialised by a forward (FP8 GEMMs really ran)."""
    return sum(1 for c in engine.module for m in c.modules() if getattr(m, "fp8_initialized", False))


def engine_keys(engine, forward_only: bool) -> dict:
    """The micro-batching keys verl's TrainingWorker injects before it calls the engine
    (engine_workers.py: train_batch / infer_batch ``default_keys``)."""
    c = engine.engine_config
    return dict(use_remove_padding=engine.model_config.get("use_remove_padding", False),
                use_dynamic_bsz=c.use_dynamic_bsz,
                max_token_len_per_gpu=c.infer_max_token_len_per_gpu if forward_only else c.max_token_len_per_gpu,
                micro_batch_size_per_gpu=c.infer_micro_batch_size_per_gpu if forward_only else c.micro_batch_size_per_gpu,
                use_fused_kernels=c.use_fused_kernels)


def _mp_broadcast(engine, t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """The rank of the model-parallel group that holds outputs (last stage, TP rank 0) sends T to the others
    (verl's controller collects from that rank and dispatches to all)."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_model_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    flags = [None] * len(ranks)
    torch.distributed.all_gather_object(flags, bool(engine.is_mp_src_rank_with_outputs()), group=group)
    src = ranks[flags.index(True)]
    out = t.to(_dev()).contiguous() if t is not None else torch.empty(shape, dtype=torch.float32, device=_dev())
    torch.distributed.broadcast(out, src=src, group=group)
    return out.cpu()


@contextlib.contextmanager
def fp8_off(engine):
    """Every TransformerConfig of the model with fp8 = None: megatron-core then enters no FP8 autocast."""
    cfgs = _model_configs(engine)
    old = _set_fp8(engine, None)
    try:
        yield
    finally:
        for c, v in zip(cfgs, old):
            c.fp8 = v


# ------------------------------------------------------------------------------------------- profile


CATEGORIES = (("all-to-all/NCCL", ("nccl", "all_to_all", "alltoall", "allgather", "all_gather", "reduce_scatter",
                                   "allreduce", "all_reduce", "broadcast", "c10d", "gloo")),
              ("attention", ("flash", "fmha", "attention", "attn", "softmax", "sdpa", "cudnn")),
              ("optimizer", ("adam", "multi_tensor", "optimizer", "l2norm", "clip_grad")),
              ("GEMM", ("gemm", "matmul", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::bmm",
                        "aten::addmm", "aten::linear", "_grouped_mm", "sm90")))


def _category(name: str) -> str:
    name = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def categorize_trace(trace: Path, wall_s: float, top: int = 12) -> dict:
    """GPU time per category from an exported chrome trace: only device events (kernels, memcpy, memset), each
    counted once; idle = wall - busy. (The profiler's key_averages() would count a kernel under the aten op that
    launched it as well: on 4x H100 that summed to 14.3 s of "busy" time in a 7.6 s step.)"""
    events = json.loads(Path(trace).read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    out = {c: 0.0 for c, _ in CATEGORIES} | {"other": 0.0}
    per_kernel: dict = {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        t = float(ev.get("dur", 0)) / 1e6
        out[_category(ev.get("name", ""))] += t
        key = ev.get("name", "")[:80]
        per_kernel[key] = per_kernel.get(key, 0.0) + t
    busy = sum(out.values())
    res = {k: round(v, 6) for k, v in out.items()}
    res |= {"wall": round(wall_s, 6), "busy": round(busy, 6), "idle": round(max(0.0, wall_s - busy), 6),
            "basis": "GPU kernel time (chrome trace device events, rank 0, the profiled step with profiler overhead)",
            "top_kernels": [[k, round(v, 6)] for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]]}
    return res


def categorize_cpu(prof) -> dict:
    """CPU op self time per category (CPU runs: no kernels, no idle)."""
    out = {c: 0.0 for c, _ in CATEGORIES} | {"other": 0.0}
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            out[_category(ev.key)] += ev.self_cpu_time_total / 1e6
    return {k: round(v, 6) for k, v in out.items()} | {"idle": None, "basis": "CPU op self time (no idle on CPU)"}


# ------------------------------------------------------------------------------------------- main


def parse_args(argv):
    p = _Parser(prog="bench_grpo_update.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model preset (dsv3_rl.models.presets; default proxy on GPU, tiny on CPU)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model preset override (repeatable)")
    p.add_argument("--layout", default="tp=1", help="megatron layout, e.g. tp=2,ep=2,pp=2 (dsv3_rl.layout.Layout)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 4 CPU, 16 GPU)")
    # not --n: torchrun (Python 3.12's argparse) reads "--n" after the script name as an ambiguous abbreviation of
    # its own --nnodes/--nproc-per-node/... and stops (seen on the GPU box, 2026-11-26)
    p.add_argument("--rollout-n", dest="n", type=int, default=None,
                   help="responses per prompt, verl's rollout.n (default 4 CPU, 8 GPU)")
    p.add_argument("--prompt-len", default=None, help="fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA:MAX "
                   "(default uniform:8:24 CPU, uniform:256:1024 GPU)")
    p.add_argument("--resp-len", default=None, help="as --prompt-len (default uniform:4:24 CPU, lognormal:1024:0.6:3072 GPU)")
    p.add_argument("--max-token-len", type=int, default=None,
                   help="verl's ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu (default 256 CPU, 16384 GPU)")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per GRPO step (ppo_mini_batch_size = prompts / this)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 1 CPU, 3 GPU); the best is reported")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 0 CPU, 1 GPU)")
    p.add_argument("--dtype", default="bf16", help="parameter dtype (bf16: verl's megatron engine trains in bf16)")
    p.add_argument("--precision", default="bf16", help="bf16 | fp8 (Transformer Engine)")
    p.add_argument("--fp8-recipe", default="blockwise", help=f"with --precision fp8: {' | '.join(RECIPES)}")
    p.add_argument("--spec", default="auto", help="te | local | auto (te where Transformer Engine imports)")
    p.add_argument("--recompute", default=None, help="none | selective | full (default: the layout's)")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate (the presets' 1e-6)")
    p.add_argument("--distributed-optimizer", default="auto",
                   help="on | off | auto (on GPU, as the presets; off on CPU, as tiny_cpu: megatron's "
                        "DistributedOptimizer wraps CUDA tensors only)")
    p.add_argument("--bucket-mb", type=int, default=None, help="refit bucket (default 2048 GPU, 64 CPU)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", type=Path, default=None, help="torch.profiler trace of one step on rank 0 into DIR")
    p.add_argument("--fault", default=None, help=f"planted fault: {', '.join(FAULTS)}")
    p.add_argument("--json", type=Path, help="write all numbers and the config here")
    args = p.parse_args(argv)

    gpu = torch.cuda.is_available()
    for name, cpu_v, gpu_v in (("prompts", 4, 16), ("n", 4, 8), ("max_token_len", 256, 16384), ("steps", 1, 3),
                               ("warmup", 0, 1), ("bucket_mb", 64, 2048), ("model", "tiny", "proxy"),
                               ("prompt_len", "uniform:8:24", "uniform:256:1024"),
                               ("resp_len", "uniform:4:24", "lognormal:1024:0.6:3072")):
        if getattr(args, name) is None:
            setattr(args, name, gpu_v if gpu else cpu_v)
    for name in ("prompts", "n", "max_token_len", "steps", "mini_batches", "bucket_mb"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: must be >= 0")
    if args.prompts % args.mini_batches:
        raise UsageError(f"--mini-batches {args.mini_batches}: must divide --prompts {args.prompts}")
    if args.dtype != "bf16":
        raise UsageError(f"--dtype {args.dtype!r}: verl's megatron engine trains bf16 parameters here (allowed: bf16)")
    if args.precision not in ("bf16", "fp8"):
        raise UsageError(f"--precision {args.precision!r} (allowed: bf16, fp8)")
    if args.fp8_recipe not in RECIPES:
        raise UsageError(f"--fp8-recipe {args.fp8_recipe!r} (allowed: {', '.join(RECIPES)})")
    if args.spec not in ("te", "local", "auto"):
        raise UsageError(f"--spec {args.spec!r} (allowed: te, local, auto)")
    if args.recompute not in (None, "none", "selective", "full"):
        raise UsageError(f"--recompute {args.recompute!r} (allowed: none, selective, full)")
    if args.distributed_optimizer not in ("on", "off", "auto"):
        raise UsageError(f"--distributed-optimizer {args.distributed_optimizer!r} (allowed: on, off, auto)")
    args.dist_opt = args.distributed_optimizer == "on" or (args.distributed_optimizer == "auto" and gpu)
    if args.dist_opt and not gpu:
        raise UsageError("--distributed-optimizer on: megatron's DistributedOptimizer needs CUDA tensors (use off on CPU)")
    if args.fault not in (None, *FAULTS):
        raise UsageError(f"--fault {args.fault!r} (allowed: {', '.join(FAULTS)})")
    if not math.isfinite(args.lr) or args.lr < 0:
        raise UsageError(f"--lr {args.lr}: must be a finite number >= 0")
    args.prompt_dist = parse_dist(args.prompt_len, "--prompt-len")
    args.resp_dist = parse_dist(args.resp_len, "--resp-len")
    longest = dist_max(args.prompt_dist) + dist_max(args.resp_dist)
    if args.max_token_len < longest:  # verl asserts it in its dynamic batching, after the model is built
        raise UsageError(f"--max-token-len {args.max_token_len}: below the longest sample the lengths allow "
                         f"(--prompt-len up to {dist_max(args.prompt_dist)} + --resp-len up to "
                         f"{dist_max(args.resp_dist)} = {longest} tokens); verl's dynamic batching needs every sample "
                         f"in one micro-batch: use --max-token-len >= {longest}")
    from dsv3_rl.layout import Layout

    try:
        args.layout_obj = Layout.parse(args.layout)
    except ValueError as e:
        raise UsageError(f"--layout {args.layout!r}: {e}") from None
    from dsv3_rl.mcore.runtime import have_te

    te = have_te()
    if args.spec == "auto":
        args.spec = "te" if te else "local"
    if args.spec == "te" and not te:
        raise UsageError("--spec te: Transformer Engine does not import here (install it, e.g. the carried bundle "
                         "../shared/gpu-te, or use --spec local)")
    if args.precision == "fp8" and (not te or args.spec != "te"):
        raise UsageError("--precision fp8 needs Transformer Engine and --spec te (megatron-core's FP8 runs in TE's "
                         f"layers; here TE {'imports' if te else 'does not import'}, spec {args.spec})")
    if args.precision == "fp8" and not gpu:
        raise UsageError("--precision fp8 needs a GPU")
    return args


def _phase_mem(dev) -> dict:
    if dev.type != "cuda":
        return {"max_allocated_bytes": None, "max_reserved_bytes": None}
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(dev)}


def _reset_mem(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dsv3_rl.models import presets

    try:
        hf = presets.hf_config(args.model, parse_set(args.set or []))
    except (KeyError, ValueError) as e:
        raise UsageError(f"--model/--set: {e.args[0]}") from None
    layout = args.layout_obj
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if layout.dp(world) == 0 or layout.edp(world) == 0:
        raise UsageError(f"--layout {args.layout}: {world} ranks are not divisible by TP*PP*CP = "
                         f"{layout.tp * layout.pp * layout.cp} and EP*ETP*PP = {layout.ep * layout.etp_ * layout.pp} "
                         f"(start with torchrun --nproc-per-node N)")
    if layout.tp > 1 and not layout.sp_:
        raise UsageError(f"--layout {args.layout}: MoE with TP > 1 needs sequence parallel (sp=true); without it "
                         "megatron-core doubles the routed-expert gradients (README, 'refused instead')")
    if (args.prompts * args.n) % layout.dp(world) or (args.prompts // args.mini_batches * args.n) % layout.dp(world):
        raise UsageError(f"--prompts {args.prompts} x --n {args.n} per mini-batch must divide over DP={layout.dp(world)}")

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("VERL_PLATFORM", "cpu")  # verl's CPU platform (patch 0010)
    rank = int(os.environ.get("RANK", "0"))
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dev = _dev()
    if world == 1 and "MASTER_PORT" not in os.environ:
        from dsv3_rl.ports import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=1800))
    from dsv3_rl.refit import verl_export

    _, ray_stand_in = verl_export.load_engine()
    try:
        res = run(args, hf, layout, world, rank, dev, ray_stand_in)
    except torch.OutOfMemoryError as e:
        # what dsv3-plan validate reads for a layout that does not fit (this rank's view; any rank may write it)
        if args.json:
            from dsv3_rl.planner.validation import oom_stub

            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.json, dict(oom_stub(config_dict(args, layout, world, hf), str(e)), rank=rank,
                                              device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"))
        print(f"grpo update bench: rank {rank} ran out of memory: {' '.join(str(e).split())[:300]}", file=sys.stderr,
              flush=True)
        os._exit(3)  # no teardown: the other ranks may sit in a collective this rank will never join
    finally:
        from megatron.core import parallel_state as mpu

        mpu.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    if rank != 0:
        return 0  # rank 0 holds the received export and decides
    for c in res["checks"]:
        print(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['check']}: {c['detail']}")
    print(summary_line(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.json, res, ensure_ascii=True)
    return 0 if res["passed"] else 1


def summary_line(res: dict) -> str:
    def ph(name):
        p = res["phases"][name]
        s = f"{name} {p['seconds'] * 1e3:.0f} ms"
        if p.get("tokens_per_s_per_gpu") is not None:
            s += f" {p['tokens_per_s_per_gpu']:.0f} tok/s/GPU"
        if p.get("tflops_per_gpu") is not None:
            s += f" {p['tflops_per_gpu']:.1f} TFLOP/s/GPU"
        if p.get("mfu") is not None:
            s += f" MFU {p['mfu'] * 100:.1f}%"
        if p.get("max_allocated_bytes") is not None:
            s += f" peak {p['max_allocated_bytes'] / 2**30:.1f} GiB"
        return s

    c = res["config"]
    line = (f"grpo update bench: {res['device']} x{c['world']} {c['model']} {c['layout']} {c['precision']}"
            f"{'/' + c['fp8_recipe'] if c['precision'] == 'fp8' else ''} spec {c['spec']}; "
            f"{c['prompts']}x{c['n']} seqs, {res['batch']['tokens']} tokens; "
            + "; ".join(ph(n) for n in PHASES)
            + f"; loss {res['update']['loss']:.4g}, weights moved {res['update']['weight_change']:.2e}")
    if res.get("fp8_logprob"):
        f = res["fp8_logprob"]
        line += f"; |dlogp| fp8 vs bf16 mean {f['mean_abs']:.2e} max {f['max_abs']:.2e}"
    return line + f"; checks {'PASSED' if res['passed'] else 'FAILED'}"


def run(args, hf, layout, world, rank, dev, ray_stand_in) -> dict:
    from functools import partial

    import numpy as np
    from tensordict import NonTensorData

    from dsv3_rl.refit.buckets import fill_buckets
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import padding
    from verl.workers.utils.losses import ppo_loss

    fp8 = args.precision == "fp8"
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        model_dir = Path(tmp)
        if not getattr(hf, "architectures", None):
            hf.architectures = ["DeepseekV3ForCausalLM"]  # what a checkpoint's config.json names (verl requires one)
        hf.save_pretrained(model_dir)  # HFModelConfig reads config.json and the tokenizer (the engine pads with it)
        from dsv3_rl.models.tokenizer import copy_tokenizer_files

        copy_tokenizer_files(model_dir)
        engine, actor_cfg = build_engine(args, hf, model_dir, layout, fp8)
    loss_fn = partial(ppo_loss, config=actor_cfg)
    dp, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    adv_fn = get_adv_estimator_fn("grpo")
    bucket_bytes = args.bucket_mb << 20

    def one_step(step: int, profile: bool = False) -> dict:
        b = sample_batch(args, hf, args.seed * 1000 + step)
        nseq = len(b["resp_lens"])
        per = nseq // dp
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        seqlens_all = [p + r for p, r in zip(b["prompt_lens"], b["resp_lens"])]
        out: dict = {"batch": b}

        # ---- log_prob: compute_log_prob (old log-probs, entropy), R3 routes replayed
        td = verl_batch(tu, padding, b, rows)
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=1.0,
                             enable_routing_replay=True, global_token_num=NonTensorData(seqlens_all), **engine_keys(engine, True))
        counted = torch.tensor([float(td["input_ids"].offsets()[-1])], dtype=torch.float64, device=dev)
        _reset_mem(dev)
        _sync()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with engine.eval_mode():
            lp_out = engine.infer_batch(td)
        _sync()
        t_lp = time.perf_counter() - t0
        mem_lp = _phase_mem(dev)
        lp = None
        if engine.is_mp_src_rank_with_outputs():
            lp = padding.no_padding_2_padding(lp_out["model_output"]["log_probs"], td).float()
        old_log_probs = _mp_broadcast(engine, lp, (per, b["response_mask"].shape[1]))
        torch.distributed.all_reduce(counted, group=engine.get_data_parallel_group())  # each DP rank its own rows
        out["log_prob"] = dict(seconds=t_lp, tokens_counted=int(counted.item()), **mem_lp)

        if fp8 and step == 0:  # the same weights and tokens through a BF16 forward
            td16 = verl_batch(tu, padding, b, rows)
            tu.assign_non_tensor(td16, calculate_entropy=False, compute_loss=False, temperature=1.0,
                                 enable_routing_replay=True, global_token_num=NonTensorData(seqlens_all), **engine_keys(engine, True))
            with fp8_off(engine), engine.eval_mode():
                o16 = engine.infer_batch(td16)
            lp16 = None
            if engine.is_mp_src_rank_with_outputs():
                lp16 = padding.no_padding_2_padding(o16["model_output"]["log_probs"], td16).float()
            lp16 = _mp_broadcast(engine, lp16, old_log_probs.shape)
            mask = b["response_mask"][rows].bool()
            d = (old_log_probs - lp16).abs()[mask].double()
            s2 = torch.tensor([float(d.sum()), float(d.numel())], dtype=torch.float64, device=dev)
            mx = torch.tensor([float(d.max()) if d.numel() else 0.0], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(s2, group=engine.get_data_parallel_group())  # each DP rank's own rows
            torch.distributed.all_reduce(mx, op=torch.distributed.ReduceOp.MAX)
            out["fp8_logprob"] = dict(mean_abs=s2[0].item() / max(s2[1].item(), 1), max_abs=mx.item(),
                                      tokens=int(s2[1].item()))

        # ---- advantages: verl's GRPO estimator on the rewards (outcome reward on each response's last token)
        rmask = b["response_mask"]
        last = rmask.sum(1) - 1
        token_rewards = torch.zeros(rmask.shape, dtype=torch.float32)
        token_rewards[torch.arange(nseq), last] = b["rewards"]
        adv, _ = adv_fn(token_level_rewards=token_rewards, response_mask=rmask, index=np.array(b["uid"], dtype=object))

        # ---- update: ppo_loss + megatron optimizer, one optimizer step per mini-batch
        full_old = torch.zeros(rmask.shape, dtype=torch.float32)
        full_old[rows] = old_log_probs
        td = verl_batch(tu, padding, b, rows, {"old_log_probs": full_old, "advantages": adv.float()})
        mini_per_dp = per // args.mini_batches
        global_mini = nseq // args.mini_batches
        sample = weight_sample(engine)
        _reset_mem(dev)
        _sync()
        torch.distributed.barrier()
        prof = None
        if profile:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            prof = torch.profiler.profile(activities=acts, record_shapes=False)
            prof.__enter__()
        t0 = time.perf_counter()
        losses, grad_norms, agreements = [], [], []
        with engine.train_mode():
            for i, mb in enumerate(tu.make_iterator(td, mini_batch_size=mini_per_dp, epochs=1, seed=args.seed,
                                                    dataloader_kwargs={"shuffle": False})):
                lens = mb["input_ids"].offsets().diff().tolist()
                gathered = [None] * dp
                torch.distributed.all_gather_object(gathered, lens, group=engine.get_data_parallel_group())
                tu.assign_non_tensor(mb, calculate_entropy=False, compute_loss=True, temperature=1.0,
                                     global_batch_size=global_mini, enable_routing_replay=True,
                                     global_token_num=NonTensorData([x for xs in gathered for x in xs]), **engine_keys(engine, False))
                o = engine.train_batch(mb, loss_function=loss_fn)
                if i == args.mini_batches - 1:
                    engine.lr_scheduler_step()
                if engine.is_mp_src_rank_with_outputs():
                    # the loss of a mini-batch is the sum over its micro-batches (each scaled to the global batch),
                    # as TrainingWorker sums it
                    losses.append(_num(o["loss"], sum))
                    gn = o["metrics"].get("grad_norm")
                    grad_norms.append(_num(gn) if gn is not None else float("nan"))
                    ra = o["metrics"].get("router_replay/route_agreement")
                    if ra is not None:
                        agreements.append(_num(ra))
        _sync()
        t_up = time.perf_counter() - t0
        mem_up = _phase_mem(dev)
        moved = weight_change(sample, engine)
        out["update"] = dict(seconds=t_up, losses=losses, grad_norms=grad_norms, route_agreement=agreements,
                             weight_change=moved, **mem_up)

        # ---- export: verl's per-tensor generator into one bucket, as the refit sender fills it (timed without the
        # checksum; a second, untimed pass checks what the buckets received)
        def export(check: bool):
            buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=dev)
            got = torch.zeros(3, dtype=torch.float64)
            nb = [0]

            def on_bucket(bucket, buf):
                _sync()  # verl synchronises before handing a bucket over
                nb[0] += 1
                if check and rank == 0:  # the receiver's view: what is in the bucket
                    for _name, t in bucket.tensors(buf):
                        got.add_(_moments(t))

            stream, _ = engine.get_per_tensor_param()
            if check and args.fault == "export":
                stream = _corrupt_first(stream)
            ntensors, nbytes = fill_buckets(stream, buffer, on_bucket)
            _sync()
            del buffer
            return ntensors, nbytes, nb[0], got.tolist()

        _reset_mem(dev)
        _sync()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        ntensors, nbytes, nbuckets, _ = export(check=False)
        t_ex = time.perf_counter() - t0
        mem_ex = _phase_mem(dev)
        checksum = export(check=True)[3] if step == args.warmup + args.steps - 1 else None
        out["export"] = dict(seconds=t_ex, tensors=ntensors, bytes=nbytes, buckets=nbuckets, checksum=checksum, **mem_ex)
        if checksum is not None:
            out["model_checksum"] = model_checksum(engine, hf.vocab_size)
        if prof is not None:
            _sync()
            prof.__exit__(None, None, None)
            out["profile"] = (prof, t_lp + t_up + t_ex)
        return out

    results = []
    for step in range(args.warmup + args.steps):
        results.append(one_step(step, profile=args.profile is not None and rank == 0 and step == args.warmup))
    timed = results[args.warmup:]
    res = report(args, hf, layout, world, dev, engine, timed, ray_stand_in)
    if fp8:
        res["fp8_logprob"] = results[0]["fp8_logprob"]
        res["fp8_te_modules_initialized"] = fp8_modules_used(engine)  # > 0: FP8 GEMMs really ran
    return res


def _num(x, reduce=None) -> float:
    """A float from what verl's engine returns: a tensor, a Metric, or a list of them (micro-batches: mean,
    or REDUCE)."""
    if isinstance(x, (list, tuple)):
        vals = [_num(v) for v in x]
        return float((reduce or (lambda v: sum(v) / max(len(v), 1)))(vals))
    if hasattr(x, "value") and not isinstance(x, torch.Tensor):
        return _num(x.value)
    return float(x)


def _corrupt_first(stream):
    """Planted fault: the first exported tensor leaves with one element changed."""
    first = True
    for name, t in stream:
        if first:
            t = t.clone()
            t.view(-1)[0] += 1
            first = False
        yield name, t


def config_dict(args, layout, world: int, hf) -> dict:
    """The run's configuration as the JSON records it (also in the out-of-memory stub)."""
    fp8 = args.precision == "fp8"
    return dict(model=args.model, set=args.set or [], layout=args.layout, world=world, dp=layout.dp(world),
                tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp_, vpp=layout.vpp, cp=layout.cp,
                sp=layout.sp_, recompute=args.recompute or layout.recompute, prompts=args.prompts, n=args.n,
                prompt_len=args.prompt_len, resp_len=args.resp_len, max_token_len_per_gpu=args.max_token_len,
                mini_batches=args.mini_batches, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
                precision=args.precision, fp8_recipe=args.fp8_recipe if fp8 else None, spec=args.spec, lr=args.lr,
                distributed_optimizer=args.dist_opt, bucket_mb=args.bucket_mb, seed=args.seed, fault=args.fault,
                router_replay="R3", use_dynamic_bsz=True, use_remove_padding=args.spec == "te",
                model_dims={k: getattr(hf, k, None) for k in (
                    "hidden_size", "num_hidden_layers", "first_k_dense_replace", "num_attention_heads",
                    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
                    "num_experts_per_tok", "n_group", "topk_group", "vocab_size")})


def report(args, hf, layout, world, dev, engine, timed, ray_stand_in) -> dict:
    fp8 = args.precision == "fp8"
    b0 = timed[0]["batch"]
    seqlens = [p + r for p, r in zip(b0["prompt_lens"], b0["resp_lens"])]
    tokens = sum(seqlens)
    resp_tokens = sum(b0["resp_lens"])
    peak = peak_tflops(dev, fp8)
    flops = {"log_prob": model_flops(hf, seqlens, 1), "update": model_flops(hf, seqlens, 3)}
    vflops = {"log_prob": verl_flops(hf, seqlens, 1), "update": verl_flops(hf, seqlens, 3)}
    phases = {}
    for name in PHASES:
        # the same batch sizes every step (same distribution; lengths differ per step): best time per phase, with
        # the FLOPs and tokens of the step it came from
        best = min(timed, key=lambda r: r[name]["seconds"])
        bb = best["batch"]
        sl = [p + r for p, r in zip(bb["prompt_lens"], bb["resp_lens"])]
        p = dict(best[name])
        p.pop("losses", None)
        s = p["seconds"]
        if name in flops:
            f = model_flops(hf, sl, 1 if name == "log_prob" else 3)
            p.update(tokens=sum(sl), tokens_per_s_per_gpu=sum(sl) / s / world, model_flops=f,
                     tflops_per_gpu=f / s / world / 1e12,
                     mfu=(f / s / world / 1e12 / peak) if peak else None,
                     verl_flops=verl_flops(hf, sl, 1 if name == "log_prob" else 3))
        else:
            p.update(GBps=p["bytes"] / s / 1e9)
        phases[name] = p
    all_mem = {}
    for name in PHASES:  # per GPU: gather every rank's peaks
        vals = torch.tensor([float(timed[-1][name].get("max_allocated_bytes") or 0),
                             float(timed[-1][name].get("max_reserved_bytes") or 0)], dtype=torch.float64, device=dev)
        g = [torch.zeros_like(vals) for _ in range(world)]
        torch.distributed.all_gather(g, vals)
        all_mem[name] = {"max_allocated_bytes": [int(x[0]) for x in g], "max_reserved_bytes": [int(x[1]) for x in g]}
    last = timed[-1]
    up = last["update"]
    loss = up["losses"][-1] if up["losses"] else float("nan")
    loss_t = torch.tensor([loss if up["losses"] else 0.0, 1.0 if up["losses"] else 0.0], dtype=torch.float64, device=dev)
    torch.distributed.all_reduce(loss_t)
    loss = loss_t[0].item() / max(loss_t[1].item(), 1.0)  # mean over the ranks that hold it (DP ranks)
    sampled = sum(p + r for p, r in zip(last["batch"]["prompt_lens"], last["batch"]["resp_lens"]))
    ex, mc = last["export"]["checksum"], last["model_checksum"]
    ex_match = ex[0] == mc[0] and all(abs(a - c) <= 1e-9 * max(1.0, abs(c)) + 1e-6 for a, c in zip(ex[1:], mc[1:]))
    checks = [
        ("loss finite", math.isfinite(loss), f"loss {loss:.6g}"),
        ("weights changed by the update", up["weight_change"] > 0.0,
         f"relative L2 change of {SAMPLE} sampled elements per parameter: {up['weight_change']:.3e}"),
        ("exported tensors == model weights", ex_match,
         f"export elements/sum/sumsq {ex[0]:.0f}/{ex[1]:.9g}/{ex[2]:.9g} vs model {mc[0]:.0f}/{mc[1]:.9g}/{mc[2]:.9g}"),
        ("tokens counted == tokens sampled", last["log_prob"]["tokens_counted"] == sampled,
         f"engine input tokens {last['log_prob']['tokens_counted']} vs sampler {sampled}"),
    ]
    import verl

    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "verl_ray": "stand-in (dsv3_rl.refit.verl_export)" if ray_stand_in else "installed",
        "te_installed": _have_te(),
        "verl_file": getattr(verl, "__file__", None),
        "engine": f"{type(engine).__module__}.{type(engine).__name__}",
        "config": dict(config_dict(args, layout, world, hf), dp=engine.get_data_parallel_size()),
        "batch": dict(sequences=len(b0["resp_lens"]), tokens=tokens, response_tokens=resp_tokens,
                      prompt_lens=b0["prompt_lens"], resp_lens=b0["resp_lens"],
                      last_step_tokens=sampled),
        "flops": dict(formula="docs/planner.md#grpo-update-bench", peak_tflops_per_gpu=peak,
                      log_prob=flops["log_prob"], update=flops["update"],
                      verl_flops_counter=vflops,
                      megatron_core_counter="none: num_floating_point_operations lives in megatron/training "
                                            "(Megatron-LM), not in the megatron-core 0.16.1 package"),
        "phases": phases,
        "memory_per_gpu": all_mem,
        "update": dict(loss=loss, losses=up["losses"], grad_norms=up["grad_norms"],
                       route_agreement=up["route_agreement"], weight_change=up["weight_change"]),
        "export": dict(checksum=ex, model_checksum=mc, tensors=last["export"]["tensors"]),
        "checks": [{"check": c, "passed": bool(ok), "detail": d} for c, ok, d in checks],
    }
    prof = next((r["profile"] for r in timed if "profile" in r), None)
    if prof is not None:
        p, wall = prof
        args.profile.mkdir(parents=True, exist_ok=True)
        trace = args.profile / "trace_rank0.json"
        p.export_chrome_trace(str(trace))
        cats = categorize_trace(trace, wall) if dev.type == "cuda" else categorize_cpu(p) | {"wall": round(wall, 6)}
        res["profile"] = dict(trace=str(trace), categories_seconds=cats)
    res["passed"] = all(c["passed"] for c in res["checks"])
    return res


if __name__ == "__main__":
    sys.exit(cli_main(main)())
