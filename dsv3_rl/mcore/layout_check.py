"""Run one training step of a DeepSeek-V3 GPTModel at some parallel layout and save what it did.

    dsv3-layout-check --hf-config CFG.json --weights CKPT --out DIR [--layout tp=2,pp=1,ep=1,etp=1,sp=true]
    (or python -m dsv3_rl.mcore.layout_check; --layout takes any dsv3_rl.layout.Layout field, e.g. dispatcher=allgather)

Launch it with ``torchrun --nproc-per-node N`` (or as one process). It loads the model weights from
the megatron dist checkpoint ``CKPT`` (``--init`` writes a freshly initialised one instead, single
process), runs forward+backward on a deterministic batch through megatron's pipeline schedule,
finalizes the grads like training does, and saves into ``DIR``:

* ``grads/``: a dist checkpoint of the *gradients*, sharded like the weights, so any layout can be
  reassembled into full tensors by :func:`load_full` in one process.
* ``loss.json``: the loss per micro-batch.

Comparing ``grads/`` of two layouts is how the patch tests show e.g. that TP2 grads equal TP1 grads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from dsv3_rl.cliargs import add_layout
from dsv3_rl.errors import cli_main
from dsv3_rl.models.config_map import Parallel
from dsv3_rl.mcore import runtime


def make_batches(vocab: int, num_microbatches: int, micro_batch_size: int, seq_length: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, vocab, (micro_batch_size, seq_length + 1), generator=g)
        out.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                        position_ids=torch.arange(seq_length).expand(micro_batch_size, seq_length).contiguous(),
                        loss_mask=torch.ones(micro_batch_size, seq_length)))
    return out


def sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """Sharded state dict of this rank's model chunk(s). Virtual-pipeline chunks are nested under
    ``model0``, ``model1``, ... like Megatron-LM's checkpoints: their dict keys are *local* layer
    names (``decoder.layers.0`` in every chunk) and would overwrite each other in one flat dict;
    the ShardedTensors inside carry the global names, which is what dist_checkpointing stores."""
    mods = [runtime.unwrap(c) for c in chunks]
    if len(mods) == 1:
        return mods[0].sharded_state_dict()
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(mods)}


def save(chunks: list[torch.nn.Module], path: Path) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded_state_dict(chunks), str(path))


def load(chunks: list[torch.nn.Module], path: Path) -> None:
    from megatron.core import dist_checkpointing

    sd = dist_checkpointing.load(sharded_state_dict(chunks), str(path))
    mods = [runtime.unwrap(c) for c in chunks]
    per_chunk = [sd] if len(mods) == 1 else [sd[f"model{i}"] for i in range(len(mods))]
    for i, (m, part) in enumerate(zip(mods, per_chunk, strict=True)):
        own = {k: v for k, v in part.items() if k in m.state_dict(keep_vars=False)}
        missing, _ = m.load_state_dict(own, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"checkpoint {path} lacks (chunk {i}) {missing[:5]}{'...' if len(missing) > 5 else ''}")


def step(hf_config, parallel: Parallel, weights: Path, out: Path, num_microbatches: int, micro_batch_size: int,
         seq_length: int, init: bool, dtype: torch.dtype, seed: int = 0) -> None:
    runtime.init_distributed(parallel, seed=1234)
    chunks = runtime.build_model(hf_config, parallel, dtype=dtype)
    if init:
        save(chunks, weights)
    else:
        load(chunks, weights)
    chunks = runtime.wrap_ddp(chunks)
    batches = make_batches(hf_config.vocab_size, num_microbatches, micro_batch_size, seq_length, seed)
    result = runtime.forward_backward(chunks, batches, num_microbatches, seq_length, micro_batch_size)
    with runtime.grads_as_data(chunks):
        save([runtime.unwrap(c) for c in chunks], out / "grads")
    from megatron.core import parallel_state as ps

    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        losses = [float(r["loss"]) for r in result]
        (out / "loss.json").write_text(json.dumps({"losses": losses}))
    torch.distributed.barrier()
    runtime.destroy()


def load_full(hf_config, path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of a dist checkpoint written by any layout, keyed by megatron's
    TP1/PP1/EP1 parameter names. Needs a (single-process) distributed context; makes its own."""
    from megatron.core import dist_checkpointing

    single = Parallel()
    own_init = not torch.distributed.is_initialized()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    try:
        if own_init:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        runtime.init_distributed(single)
        chunks = runtime.build_model(hf_config, single, dtype=dtype)
        sd = dist_checkpointing.load(sharded_state_dict(chunks), str(path))
        return {k: v.detach().clone() for k, v in sd.items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    finally:
        if own_init:
            runtime.destroy()
            for k, v in saved.items():  # leave no rendezvous env behind for child processes
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@cli_main
def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig

    ap = argparse.ArgumentParser(prog="dsv3-layout-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-config", required=True, help="HF model dir or config.json")
    ap.add_argument("--weights", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="grads/ and loss.json go here")
    ap.add_argument("--init", action="store_true", help="initialise and write --weights (single layout)")
    add_layout(ap, help="the layout to run at; the world size comes from torchrun")
    ap.add_argument("--num-microbatches", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=16)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args(argv)
    cfg_path = Path(args.hf_config)
    hf_config = AutoConfig.from_pretrained(cfg_path.parent if cfg_path.is_file() else cfg_path)
    parallel = args.layout
    args.out.mkdir(parents=True, exist_ok=True)
    step(hf_config, parallel, args.weights, args.out, args.num_microbatches, args.micro_batch_size, args.seq_length,
         args.init, torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
