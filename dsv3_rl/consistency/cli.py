"""dsv3-consistency: do vLLM (rollout) and megatron-core (trainer) route and score tokens alike?

    dsv3-consistency run [--model DIR] [--dtype bf16|fp32] [--prompts N|FILE.json] [--max-tokens 16]
                         [--json FILE] [--out DIR] [--rollout-cache DIR]
    dsv3-consistency check-faults [same options]

``run`` loads one HF checkpoint into vLLM (CPU build) and into the megatron GPTModel, lets vLLM
generate from the shipped prompts while recording each token's routed experts per MoE layer, then
scores the same tokens on the trainer three times: without replay, and with verl's R3 replay of
vLLM's routes in the log-prob pass and in the update pass (forward + backward). It reports per
layer the route agreement (fraction of (token, layer) whose top-k expert sets are equal) and the
log-prob gap (mean/max |delta logp|, k3 KL). Gates: with replay the routes the trainer used equal
vLLM's in both passes (agreement 1.0) and the log-prob gap stays small; without replay agreement
and gap stay within bounds. Exit 1 when a gate fails, 2 on bad input.

``check-faults`` plants faults that must each FAIL a gate (or be refused): routes shifted by one
token, replay in the log-prob pass only, vLLM serving without the expert bias, vLLM routing without
the group limit. It prints one table and exits 0 only when every fault fails.

``--rollout-cache DIR`` keeps vLLM's rollouts in DIR and reuses one made for the same model files, prompts, dtype,
--max-tokens, --seed and fault (``run`` then ``check-faults`` start vLLM for the clean rollout once; a rerun after a
trainer-side change starts it not at all).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv3_rl.cliargs import fraction, positive_int
from dsv3_rl.consistency import metrics
from dsv3_rl.errors import Dsv3Error, cli_main, is_read_only

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "examples/deepseek_v3/models/dsv3-tiny-warm"
DEFAULT_DATA = REPO / "examples/deepseek_v3/data/identity-arith/data/test-00000-of-00001.parquet"


@dataclass(frozen=True)
class Gates:
    """Bounds of a passing run (bf16 defaults; measured values are in docs/consistency.md)."""

    replay_agreement: float = 1.0
    replay_logprob_mean: float = 0.02
    # bf16 on the demo's model: 0.996 measured clean, 0.93-0.98 per prompt with the expert bias zeroed
    native_agreement_min: float = 0.99
    native_logprob_mean: float = 0.03


class ConsistencyError(Dsv3Error, ValueError):
    pass


def load_prompts(spec: str) -> list[str]:
    """``N`` (the first N problems of the shipped identity-arithmetic test split) or a JSON list file."""
    if spec.isdigit():
        import pandas as pd

        n = int(spec)
        if n < 1:
            raise ConsistencyError(f"--prompts {spec}: need at least 1 prompt")
        problems = pd.read_parquet(DEFAULT_DATA)["problem"].tolist()
        return [problems[i % len(problems)] for i in range(n)]
    path = Path(spec)
    try:
        prompts = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConsistencyError(f"--prompts {path}: no such file (give a count or a JSON list of strings)") from None
    except json.JSONDecodeError as e:
        raise ConsistencyError(f"--prompts {path}: not JSON ({e})") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ConsistencyError(f"--prompts {path}: must be a non-empty JSON list of non-empty strings")
    return prompts


DEFAULT_MODEL_LEN = 512  # vLLM's max_model_len when prompt + --max-tokens fit in it (the KV cache stays small)


def check_model(model: Path, prompts: list[str], max_tokens: int) -> int:
    """Refuse, in one line, a --model the run cannot use, before vLLM or megatron start: no or invalid
    config.json, no MoE layer (nothing routed to compare), no loadable tokenizer, or prompts + --max-tokens
    beyond its max_position_embeddings. Returns vLLM's max_model_len: every prompt gets all --max-tokens."""
    from dsv3_rl.checkpoint.hf_config import ConfigError, load_config

    if not (model / "config.json").is_file():
        raise ConsistencyError(f"--model {model}: no config.json (an HF DeepSeek-V3 checkpoint dir)")
    try:
        cfg = load_config(model)
    except ConfigError as e:
        raise ConsistencyError(f"--model {model}: {e}") from None
    n_layers, n_experts, dense = cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["first_k_dense_replace"]
    if n_experts < 1 or dense >= n_layers:
        raise ConsistencyError(f"--model {model}: a dense model (n_routed_experts {n_experts}, first_k_dense_replace "
                               f"{dense} of num_hidden_layers {n_layers}): no MoE layer, so no routes to compare; "
                               f"give a DeepSeek-V3 checkpoint with MoE layers")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        from dsv3_rl.consistency.vllm_side import prompt_ids

        longest = max(len(prompt_ids(tok, p)) for p in prompts)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a missing or broken tokenizer
        what = " ".join(str(e).split())[:200]
        raise ConsistencyError(f"--model {model}: no usable tokenizer with a chat template ({type(e).__name__}: "
                               f"{what}); expected tokenizer.json and tokenizer_config.json beside config.json") from None
    positions = cfg["max_position_embeddings"]
    if longest + max_tokens > positions:
        raise ConsistencyError(f"--max-tokens {max_tokens}: the longest prompt has {longest} tokens and {model} takes "
                               f"{positions} positions (max_position_embeddings): at most {positions - longest}")
    return max(min(DEFAULT_MODEL_LEN, positions), longest + max_tokens)


def check_writable(args) -> None:
    """--out and --json's directory must be writable: refused before the run, not after it (the report kept)."""
    for flag, path in (("--out", args.out), ("--json", args.json), ("--rollout-cache", args.rollout_cache)):
        if path is not None and is_read_only(path):
            raise ConsistencyError(f"{flag} {path}: read-only or not writable; choose a writable location")


def rollout_key(model: Path, prompts: list[str], dtype: str, max_tokens: int, seed: int, fault: str | None,
                max_model_len: int) -> str:
    """What a rollout depends on: the model dir's files (name, size, mtime), the prompts and vLLM's settings."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model.iterdir() if p.is_file())
    what = [str(model.resolve()), files, prompts, dtype, max_tokens, seed, fault, max_model_len]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def rollout(model: Path, prompts: list[str], dtype: str, max_tokens: int, seed: int, fault: str | None,
            work: Path, max_model_len: int = DEFAULT_MODEL_LEN, cache: Path | None = None) -> dict:
    """vLLM's side, in its own process (it owns torch.distributed there); with CACHE, one made before for the same
    inputs (:func:`rollout_key`) is read back instead, and a new one is kept there (vllm_side writes it atomically)."""
    pfile, out = work / "prompts.json", work / f"rollout-{fault or 'clean'}.pt"
    if cache is not None:
        out = cache / f"rollout-{fault or 'clean'}-{rollout_key(model, prompts, dtype, max_tokens, seed, fault, max_model_len)}.pt"
        if out.is_file():
            print(f"vLLM rollout ({fault or 'clean'}) reused: {out}", flush=True)
            return torch.load(out, weights_only=False)
        out.parent.mkdir(parents=True, exist_ok=True)
    pfile.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "dsv3_rl.consistency.vllm_side", "--model", str(model), "--prompts", str(pfile),
           "--out", str(out), "--dtype", dtype, "--max-tokens", str(max_tokens), "--seed", str(seed),
           "--max-model-len", str(max_model_len)]
    if fault:
        cmd += ["--fault", fault]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        tail = "\n".join(proc.stdout.splitlines()[-5:] + proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"vLLM side failed (exit {proc.returncode}):\n{tail}")
    return torch.load(out, weights_only=False)


def summarise(roll: dict, train: dict, hf) -> dict:
    """The report of one run (the JSON shape of issue 16)."""
    r_routes = [s["routes"] for s in roll["sequences"]]
    r_lp = [s["logprobs"] for s in roll["sequences"]]

    def side(name: str) -> dict:
        agree, per_layer = metrics.route_agreement(r_routes, [s[name]["routes"] for s in train["sequences"]])
        return {"route_agreement": agree, **metrics.logprob_gap(r_lp, [s[name]["logprobs"] for s in train["sequences"]]),
                "per_layer": per_layer}

    native, logprob, update = side("native"), side("logprob"), side("update")
    with_replay = {"route_agreement": min(logprob["route_agreement"], update["route_agreement"]),
                   **{k: logprob[k] for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "k3_kl", "tokens")},
                   "per_layer": [{"layer": a["layer"], "route_agreement": min(a["route_agreement"], b["route_agreement"])}
                                 for a, b in zip(logprob["per_layer"], update["per_layer"], strict=True)],
                   "passes": {"compute_log_prob": logprob, "update": update}}
    load, load_stats = metrics.expert_load(r_routes, hf.n_routed_experts)
    return {"without_replay": native, "with_replay": with_replay, "dtype": roll["dtype"],
            "sequences": len(roll["sequences"]), "routed_rows": int(sum(r.shape[0] for r in r_routes)),
            "group_limit_violations": metrics.group_limit_violations(r_routes, hf.n_routed_experts, hf.n_group, hf.topk_group),
            "expert_load": {"tokens_per_expert": load.tolist(), "per_layer": load_stats}}


def gate(report: dict, g: Gates) -> list[tuple[str, bool, str]]:
    w, n = report["with_replay"], report["without_replay"]
    rows = []
    for p, rec in w["passes"].items():
        rows.append((f"replay: trainer routes == vLLM routes ({p})", rec["route_agreement"] >= g.replay_agreement,
                     f"agreement {rec['route_agreement']:.4f} (need {g.replay_agreement})"))
    rows.append(("replay: log-prob gap", w["logprob_abs_diff_mean"] <= g.replay_logprob_mean,
                 f"mean |dlogp| {w['logprob_abs_diff_mean']:.4f} (<= {g.replay_logprob_mean})"))
    rows.append(("no replay: route agreement", n["route_agreement"] >= g.native_agreement_min,
                 f"agreement {n['route_agreement']:.4f} (>= {g.native_agreement_min})"))
    rows.append(("no replay: log-prob gap", n["logprob_abs_diff_mean"] <= g.native_logprob_mean,
                 f"mean |dlogp| {n['logprob_abs_diff_mean']:.4f} (<= {g.native_logprob_mean})"))
    return rows


def write_plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for key, label in (("without_replay", "no replay"), ("with_replay", "R3 replay")):
        pl = report[key]["per_layer"]
        ax.plot([p["layer"] for p in pl], [p["route_agreement"] for p in pl], marker="o", label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("route agreement (vLLM vs megatron)")
    lo = min(p["route_agreement"] for k in ("without_replay", "with_replay") for p in report[k]["per_layer"])
    ax.set_ylim(max(0.0, min(0.98, lo - 0.01)), 1.002)
    ax.set_xticks([p["layer"] for p in report["without_replay"]["per_layer"]])
    ax.set_title(f"route agreement per MoE layer ({report['dtype']}, {report['routed_rows']} tokens)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "route_agreement.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    load = torch.tensor(report["expert_load"]["tokens_per_expert"], dtype=torch.float)
    layers = [p["layer"] for p in report["expert_load"]["per_layer"]]
    fig, ax = plt.subplots(figsize=(6, 0.6 + 0.5 * len(layers)))
    im = ax.imshow(load[layers].numpy(), aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
    ax.set_xlabel("expert")
    ax.set_title("expert load (tokens routed by vLLM)")
    fig.colorbar(im, ax=ax, label="tokens")
    fig.tight_layout()
    paths.append(out / "expert_load.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _measure(args, work: Path, trainer, vllm_fault: str | None = None, trainer_fault: str | None = None,
             roll: dict | None = None) -> dict:
    roll = roll or rollout(args.model, args.prompt_list, args.dtype, args.max_tokens, args.seed, vllm_fault, work,
                           args.max_model_len, args.rollout_cache)
    return summarise(roll, trainer.passes(roll, trainer_fault), trainer.hf), roll


def _print_report(report: dict, rows: list, out=print) -> None:
    w, n = report["with_replay"], report["without_replay"]
    out(f"consistency ({report['dtype']}, {report['sequences']} sequences, {report['routed_rows']} routed tokens, "
        f"{w['tokens']} response tokens)")
    out(f"  {'':14} {'route agreement':>16} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'k3 KL':>10}")
    for label, rec in (("no replay", n), ("R3 replay", w)):
        out(f"  {label:14} {rec['route_agreement']:16.4f} {rec['logprob_abs_diff_mean']:13.5f} "
            f"{rec['logprob_abs_diff_max']:12.5f} {rec['k3_kl']:10.2e}")
    out("  per layer (no replay): " + ", ".join(f"L{p['layer']} {p['route_agreement']:.3f}" for p in n["per_layer"]))
    for name, ok, detail in rows:
        out(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")


FAULT_PLAN = (
    ("shift_routes", None, "shift_routes", "rollout routes replayed one token late"),
    ("replay_logprob_only", None, "replay_logprob_only", "replay in compute_log_prob, not in the update"),
    ("zero_expert_bias", "zero_expert_bias", None, "vLLM serves e_score_correction_bias = 0"),
    ("no_group_limit", "no_group_limit", None, "vLLM routes without the group limit"),
)


def cmd_run(args) -> int:
    from dsv3_rl.consistency.mcore_side import Trainer

    g = Gates(native_agreement_min=args.min_agreement)
    with tempfile.TemporaryDirectory(prefix="dsv3-consistency-") as tmp, Trainer(args.model, args.dtype) as trainer:
        report, _ = _measure(args, Path(tmp), trainer)
    rows = gate(report, g)
    report["gates"] = [{"gate": n, "passed": ok, "detail": d} for n, ok, d in rows]
    report["passed"] = all(ok for _, ok, _ in rows)
    report["model"] = str(args.model)
    _print_report(report, rows)
    if args.json:  # first: the report survives a failure to draw or write the plots
        _write_json(args.json, report)
    plots = write_plots(report, args.out)
    print(f"{'PASSED' if report['passed'] else 'FAILED'}: R3 agreement {report['with_replay']['route_agreement']:.3f}, "
          f"no-replay agreement {report['without_replay']['route_agreement']:.3f}, mean |dlogp| "
          f"{report['without_replay']['logprob_abs_diff_mean']:.4f} -> {report['with_replay']['logprob_abs_diff_mean']:.4f}"
          f" with replay; plots: {', '.join(str(p) for p in plots)}" + (f"; json: {args.json}" if args.json else ""))
    return 0 if report["passed"] else 1


def cmd_check_faults(args) -> int:
    from dsv3_rl.consistency.mcore_side import Trainer

    g = Gates(native_agreement_min=args.min_agreement)
    results = []
    with tempfile.TemporaryDirectory(prefix="dsv3-consistency-") as tmp, Trainer(args.model, args.dtype) as trainer:
        work = Path(tmp)
        clean, roll = _measure(args, work, trainer)
        rows = gate(clean, g)
        results.append({"fault": "none (clean)", "what": "baseline", "failed": [n for n, ok, _ in rows if not ok],
                        "expected_fail": False})
        for name, vf, tf, what in FAULT_PLAN:
            try:
                rep, _ = _measure(args, work, trainer, vf, tf, roll=None if vf else roll)
                failed = [n for n, ok, _ in gate(rep, g) if not ok]
            except RuntimeError as e:
                msg = str(e).strip().splitlines()
                failed = ["refused: " + next((ln for ln in msg if "router replay" in ln), msg[-1] if msg else "error")]
            results.append({"fault": name, "what": what, "failed": failed, "expected_fail": True})
    ok_all = True
    print(f"{'fault':22} {'planted':48} result")
    for r in results:
        good = bool(r["failed"]) == r["expected_fail"]
        ok_all &= good
        verdict = ("FAILS as it must: " + "; ".join(r["failed"])) if r["expected_fail"] and r["failed"] else \
                  ("passes" if not r["failed"] else "FAILS: " + "; ".join(r["failed"]))
        print(f"{r['fault']:22} {r['what']:48} {verdict}{'' if good else '   <-- WRONG'}")
    if args.json:
        _write_json(args.json, {"dtype": args.dtype, "faults": results, "passed": ok_all})
    n_f = len(FAULT_PLAN)
    caught = sum(1 for r in results if r["expected_fail"] and r["failed"])
    print(f"{'PASSED' if ok_all else 'FAILED'}: {caught}/{n_f} planted faults fail, clean run "
          f"{'passes' if not results[0]['failed'] else 'FAILS'}")
    return 0 if ok_all else 1


def _write_json(path: Path, obj: dict) -> None:
    from dsv3_rl.fs import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, obj)


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-consistency", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("run", "measure and gate one checkpoint"), ("check-faults", "plant faults; each must fail")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF DeepSeek-V3 checkpoint dir (default: the demo's)")
        p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
        p.add_argument("--prompts", default="8", help="a count of shipped prompts, or a JSON list file (default 8)")
        p.add_argument("--max-tokens", type=positive_int, default=24,
                       help="tokens generated per prompt, all of them (default 24; prompt + this must fit the "
                            "model's max_position_embeddings)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--min-agreement", type=fraction, default=Gates.native_agreement_min,
                       help=f"no-replay route agreement gate (default {Gates.native_agreement_min}, for the demo's model in bf16)")
        p.add_argument("--json", type=Path, help="write the report here")
        p.add_argument("--out", type=Path, default=Path("out/consistency"), help="plots go here (default out/consistency)")
        p.add_argument("--rollout-cache", type=Path, help="keep vLLM's rollouts here; reuse one made for the same "
                       "model files, prompts, dtype, --max-tokens, --seed and fault")
    args = ap.parse_args(argv)
    args.prompt_list = load_prompts(args.prompts)
    check_writable(args)
    args.max_model_len = check_model(args.model, args.prompt_list, args.max_tokens)
    return cmd_run(args) if args.cmd == "run" else cmd_check_faults(args)


if __name__ == "__main__":
    sys.exit(main())
