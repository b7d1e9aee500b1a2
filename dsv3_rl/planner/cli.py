"""``python -m dsv3_rl.planner`` (console script ``dsv3-plan``).

    dsv3-plan plan --model 671b --gpu H100 --nodes 64 --prompts 512 --n 16 --response-len 8192 \\
        --plot plan.png --json plan.json
    dsv3-plan check --model 671b --gpu H20 --nodes 12 --layout tp=8,pp=12,ep=8,etp=1,last_stage_layers=6,recompute=full
    dsv3-plan published            # verdicts on the published DeepSeek-V3 layouts
    dsv3-plan validate             # predictions vs tests/assets/planner/measured_*.jsonl
    dsv3-plan phases --model proxy_4xH100 --gpu H100 --gpus-per-node 4 --prompts 8 --n 8 ...   # per-phase GRPO
                                   # training step (log-prob, update, export) of the best layouts + one that OOMs
    dsv3-plan validate RESULTS/bench_*.json --predicted predicted.json --doc docs/planner.md
                                   # bench/bench_grpo_update.py results vs the planner, table into the doc
    dsv3-plan flops --bench-json RESULTS/bench_best1.json   # our FLOP count vs verl's and Megatron-LM's, per term

Exit status: 0 = fits / something feasible, 1 = does not fit / nothing feasible, 2 = bad input.
Options of :class:`~dsv3_rl.planner.spec.Options` are set with ``--set key=value`` (repeatable);
unknown keys are errors listing the allowed ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from dsv3_rl.cliargs import usage_errors
from dsv3_rl.errors import cli_main
from dsv3_rl.layout import from_dict, parse_kv
from dsv3_rl.planner.spec import Cluster, GRPOShape, Layout, Options, RolloutLayout
from dsv3_rl.fs import read_json, write_json_atomic

ASSETS = Path(__file__).resolve().parents[2] / "tests" / "assets" / "planner"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="JSON file with 'model', 'cluster', 'grpo', 'options' sections "
                   "(command-line flags override it)")
    p.add_argument("--model", help="preset name (671b, deepseek-v3, proxy, tiny) or HF config.json path")
    p.add_argument("--gpu", help="GPU type (H100, H200, H20, H800, A100, B200)")
    p.add_argument("--gpu-memory-gib", type=float)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--nodes", type=int)
    p.add_argument("--prompts", type=int, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, help="samples per prompt (rollout.n)")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--response-len", type=int)
    p.add_argument("--mini-batch", type=int, help="ppo_mini_batch_size (prompts)")
    p.add_argument("--micro-batch", type=int, help="ppo_micro_batch_size_per_gpu (fixed micro-batches)")
    p.add_argument("--no-dynamic-batch", action="store_true")
    p.add_argument("--max-tokens-per-gpu", type=int, help="ppo_max_token_len_per_gpu (dynamic batches)")
    p.add_argument("--placement", choices=["colocated", "separate"])
    p.add_argument("--rollout-gpus", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any Options field")
    p.add_argument("--json", type=Path, help="write the full result as JSON (atomic)")


def _inputs(a) -> tuple:
    cfg = read_json(a.config, what="planner config (--config)") if a.config else {}
    unknown = sorted(set(cfg) - {"model", "cluster", "grpo", "options"})
    if unknown:
        raise ValueError(f"--config {a.config}: unknown section(s) {unknown}; allowed: model, cluster, grpo, options")
    model = a.model or cfg.get("model") or "671b"
    cluster = dict(cfg.get("cluster", {}))
    for k, v in (("gpu", a.gpu), ("gpu_memory_gib", a.gpu_memory_gib), ("gpus_per_node", a.gpus_per_node), ("nodes", a.nodes)):
        if v is not None:
            cluster[k] = v
    grpo = dict(cfg.get("grpo", {}))
    for k, v in (("prompts_per_step", a.prompts), ("n_samples", a.n), ("max_prompt_len", a.prompt_len),
                 ("max_response_len", a.response_len), ("ppo_mini_batch_size", a.mini_batch),
                 ("micro_batch_size", a.micro_batch), ("max_token_len_per_gpu", a.max_tokens_per_gpu)):
        if v is not None:
            grpo[k] = v
    if a.no_dynamic_batch:
        grpo["dynamic_batch"] = False
    options = dict(cfg.get("options", {}))
    if a.placement:
        options["placement"] = a.placement
    if a.rollout_gpus:
        options["rollout_gpus"] = a.rollout_gpus
    options.update(parse_kv(Options, a.set))
    return model, from_dict(Cluster, cluster), from_dict(GRPOShape, grpo), from_dict(Options, options)


def cmd_plan(a) -> int:
    from dsv3_rl.planner.search import plan

    model, cluster, grpo, options = _inputs(a)
    res = plan(model, cluster, grpo, options, progress=not a.quiet)
    print(res.table(top=a.top, rejected=a.rejected))
    if a.plot:
        res.plot(a.plot, top=a.plot_top)
        print(f"plot: {a.plot}")
    if a.json:
        write_json_atomic(a.json, res.to_dict(), indent=1, default=str, ensure_ascii=True)
        print(f"json: {a.json}")
    best = res.best
    if best is not None and best.rollout is not None:  # refit-time model of the best layout (docs/refit.md)
        from dsv3_rl.planner.model import load_model as _load_model
        from dsv3_rl.planner.refit import refit_lines

        for line in refit_lines(_load_model(model), cluster.gpu_type, cluster.gpus_per_node, best.trainer_gpus,
                                best.layout, best.rollout, options.rollout_quantization):
            print(line)
    print(f"summary: {len(res.feasible)} feasible / {res.evaluated} evaluated on {cluster.nodes}x{cluster.gpus_per_node} "
          f"{cluster.gpu}; best: {best.describe() if best else 'none'}"
          + (f" ({best.memory.total / 2**30:.1f} GiB peak)" if best else ""))
    return 0 if res.feasible else 1


def cmd_check(a) -> int:
    from dsv3_rl.planner.search import evaluate
    from dsv3_rl.planner.report import evaluation_report
    from dsv3_rl.planner.model import load_model

    model, cluster, grpo, options = _inputs(a)
    lay = Layout.parse(a.layout)
    ro = from_dict(RolloutLayout, parse_kv(RolloutLayout, [a.rollout])) if a.rollout else None
    m = load_model(model)
    ev = evaluate(m, cluster, grpo, lay, options, rollout=ro)
    print(evaluation_report(ev, m, cluster, grpo, options))
    if a.json:
        write_json_atomic(a.json, ev.to_dict(), indent=1, default=str, ensure_ascii=True)
    print(f"summary: {'FITS' if ev.feasible else 'DOES NOT FIT'}: {ev.describe()}"
          + (f", {ev.memory.total / 2**30:.1f} GiB peak" if ev.memory else "")
          + ("" if ev.feasible else f"; first failed rule: {ev.violations[0]}"))
    return 0 if ev.feasible else 1


def cmd_published(a) -> int:
    from dsv3_rl.planner.published import CASES, run_case

    bad = 0
    for case in CASES:
        fits, text, obj = run_case(case)
        ok = fits == case.expect_feasible
        bad += not ok
        print(f"=== {case.name}: {'feasible' if fits else 'infeasible'} (expected "
              f"{'feasible' if case.expect_feasible else 'infeasible'}) {'OK' if ok else 'MISMATCH'}")
        print(f"source: {case.source}")
        if a.verbose:
            print(text)
        else:
            mem = getattr(obj, "memory", None)
            if mem is not None:
                extra = f" (reported ~{case.reported_gb_per_gpu:.0f} GB)" if case.reported_gb_per_gpu else ""
                print(f"predicted peak {mem.total / 2**30:.1f} GiB = {mem.total / 1e9:.1f} GB per GPU{extra}")
            else:
                print(text.splitlines()[-1] if fits else "\n".join(x for x in text.splitlines() if "lower bound" in x))
    print(f"summary: {len(CASES) - bad}/{len(CASES)} published cases judged as expected")
    return 1 if bad else 0


def cmd_phases(a) -> int:
    from dsv3_rl.planner.phases import expected_seq_lens, phase_table, pick_bench_layouts, predict_phases

    model, cluster, grpo, options = _inputs(a)
    model_set = {}
    if a.model_set:
        from dsv3_rl.cliargs import parse_set
        from dsv3_rl.planner.model import ModelSpec
        from dsv3_rl.models.presets import preset_kwargs

        model_set = parse_set(a.model_set)
        model = ModelSpec.from_hf(preset_kwargs(model, model_set),
                                  name=model + "".join(f" {k}={v}" for k, v in model_set.items()))
    if a.response_mean is not None:
        if not 0 < a.response_mean <= grpo.max_response_len:
            raise ValueError(f"--response-mean {a.response_mean}: must be in (0, --response-len {grpo.max_response_len}]")
        grpo = dataclasses.replace(grpo, mean_length_fraction=a.response_mean / grpo.max_response_len)
    if a.resp_dist:
        from dsv3_rl.planner.phases import sample_seq_lens

        lens = sample_seq_lens(grpo.prompts_per_step, grpo.n_samples, a.prompt_dist or f"fixed:{grpo.max_prompt_len}",
                               a.resp_dist, a.seed)
        if max(lens) > grpo.seq_len:
            raise ValueError(f"--prompt-dist/--resp-dist draw {max(lens)} tokens > --prompt-len + --response-len {grpo.seq_len}")
    else:
        lens = expected_seq_lens(grpo)
    picks = [(f"layout{i + 1}", Layout.parse(x)) for i, x in enumerate(a.layout)] if a.layout else \
        pick_bench_layouts(model, cluster, grpo, options, top=a.top, oom_factor=a.oom_factor, seq_lens=lens)
    picks = [(f"{a.tag_prefix}{t}", lay) for t, lay in picks]
    preds = [(tag, predict_phases(model, cluster, grpo, lay, options, seq_lens=lens)) for tag, lay in picks]
    print(f"model {getattr(model, 'name', model)}, {cluster.world}x {cluster.gpu} ({cluster.memory_bytes / 2**30:.1f} GiB), batch "
          f"{grpo.prompts_per_step} prompts x {grpo.n_samples}, {sum(lens)} tokens (mean sequence "
          f"{sum(lens) / len(lens):.0f}, max {max(lens)}), max {grpo.tokens_per_micro_batch} tokens per micro-batch"
          + ("" if options.remove_padding else ", micro-batches padded to the longest sequence (BSHD)"))
    print(phase_table(preds, cluster.memory_bytes / 2**30))
    for tag, p in preds:
        if not p.feasible:
            print(f"{tag}: {p.layout.short()} rejected: {p.violations[0]}")
    if a.json:
        from dsv3_rl.planner.phases import predictions_json

        prev = read_json(a.json, what="--add: planner predictions") if a.add and a.json.exists() else None
        write_json_atomic(a.json, predictions_json(model, cluster, grpo, options, preds, model_set=model_set,
                                                   seq_lens=lens, previous=prev), indent=1, default=str, ensure_ascii=True)
        print(f"json: {a.json}" + (" (runs added)" if prev else ""))
    ok = [p for _, p in preds if p.feasible]
    print(f"summary: {len(ok)} of {len(preds)} layouts predicted to fit; "
          + "; ".join(f"{t} {p.layout.short()} " + (f"{p.peak_memory / 2**30:.1f} GiB {p.step_seconds:.2f} s"
                                                   if p.feasible else "rejected") for t, p in preds))
    # as `check`: a layout the user asked for that is rejected is exit 1 (the automatic picks add one that OOMs)
    return 1 if a.layout and len(ok) < len(preds) else 0


def cmd_validate(a) -> int:
    from dsv3_rl.planner.validation import load_measurements, predict_row, row_attention

    bench = [p for p in a.measured if p.suffix == ".json"]
    if bench or a.predicted or a.doc:
        if len(bench) != len(a.measured) or not bench:
            raise ValueError("validate: give either bench/bench_grpo_update.py --json files (*.json) or "
                             "measure_train_memory rows (*.jsonl), not both; --predicted/--doc need *.json files")
        return _validate_bench(bench, a.predicted, a.doc)
    paths = a.measured or sorted(ASSETS.glob("measured_*.jsonl"))
    if not paths:
        print(f"no measurement files under {ASSETS}", file=sys.stderr)
        return 2
    worst, n = 0.0, 0
    for p in paths:
        for row in load_measurements(p):
            pred = predict_row(row)
            meas = row.get("peak_allocated")
            if row.get("device") != "cuda" or not meas:
                note = "none" if not meas else (f"{meas / 2**20:.1f} MiB on {row.get('device')}, error {pred / meas - 1:+.1%}"
                                                " (not a GPU measurement)")
                print(f"{row['name']:30s} predicted {pred / 2**20:9.1f} MiB  measured: {note}")
                continue
            err = pred / meas - 1
            worst = max(worst, abs(err))
            n += 1
            print(f"{row['name']:30s} predicted {pred / 2**30:7.2f} GiB  measured {meas / 2**30:7.2f} GiB  error {err:+.1%}"
                  f"  attention {row_attention(row)}")
    if not n:
        print("summary: no GPU measurements (device 'cuda') yet; nothing validated", file=sys.stderr)
        return 1
    print(f"summary: {n} GPU measurements, worst error {worst:.1%} (target 15%)")
    return 0 if worst <= 0.15 else 1


DOC_BEGIN = "<!-- grpo-update-table: begin (dsv3-plan validate --doc fills this) -->"
DOC_END = "<!-- grpo-update-table: end -->"


def _validate_bench(paths, predicted, doc) -> int:
    from dsv3_rl.planner.validation import bench_table, compare_bench, load_bench_json, registered_drift

    rows = [compare_bench(load_bench_json(p)) for p in paths]
    reg = read_json(predicted, what="planner predictions (dsv3-plan phases --json)") if predicted else None
    table = bench_table(rows, reg)
    print(table)
    for r in rows:  # where the time goes: the planner's parts next to the bench's profile (when it ran --profile)
        if r.get("predicted_parts"):
            print(f"{r['layout']}: predicted step parts " + ", ".join(f"{k} {v:.2f} s" for k, v in r["predicted_parts"].items())
                  + (("; measured profile " + ", ".join(f"{k} {v:.2f} s" for k, v in r["profile"].items()
                                                        if isinstance(v, (int, float)))) if r.get("profile") else ""))
    for r in rows:
        v = "n/a " if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        print(f"{v} {r['name']}: {r['layout']}" + ("" if r["ok"] else ": " + "; ".join(r["reasons"])))
    if reg is not None:
        for line in registered_drift(rows, reg):
            print(f"note: {line}")
    if doc:
        text = Path(doc).read_text()
        if DOC_BEGIN not in text or DOC_END not in text or text.index(DOC_BEGIN) > text.index(DOC_END):
            raise ValueError(f"--doc {doc}: no table markers ({DOC_BEGIN!r} ... {DOC_END!r})")
        head, rest = text.split(DOC_BEGIN, 1)
        tail = rest.split(DOC_END, 1)[1]
        from dsv3_rl.fs import write_text_atomic

        write_text_atomic(doc, head + DOC_BEGIN + "\n" + table + "\n" + DOC_END + tail)
        print(f"doc: {doc} (table between the markers replaced)")
    judged = [r for r in rows if r["ok"] is not None]
    bad = sum(not r["ok"] for r in judged)
    print(f"summary: {len(judged) - bad}/{len(judged)} GPU bench rows within the planner's tolerances "
          f"(memory 15%, step time 1.5x; out of memory where the planner says so)"
          + (f"; {len(rows) - len(judged)} not judged (not a GPU measurement)" if len(rows) > len(judged) else ""))
    return 1 if bad or not judged else 0


@cli_main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="rank every feasible layout; explain every rejected one")
    _common(p)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--rejected", type=int, default=10, help="rejected layouts to list (all are in --json)")
    p.add_argument("--plot", type=Path, help="PNG of the memory breakdown of the top layouts")
    p.add_argument("--plot-top", type=int, default=5)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("check", help="does one layout fit?")
    _common(p)
    p.add_argument("--layout", required=True, help="Layout fields, e.g. tp=8,pp=12,ep=8,etp=1,last_stage_layers=6,recompute=full")
    p.add_argument("--rollout", help="RolloutLayout fields, e.g. tp=32,gpus=96,gpu_memory_utilization=0.6 (default: best)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("published", help="verdicts on published DeepSeek-V3 layouts")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_published)
    p = sub.add_parser("phases", help="per-phase prediction (log-prob, update, export) of the GRPO training step for "
                       "the best layouts and one rejected as out of memory (what bench/bench_grpo_update.py measures)")
    _common(p)
    p.add_argument("--layout", action="append", default=[], help="predict these layouts instead of searching (repeatable)")
    p.add_argument("--top", type=int, default=3, help="best layouts to list")
    p.add_argument("--oom-factor", type=float, default=1.15,
                   help="the out-of-memory layout listed: the smallest predicted peak >= this x GPU memory")
    p.add_argument("--response-mean", type=float, help="mean response length (default: response-len x 0.6)")
    p.add_argument("--prompt-dist", help="prompt lengths as the bench draws them: fixed:N | uniform:LO:HI | "
                   "lognormal:MEDIAN:SIGMA:MAX (with --resp-dist; default fixed:--prompt-len)")
    p.add_argument("--resp-dist", help="response lengths as the bench draws them (seeded sample instead of every "
                   "response at the mean)")
    p.add_argument("--seed", type=int, default=1, help="seed of the --resp-dist sample")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the --model preset (JSON value), as the bench's --set, e.g. num_hidden_layers=2")
    p.add_argument("--tag-prefix", default="", help="prefix of the run tags in --json (e.g. 2gpu-)")
    p.add_argument("--add", action="store_true", help="--json: keep the file's other runs, replace those of the same tag")
    p.set_defaults(func=cmd_phases)
    p = sub.add_parser("validate", help="predictions vs measured peak memory")
    p.add_argument("measured", nargs="*", type=Path,
                   help="measure_train_memory rows (*.jsonl; default tests/assets/planner/measured_*.jsonl) or "
                   "bench_grpo_update.py results (*.json: per-phase time and memory vs dsv3-plan phases)")
    p.add_argument("--predicted", type=Path, help="dsv3-plan phases --json file made before the run: its numbers are "
                   "the table's 'registered' columns, and a drift of today's planner from them is printed")
    p.add_argument("--doc", type=Path, help="replace the table between the grpo-update-table markers of this "
                   "markdown file (docs/planner.md)")
    p.set_defaults(func=cmd_validate)
    from dsv3_rl.planner import async_overlap  # `dsv3-plan async`: what one-step-off buys (issue 27)
    from dsv3_rl.planner import flops  # `dsv3-plan flops`: our FLOP count next to verl's and Megatron-LM's

    async_overlap.add_parser(sub)
    flops.add_parser(sub)
    a = ap.parse_args(argv)
    with usage_errors():
        return a.func(a)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
