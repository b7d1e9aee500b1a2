"""Every preset dry-runs against verl 0.9.1's real Hydra config, and planted faults are caught.

The dry run composes ``ppo_megatron_trainer`` with the preset's overrides exactly as ``main_ppo`` would,
runs verl's ``validate_config`` and the worker dataclasses, the launcher's parallel/model checks and the
planner. Inputs are real but small: the shipped MATH sample, a config-only DeepSeek-V3 checkpoint (config
+ tokenizer, no weights) written by ``mini_model``, and a dist-checkpoint manifest standing in for the
converter's output.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsv3_rl.launch import run as launch_run
from dsv3_rl.recipes.algorithms import trainer_world
from dsv3_rl.recipes.presets import REPO, list_presets, load_preset
from dsv3_rl.checkpoint.outputs import CONVERT_TOOL, MANIFEST, write_manifest
from dsv3_rl.verl_glue.compose import VerlConfigError

pytestmark = pytest.mark.slow  # imports verl + megatron-core once (~20 s), then a few seconds per preset

SAMPLE = REPO / "examples" / "deepseek_v3" / "data" / "MATH-lighteval-sample"
SAMPLES = {"math_lighteval": SAMPLE, "gsm8k": REPO / "examples" / "deepseek_v3" / "data" / "gsm8k-sample"}
OTC = "+actor_rollout_ref.actor.megatron.override_transformer_config."


@pytest.fixture(scope="module")
def dsv3_config_only(tmp_path_factory) -> Path:
    from dsv3_rl.minimodel.mini_model import write_mini_model

    out = tmp_path_factory.mktemp("ckpt") / "DeepSeek-V3-0324-BF16"
    write_mini_model("deepseek-v3", out)  # config.json + tokenizer only (671B: config only)
    return out


def environ_for(preset: str, tmp: Path, dsv3_cfg: Path) -> dict[str, str]:
    """A run environment whose inputs exist: the sample dataset, the 671B config, a converted checkpoint."""
    p = load_preset(preset)
    env = {"WORK_DIR": str(tmp / preset), "DATA_RAW": str(SAMPLES[p.data["dataset"]]), "MCORE_PATH": str(tmp / preset / "mcore")}
    if p.weights["source"] == "download":
        env["MODEL_PATH"] = str(dsv3_cfg)
    paths = launch_run.resolve_paths(p, env, {})
    mc = Path(env["MCORE_PATH"])
    mc.mkdir(parents=True, exist_ok=True)
    write_manifest(mc, CONVERT_TOOL, {"complete": True, "direction": "hf->mcore", "source": str(paths.hf)})
    return env


def errors(launch):
    return [f for f in launch.findings if f.level == "error"]


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_dry_runs_clean(preset, tmp_path, dsv3_config_only):
    load_preset(preset)  # a preset that does not load is a failure, never a skip
    launch = launch_run.resolve(preset, [], environ_for(preset, tmp_path, dsv3_config_only))
    errs = errors(launch)
    assert errs == [], "\n".join(map(str, errs))
    assert launch.argv[1:4] == ["-m", launch.preset.entry, f"--config-name={launch.preset.config_name}"]
    s = launch.sizes
    assert s.world == trainer_world(launch.preset)  # off-policy modes: the hardware minus the rollout's share
    if not launch.preset.is_cpu:  # the planner ran and the layout fits
        assert any(f.check == "planner" and f.level == "info" and f.message.startswith("fits") for f in launch.findings), \
            [str(f) for f in launch.findings if f.check == "planner"]


def test_671b_command_carries_the_rl_settings(tmp_path, dsv3_config_only):
    launch = launch_run.resolve("671b_512xH100", [], environ_for("671b_512xH100", tmp_path, dsv3_config_only))
    assert errors(launch) == []
    cmd = launch.argv
    otc = "+actor_rollout_ref.actor.megatron.override_transformer_config."
    for item in ("moe_router_num_groups=8", "moe_router_group_topk=4", "moe_router_bias_update_rate=0.0",
                 "moe_router_load_balancing_type=none", "moe_aux_loss_coeff=0.0", "moe_router_dtype=fp32",
                 "pipeline_model_parallel_layout='Et|(tt|)*30L'"):
        assert otc + item in cmd, item
    for item in ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective",
                 "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_modules=[core_attn,mla_up_proj,layernorm,moe,mlp]",
                 "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true",
                 "actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                 "actor_rollout_ref.ref.megatron.use_dist_checkpointing=true",
                 "actor_rollout_ref.actor.megatron.param_offload=true",
                 "actor_rollout_ref.actor.megatron.optimizer_offload=true",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                 "actor_rollout_ref.rollout.data_parallel_size=32",
                 "actor_rollout_ref.rollout.expert_parallel_size=64",
                 "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
                 "trainer.resume_mode=auto", "trainer.nnodes=64", "trainer.logger=[console,file,tensorboard,wandb]"):
        assert item in cmd, item
    assert launch.env["WANDB_MODE"] == "offline" and launch.env["TENSORBOARD_DIR"].startswith(str(launch.paths.logs))
    assert f"trainer.default_local_dir={launch.paths.ckpt}" in cmd
    # the checkpoint exists (config only), so verl's HFModelConfig was built from it too
    assert launch.model_src.endswith("config.json")


def test_user_overrides_pass_through_and_replace_preset_values(tmp_path, dsv3_config_only):
    env = environ_for("proxy_8xH100", tmp_path, dsv3_config_only)
    launch = launch_run.resolve("proxy_8xH100", ["data.train_batch_size=128", "trainer.total_training_steps=3",
                                                 "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp64"],
                                env)
    cmd = launch.argv
    assert "data.train_batch_size=128" in cmd and "data.train_batch_size=64" not in cmd
    assert "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp64" in cmd
    assert sum("moe_router_dtype" in a for a in cmd) == 1
    from omegaconf import OmegaConf

    assert OmegaConf.select(launch.cfg, "trainer.total_training_steps") == 3


# ------------------------------------------------------------------------------ planted faults


def test_fault_removed_verl_key_grad_offload():
    with pytest.raises(VerlConfigError, match=r"grad_offload.*did you mean.*offload.*param_offload=True also releases"):
        launch_run.resolve("671b_96xH20", ["actor_rollout_ref.actor.megatron.grad_offload=true"])


def test_fault_misspelt_verl_key():
    with pytest.raises(VerlConfigError, match=r"data.train_batch_sise.*did you mean 'train_batch_size'"):
        launch_run.resolve("proxy_8xH100", ["data.train_batch_sise=64"])
    with pytest.raises(VerlConfigError, match=r"'\+' adds keys only below"):
        launch_run.resolve("proxy_8xH100", ["+trainer.save_frequency=5"])


@pytest.mark.parametrize("overrides, pattern", [
    ([f"{OTC}pipeline_model_parallel_layout='Et|(tt|)*30tL'"],
     r"\[layers_vs_pp\] .*has 62 decoder layers \(t\) but the model has num_layers=61"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=12"],
     r"\[layers_vs_pp\] .*'Et\|\(tt\|\)\*30L' has 32 stages, not a multiple of PP=12"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=16", f"{OTC}pipeline_model_parallel_layout=null",
      f"{OTC}num_layers_in_first_pipeline_stage=4", f"{OTC}num_layers_in_last_pipeline_stage=2"],
     r"\[layers_vs_pp\] num_hidden_layers=61 minus first/last stage layers 4/2 leaves 55 layers for 14 middle stages"),
    (["trainer.nnodes=63"], r"\[gpus_vs_tp_pp_dp\] 504 GPUs \(63 nodes x 8\) are not divisible by TP\*PP\*CP = 2\*32\*1 = 64"),
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=48"], r"\[experts_vs_ep\] n_routed_experts=256 .* EP=48"),
    (["actor_rollout_ref.rollout.expert_parallel_size=32"], r"expert_parallel_size must be equal to tensor_model_parallel_size"),
    (["+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granulrity=full"],
     r"recompute_granulrity: not a field of megatron-core's MLATransformerConfig; did you mean 'recompute_granularity'"),
    (["+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_group_topk=2"],
     r"\[router\] .*moe_router_group_topk=2 but the model's config gives 4"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=48"], r"\[batch\] data.train_batch_size=512 is not divisible by"),
    (["data.max_response_length=200000"], r"\[seq_vs_positions\] .* > the model's max_position_embeddings=163840"),
])
def test_fault_is_caught_with_its_values(overrides, pattern, tmp_path, dsv3_config_only):
    launch = launch_run.resolve("671b_512xH100", overrides, environ_for("671b_512xH100", tmp_path, dsv3_config_only))
    errs = [str(f) for f in errors(launch)]
    assert any(re.search(pattern, e) for e in errs), errs


def test_fault_layout_that_does_not_fit_is_a_planner_warning(tmp_path, dsv3_config_only):
    # GPU optimizer without offload on 96 H20s: the planner says it does not fit (a warning, not an error)
    oo = "+actor_rollout_ref.actor.optim.override_optimizer_config."
    launch = launch_run.resolve("671b_96xH20", ["actor_rollout_ref.actor.megatron.param_offload=false",
                                                "actor_rollout_ref.actor.megatron.optimizer_offload=false",
                                                oo + "optimizer_cpu_offload=false", oo + "optimizer_offload_fraction=0.0"],
                                environ_for("671b_96xH20", tmp_path, dsv3_config_only))
    plan = [f for f in launch.findings if f.check == "planner"]
    assert plan and plan[0].level == "warning" and "DOES NOT FIT" in plan[0].message, [str(f) for f in plan]


def test_missing_inputs_are_errors_that_say_what_to_do(tmp_path):
    launch = launch_run.resolve("671b_512xH100", [], {"WORK_DIR": str(tmp_path)})
    msgs = [str(f) for f in errors(launch)]
    assert any("[stage:download]" in m and "modelscope download --model deepseek-ai/DeepSeek-V3-0324" in m for m in msgs), msgs
    assert any("[stage:data]" in m and "AI-ModelScope/MATH-lighteval" in m for m in msgs), msgs


def test_cli_dry_run_exit_status(tmp_path, dsv3_config_only, capsys, monkeypatch):
    from dsv3_rl.launch.cli import main

    for k, v in environ_for("proxy_16xH20", tmp_path, dsv3_config_only).items():
        monkeypatch.setenv(k, v)
    assert main(["--preset", "proxy_16xH20", "--dry-run", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "dry run proxy_16xH20: OK" in out and "TP2 PP2 EP8 ETP1 DP4" in out
    assert main(["--preset", "proxy_16xH20", "--dry-run", "--quiet", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"]) == 1
    assert "heads_vs_tp" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a misspelt launcher option is not taken for an override
        main(["--preset", "proxy_16xH20", "--dry-run", "--dryrun"])
    assert e.value.code == 2


def test_stages_run_for_real_then_skip(tmp_path):
    """tiny model, for real: weights (mini_model) -> config check -> HF->mcore (dsv3_rl.convert) -> data prep
    (length filter with the model's tokenizer); a second launch finds every output verified and skips them."""
    from dsv3_rl.launch.cli import execute

    preset = tmp_path / "tiny_stages_1xH100.yaml"
    preset.write_text(f"extends: {REPO / 'examples/deepseek_v3/presets/_tiny.yaml'}\n"
                      "hardware: {gpu: H100, nodes: 1, gpus_per_node: 1}\nlayout: {tp: 1}\nrollout: {tp: 1}\n"
                      "data: {train_size: 16, test_size: 4, length_filter: true}\n")
    env = {"WORK_DIR": str(tmp_path / "work"), "PATH": __import__("os").environ["PATH"]}
    launch = launch_run.resolve(str(preset), [], env, validate=False)
    assert [s.status()[0] for s in launch.stages] == ["run", "skip", "run", "run", "run"]
    assert execute(launch, stages_only=True) == 0
    data = launch.paths.data
    import pandas as pd

    assert len(pd.read_parquet(data / "train.parquet")) == 16 and (data / ".dsv3-launch-data.json").is_file()
    again = launch_run.resolve(str(preset), [], env, validate=False)
    assert (launch.paths.mcore / MANIFEST).is_file()
    assert f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={launch.paths.mcore}" in launch.argv
    assert [s.status()[0] for s in again.stages] == ["done", "skip", "done", "done", "done"], \
        [s.status() for s in again.stages]
    changed = launch_run.resolve(str(preset), ["data.max_prompt_length=128"], env, validate=False)
    assert changed.stages[-1].status() == ("run", "options changed since the last run")


def test_gsm8k_preset_prepares_gsm8k_and_the_reward_scores_it(tmp_path):
    """tiny_cpu_gsm8k, stages for real: its data stage converts the shipped GSM8K sample (not MATH), the
    parquet carries GSM8K's data_source, and the reward the preset wires in scores those rows: the
    reference answer 1, the same answer changed 0."""
    import pandas as pd

    from dsv3_rl.launch.cli import execute
    from dsv3_rl.launch.run import REWARD_FILE
    from dsv3_rl.reward.math_reward import compute_score

    env = {"WORK_DIR": str(tmp_path / "work"), "PATH": __import__("os").environ["PATH"]}
    launch = launch_run.resolve("tiny_cpu_gsm8k", [], env, validate=False)
    data_stage = launch.stages[-1]
    assert data_stage.name == "data" and "dsv3_rl.data.gsm8k" in data_stage.argv
    assert launch.paths.data_raw == SAMPLES["gsm8k"] and launch.paths.data.name == "gsm8k"
    assert f"reward.custom_reward_function.path={REWARD_FILE}" in launch.argv
    assert execute(launch, stages_only=True) == 0
    df = pd.read_parquet(launch.paths.data / "train.parquet")
    assert len(df) > 0 and set(df["data_source"]) == {"openai/gsm8k"}, set(df["data_source"])
    for row in df.head(8).itertuples():
        gt = row.reward_model["ground_truth"]
        right = compute_score(row.data_source, f"so the answer is \\boxed{{{gt}}}", gt)
        wrong = compute_score(row.data_source, f"so the answer is \\boxed{{{gt}1}}", gt)
        assert right["score"] == 1.0 and wrong["score"] == 0.0, (gt, right, wrong)
    # the MATH preset it extends converts MATH, not GSM8K
    assert "dsv3_rl.data.math_lighteval" in launch_run.resolve("tiny_cpu", [], env, validate=False).stages[-1].argv


def test_missing_gsm8k_raw_data_names_gsm8ks_download(tmp_path):
    env = {"WORK_DIR": str(tmp_path), "DATA_RAW": str(tmp_path / "nope")}
    launch = launch_run.resolve("tiny_cpu_gsm8k", [], env)
    msgs = [str(f) for f in errors(launch) if "[stage:data]" in str(f)]
    assert msgs and "openai/gsm8k" in msgs[0] and str(tmp_path / "nope") in msgs[0], msgs
    assert "MATH-lighteval" not in msgs[0]


def test_cpu_preset_runs_without_te_attention_switches(tmp_path, dsv3_config_only):
    """A GPU shell's NVTE_FLASH_ATTN=1 fails megatron's local-attention check in every CPU trainer: the CPU
    preset's process environment drops TE's switches and says so; a GPU preset passes them on."""
    env = {**environ_for("tiny_cpu", tmp_path, dsv3_config_only), "NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0"}
    launch = launch_run.resolve("tiny_cpu", [], env, validate=False)
    full = launch.full_env(env)
    assert "NVTE_FLASH_ATTN" not in full and "NVTE_FUSED_ATTN" not in full
    assert any("unsetting NVTE_FLASH_ATTN, NVTE_FUSED_ATTN" in n for n in launch.notes), launch.notes
    # planted fault: a GPU preset must keep the user's switches
    env = {**environ_for("proxy_8xH100", tmp_path, dsv3_config_only), "NVTE_FLASH_ATTN": "1"}
    gpu = launch_run.resolve("proxy_8xH100", [], env, validate=False)
    assert gpu.full_env(env)["NVTE_FLASH_ATTN"] == "1"


def test_megatron_fields_cache_equals_megatron_and_follows_its_sources(tmp_path, monkeypatch):
    """The launcher checks override_* keys against megatron-core's dataclass fields without importing megatron-core
    on every launch (issue 28: ~4 s before main_ppo starts): the names are cached per megatron-core source tree.
    The cache holds what megatron-core says; a launch with a warm cache imports no megatron-core module; an edited
    source file is another key (twin: a planted wrong entry under the current key is what the check uses, so a
    stale cache would be believed if the key did not follow the sources)."""
    import dataclasses
    import importlib
    import json
    import os
    import subprocess
    import sys

    from dsv3_rl.launch import verl_config as vc

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    module, cls = vc.MEGATRON_TARGETS[".override_transformer_config"]
    key = vc._megatron_source_key()
    assert key, "megatron-core's sources not found"
    first = vc._megatron_fields(module, cls)  # cold: imports megatron-core, writes the cache
    path = vc._fields_cache_path(key)
    live = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))}
    assert first == live and set(json.loads(path.read_text())[f"{module}.{cls}"]) == live
    code = ("import sys; from dsv3_rl.launch import verl_config as vc; "
            f"f = vc._megatron_fields({module!r}, {cls!r}); "
            "print(len(f), any(m.startswith('megatron.core') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                         "XDG_CACHE_HOME": str(tmp_path / "cache")}, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [str(len(live)), "False"], out.stdout + out.stderr[-2000:]
    # twin: a wrong entry under the current key is believed ...
    path.write_text(json.dumps({f"{module}.{cls}": ["recompute_granularity"]}))
    assert vc._megatron_fields(module, cls) == {"recompute_granularity"}
    # ... so the key must change with the sources: another size or mtime of one file is another key
    monkeypatch.setattr(vc, "_megatron_source_key", lambda: key[:-1] + ("0" if key[-1] != "0" else "1"))
    assert vc._megatron_fields(module, cls) == live
    tf = Path(importlib.import_module(module).__file__)
    st = tf.stat()
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        os.utime(tf, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        assert vc._megatron_source_key() != key
    finally:
        os.utime(tf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert vc._megatron_source_key() == key


def _planner_line(launch) -> str:
    return next(f.message for f in launch.findings if f.check == "planner")


def _line_names_the_spec_verl_builds(line: str) -> bool:
    """Whether the planner line names the spec verl's model initializer builds on this host (patch 0013)."""
    from verl.models.mcore.model_initializer import _use_transformer_engine

    here = "transformer_engine" if _use_transformer_engine() else "local"
    m = re.search(r"this host would build the (\w+) spec", line) or re.search(r"(\w+) spec, attention", line)
    return m is not None and m.group(1) == here


def test_planner_line_names_the_spec_this_host_builds(tmp_path, dsv3_config_only, monkeypatch):
    from dsv3_rl.launch import checks

    env = environ_for("proxy_1xH100", tmp_path, dsv3_config_only)
    line = _planner_line(launch_run.resolve("proxy_1xH100", [], env))
    assert line.startswith("fits") and _line_names_the_spec_verl_builds(line), line
    # twin: a spec test that ignores whether Transformer Engine imports here (the line before 2026-12-07) claims
    # the TE spec on a host where verl builds the local one (this CPU box has no TE), or the reverse on a TE host
    from verl.models.mcore.model_initializer import _use_transformer_engine

    monkeypatch.setattr(checks, "trainer_spec", lambda: "local" if _use_transformer_engine() else "transformer_engine")
    line = _planner_line(launch_run.resolve("proxy_1xH100", [], environ_for("proxy_1xH100", tmp_path / "b", dsv3_config_only)))
    assert not _line_names_the_spec_verl_builds(line), line
