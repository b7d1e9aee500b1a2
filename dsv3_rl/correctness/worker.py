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
import sys
import time
from pathlib import Path

import torch
from dsv3_rl.fs import atomic_path

T_START = time.time()

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_job(spec: dict, job: dict, batch: dict) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from dsv3_rl.correctness.data import micro_batches
    from dsv3_rl.correctness.hooks import MCoreCapture
    from dsv3_rl.correctness.layouts import Layout
    from dsv3_rl.mcore import layout_check, runtime

    out = Path(job["out"])
    layout = Layout(**job["layout"])
    hf_config = AutoConfig.from_pretrained(spec["hf_config"])
    for k, v in job.get("hf_config_overrides", {}).items():
        setattr(hf_config, k, v)
    parallel = layout
    runtime.init_distributed(parallel, seed=1234)
    chunks = runtime.build_model(hf_config, parallel, dtype=DTYPES[spec["dtype"]], use_te=spec.get("use_te"),
                                 config_overrides=job.get("config_overrides") or None)
    layout_check.load(chunks, Path(job["weights"]))
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
    result = runtime.forward_backward(chunks, mine, len(mine), seq, mbs)
    capture.remove()

    rank = torch.distributed.get_rank()
    meta = dict(rank=rank, tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
                pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=dp_rank, dp=dp, n_micro=len(mine),
                micro_batch_size=mbs, seq_length=seq, sequence_parallel=layout.sp_)
    losses = [float(r["loss"]) for r in result] if ps.is_pipeline_last_stage(ignore_virtual=True) else None
    (out / "acts").mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "acts" / f"rank{rank}.pt") as tmp:
        torch.save({"meta": meta, "records": dict(capture.records), "losses": losses}, tmp)

    with runtime.grads_as_data(chunks):
        layout_check.save(chunks, out / "grads")
    torch.distributed.barrier()
    if rank == 0:
        (out / "done.json").write_text(json.dumps({"layout": layout.name, "world": torch.distributed.get_world_size()}))
    del chunks, capture, result
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    from dsv3_rl.models.config_map import UnsupportedConfigError
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
