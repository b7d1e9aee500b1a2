"""Worker for tests/unit/test_verl_ckpt_restore.py: verl's Megatron training engine (the actor's, built as
bench/bench_grpo_update.py builds it: verl's config dataclasses, ``EngineRegistry``, megatron-core's optimizer and
LR scheduler, the demo's non-distributed optimizer) on the tiny DeepSeek-V3, one process over gloo.

    python verl_ckpt_restore_worker.py save CKPT_DIR SNAPSHOT   # one optimizer step, save via verl's checkpoint
                                                                # manager, snapshot the state that was saved
    python verl_ckpt_restore_worker.py load CKPT_DIR SNAPSHOT   # a fresh engine, compared before (the twin: a
                                                                # re-initialised optimizer, NeMo-RL #3171) and
                                                                # after it loads the checkpoint

``RESTORE_LR_SCHEDULE=0``: verl's default ``use_checkpoint_opt_param_scheduler: false`` (the LR schedule is then not
restored: a resumed run warms up again). Prints one JSON line: the comparison of the optimizer state (every Adam moment and step count, tensor by tensor),
the LR schedule (steps, current LR) and the RNG state with the snapshot.
"""

import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_grpo_update", REPO / "bench" / "bench_grpo_update.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def optimizer_state(engine) -> dict[str, torch.Tensor]:
    """Every tensor of the torch optimizer(s) under megatron's (chained) optimizer, in parameter order."""
    out = {}
    chain = getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]
    for i, opt in enumerate(chain):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                for k, v in inner.state.get(p, {}).items():
                    out[f"opt{i}.group{g}.param{j}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(float(v))).detach().clone()
    return out


def snapshot(engine) -> dict:
    sch = engine.lr_scheduler
    return {"optimizer": optimizer_state(engine), "lr_steps": int(sch.num_steps),
            "lr": float(engine.optimizer.param_groups[0]["lr"]), "rng": torch.get_rng_state().clone()}


def compare(want: dict, got: dict) -> list[str]:
    bad = []
    missing = sorted(set(want["optimizer"]) - set(got["optimizer"]))
    if missing:
        bad.append(f"{len(missing)} optimizer tensor(s) missing after the load, first {missing[0]}")
    for k, v in want["optimizer"].items():
        if k in got["optimizer"] and not torch.equal(v, got["optimizer"][k]):
            bad.append(f"optimizer {k} differs (max |diff| {float((v.float() - got['optimizer'][k].float()).abs().max()):.3g})")
    if want["lr_steps"] != got["lr_steps"] or want["lr"] != got["lr"]:
        bad.append(f"LR schedule: saved {want['lr_steps']} steps lr {want['lr']}, restored {got['lr_steps']} lr {got['lr']}")
    if not torch.equal(want["rng"], got["rng"]):
        bad.append("torch RNG state differs")
    return bad


def main():
    mode, ckpt, snap = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    from dsv3_rl.mcore.runtime import init_single_process_group

    init_single_process_group(backend="gloo")  # one process, an in-memory store: no port, nothing in os.environ
    from dsv3_rl.layout import Layout
    from dsv3_rl.refit import verl_export

    verl_export.load_engine()
    import verl.workers.config as vc

    optim = vc.McoreOptimizerConfig  # the trainer sets total_training_steps at run time (verl's _mutable_fields)
    # our presets set use_checkpoint_opt_param_scheduler (verl's default False restores no LR schedule); ``verl_default``
    # in the environment keeps verl's default (the twin)
    sched = os.environ.get("RESTORE_LR_SCHEDULE", "1") == "1"
    vc.McoreOptimizerConfig = lambda **kw: optim(**{**kw, "total_training_steps": 12, "lr_warmup_steps": 4,
                                                    "use_checkpoint_opt_param_scheduler": sched})
    bench = _bench()
    args = types.SimpleNamespace(spec="local", seed=1, lr=1e-3, n=2, prompts=2, mini_batches=1, max_token_len=256,
                                 no_distributed_optimizer=True, dist_opt=False, recompute=None, fp8_recipe="blockwise")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            from transformers import AutoConfig

            from dsv3_rl.minimodel.mini_model import write_mini_model

            model_dir = write_mini_model("tiny", Path(tmp) / "hf", seed=3)  # config, tokenizer, weights
            hf = AutoConfig.from_pretrained(model_dir)
            engine, _ = bench.build_engine(args, hf, Path(model_dir), Layout(), False)
        if mode == "save":
            g = torch.Generator().manual_seed(7)
            for chunk in engine.module:
                for p in chunk.parameters():
                    grad = getattr(p, "main_grad", None)
                    if grad is not None:
                        grad.copy_(torch.randn(grad.shape, generator=g) * 1e-2)
            ok, _, _ = engine.optimizer.step()
            assert ok, "the optimizer step was skipped"
            engine.lr_scheduler.step(increment=1)
            torch.manual_seed(1234)  # an RNG state that a fresh process would not have
            want = snapshot(engine)
            engine.save_checkpoint(str(ckpt), global_step=1)
            torch.save(want, snap)
            print(json.dumps({"saved": len(want["optimizer"]), "lr_steps": want["lr_steps"]}))
            return
        want = torch.load(snap, weights_only=False)
        fresh = compare(want, snapshot(engine))
        engine.load_checkpoint(str(ckpt), del_local_after_load=False)
        print(json.dumps({"compared": len(want["optimizer"]), "fresh": fresh, "loaded": compare(want, snapshot(engine))}))
    finally:
        from megatron.core import parallel_state as mpu

        mpu.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
