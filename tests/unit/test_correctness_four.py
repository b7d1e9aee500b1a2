"""4-process correctness layouts on CPU (gloo, 4 processes on however many cores), each against transformers in
fp32, with planted faults; and a documented known failure reported as XFAIL by the CLI (exit 0).

A representative subset of ``layouts.FOUR_PROC_LAYOUTS`` runs here (the GPU session runs all of them, with a
fault at each: ``scripts/gpu_session.sh four-gpu``): EP4 (2 experts per rank), PP4 x VPP2 (on the 8-layer
variant of the tiny model the layout asks for) and TP2+SP x PP2, clean; swap-experts at EP4 and the MLA
TP-gradient patch reverted at TP2 x PP2, which must FAIL; and tp2_nosp_dense (2 processes, an all-dense
variant), documented to fail on the local spec only through MLA's q_a_layernorm gradient.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3_rl.correctness import faults, layouts
from dsv3_rl.correctness.runner import Candidate, Options, Suite

REPO = Path(__file__).resolve().parents[2]
FORWARD_SECTIONS = {"MLA", "MOE", "MLP", "Layer", "Final"}
CLEAN = ["ep4", "pp4_vpp2", "tp2_pp2", "tp2_nosp_dense"]
FAULTED = [("swap-experts", "ep4"), ("mla-tp-grad-patch-reverted", "tp2_pp2")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("correctness4")


@pytest.fixture(scope="module")
def results(work):
    cands = [Candidate(n, layouts.get(n)) for n in CLEAN]
    cands += [Candidate(f"{f}@{n}", layouts.get(n), faults.get(f)) for f, n in FAULTED]
    lines: list[str] = []
    suite = Suite(Options(work=str(work), spec="local"), out=lines.append)
    res = suite.execute(cands, show=True)
    return {r.layout: r for r in res}, "\n".join(lines)


def _failing(r) -> list:
    return [c for c in r.checks if not c.passed]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep4", "pp4_vpp2", "tp2_pp2"])
def test_four_process_layout_matches_transformers(results, name):
    res, log = results
    r = res[name]
    assert r.status == "PASS", f"{name}: " + "; ".join(c.line() for c in _failing(r)[:5]) + "\n" + r.log_tail
    assert "4 processes" in r.description
    names = " ".join(c.name for c in r.checks)
    for what in ("Attention Output", "Router Top-k Agreement", "MOE Routed Output", "Loss", "Routed Experts grads",
                 "MLA grads"):
        assert what in names, (name, what)
    if name == "pp4_vpp2":  # the 8-layer variant: every layer compared, the last one on the last chunk
        assert "model num_hidden_layers=8" in r.description and "Layer 7 Attention Output" in names
        assert "variant-num_hidden_layers8" in log


@pytest.mark.slow
@pytest.mark.parametrize("fault,name", FAULTED)
def test_planted_fault_fails_at_four_processes(results, fault, name):
    r = results[0][f"{fault}@{name}"]
    assert r.status == "FAIL", f"planted fault {fault} at {name} PASSED"
    failing = {c.name.split(" (")[0] for c in _failing(r)}
    want = {"swap-experts": "Layer 1 MOE Routed Output", "mla-tp-grad-patch-reverted": "Layer 0 MLA grads"}[fault]
    assert want in failing, sorted(failing)[:10]
    if fault == "mla-tp-grad-patch-reverted":  # only the backward is wrong
        assert all(c.passed for c in r.checks if c.section in FORWARD_SECTIONS)


@pytest.mark.slow
def test_dense_tp2_without_sp_fails_only_on_the_q_norm_grad_on_the_local_spec(results):
    """Known megatron-core behaviour, pinned (XFAIL on the local spec): a dense MLA model trained at TP2 without SP
    gets MLA's q_a_layernorm gradient 2x (finalize_model_grads all-reduces 'q_layernorm' over TP although the
    norm acts on the replicated latent); everything else matches transformers. On the TE spec the norm is fused
    into linear_q_up_proj (another name), so there the layout is expected to PASS."""
    r = results[0]["tp2_nosp_dense"]
    assert r.status == "XFAIL", r.status
    assert all(c.passed for c in r.checks if c.section in FORWARD_SECTIONS)
    failing = _failing(r)
    assert failing and all(c.section == "Gradients" and "MLA" in c.name for c in failing), [c.line() for c in failing]
    assert all(c.value == pytest.approx(1.0, abs=1e-4) for c in failing), [(c.name, c.value) for c in failing]
    assert "q_a_layernorm" in " ".join(c.line() for c in failing)


@pytest.mark.slow
def test_cli_exits_0_on_a_documented_known_failure_and_says_so(work, tmp_path):
    """The CLI in the suite's work dir: the random models and their conversions made there are reused (the CLI's
    own reference and workers run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TORCHDYNAMO_DISABLE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "dsv3_rl.correctness", "run", "--layout", "tp2_nosp_dense", "--spec", "local",
                        "--work", str(work), "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "============= Overall Result =============\nPASS (1 known failure(s) as documented: tp2_nosp_dense)" in r.stdout
    assert "XFAIL tp2_nosp_dense: documented known failure" in r.stdout
    assert "correctness (spec local, fp32): 1 layout(s)" in r.stdout
