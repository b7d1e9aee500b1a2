"""Router replay at a trainer layout, without a rollout engine: record, replay, and prove the replay bites.

    dsv3-replay-check [--layout tp=2,ep=2] ...     # = python -m dsv3_rl.consistency.replay_check; under torchrun:
    torchrun --nproc-per-node N -m dsv3_rl.consistency.replay_check [--layout tp=2,ep=2]
        [--model tiny-vllm] [--dtype bf16|fp32] [--seq-length 64] [--json FILE] [--fault shift] [--spec auto|te|local]

On one micro-batch of random tokens, through megatron's pipeline schedule (forward + backward) and
verl's router replay (``apply_router_replay_patch``, ``RouterReplayAction``, ``set_replay_data`` /
``get_recorded_data``, as verl's R2 uses them), every rank:

1. **record**: routes each token itself, verl records the top-k per router (R2's ``compute_log_prob``);
2. **replay**: the same weights with the recorded routes replayed (R2's update): the routes the routers
   hand the dispatcher (a forward hook on every ``TopKRouter``) must equal the recorded ones (agreement
   1.0) and the loss must be the same (up to 4x the difference of the record pass run twice: bitwise on
   CPU; GPU kernels with atomics move a bf16 loss by ~1e-4 relative from one run to the next);
3. **bite**: the router weights perturbed, replay again: the routes must still be the recorded ones,
   while the perturbed router on its own picks other experts for some tokens (so replay is what holds
   them, not a router that happens to agree).

``--fault shift`` replays the recorded routes one token late: the replay gates must FAIL (the planted
fault that shows the check can). Exit 0 when every gate passes, 1 otherwise. Works on CPU (gloo) and
GPUs (NCCL), any layout megatron-core and verl's replay support (TP/SP, EP, PP; one micro-batch).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

from dsv3_rl.cliargs import positive_int, usage_errors
from dsv3_rl.errors import Dsv3Error, cli_main

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _agree(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> tuple[int, int]:
    from dsv3_rl.consistency.metrics import route_sets

    same = total = 0
    for lid, ra in a.items():
        eq = (route_sets(ra) == route_sets(b[lid])).all(-1)
        same += int(eq.sum())
        total += int(eq.numel())
    return same, total


def run(layout_text: str, model: str, dtype: str, seq_length: int, fault: str | None, seed: int = 0,
        spec: str = "auto") -> dict:
    import torch.distributed as dist

    from dsv3_rl.consistency.mcore_side import RouteHook
    from dsv3_rl.correctness.spec import resolve_spec
    from dsv3_rl.layout import Layout
    from dsv3_rl.mcore import layout_check, runtime
    from dsv3_rl.models import presets

    layout = Layout.parse(layout_text)
    spec = resolve_spec(spec)
    # deterministic kernels where torch has them (GPU scatter/index_add, cuBLAS): a replayed pass can then be
    # compared with the recorded one bit for bit instead of up to atomics' noise
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    hf = presets.hf_config(model)
    if not torch.cuda.is_available():
        os.environ.setdefault("VERL_PLATFORM", "cpu")  # verl's CPU platform (patch 0010)
    runtime.init_distributed(layout, seed=1234 + seed)
    from dsv3_rl.refit.verl_export import import_module  # without Ray (the GPU box) verl's __init__ is skipped

    rr = import_module("verl.utils.megatron.router_replay_patch")
    RouterReplay, RouterReplayAction = rr.RouterReplay, rr.RouterReplayAction
    rr.apply_router_replay_patch()  # as verl's MegatronEngine does for R2/R3
    overrides = {"moe_enable_routing_replay": True}
    if torch.cuda.is_available():
        overrides["use_cpu_initialization"] = False  # initialise on the GPU: seconds, not minutes (proxy: 5.2B)
    chunks = runtime.build_model(hf, layout, dtype=DTYPES[dtype], config_overrides=overrides, use_te=spec == "te")
    chunks = runtime.wrap_ddp(chunks)
    hook = RouteHook([runtime.unwrap(c) for c in chunks])
    batch = layout_check.make_batches(hf.vocab_size, 1, 1, seq_length, seed=seed)

    def step() -> float | None:
        res = runtime.forward_backward(chunks, batch, num_microbatches=1, seq_length=seq_length, micro_batch_size=1)
        return float(res[0]["loss"]) if res else None

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    loss_again = step()  # the same pass twice: the run-to-run noise of the loss (GPU atomics in bf16; 0 on CPU)
    hook.pop_layers()
    loss_record = step()
    routes_record = hook.pop_layers()
    recorded = [r.clone() for r in RouterReplay.get_recorded_data()]
    if any(r is None for r in recorded) or not recorded:
        raise Dsv3Error("verl's router replay recorded nothing (is moe_enable_routing_replay reaching the routers?)")
    target = [torch.cat([r[:1], r[:-1]]) for r in recorded] if fault == "shift" else recorded

    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    RouterReplay.set_replay_data(target)
    loss_replay = step()
    routes_replay = hook.pop_layers()
    RouterReplay.clear_global_indices()

    from megatron.core.transformer.moe.router import TopKRouter

    g = torch.Generator().manual_seed(4321)
    for c in chunks:
        for m in runtime.unwrap(c).modules():
            if isinstance(m, TopKRouter):
                noise = torch.randn(m.weight.shape, generator=g).to(m.weight.device, m.weight.dtype)
                m.weight.data.add_(noise * m.weight.data.float().std().to(m.weight.dtype) * 2)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    step()
    routes_native_perturbed = hook.pop_layers()
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    RouterReplay.set_replay_data(target)
    step()
    routes_replay_perturbed = hook.pop_layers()
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()

    counts = torch.tensor([*_agree(routes_replay, routes_record), *_agree(routes_replay_perturbed, routes_record),
                           *_agree(routes_native_perturbed, routes_record)], dtype=torch.float64, device=runtime.device())
    dist.all_reduce(counts)
    have = loss_record is not None
    losses = torch.tensor([loss_record if have else 0.0, loss_replay if have else 0.0, loss_again if have else 0.0,
                           1.0 if have else 0.0], dtype=torch.float64, device=runtime.device())
    dist.all_reduce(losses)  # the last pipeline stage holds the loss (and DP ranks the same one): take the mean
    n = max(losses[3].item(), 1.0)
    lr, lp, la = losses[0].item() / n, losses[1].item() / n, losses[2].item() / n
    noise = abs(la - lr)
    c = counts.tolist()
    result = {
        "layout": layout_text, "model": model, "dtype": dtype, "world": dist.get_world_size(), "fault": fault, "spec": spec,
        "tokens_x_layers": int(c[1]),
        "replay_agreement": c[0] / c[1], "replay_perturbed_agreement": c[2] / c[3],
        "native_perturbed_agreement": c[4] / c[5], "loss_record": lr, "loss_replay": lp, "loss_noise": noise,
    }
    gates = [
        ("replayed routes == recorded routes", result["replay_agreement"] == 1.0),
        # equal up to the noise of the same pass run twice (bitwise where the forward is deterministic)
        ("loss with replay == loss recorded", abs(lp - lr) <= max(4 * noise, 1e-6 * max(1.0, abs(lr)))),
        ("replay holds the routes under a perturbed router", result["replay_perturbed_agreement"] == 1.0),
        ("the perturbed router alone routes differently", result["native_perturbed_agreement"] < 1.0),
    ]
    result["gates"] = [{"gate": g_, "passed": ok} for g_, ok in gates]
    result["passed"] = all(ok for _, ok in gates)
    runtime.destroy()
    return result


def check_args(args) -> None:
    """--model a preset, --layout valid and matching this run's world size: one line (exit 2) before anything runs."""
    from dsv3_rl.layout import Layout
    from dsv3_rl.models import presets

    try:
        presets.resolve(args.model)
    except KeyError as e:
        raise Dsv3Error(f"--model: {e.args[0]}") from None
    layout = Layout.parse(args.layout)  # a LayoutError names the key
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not layout.dp(world) or not layout.edp(world):
        mp, emp = layout.tp * layout.pp * layout.cp, layout.etp_ * layout.ep * layout.pp
        need = mp * emp // math.gcd(mp, emp)
        how = ("this is one process, not started by torchrun" if "WORLD_SIZE" not in os.environ
               else f"torchrun started {world} process(es)")
        raise Dsv3Error(f"--layout {args.layout}: needs a world size divisible by TP*PP*CP = {mp} and EP*ETP*PP = {emp}; "
                        f"{how}: run torchrun --nproc-per-node {need} -m dsv3_rl.consistency.replay_check "
                        f"--layout {args.layout}")


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-replay-check", description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="tp=1", help="megatron layout, e.g. tp=2,ep=2 (world size from torchrun)")
    ap.add_argument("--model", default="tiny-vllm", help="a model preset of dsv3_rl.models.presets")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--seq-length", type=positive_int, default=64)
    ap.add_argument("--fault", choices=("shift",))
    ap.add_argument("--spec", choices=("auto", "te", "local"), default="auto",
                    help="megatron layer spec: te (Transformer Engine), local, auto (te where it imports)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    check_args(args)
    from dsv3_rl.correctness.spec import resolve_spec

    with usage_errors():
        resolve_spec(args.spec)  # --spec te without a usable Transformer Engine: one line, exit 2
    res = run(args.layout, args.model, args.dtype, args.seq_length, args.fault, spec=args.spec)
    if int(os.environ.get("RANK", "0")) == 0:
        for g in res["gates"]:
            print(f"  {'PASS' if g['passed'] else 'FAIL'}  {g['gate']}")
        if args.json:
            from dsv3_rl.fs import write_json_atomic

            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.json, res)
        print(f"replay check {res['layout']} x{res['world']} {res['dtype']} spec {res['spec']}"
              f"{' fault=' + res['fault'] if res['fault'] else ''}: "
              f"{'PASSED' if res['passed'] else 'FAILED'}; replay agreement {res['replay_agreement']:.4f}, under a "
              f"perturbed router {res['replay_perturbed_agreement']:.4f} (router alone {res['native_perturbed_agreement']:.4f}), "
              f"loss {res['loss_record']:.6f} -> {res['loss_replay']:.6f} (noise {res['loss_noise']:.1e}), "
              f"{res['tokens_x_layers']} token x layer routes")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
