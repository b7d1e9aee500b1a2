"""bench/bench_train_step.py's --spec: the TE spec and the TE-free (local) path as each runs for real. With TE
installed, megatron's local spec would fall back to its unfused attention and per-expert loop (patches 0012/0013
select SDPA and grouped GEMM only without TE), so the bench forces them; the TE spec gets TEGroupedMLP. CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train_step", REPO / "bench" / "bench_train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_spec_parsing(bench):
    assert bench.parse_args([]).specs == ["auto"]
    assert bench.parse_args(["--spec", "te,local"]).specs == ["te", "local"]
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--spec", "te,cudnn"])
    assert e.value.code == 2


def test_overrides_per_spec(bench):
    from megatron.core.transformer.enums import AttnBackend

    # local spec on a TE machine: the TE-free fast path forced on (what it runs where TE is absent)
    assert bench.mcore_overrides("local", "auto", "auto", te_installed=True) == {
        "attention_backend": AttnBackend.sdpa, "moe_sequential_grouped_mm": True}
    # without TE: megatron's own auto selection (the patches pick SDPA and grouped GEMM themselves)
    assert bench.mcore_overrides("local", "auto", "auto", te_installed=False) == {
        "attention_backend": AttnBackend.auto, "moe_sequential_grouped_mm": None}
    assert bench.mcore_overrides("local", "off", "unfused", te_installed=True)["moe_sequential_grouped_mm"] is False
    assert bench.mcore_overrides("te", "auto", "auto", te_installed=True) == {
        "attention_backend": AttnBackend.auto, "moe_grouped_gemm": True}
    assert bench.mcore_overrides("te", "off", "auto", te_installed=True)["moe_grouped_gemm"] is False


def test_te_spec_refused_without_te(bench, capsys, monkeypatch):
    from dsv3_rl.errors import run_main

    monkeypatch.setattr(bench, "ARGS", bench.parse_args(["--cpu-smoke", "--spec", "te"]))
    assert run_main(lambda argv: bench.main()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --spec te: Transformer Engine is not installed"), err
