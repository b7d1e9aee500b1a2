"""Planner predictions vs measured peak memory of real megatron-core training steps
(``dsv3_rl.planner.measure``, run as ``bench/measure_train_memory.py``), kept under tests/assets/planner/.

* ``measured_gpu.jsonl``: the GPU set (one H200, 2026-11-22; core attention through torch SDPA,
  patch 0012's default without TE). Rows measured on CUDA must be within 15% of the planner;
  no CUDA row (``measured: null``, not run on a GPU yet) makes the 15% tests FAIL, saying how to measure.
* ``measured_gpu_act.jsonl``: the ``gpu-act`` set (one H100, 2026-11-24, one process per config):
  long sequences and micro-batch 2, where activations + logits are 38-84% of the peak (>= 55% in 5
  of 7 rows), so the 15% bound also pins the per-layer activation model (in ``measured_gpu.jsonl``
  they are <= 41% of the peak); two rows use the 671B presets' recompute list and layernorm.
* ``cpu_emulated_smoke.jsonl``: the same kind of step on CPU with the allocator emulated (storage
  bytes alive, 512 B blocks) - not a GPU measurement, checked to 10% as a regression guard.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from dsv3_rl.planner import measure
from dsv3_rl.planner.validation import bench_setup, load_measurements, predict_row, row_attention

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "planner"
GPU = ASSETS / "measured_gpu.jsonl"
GPU_ACT = ASSETS / "measured_gpu_act.jsonl"
CPU = ASSETS / "cpu_emulated_smoke.jsonl"
TOLERANCE = 0.15


def _gpu_rows():
    """The committed CUDA rows; none FAILS (never skips): the 15% checks would then check nothing."""
    rows = [r for r in load_measurements(GPU) if r.get("device") == "cuda" and r.get("peak_allocated")]
    rel = GPU.relative_to(GPU.parents[3])
    assert rows, (f"no GPU measurement in {rel} (rows say measured: null): run `python bench/measure_train_memory.py "
                  f"--out {rel}` on an H100/H200 and commit the rows")
    return rows


def test_gpu_set_covers_the_dimensions():
    """>= 4 configs that differ in layers, experts, sequence length and recompute."""
    rows = load_measurements(GPU)
    assert len(rows) >= 4
    for key in (lambda r: r["hf_config"]["num_hidden_layers"], lambda r: r["hf_config"]["n_routed_experts"],
                lambda r: r["seq_length"], lambda r: json.dumps(r["recompute"], sort_keys=True)):
        assert len({key(r) for r in rows}) >= 2


def test_gpu_measurements_within_15_percent():
    rows = _gpu_rows()
    errors = {r["name"]: predict_row(r) / r["peak_allocated"] - 1 for r in rows if not r.get("oom")}
    assert len(errors) >= 4, errors
    bad = {k: f"{v:+.1%}" for k, v in errors.items() if abs(v) > TOLERANCE}
    assert not bad, f"predictions off by more than {TOLERANCE:.0%}: {bad}"


def _act_rows():
    return [r for r in load_measurements(GPU_ACT) if r.get("device") == "cuda" and r.get("peak_allocated")]


def _dynamic_errors(rows, predict=predict_row):
    """Relative error of the part of the peak above the static memory (weights + grads + optimizer
    states, measured just before the step): the activations, logits and backward working set."""
    return {r["name"]: (predict(r) - r["static_allocated"]) / (r["peak_allocated"] - r["static_allocated"]) - 1
            for r in rows}


def test_gpu_activation_rows_are_activation_dominated_and_within_15_percent():
    rows = _act_rows()
    assert len(rows) >= 4, f"{GPU_ACT.name}: expected >= 4 measured rows"
    assert {r["impl"]["attention"] for r in rows} == {"sdpa"}
    recompute = {json.dumps(r["recompute"], sort_keys=True) for r in rows}
    assert len(recompute) >= 3, recompute
    # the part above the static memory is most of the peak in >= 4 rows: those check the activations
    # (the 671B presets' heavy selective list leaves 38% in act-L12-E16-s8192x2-preset512)
    share = {r["name"]: (r["peak_allocated"] - r["static_allocated"]) / r["peak_allocated"] for r in rows}
    assert sum(v >= 0.5 for v in share.values()) >= 4 and min(share.values()) >= 0.3, share
    total = {r["name"]: predict_row(r) / r["peak_allocated"] - 1 for r in rows}
    assert all(abs(e) <= TOLERANCE for e in total.values()), total
    dynamic = _dynamic_errors(rows)
    assert all(abs(e) <= TOLERANCE for e in dynamic.values()), dynamic


def _scaled_activation_model(monkeypatch, kept_scale=1.0, ignore_recompute=False):
    from dsv3_rl.planner import memory

    real = memory.layer_activation

    def fake(*a, **k):
        la = real(*a, **k)
        kept = la.full if ignore_recompute else la.kept
        return dataclasses.replace(la, kept=kept * kept_scale)

    monkeypatch.setattr(memory, "layer_activation", fake)


def test_planted_fault_activation_model_30_percent_low_fails_activation_rows(monkeypatch):
    """Twin: per-layer activations 30% low still pass the old set (activations <= 41% of its peaks)
    but must fail the activation-dominated rows."""
    _scaled_activation_model(monkeypatch, kept_scale=0.7)
    old = {r["name"]: predict_row(r) / r["peak_allocated"] - 1 for r in _gpu_rows()}
    assert all(abs(e) <= TOLERANCE for e in old.values()), old  # why the old set alone is not enough
    new = {r["name"]: predict_row(r) / r["peak_allocated"] - 1 for r in _act_rows()}
    assert any(abs(e) > TOLERANCE for e in new.values()), new


def test_planted_fault_selective_recompute_ignored_fails_activation_rows(monkeypatch):
    """Twin: a model that forgets what selective recompute drops must fail the selective rows."""
    _scaled_activation_model(monkeypatch, ignore_recompute=True)
    selective = [r for r in _act_rows() if (r["recompute"] or {}).get("granularity") == "selective"]
    assert selective
    errors = _dynamic_errors(selective)
    assert any(abs(e) > TOLERANCE for e in errors.values()), errors


def test_gpu_rows_say_the_attention_path_they_ran():
    """The GPU set ran without TE, so patch 0012 put core attention on torch SDPA; the rows say so
    and the planner predicts them with its SDPA (fused kernel) model."""
    rows = _gpu_rows()
    assert {row_attention(r) for r in rows} == {"sdpa"}
    m, lay, g, o = bench_setup(rows[0])
    assert o.attention_impl == "sdpa"


def test_planted_fault_unfused_attention_model_fails_gpu_rows():
    """Twin: predicting the (SDPA) GPU rows with the unfused S x S attention model - the bug this
    label fixes - must fail the 15% check."""
    rows = _gpu_rows()
    errors = {}
    for r in rows:
        wrong = copy.deepcopy(r)
        wrong["impl"]["attention"] = "unfused"
        errors[r["name"]] = predict_row(wrong) / r["peak_allocated"] - 1
    assert any(abs(e) > TOLERANCE for e in errors.values()), errors


def test_row_attention_rejects_what_is_not_modelled():
    assert row_attention({"name": "x"}) == "unfused"  # rows from before patch 0012
    assert row_attention({"name": "x", "impl": {"attention": "sdpa", "attention_kernel": "cudnn"}}) == "sdpa"
    with pytest.raises(ValueError, match="math kernel"):
        row_attention({"name": "x", "impl": {"attention": "sdpa", "attention_kernel": "math"}})
    with pytest.raises(ValueError, match="allowed: sdpa, unfused"):
        row_attention({"name": "x", "impl": {"attention": "flash"}})


def test_bench_reads_the_sdpa_kernel_off_the_graph():
    import torch

    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # fused CPU kernel
    assert measure._attention_kernel(out.permute(2, 0, 1, 3).reshape(8, 1, 32)) == "flash_cpu"
    v = torch.randn(1, 2, 8, 8, requires_grad=True)  # unequal head dims: torch's math fallback on CPU
    out = torch.nn.functional.scaled_dot_product_attention(q, q, v, is_causal=True)
    assert measure._attention_kernel(out) == "math"
    with torch.no_grad():
        assert measure._attention_kernel(torch.nn.functional.scaled_dot_product_attention(q, q, q)) is None


def test_cpu_emulated_within_10_percent():
    rows = load_measurements(CPU)
    assert rows and all(r["device"] == "cpu-emulated" for r in rows)
    errors = {r["name"]: predict_row(r) / r["peak_allocated"] - 1 for r in rows}
    assert all(abs(e) < 0.10 for e in errors.values()), errors
    # the static part (weights + grad buffer + optimizer states) is read off the tensors
    for r in rows:
        assert r["weight_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] <= r["static_allocated"]


def test_planted_fault_scaled_prediction_fails_the_check():
    """Twin: a predictor 30% high must fail the 15% comparison on the same rows."""
    rows = _gpu_rows() or load_measurements(CPU)
    errors = [1.3 * predict_row(r) / r["peak_allocated"] - 1 for r in rows]
    assert any(abs(e) > TOLERANCE for e in errors)


def test_bench_lists_configs_and_predicts(tmp_path, capsys):
    assert measure.main(["--list"]) == 0
    out = tmp_path / "pred.jsonl"
    assert measure.main(["--predict-only", "--out", str(out)]) == 0
    rows = load_measurements(out)
    assert len(rows) == len(measure.GPU_SET) and all(r["measured"] is None and r["planner_predicted_allocated"] for r in rows)
    assert measure.main(["--set", "gpu", "--only", "nope", "--predict-only"]) == 0  # --only filters, nothing to do
    assert measure.main(["--only", "nope", "--device", "cpu"]) == 2
    assert "not in set" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_cpu_reproduces_asset(tmp_path):
    """Re-run one CPU config through the real megatron-core step and match the stored row."""
    name = "tiny-L3-E8-s256-none"
    out = tmp_path / "row.jsonl"
    assert measure.main(["--set", "cpu-smoke", "--only", name, "--device", "cpu", "--out", str(out)]) == 0
    new = load_measurements(out)[0]
    old = next(r for r in load_measurements(CPU) if r["name"] == name)
    assert abs(new["peak_allocated"] / old["peak_allocated"] - 1) < 0.02
    assert new["weight_bytes"] == old["weight_bytes"] and new["optimizer_bytes"] == old["optimizer_bytes"]


@pytest.mark.slow
def test_bench_one_process_per_config_matches_in_process(tmp_path):
    """The per-config child processes (the CUDA default, --isolate on CPU) give the stored rows."""
    names = ["tiny-L3-E8-s256-none", "tiny-L3-E16-s256-selmoe"]
    out = tmp_path / "rows.jsonl"
    assert measure.main(["--set", "cpu-smoke", "--only", ",".join(names), "--device", "cpu", "--isolate",
                       "--out", str(out)]) == 0
    new = {r["name"]: r for r in load_measurements(out)}
    old = {r["name"]: r for r in load_measurements(CPU)}
    assert sorted(new) == sorted(names)
    for n in names:
        assert abs(new[n]["peak_allocated"] / old[n]["peak_allocated"] - 1) < 0.02, n
