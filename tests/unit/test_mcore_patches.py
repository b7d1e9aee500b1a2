"""Each megatron-core patch shows the behaviour it exists for, and a planted-fault twin shows the
failure when that one patch is reverted (in a scratch copy of the patched tree, so the real backend
is never touched).

Gradient checks compare layouts against the single-process model with megatron-core's own
machinery: weights come from one dist checkpoint, each layout runs one training step through the
pipeline schedule + DDP + finalize_model_grads, and its gradients are saved as a dist checkpoint
(sharded like the weights) and reassembled into full tensors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv3_rl.backends import load_lock
from dsv3_rl.patching import lint
from dsv3_rl.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("mcore_scenarios.py")
MCORE = load_lock()["megatron-core"]
# a backend that is not there FAILS, never skips (issue 18): `make setup` fetches, patches and installs it
assert MCORE.path().exists(), f"{MCORE.path()} is missing: megatron-core is not fetched; run `make setup`"

# fp32 on CPU: layouts differ from one process only by reduction order.
GRAD_RTOL = 1e-5


def tiny_config(path: Path) -> Path:
    """The tiny DeepSeek-V3 preset (MLA + yarn, sigmoid router with expert bias and group-limited
    top-k, shared expert, dense first layer)."""
    from dsv3_rl.models.presets import hf_config

    cfg = hf_config("tiny")
    cfg.save_pretrained(path)
    return path


def _env(pythonpath: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_layout(cfg: Path, weights: Path, out: Path, args: list[str], nproc: int = 2,
               pythonpath: Path | None = None, init: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "dsv3_rl.mcore.layout_check",
           "--hf-config", str(cfg), "--weights", str(weights), "--out", str(out), *args]
    if init:
        cmd.append("--init")
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(pythonpath), timeout=600)


# Later patches that build on an earlier one (they use what it adds) are reversed with it.
DEPENDENTS = {"0008-cpu-device-placement.patch": ["0014-cpu-mixed-precision-optimizer.patch"]}  # get_current_device()


def tree_without(patch_name: str, dest: Path) -> Path:
    """A copy of the patched megatron tree with one patch (and its DEPENDENTS) reversed (import it via PYTHONPATH)."""
    patches = {p.name: p for p in lint(MCORE, headers=False)}
    shutil.copytree(MCORE.path() / "megatron", dest / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in [*reversed(DEPENDENTS.get(patch_name, [])), patch_name]:
        r = subprocess.run(["git", "apply", "-R", str(patches[name].path)], cwd=dest, capture_output=True, text=True)
        assert r.returncode == 0, f"could not reverse {name} in scratch copy: {r.stderr}"
    return dest


def grad_errors(cfg: Path, ref: Path, other: Path) -> dict[str, float]:
    from transformers import AutoConfig

    from dsv3_rl.mcore.layout_check import load_full

    hf = AutoConfig.from_pretrained(cfg)
    a, b = load_full(hf, ref), load_full(hf, other)
    assert a.keys() == b.keys()
    return {k: float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-30)) for k in a}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """Weights (dist checkpoint) + single-process reference gradients."""
    d = tmp_path_factory.mktemp("mcore_ref")
    cfg = tiny_config(d / "hf")
    r = run_layout(cfg, d / "weights", d / "tp1", [], nproc=1, init=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return cfg, d / "weights", d / "tp1" / "grads"


LAYOUTS = {
    "tp2_sp": ["--layout", "tp=2,etp=1"],  # ETP1: experts replicated over TP (0005), SP (0004), rope key (0003)
    "ep2_alltoall": ["--layout", "ep=2,etp=1"],
    "ep2_allgather": ["--layout", "ep=2,etp=1,dispatcher=allgather"],
    "pp2": ["--layout", "pp=2,etp=1"],
    "tp2_ep2": ["--layout", "tp=2,ep=2,etp=1"],
}


@pytest.fixture(scope="module")
def layout_errs(ref, tmp_path_factory):
    """layout name -> grad rel errors against the reference; each layout runs once in this module (a launch is
    ~20-50 s on 2 cores), whichever test asks first."""
    cfg, weights, ref_grads = ref
    done: dict[str, dict[str, float]] = {}

    def errs(layout: str) -> dict[str, float]:
        if layout not in done:
            out = tmp_path_factory.mktemp(f"layout_{layout}")
            r = run_layout(cfg, weights, out, LAYOUTS[layout])
            assert r.returncode == 0, r.stderr[-4000:]
            done[layout] = grad_errors(cfg, ref_grads, out / "grads")
        return done[layout]

    return errs


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_single_process(layout_errs, layout):
    errs = layout_errs(layout)
    worst = max(errs, key=errs.get)
    assert errs[worst] < GRAD_RTOL, f"{layout}: {worst} grad rel err {errs[worst]:.3e}"


@pytest.mark.slow
def test_tp2_grads_equal_tp1(layout_errs):
    """TP2 + sequence parallel + ETP1 (the tp2_sp run above, not launched again): every gradient, norms and routed
    experts included."""
    errs = layout_errs("tp2_sp")
    assert max(errs.values()) < GRAD_RTOL, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert any("layernorm" in k for k in errs) and any("local_experts" in k for k in errs)


# Numeric twins: with the patch reversed the step runs but these gradients are wrong.
NUMERIC_TWINS = {
    "0003-mla-rope-key-grad-sum-over-tp.patch": "self_attention.linear_kv_down_proj.weight",
    "0005-moe-expert-grads-etp-differs-from-tp.patch": "mlp.experts.local_experts.0.linear_fc1.weight",
}


@pytest.mark.slow
@pytest.mark.parametrize("patch", list(NUMERIC_TWINS))
def test_planted_fault_patch_reverted(ref, tmp_path, patch):
    cfg, weights, ref_grads = ref
    scratch = tree_without(patch, tmp_path / "tree")
    r = run_layout(cfg, weights, tmp_path / "out", ["--layout", "tp=2,etp=1"], pythonpath=scratch)
    assert r.returncode == 0, r.stderr[-4000:]
    errs = grad_errors(cfg, ref_grads, tmp_path / "out" / "grads")
    hit = {k: v for k, v in errs.items() if NUMERIC_TWINS[patch] in k}
    assert hit and max(hit.values()) > 100 * GRAD_RTOL, f"reverting {patch} did not break {NUMERIC_TWINS[patch]}: {hit}"


def run_scenario(name: str, cfg: Path, work: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCENARIOS), name, str(cfg), str(work)], capture_output=True,
                          text=True, env=_env(pythonpath), timeout=600, cwd=work)


@pytest.fixture(scope="module")
def patched_scenario(cfg_dir, tmp_path_factory):
    """scenario name -> its run on the patched tree, once per module (te_spec and build_and_train are asked for by
    two tests each)."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def run(name: str) -> subprocess.CompletedProcess:
        if name not in done:
            done[name] = run_scenario(name, cfg_dir, tmp_path_factory.mktemp(f"scenario_{name}"))
        return done[name]

    return run


# (scenario, patch whose absence breaks it, text of the failure without it)
NEEDED = [
    ("te_spec", "0001-te-spec-mla-down-proj-column-parallel.patch", "linear_q_down_proj is"),
    ("build_and_train", "0002-local-attention-mla-head-dims.patch", "unexpected keyword argument 'k_channels'"),
    ("sp_norm", "0004-torch-norm-sequence-parallel.patch", "sequence parallel not supported by torch LayerNorm"),
    ("build_and_train", "0006-mla-moe-without-transformer-engine.patch", "isinstance() arg 2 must be a type"),
    ("rng_seed", "0007-cpu-rng-tracker.patch", "Torch not compiled with CUDA enabled"),
    ("build_and_train", "0008-cpu-device-placement.patch", "Torch not compiled with CUDA enabled"),
    ("build_and_train", "0009-cpu-moe-token-dispatch.patch", "torch.cuda.Stream requires CUDA support"),
    ("dist_ckpt_save", "0010-cpu-dist-checkpointing.patch", "Torch not compiled with CUDA enabled"),
    ("bf16_optimizer_step", "0014-cpu-mixed-precision-optimizer.patch", "Torch not compiled with CUDA enabled"),
    ("recompute_selective", "0015-recompute-without-te-fp8-flag.patch", "FP8GlobalStateManager"),
    ("light_import", "0016-import-without-compiling.patch", "importing megatron-core loaded ['torch._dynamo', 'wandb', 'tensorboard']"),
]


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("scenario", sorted({s for s, _, _ in NEEDED}))
def test_scenario_passes_on_patched_tree(patched_scenario, scenario):
    r = patched_scenario(scenario)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"scenario {scenario}" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only failures cannot show on a CUDA machine")
@pytest.mark.parametrize("scenario,patch,error", NEEDED, ids=[p[:4] for _, p, _ in NEEDED])
def test_patch_is_needed(cfg_dir, tmp_path, scenario, patch, error):
    scratch = tree_without(patch, tmp_path / "tree")
    r = run_scenario(scenario, cfg_dir, tmp_path, pythonpath=scratch)
    assert r.returncode != 0, f"{scenario} passed with {patch} reverted"
    assert error in r.stderr + r.stdout, (r.stderr + r.stdout)[-3000:]


def test_te_spec_mla_down_proj_is_column_parallel(patched_scenario):
    r = patched_scenario("te_spec")
    assert r.returncode == 0, r.stderr[-3000:]


def test_local_spec_dsv3_trains_without_te(patched_scenario):
    r = patched_scenario("build_and_train")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loss" in r.stdout


def test_jit_fuser_compiles_at_first_call(monkeypatch):
    """Patch 0016: megatron's jit_fuser still torch.compiles what it decorates, once, at the first call instead of at
    import (the light_import scenario and its twin show the import side); the fused functions compute what their
    formulas say (megatron's tanh GeLU of x + bias against the formula written out here)."""
    import megatron.core.jit as jit
    from megatron.core.fusions.fused_bias_gelu import bias_gelu

    assert jit.jit_fuser is jit.compile_on_first_call  # torch >= 2.2: the compiling fuser, not the no-op one
    compiled = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: compiled.append(fn) or real(fn, *a, **k))

    @jit.jit_fuser
    def scaled_sum(x, y):
        return 2 * x + y

    assert compiled == []  # decorating compiles nothing
    x, y = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(scaled_sum(x, y), 2 * x + y)
    torch.testing.assert_close(scaled_sum(y, x), 2 * y + x)
    assert compiled == [scaled_sum.__wrapped__]  # compiled at the first call, once

    b, h = torch.randn(6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    z = h + b
    ref = 0.5 * z * (1 + torch.tanh(0.79788456 * (z + 0.044715 * z**3)))
    torch.testing.assert_close(bias_gelu(b, h), ref)


def test_timers_write_reaches_tensorboard_and_wandb(monkeypatch, tmp_path):
    """Patch 0016 leaves wandb and tensorboard to whoever makes the writer: Timers.write still hands each timer's max
    time to a tensorboard SummaryWriter (read back from its event file) and to the wandb module (its log call
    recorded), and the names the module used to bind (`timers.wandb`, `timers.SummaryWriter`) still resolve."""
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from megatron.core import timers as mtimers

    assert mtimers.wandb is wandb and mtimers.SummaryWriter is SummaryWriter
    t = mtimers.Timers(log_level=2, log_option="max")
    # the cross-rank gather needs CUDA (torch.cuda.current_device()); its result is what write() hands on
    monkeypatch.setattr(t, "_get_global_min_max_time", lambda names, *a: {n: (0.25, 0.5) for n in names})
    tb = SummaryWriter(log_dir=str(tmp_path / "tb"))
    t.write(["step"], tb, iteration=3)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("step-time")] == [(3, 0.5)]
    logged = []
    monkeypatch.setattr(wandb, "log", lambda data, step: logged.append((data, step)))
    t.write(["step"], wandb, iteration=4)
    assert logged == [({"step-time": 0.5}, 4)]


def test_cpu_rng_tracker_fork():
    """On CPU the tracker's named states fork and restore like CUDA ones: forked draws are
    reproducible from the seed, and the default stream is untouched by forks."""
    code = r"""
import os, torch
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
ps.initialize_model_parallel()
def draw():
    model_parallel_cuda_manual_seed(7)
    a = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        f1 = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        f2 = torch.rand(4)
    b = torch.rand(4)
    return a, f1, f2, b
a, f1, f2, b = draw()
a2, g1, g2, b2 = draw()
assert torch.equal(f1, g1) and torch.equal(f2, g2), "forked draws not reproducible"
assert not torch.equal(f1, f2), "fork did not advance its state"
model_parallel_cuda_manual_seed(7); x = torch.rand(4); y = torch.rand(4)
assert torch.equal(a, x) and torch.equal(b, y), "forks disturbed the default stream"
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**_env(), "PORT": str(free_port())}, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
