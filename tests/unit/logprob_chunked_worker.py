"""One rank of tests/unit/test_logprob_chunked.py (torchrun, gloo, megatron's tensor-parallel group = the world).

verl's own ``MegatronEngineWithLMHead._lm_head_logits_processor`` (the function verl's Megatron engine calls on
the last stage's logits) runs on this rank's vocabulary shard twice: ``log_prob_chunk_size`` 0 (verl's unfused
path) and > 0 (patch 0041's chunked path), plus an independent reference: torch's log_softmax over the whole
vocabulary (the shards concatenated), on one process. Rank 0 prints one JSON line: the largest differences of the
log-probs, the entropy and the gradient of ``sum(w1 * log_probs + w2 * entropy)`` w.r.t. the logits, and what
each path saved for backward; the chunked path also with each planted FAULT in turn (planted, run, taken out).
argv: DTYPE (float32 | bfloat16) [FAULT...]."""

from __future__ import annotations

import json
import sys
import types

import torch
import torch.distributed as dist

DTYPE = getattr(torch, sys.argv[1])
FAULTS = ("", *sys.argv[2:])  # no fault first, then each planted fault in turn (tests/unit/test_logprob_chunked.py)
N, V_FULL = 203, 1000  # tokens (not a multiple of any chunk size below), vocabulary (two shards of 500)
CHUNKS = (1, 64, 97, N, N + 50)


def _config(chunk: int):
    return types.SimpleNamespace(engine_config=types.SimpleNamespace(
        log_prob_chunk_size=chunk, entropy_from_logits_with_chunking=False, entropy_from_logits_chunk_size=2048))


def _inputs():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, N, V_FULL, generator=g) * 3.0
    logits[0, :20, :5] += 12.0  # a few peaked distributions (the max matters)
    labels = torch.randint(0, V_FULL, (1, N), generator=g)
    labels[0, :10] = torch.arange(10) * 97  # labels on both shards, and at shard edges
    labels[0, 10], labels[0, 11] = V_FULL // 2 - 1, V_FULL // 2
    temperature = 0.5 + torch.rand(1, N, generator=g)
    w1, w2 = torch.randn(1, N, generator=g), torch.randn(1, N, generator=g)
    return logits, labels, temperature, w1, w2


def _through_verl(chunk: int, shard: torch.Tensor, labels, temperature, w1, w2, entropy: bool = True):
    """verl's logits processor on SHARD (this rank's vocabulary) with log_prob_chunk_size CHUNK (ENTROPY: verl's
    calculate_entropy; without it only w1 * log_probs is differentiated and the entropy is reported as 0)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    leaf = shard.detach().clone().to(DTYPE).requires_grad_(True)
    logits = leaf.clone()  # the model's output is not a leaf (the processor divides it in place)
    saved = []

    def pack(t):
        saved.append((str(t.dtype).replace("torch.", ""), list(t.shape), t.untyped_storage().data_ptr()))
        return t

    given = logits.untyped_storage().data_ptr()  # the logits themselves (divided in place): the model's, not new

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ret = MegatronEngineWithLMHead._lm_head_logits_processor(
            _config(chunk), logits, labels, temperature.clone(), calculate_sum_pi_squared=False,
            calculate_entropy=entropy, distillation_use_topk=False, distillation_only=False,
            logits_processor_func=None, batch=None, data_format="thd")
    if not entropy:
        assert "entropy" not in ret, sorted(ret)
        ret["entropy"] = torch.zeros_like(ret["log_probs"])
    (ret["log_probs"].float() * w1).sum().add((ret["entropy"].float() * w2).sum()).backward()
    v = shard.shape[-1]
    wide_fp32 = [s for s in saved if s[0] == "float32" and s[1][-1:] == [v] and s[2] != given]
    return {"log_probs": ret["log_probs"].detach().float(), "entropy": ret["entropy"].detach().float(),
            "grad": leaf.grad.float(), "saved_vocab_wide_fp32": len({s[2] for s in wide_fp32})}


def _reference(logits, labels, temperature, w1, w2):
    """Whole vocabulary on one process: the logits divided by the temperature in DTYPE (as verl does, in place),
    then torch's log_softmax and autograd in fp32."""
    z = logits.to(DTYPE, copy=True).requires_grad_(True)  # a copy: fp32 .to() would hand back LOGITS itself
    lsm = torch.log_softmax((z / temperature.unsqueeze(-1).to(DTYPE)).float(), dim=-1)
    lp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    (lp * w1).sum().add((ent * w2).sum()).backward()
    return {"log_probs": lp.detach(), "entropy": ent.detach(), "grad": z.grad.float()}


def _plant(fault: str):
    """Plant FAULT in patch 0041's chunked path; returns the function that takes it out again."""
    from verl.utils.megatron import tensor_parallel as tp

    mpu, chunk_grad = tp.mpu, tp._chunk_grad
    if fault == "rank_offset":  # every rank takes the labels as its own: no vocab offset for shard 1
        tp.mpu = types.SimpleNamespace(get_tensor_model_parallel_group=mpu.get_tensor_model_parallel_group,
                                       get_tensor_model_parallel_rank=lambda: 0)
    elif fault == "no_entropy_grad":  # the backward forgets the entropy's share of the gradient
        tp._chunk_grad = lambda c, col, here, lse, pz, g_lp, g_ent: chunk_grad(c, col, here, lse, None, g_lp, None)
    elif fault:
        raise SystemExit(f"unknown fault {fault}")

    def undo():
        tp.mpu, tp._chunk_grad = mpu, chunk_grad
    return undo


def main() -> None:
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mpu

    world, rank = dist.get_world_size(), dist.get_rank()
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    logits, labels, temperature, w1, w2 = _inputs()
    v = V_FULL // world
    shard = logits[..., rank * v:(rank + 1) * v]

    def gathered(res):  # the gradient shards of every rank, concatenated along the vocabulary
        parts = [torch.empty_like(res["grad"]) for _ in range(world)]
        dist.all_gather(parts, res["grad"].contiguous())
        return {**res, "grad": torch.cat(parts, dim=-1)}

    unfused = gathered(_through_verl(0, shard, labels, temperature, w1, w2))
    ref = _reference(logits, labels, temperature, w1, w2)
    # the update without an entropy term (verl's calculate_entropy off): log-probs and their gradient only
    no_ent = {c: gathered(_through_verl(c, shard, labels, temperature, w1, torch.zeros_like(w2), entropy=False))
              for c in CHUNKS}
    ref_no_ent = _reference(logits, labels, temperature, w1, torch.zeros_like(w2))
    chunked = {}
    for fault in FAULTS:
        undo = _plant(fault)
        chunked[fault] = {c: gathered(_through_verl(c, shard, labels, temperature, w1, w2)) for c in CHUNKS}
        undo()

    # tolerances (torch.allclose): fp32 numbers 1e-5; a bf16 gradient is stored in bf16 (its last bit may differ)
    tol = {"log_probs": 1e-5, "entropy": 1e-5, "grad": 1e-5 if DTYPE == torch.float32 else 1e-2}

    def diff(a, b):
        return {k: {"max_abs": float((a[k] - b[k]).abs().max()),
                    "close": bool(torch.allclose(a[k], b[k], rtol=tol[k], atol=1e-5))}
                for k in ("log_probs", "entropy", "grad")}

    if rank == 0:
        print(json.dumps({
            "dtype": sys.argv[1], "tp": world, "tokens": N, "vocab": V_FULL,
            "unfused_vs_reference": diff(unfused, ref),
            "chunked_without_entropy_vs_reference": {str(c): diff(r, {**ref_no_ent, "entropy": r["entropy"]})
                                                      for c, r in no_ent.items()},
            "chunked_vs_reference": {f or "none": {str(c): diff(r, ref) for c, r in runs.items()}
                                     for f, runs in chunked.items()},
            "saved_vocab_wide_fp32": {"unfused": unfused["saved_vocab_wide_fp32"],
                                      **{str(c): r["saved_vocab_wide_fp32"] for c, r in chunked[""].items()}},
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
