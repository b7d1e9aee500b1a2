"""megatron-core training steps at one or more layouts, with activation hooks (a torchrun entry point).

    torchrun --nproc-per-node N -m dsv3_rl.correctness.worker --spec SPEC.json

SPEC.json (written by :mod:`runner`): ``hf_config`` (HF model dir), ``batch`` (``torch.save``d
batch from :mod:`data`), ``micro_batch_size``, ``dtype``, and ``jobs``, each with ``out`` (its
result dir), ``weights`` (megatron dist checkpoint), ``layout`` (:class:`layouts.Layout` fields),
``config_overrides`` (MLATransformerConfig fields) and ``hf_config_overrides``. Jobs of one world
size share the launch (imports cost ~10 s per process on a small CPU box; the steps far less); the
model-parallel groups are rebuilt for every job.

Per job every rank loads the weights, runs forward + backward through megatron's pipeline schedule,
DDP and ``finalize_model_grads`` (``runtime.forward_backward``) on its data-parallel share of the
micro-batches, and writes:

* ``OUT/acts/rank<r>.pt``: its hook records (:class:`hooks.MCoreCapture`), its parallel ranks and,
  on the last pipeline stage, the loss of each of its micro-batches;
* ``OUT/grads/``: a dist checkpoint of the gradients, sharded like the weights;
* ``OUT/done.json`` (rank 0), or ``OUT/refused.txt`` when the config mapping refuses the config.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

T_START = time.time()

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _feed(chunks: list, mine: list[dict]) -> list[dict]:
    """The micro-batches in the order the schedule asks for them. ``runtime.forward_backward``
    hands every model chunk the same iterator, and the interleaved (virtual pipeline) schedule
    calls the forward step of chunk c for micro-batch m in the order of megatron's own
    ``get_schedule_table``: feed exactly that sequence."""
    if len(chunks) == 1:
        return mine
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from dsv3_rl.mcore.runtime import unwrap

    cfg = unwrap(chunks[0]).config
    group = cfg.microbatch_group_size_per_vp_stage or cfg.pipeline_model_parallel_size
    return [mine[m] for m, _chunk in get_schedule_table(len(mine), len(chunks), group)]


def _sharded(chunks: list) -> dict:
    """Sharded state dict of this rank's chunk(s). Virtual-pipeline chunks are nested under
    ``model0``, ``model1``, ... like Megatron-LM's checkpoints: their dict keys are *local* layer
    names (``decoder.layers.0`` in every chunk) and would overwrite each other in one flat dict
    (the ShardedTensors inside carry the global names, which is what dist_checkpointing stores)."""
    from dsv3_rl.mcore.runtime import unwrap

    mods = [unwrap(c) for c in chunks]
    if len(mods) == 1:
        return mods[0].sharded_state_dict()
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(mods)}


def load_weights(chunks: list, path: Path) -> None:
    from megatron.core import dist_checkpointing

    from dsv3_rl.mcore.runtime import unwrap

    sd = dist_checkpointing.load(_sharded(chunks), str(path))
    mods = [unwrap(c) for c in chunks]
    per_chunk = [sd] if len(mods) == 1 else [sd[f"model{i}"] for i in range(len(mods))]
    for i, (m, part) in enumerate(zip(mods, per_chunk, strict=True)):
        own = {k: v for k, v in part.items() if k in m.state_dict(keep_vars=False)}
        missing, _ = m.load_state_dict(own, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"checkpoint {path} lacks (chunk {i}) {missing[:5]}{'...' if len(missing) > 5 else ''}")


def save(chunks: list, path: Path) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_sharded(chunks), str(path))


def run_job(spec: dict, job: dict, batch: dict) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from dsv3_rl.correctness.data import micro_batches
    from dsv3_rl.correctness.hooks import MCoreCapture
    from dsv3_rl.correctness.layouts import Layout
    from dsv3_rl.mcore import runtime

    out = Path(job["out"])
    layout = Layout(**job["layout"])
    hf_config = AutoConfig.from_pretrained(spec["hf_config"])
    for k, v in job.get("hf_config_overrides", {}).items():
        setattr(hf_config, k, v)
    parallel = layout.parallel()
    runtime.init_distributed(parallel, seed=1234)
    chunks = runtime.build_model(hf_config, parallel, dtype=DTYPES[spec["dtype"]],
                                 config_overrides=job.get("config_overrides") or None)
    load_weights(chunks, Path(job["weights"]))
    chunks = runtime.wrap_ddp(chunks)
    if layout.moe_tp_without_sp:
        # MoELayer.forward refuses MoE + TP without SP in training mode (a performance guard, not a
        # numerical one). Dropout is 0 and no aux loss is on, so eval mode changes nothing else.
        for c in chunks:
            c.eval()
    capture = MCoreCapture(chunks)

    mbs = spec["micro_batch_size"]
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = micro_batches(batch, mbs, dp_rank, dp)
    seq = batch["tokens"].shape[1]
    result = runtime.forward_backward(chunks, _feed(chunks, mine), len(mine), seq, mbs)
    capture.remove()

    rank = torch.distributed.get_rank()
    meta = dict(rank=rank, tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
                pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=dp_rank, dp=dp, n_micro=len(mine),
                micro_batch_size=mbs, seq_length=seq, sequence_parallel=layout.seq_parallel)
    losses = [float(r["loss"]) for r in result] if ps.is_pipeline_last_stage(ignore_virtual=True) else None
    (out / "acts").mkdir(parents=True, exist_ok=True)
    tmp = out / "acts" / f".rank{rank}.pt.tmp"
    torch.save({"meta": meta, "records": dict(capture.records), "losses": losses}, tmp)
    os.replace(tmp, out / "acts" / f"rank{rank}.pt")

    with runtime.grads_as_data(chunks):
        save(chunks, out / "grads")
    torch.distributed.barrier()
    if rank == 0:
        (out / "done.json").write_text(json.dumps({"layout": layout.name, "world": torch.distributed.get_world_size()}))
    del chunks, capture, result
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    from dsv3_rl.convert.config_map import UnsupportedConfigError
    from dsv3_rl.mcore import runtime

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", type=Path, required=True)
    args = ap.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    from dsv3_rl.correctness.data import no_tf32

    no_tf32()
    batch = torch.load(spec["batch"])
    try:
        for job in spec["jobs"]:
            Path(job["out"]).mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            try:
                run_job(spec, job, batch)
                print(f"job {Path(job['out']).name}: layout {job['layout']['name']}: {time.time() - t0:.1f} s "
                      f"(since start {time.time() - T_START:.1f} s)", flush=True)
            except UnsupportedConfigError as e:  # every rank refuses alike; a result, not a crash
                (Path(job["out"]) / "refused.txt").write_text(str(e))
                print(f"REFUSED: {e}", file=sys.stderr, flush=True)
    finally:
        runtime.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
