"""Distributed runtime and DeepSeek-V3 model construction on megatron-core.

Works on GPUs (NCCL) and on CPUs (gloo, with the project's megatron-core CPU patches), so the
same code runs the CPU correctness suite in CI and the GPU suite on real machines.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from dsv3_rl.models.config_map import Parallel, RouterSettings, gpt_model_kwargs, hf_to_mcore_config
from dsv3_rl.mcore import te_env

te_env.pin_torch_cudnn()  # before megatron-core imports Transformer Engine: one cuDNN per process


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(parallel: Parallel, seed: int = 1234, timeout_s: int = 600) -> None:
    """Initialise torch.distributed from the usual env (RANK/WORLD_SIZE/MASTER_*; single process
    when unset) and megatron's model-parallel groups for ``parallel``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        te_env.check_cudnn()  # before any GPU work: a second cuDNN is one error line, not a crash later
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    if world == 1 and "MASTER_PORT" not in os.environ:
        # A lone process started without a launcher (under torchrun the agent's MASTER_PORT is kept)
        init_single_process_group(timeout_s)
    elif not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by TP*PP*CP = {parallel.tp}*{parallel.pp}*{parallel.cp}")
    expert_parallel = parallel.ep * parallel.etp_ * parallel.pp
    if world % expert_parallel:
        raise ValueError(f"world size {world} is not divisible by EP*ETP*PP = {parallel.ep}*{parallel.etp_}*{parallel.pp}")
    destroy_model_parallel_groups()
    ps.initialize_model_parallel(**parallel.mcore_sizes())
    model_parallel_cuda_manual_seed(seed)


def init_single_process_group(timeout_s: int = 600, backend: str | None = None) -> bool:
    """A world-size-1 process group on an in-memory store (no port, nothing written to ``os.environ``); False when
    one exists already. Writing ``MASTER_PORT`` into the environment, as this did before, leaked it into every
    subprocess the same process started later (pytest workers: a one-process CLI then inherited a port this process
    still held, EADDRINUSE; CI of 2026-11-26)."""
    if dist.is_initialized():
        return False
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return True


def destroy_model_parallel_groups() -> None:
    """megatron's destroy_model_parallel() only forgets its groups; torch keeps each one (and, with NCCL, its
    communicator and buffers on the GPU) until it is destroyed. A process that rebuilds the groups for every job
    (the correctness worker: a dozen layouts per launch) ran 4x H100 out of memory that way (2026-11-26)."""
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        for pg in list(c10d._world.pg_map):
            if pg is not c10d.GroupMember.WORLD:
                dist.destroy_process_group(pg)
    ps.destroy_model_parallel()


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def have_te() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE

        return bool(HAVE_TE)
    except ImportError:
        return False


def build_model(hf_config: Any, parallel: Parallel = Parallel(), dtype: torch.dtype = torch.float32,
                router: RouterSettings = RouterSettings(), use_te: bool | None = None,
                config_overrides: dict | None = None) -> list[torch.nn.Module]:
    """GPTModel chunk(s) of this rank for an HF DeepSeek-V3 config (one per virtual pipeline stage).

    Uses megatron-core's TE spec where Transformer Engine is installed, else its local spec.
    Initialisation happens on CPU (``use_cpu_initialization``) so it is identical for every layout;
    the model is then moved to the device.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = have_te() if use_te is None else use_te
    overrides = {"use_cpu_initialization": True, **(config_overrides or {})}
    config = hf_to_mcore_config(hf_config, parallel, router, dtype, **overrides)
    vpp = parallel.vpp or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if parallel.vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=stage)
        model = GPTModel(config, spec, pre_process=pre, post_process=post, vp_stage=stage, **gpt_model_kwargs(hf_config))
        chunks.append(model.to(device()))
    return chunks


def wrap_ddp(chunks: list[torch.nn.Module], use_distributed_optimizer: bool = False) -> list[torch.nn.Module]:
    """megatron DistributedDataParallel around each chunk (fp32 grads in ``param.main_grad``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    return [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def forward_backward(chunks: list[torch.nn.Module], batches: Iterable[dict], num_microbatches: int, seq_length: int,
                     micro_batch_size: int, forward_only: bool = False,
                     loss_fn: Callable | None = None) -> list[dict]:
    """One step through megatron's own pipeline schedule, then ``finalize_model_grads``.

    Each batch: ``tokens`` [b, s], ``position_ids`` [b, s], ``labels`` [b, s], ``loss_mask`` [b, s].
    The loss is the token-mean cross entropy over each micro-batch, averaged over micro-batches
    (and data-parallel ranks by DDP), i.e. what HF's ``loss`` is for the same tokens.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = list(batches)
    if len(chunks) > 1:
        # The interleaved (virtual pipeline) schedule calls chunk c's forward step for micro-batch
        # m in the order of megatron's own schedule table, all chunks sharing one iterator: feed
        # exactly that sequence.
        from megatron.core.pipeline_parallel.schedules import get_schedule_table

        cfg = unwrap(chunks[0]).config
        group = cfg.microbatch_group_size_per_vp_stage or cfg.pipeline_model_parallel_size
        batches = [batches[m] for m, _chunk in get_schedule_table(len(batches), len(chunks), group)]
    it = iter(batches)

    def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
        losses = output.float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * mask) / mask.sum()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        dev = device()
        out = model(batch["tokens"].to(dev), batch["position_ids"].to(dev), attention_mask=None,
                    labels=batch["labels"].to(dev))
        return out, lambda o: (loss_fn or loss_func)(batch["loss_mask"].to(dev), o)

    for c in chunks:
        if hasattr(c, "zero_grad_buffer"):
            c.zero_grad_buffer()
    fb = get_forward_backward_func()
    data_iterator = [it] * len(chunks) if len(chunks) > 1 else it
    result = fb(forward_step_func=forward_step, data_iterator=data_iterator,
                model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_microbatches,
                seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only)
    if not forward_only:
        finalize_model_grads(chunks)
    return result


@contextlib.contextmanager
def grads_as_data(chunks: list[torch.nn.Module]):
    """Temporarily point every parameter's ``.data`` at its ``main_grad`` (or ``.grad``), so that
    megatron's sharded state dict + dist_checkpointing save the *gradients* with the same sharding
    metadata as the weights (used to reassemble full gradients from any layout)."""
    saved = []
    for c in chunks:
        for p in c.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is None:
                g = torch.zeros_like(p.data)
            saved.append((p, p.data))
            p.data = g.view_as(p.data).to(p.data.dtype) if g.dtype != p.data.dtype else g.view_as(p.data)
    try:
        yield
    finally:
        for p, d in saved:
            p.data = d
