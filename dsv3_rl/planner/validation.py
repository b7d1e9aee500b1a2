"""The planner's prediction for a row of ``bench/measure_train_memory.py`` output, so measured peak
memory can be compared with it (``dsv3-plan validate``, tests/unit/test_planner_validation.py).

A bench row describes one single-GPU megatron-core training step of a DeepSeek-V3-shaped model
(TP=PP=EP=1, local spec, megatron's cross entropy, DistributedOptimizer at DP=1); the prediction
is the planner's torch-allocated peak (everything but the non-torch reserve) for that setup. The
core attention path is the one the row says the built model ran (``impl.attention``: ``sdpa`` or
``unfused``, read off ``core_attention.use_sdpa`` by the bench; ``impl.attention_kernel`` names the
SDPA kernel). Rows without it predate patch 0012 and ran the unfused path.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv3_rl.planner.memory import train_memory
from dsv3_rl.planner.model import ModelSpec
from dsv3_rl.planner.pipeline import split_layers
from dsv3_rl.planner.spec import GRPOShape, Layout, Options

REQUIRED = ("name", "hf_config", "seq_length", "micro_batch_size", "num_microbatches", "recompute")


def load_measurements(path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or not line.lstrip().startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e}") from e
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"{path}:{i}: row lacks {missing}")
        rows.append(row)
    return rows


def row_attention(row: dict) -> str:
    """The planner's ``Options.attention`` for a bench row: what the measured model ran."""
    impl = row.get("impl") or {}
    att = impl.get("attention", "unfused")
    if att not in ("sdpa", "unfused"):
        raise ValueError(f"row {row.get('name')!r}: impl.attention={att!r}; allowed: sdpa, unfused")
    kernel = impl.get("attention_kernel")
    if att == "sdpa" and kernel == "math":
        # torch's math fallback materialises the S x S scores/probs (CPU with MLA's unequal head
        # dims): neither of the planner's attention models
        raise ValueError(f"row {row.get('name')!r}: SDPA ran its math kernel, which the planner does not model; "
                         f"measure with --attention unfused or head dims a fused kernel takes")
    return att


def bench_setup(row: dict) -> tuple[ModelSpec, Layout, GRPOShape, Options]:
    m = ModelSpec.from_hf(row["hf_config"], name=row["name"])
    rc = row["recompute"] or {}
    gran = rc.get("granularity") or "none"
    lay = Layout(recompute=gran, recompute_modules=tuple(rc.get("modules", ("core_attn",))) if gran == "selective" else (),
                 recompute_method=rc.get("method", "uniform"), recompute_num_layers=rc.get("num_layers", 1))
    s, b, nmb = row["seq_length"], row["micro_batch_size"], row["num_microbatches"]
    g = GRPOShape(prompts_per_step=b * nmb, n_samples=1, max_prompt_len=s - 1, max_response_len=1,
                  micro_batch_size=b, dynamic_batch=False)
    # megatron's fallback optimizer is torch Adam(W); on CUDA it runs foreach (one fp32 temporary
    # per param during step()), on CPU per tensor
    torch_foreach = row.get("device") in ("cuda", None) and "torch" in str(row.get("impl", {}).get("optimizer", "torch"))
    o = Options(transformer_impl="local", attention=row_attention(row), loss="megatron_ce", ref_model=False, rollout=False, reserve_gib=0.0,
                moe_grouped_gemm=False, grad_reduce_in_fp32=True, distributed_optimizer=True,
                optimizer_impl="torch" if torch_foreach else "fused")
    return m, lay, g, o


def predict_row(row: dict) -> float:
    """Predicted torch-allocated peak bytes for a bench row."""
    m, lay, g, o = bench_setup(row)
    split, v = split_layers(m.num_layers, 1)
    mb, _ = train_memory(m, split, lay, g, o, 1, row["num_microbatches"])
    return mb.allocated


# --- the GRPO update bench (bench/bench_grpo_update.py --json) --------------------------------------------

#: acceptance: peak memory per GPU within 15%, step time (log-prob + update + export) within 1.5x
MEMORY_TOLERANCE = 0.15
TIME_FACTOR = 1.5
GRPO_PHASES = ("log_prob", "update", "export")
GIB_ = 2**30


def load_bench_json(path) -> dict:
    """One ``bench/bench_grpo_update.py --json`` result: ``config`` (model, set, layout, world, prompts, n, spec,
    precision, max_token_len_per_gpu, ...), ``device``, ``batch`` (prompt_lens, resp_lens), ``phases`` (seconds,
    tokens per phase) and ``memory_per_gpu`` (max_allocated_bytes per rank per phase). A run that ran out of memory
    is ``{"status": "oom", "config": {...}}`` (the bench writes no result then: :func:`oom_stub`)."""
    from dsv3_rl.fs import read_json

    row = read_json(path, what="GRPO update bench result")
    if not isinstance(row, dict):
        raise ValueError(f"{path}: not a JSON object (a bench_grpo_update.py --json result)")
    cfg = row.get("config")
    need = ("model", "layout", "world", "prompts", "n")
    missing = [f"config.{k}" for k in need if not isinstance(cfg, dict) or cfg.get(k) is None]
    if not _oom(row):
        missing += [k for k in ("phases", "memory_per_gpu", "batch") if k not in row]
        if isinstance(row.get("phases"), dict):
            missing += [f"phases.{k}" for k in GRPO_PHASES if k not in row["phases"]]
    if missing:
        raise ValueError(f"{path}: bench result lacks {missing}")
    row.setdefault("_path", str(path))
    return row


def oom_stub(config: dict, log_tail: str = "") -> dict:
    """The result of a bench run that ran out of memory: its ``config`` (the flags it was given) and ``status``."""
    return {"status": "oom", "config": config, "log_tail": log_tail[-2000:]}


def _oom(row: dict) -> bool:
    return str(row.get("status") or "ok").lower() == "oom"


def bench_model(cfg: dict) -> ModelSpec:
    from dsv3_rl.cliargs import parse_set
    from dsv3_rl.models.presets import preset_kwargs

    sets = cfg.get("set") or []
    sets = parse_set(sets) if isinstance(sets, list) else dict(sets)
    name = str(cfg["model"])
    return ModelSpec.from_hf(preset_kwargs(name, sets), name=name + "".join(f" {k}={v}" for k, v in sets.items()))


def _dist_max(text) -> int | None:
    """The largest length of a bench distribution ``fixed:N`` | ``uniform:LO:HI`` | ``lognormal:MEDIAN:SIGMA:MAX``."""
    if text is None:
        return None
    kind, _, rest = str(text).partition(":")
    vals = [float(x) for x in rest.split(":") if x]
    return int(vals[-1]) if vals else None


def bench_inputs(row: dict):
    """(model, cluster, grpo, layout, options, seq_lens) of a bench result: what it ran, as planner inputs."""
    from dsv3_rl.planner.spec import Cluster

    cfg = row["config"]
    m = bench_model(cfg)
    lay = Layout.parse(str(cfg["layout"]))
    if cfg.get("recompute") not in (None, lay.recompute):
        lay = Layout.parse(f"{cfg['layout']},recompute={cfg['recompute']}")
    world = int(cfg["world"])
    gpu = "H200" if "H200" in str(row.get("device", "")) else "H100"
    prompts, n = int(cfg["prompts"]), int(cfg["n"])
    batch = row.get("batch") or {}
    if batch.get("prompt_lens") and batch.get("resp_lens"):
        p_lens, r_lens = batch["prompt_lens"], batch["resp_lens"]
        p_lens = [p_lens[i // n] for i in range(len(r_lens))] if len(p_lens) == prompts else p_lens
        seq_lens = [int(a) + int(b) for a, b in zip(p_lens, r_lens)]
        p_max = max(_dist_max(cfg.get("prompt_len")) or 0, max(p_lens))
        r_max = max(_dist_max(cfg.get("resp_len")) or 0, max(r_lens))
    else:  # an out-of-memory stub (no lengths recorded): a seeded sample of the same distributions
        from dsv3_rl.planner.phases import sample_seq_lens

        p_max, r_max = _dist_max(cfg.get("prompt_len")) or 1, _dist_max(cfg.get("resp_len")) or 1
        seq_lens = sample_seq_lens(prompts, n, str(cfg.get("prompt_len")), str(cfg.get("resp_len")), int(cfg.get("seed") or 1))
    mini = int(cfg.get("mini_batches") or 1)
    g = GRPOShape(prompts_per_step=prompts, n_samples=n, max_prompt_len=p_max, max_response_len=r_max,
                  ppo_mini_batch_size=prompts // mini, dynamic_batch=True,
                  max_token_len_per_gpu=int(cfg["max_token_len_per_gpu"]) if cfg.get("max_token_len_per_gpu") else None)
    spec = str(cfg.get("spec") or "local")
    fp8 = str(cfg.get("precision") or "bf16") == "fp8"
    te_opt = bool(row.get("te_installed", spec == "te"))  # megatron takes TE's FusedAdam whenever TE imports
    o = Options(rollout=False, ref_model=False, param_offload=False, optimizer_offload=False,
                remove_padding=bool(cfg.get("use_remove_padding", spec == "te")),  # the bench: THD only with TE
                recompute=lay.recompute, distributed_optimizer=bool(cfg.get("distributed_optimizer", True)),
                transformer_impl="transformer_engine" if spec == "te" else "local",
                optimizer_impl="fused" if te_opt else "torch",
                train_precision="fp8" if fp8 else "bf16", fp8_recipe=str(cfg.get("fp8_recipe") or "blockwise"))
    c = Cluster(gpu=gpu, gpus_per_node=world, nodes=1)
    return m, c, g, lay, o, seq_lens


def compare_bench(row: dict) -> dict:
    """Measured vs predicted for one bench result: per phase seconds (the prediction scaled to the tokens of the
    step the bench reports for that phase), the peak allocated memory per GPU (largest over ranks and phases) and
    its error, the verdict and why. An out-of-memory result passes when the planner rejects the layout by its
    memory rule."""
    from dsv3_rl.planner.phases import predict_phases

    m, c, g, lay, o, lens = bench_inputs(row)
    pred = predict_phases(m, c, g, lay, o, seq_lens=lens)
    out = dict(name=row.get("_path", "row"), model=m.name, layout=lay.short(), world=c.world, predicted=pred.to_dict(),
               reasons=[], measured_update_mfu=None)
    if _oom(row):
        out["measured_oom"] = True
        out["ok"] = not pred.feasible and all(v.rule.startswith("mem.") for v in pred.violations)
        if not out["ok"]:
            out["reasons"].append("ran out of memory but the planner predicts it fits "
                                  f"({pred.peak_memory / GIB_:.1f} GiB allocated)")
        return out
    if not pred.feasible:
        out["reasons"].append(f"ran, but the planner rejects it: {pred.violations[0]}")
    out["gpu"] = str(row.get("device") or "")
    if not out["gpu"] or out["gpu"] == "cpu":  # the CPU smoke test: read and predicted, not a measurement to judge
        out["not_gpu"] = True
    tokens = sum(lens)
    rows, meas_s, meas_mem = {}, 0.0, 0.0
    for ph in GRPO_PHASES:
        x = row["phases"][ph]
        s = float(x["seconds"])
        mem_ph = max([x or 0 for x in ((row.get("memory_per_gpu") or {}).get(ph) or {}).get("max_allocated_bytes") or [0]])
        scale = float(x.get("tokens") or tokens) / tokens if ph != "export" else 1.0
        p_s = pred.phases[ph].seconds * scale
        meas_s += s
        meas_mem = max(meas_mem, float(mem_ph))
        rows[ph] = dict(measured_s=s, predicted_s=p_s, ratio=p_s / s if s else float("inf"),
                        measured_gib=mem_ph / GIB_, predicted_gib=pred.phases[ph].peak_memory / GIB_)
    out["measured_update_mfu"] = row["phases"]["update"].get("mfu")
    out["profile"] = (row.get("profile") or {}).get("categories_seconds")
    parts: dict[str, float] = {}
    for ph in ("log_prob", "update"):
        for k, v in pred.phases[ph].parts.items():
            key = {"compute": "compute", "optimizer": "optimizer", "elementwise": "memory-bound",
                   "host_gaps": "host gaps"}.get(k, "communication")
            parts[key] = parts.get(key, 0.0) + v
    parts["export"] = pred.phases["export"].seconds
    out["predicted_parts"] = parts
    out["phases"] = rows
    pred_s = sum(r["predicted_s"] for r in rows.values())
    out["measured_step_s"], out["predicted_step_s"] = meas_s, pred_s
    out["time_ratio"] = pred_s / meas_s if meas_s else float("inf")
    out["measured_peak_gib"], out["predicted_peak_gib"] = meas_mem / GIB_, pred.peak_memory / GIB_
    out["memory_error"] = pred.peak_memory / meas_mem - 1 if meas_mem else float("inf")
    if out.get("not_gpu"):
        out["ok"] = None
        out["reasons"].append(f"device {out['gpu'] or 'unknown'}: not a GPU measurement, not judged")
        return out
    if abs(out["memory_error"]) > MEMORY_TOLERANCE:
        out["reasons"].append(f"peak memory {out['memory_error']:+.1%} off (tolerance {MEMORY_TOLERANCE:.0%})")
    if not 1 / TIME_FACTOR <= out["time_ratio"] <= TIME_FACTOR:
        out["reasons"].append(f"step time predicted/measured {out['time_ratio']:.2f}x (tolerance {TIME_FACTOR}x)")
    out["ok"] = not out["reasons"]
    return out


def _match(row: dict, reg: dict | None) -> dict | None:
    """The registered run (``dsv3-plan phases --json``) of the same layout, world and model."""
    if not reg:
        return None
    for r in reg.get("runs", []):
        if r["layout"] == row["layout"] and r["world"] == row["world"] and \
                r["predicted"]["layout"] == row["predicted"]["layout"] and \
                r["model"] + "".join(f" {k}={v}" for k, v in r.get("model_set", {}).items()) == row["model"]:
            return r
    return None


def bench_table(rows: list[dict], reg: dict | None = None) -> str:
    """The markdown table of docs/planner.md: measured vs predicted per bench row."""
    head = ("| run | GPUs | layout | peak GiB/GPU measured | predicted | error | log-prob s meas / pred | "
            "update s meas / pred | export s meas / pred | step s meas / pred (ratio) | update MFU meas / pred | verdict |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        tag = (_match(r, reg) or {}).get("tag", Path(r["name"]).stem)
        if r.get("measured_oom"):
            lines.append(f"| {tag} | {r['world']} | {r['layout']} | out of memory | {r['predicted']['peak_memory_gib']:.1f} "
                         f"| - | - | - | - | - | - | {'PASS' if r['ok'] else 'FAIL'} (OOM {'predicted' if r['ok'] else 'not predicted'}) |")
            continue
        ph = r["phases"]
        pm = r["predicted"]["phases"]["update"]["mfu"]
        mm = r.get("measured_update_mfu")
        cells = [f"{ph[k]['measured_s']:.2f} / {ph[k]['predicted_s']:.2f}" for k in GRPO_PHASES]
        verdict = "n/a (not a GPU)" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        lines.append(f"| {tag} | {r['world']} | {r['layout']} | {r['measured_peak_gib']:.1f} | {r['predicted_peak_gib']:.1f} | "
                     f"{r['memory_error']:+.1%} | " + " | ".join(cells)
                     + f" | {r['measured_step_s']:.2f} / {r['predicted_step_s']:.2f} ({r['time_ratio']:.2f}x) | "
                     f"{(f'{mm:.1%}' if mm is not None else '-')} / {pm:.1%} | {verdict} |")
    return "\n".join(lines)


def registered_drift(rows: list[dict], reg: dict) -> list[str]:
    """Where today's planner differs from the registered predictions (peak memory by more than 1%, step time by
    more than 10%: the registered batch had every response at the mean length, the bench draws them), and runs
    registered but not measured."""
    out, seen = [], set()
    for r in rows:
        m = _match(r, reg)
        if m is None:
            out.append(f"{r['name']}: {r['layout']} on {r['world']} GPUs was not registered in --predicted")
            continue
        seen.add(m["tag"])
        a, b = m["predicted"], r["predicted"]
        for key, tol in (("peak_memory_gib", 0.01), ("step_seconds", 0.10)):  # the bench draws its lengths at random
            if a[key] and abs(b[key] / a[key] - 1) > tol:
                out.append(f"{m['tag']}: {key} registered {a[key]} -> today's planner {b[key]} (the planner changed, or "
                           f"the bench's batch differs from the registered one)")
    for r in reg.get("runs", []):
        if r["tag"] not in seen:
            out.append(f"{r['tag']}: {r['layout']} on {r['world']} GPUs registered but no bench result given")
    return out
