"""Resolve a preset into the exact run: paths, environment, stages, verl overrides, the final command,
and every check's findings. Nothing here touches a GPU; :mod:`dsv3_rl.launch.cli` executes the result.

Order of the verl overrides (later wins): the preset's sections turned into verl keys (``layout``,
``rollout``, ``router`` + the model's routing facts, ``hardware``, ``run``), the preset's ``verl:``
tree, the path wiring, then the command line. A command-line key
that the preset also sets replaces the preset's value in place (so ``+`` keys are never added twice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dsv3_rl.launch import checks, stages as stages_mod
from dsv3_rl.launch.verl_config import check_cli_overrides, check_open_dicts, validate_like_main_ppo
from dsv3_rl.recipes.presets import REPO, Preset, PresetError, load_preset
from dsv3_rl.verl_glue.compose import (VerlConfigError, admits_text, base_config, compose, declared_type,
                                      hydra_args)
from dsv3_rl.verl_glue.overrides import (Override, deep_merge, flatten, get_dotted as deep_get, parse_overrides,
                                         set_dotted, to_overrides)

A = "actor_rollout_ref.actor"
M = f"{A}.megatron"
OTC = f"{M}.override_transformer_config"
REF_M = "actor_rollout_ref.ref.megatron"
R = "actor_rollout_ref.rollout"

#: keys of config_map's MLATransformerConfig kwargs the launcher passes through override_transformer_config
ROUTER_MCORE_KEYS = ("moe_router_num_groups", "moe_router_group_topk", "moe_router_score_function",
                     "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_bias_update_rate",
                     "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_dtype")
#: model-shape keys compared between the preset's model and an existing checkpoint's config.json
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "n_routed_experts", "num_experts_per_tok",
              "n_group", "topk_group", "first_k_dense_replace", "moe_intermediate_size", "intermediate_size",
              "kv_lora_rank", "q_lora_rank", "vocab_size")
REWARD_FILE = REPO / "toolkits" / "reward" / "math_reward.py"
METRICS_FILE = "metrics.jsonl"  # verl's file logger output under LOG_DIR (VERL_FILE_LOGGER_PATH)

# TransformerEngine's attention switches. megatron-core's LanguageModule asserts they agree with the model's
# attention_backend (and exports them into os.environ whenever it builds a GPTModel); the CPU presets use
# ``attention_backend: local``, so an NVTE_FLASH_ATTN=1 from a GPU shell (or left by an in-process model)
# fails every trainer with 'NVTE_FLASH_ATTN set to 1, but expected 0'. Without TE they select nothing.
TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def pop_te_attention_env(environ) -> dict[str, str]:
    """Remove TE's attention switches from ENVIRON (a CPU run's environment); return what was removed."""
    return {k: environ.pop(k) for k in TE_ATTENTION_ENV if k in environ}


@dataclasses.dataclass
class Paths:
    work: Path
    model: Path
    hf: Path
    mcore: Path
    data_raw: Path
    data: Path
    ckpt: Path
    logs: Path

    ENV = {"work": "WORK_DIR", "model": "MODEL_PATH", "hf": "HF_PATH", "mcore": "MCORE_PATH", "data_raw": "DATA_RAW",
           "data": "DATA_DIR", "ckpt": "CKPT_DIR", "logs": "LOG_DIR"}

    def items(self):
        return [(self.ENV[f.name], getattr(self, f.name)) for f in dataclasses.fields(self)]


def _p(v: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(os.path.expandvars(str(v)))).absolute()


def resolve_paths(preset: Preset, environ: dict[str, str], model_cfg: dict) -> Paths:
    e = lambda k: environ.get(k) or None  # noqa: E731
    work = _p(e("WORK_DIR") or REPO / "runs")
    name = preset.weights["name"]
    shipped = REPO / preset.weights["path"] if preset.weights["source"] == "shipped" else None
    model = _p(e("MODEL_PATH") or shipped or work / "models" / name)
    fp8 = preset.weights["fp8"] is True or (preset.weights["fp8"] == "auto" and stages_mod.is_fp8(model, model_cfg))
    hf = _p(e("HF_PATH") or (Path(f"{model}-BF16") if fp8 else model))
    mcore = _p(e("MCORE_PATH") or work / "models" / f"{hf.name}-mcore")
    raw_default = preset.data.get("raw")
    raw_default = (REPO / raw_default) if raw_default and not os.path.isabs(raw_default) else raw_default
    data_raw = _p(e("DATA_RAW") or raw_default or work / "dataset" / stages_mod.dataset_spec(preset.data["dataset"]).name)
    data = _p(e("DATA_DIR") or work / "data" / preset.data["dataset"])
    proj, exp = preset.run["project"], preset.run["experiment"]
    ckpt = _p(e("CKPT_DIR") or work / "ckpt" / proj / exp)
    logs = _p(e("LOG_DIR") or work / "logs" / proj / exp)
    return Paths(work, model, hf, mcore, data_raw, data, ckpt, logs)


def model_facts(preset: Preset, hf_dir: Path) -> tuple[dict, str, list[checks.Finding]]:
    """The HF config the run trains (the checkpoint's when it exists, else the model preset's), its source,
    and findings where the checkpoint disagrees with the preset's model."""
    from dsv3_rl.models import presets as mp

    cfg = {"model_type": "deepseek_v3", **mp.preset_kwargs(preset.model)}
    findings: list[checks.Finding] = []
    src = f"model preset {mp.resolve(preset.model)!r} (dsv3_rl.models.presets)"
    disk = stages_mod.read_config(hf_dir)
    if disk is not None:
        diff = [f"{k}: preset {cfg.get(k)!r}, checkpoint {disk.get(k)!r}" for k in SHAPE_KEYS
                if k in cfg and k in disk and cfg[k] != disk[k]]
        if diff:
            findings.append(checks.Finding("error", "model", f"{hf_dir}/config.json is not the preset's model "
                                                             f"{preset.model!r}: {'; '.join(diff)}"))
        cfg, src = disk, f"{hf_dir}/config.json"
    return cfg, src, findings


def router_facts(model_cfg: dict, router: dict) -> dict[str, Any]:
    """override_transformer_config router keys from dsv3_rl.models.config_map (the single HF->mcore mapping)."""
    from dsv3_rl.models.config_map import RouterSettings, hf_to_mcore_kwargs

    cfg = {k: v for k, v in model_cfg.items() if k != "quantization_config"}
    cfg["num_nextn_predict_layers"] = 0
    kw = hf_to_mcore_kwargs(cfg, router=RouterSettings(**router))
    return {k: kw[k] for k in ROUTER_MCORE_KEYS if k in kw and kw[k] is not None}


@functools.lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (/proc/cpuinfo; empty where there is none)."""
    from dsv3_rl.recipes.train_precision import cpu_flags

    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return frozenset()


def train_mode(preset: Preset) -> tuple[str, str]:
    """The preset's training precision on this machine (``train_precision: auto`` resolved by the CPU's flags) and
    why, for auto ('' otherwise): dsv3_rl.recipes.train_precision.resolve."""
    from dsv3_rl.recipes.train_precision import resolve as resolve_precision

    flags = host_cpu_flags() if preset.is_cpu and preset.train_precision == "auto" else frozenset()
    return resolve_precision(preset.train_precision, preset.is_cpu, flags)


def derived_tree(preset: Preset, model_cfg: dict) -> dict:
    """verl keys for the preset's layout / rollout / router / hardware / run sections."""
    t: dict = {}
    lay = preset.layout
    key = {"tp": f"{M}.tensor_model_parallel_size", "pp": f"{M}.pipeline_model_parallel_size",
           "ep": f"{M}.expert_model_parallel_size", "etp": f"{M}.expert_tensor_parallel_size",
           "vpp": f"{M}.virtual_pipeline_model_parallel_size", "cp": f"{M}.context_parallel_size",
           "sp": f"{M}.sequence_parallel", "first_stage_layers": f"{OTC}.num_layers_in_first_pipeline_stage",
           "last_stage_layers": f"{OTC}.num_layers_in_last_pipeline_stage",
           "pipeline_layout": f"{OTC}.pipeline_model_parallel_layout",
           "account_for_embedding": f"{OTC}.account_for_embedding_in_pipeline_split",
           "account_for_loss": f"{OTC}.account_for_loss_in_pipeline_split",
           "dispatcher": f"{OTC}.moe_token_dispatcher_type"}
    for k, verl_key in key.items():
        if k in lay and lay[k] is not None:
            set_dotted(t, verl_key, lay[k])
    if "sp" not in lay:
        set_dotted(t, f"{M}.sequence_parallel", int(lay.get("tp", 1)) > 1)
    rc = lay.get("recompute", "none")
    if rc == "none":
        set_dotted(t, f"{OTC}.recompute_granularity", None)
    elif rc == "selective":
        set_dotted(t, f"{OTC}.recompute_granularity", "selective")
        set_dotted(t, f"{OTC}.recompute_modules", list(lay.get("recompute_modules") or ["core_attn"]))
    else:
        set_dotted(t, f"{OTC}.recompute_granularity", "full")
        set_dotted(t, f"{OTC}.recompute_method", lay.get("recompute_method", "uniform"))
        set_dotted(t, f"{OTC}.recompute_num_layers", int(lay.get("recompute_num_layers", 1)))
    ro = preset.rollout
    for k, verl_key in (("name", "name"), ("tp", "tensor_model_parallel_size"), ("dp", "data_parallel_size"),
                        ("ep", "expert_parallel_size"), ("gpu_memory_utilization", "gpu_memory_utilization")):
        if k in ro:
            set_dotted(t, f"{R}.{verl_key}", ro[k])
    if preset.is_cpu and ro.get("name", "vllm") == "vllm" and int(ro.get("tp", 1)) == 1:
        # vLLM's CPU build at rollout tp 1: the model in the EngineCore process (UniProcExecutor), not in a worker
        # process of its own. verl asks for "mp" (an EngineCore and a worker per engine); vLLM's CPU platform keeps
        # "uni" only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (env/cpu.sh; it would pin OpenMP threads per worker,
        # which the CPU presets do not: VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=1). One process fewer per
        # engine: measured 2026-11-27 on 2 cores, a 4-step run 159 s / 252 CPU-s against 189 s / 300 (docs/ci-history.md)
        set_dotted(t, f"{R}.engine_kwargs.vllm.distributed_executor_backend", "uni")
    if preset.router:
        for k, v in router_facts(model_cfg, preset.router).items():
            set_dotted(t, f"{OTC}.{k}", v)
    set_dotted(t, "trainer.nnodes", preset.nodes)
    set_dotted(t, "trainer.n_gpus_per_node", preset.gpus_per_node)
    set_dotted(t, "trainer.project_name", preset.run["project"])
    set_dotted(t, "trainer.experiment_name", preset.run["experiment"])
    from dsv3_rl.recipes import rollout_correction  # preset.rollout_correction by name -> algorithm.rollout_correction

    t = deep_merge(t, rollout_correction.verl_tree(preset.rollout_correction))
    from dsv3_rl.recipes import router_replay  # preset.router_replay by name -> actor.megatron.router_replay

    t = deep_merge(t, router_replay.verl_tree(preset.router_replay))
    from dsv3_rl.recipes import rollout_quantization  # preset.rollout_quantization by name -> rollout.quantization

    t = deep_merge(t, rollout_quantization.verl_tree(preset.rollout_quantization))
    from dsv3_rl.recipes import train_precision  # preset.train_precision -> megatron dtype / override_transformer_config.fp8

    t = deep_merge(t, train_precision.verl_tree(train_mode(preset)[0], preset.fp8_recipe))
    from dsv3_rl.recipes import algorithms  # preset.trainer_mode / algorithm by name -> resources, losses, filters

    resp = (preset.verl.get("data") or {}).get("max_response_length")
    return deep_merge(t, algorithms.verl_tree(algorithms.choice_of(preset), preset.hardware, resp))


#: the verl keys :func:`path_tree` sets: where the run's inputs and outputs are, not what the run is (a moved or
#: copied run directory is the same run: dsv3_rl.launch.workdir.identity leaves them out)
PATH_KEYS = ("actor_rollout_ref.model.path", "data.train_files", "data.val_files", "trainer.default_local_dir",
             "reward.custom_reward_function.path", f"{M}.dist_checkpointing_path", f"{REF_M}.dist_checkpointing_path")


def path_tree(preset: Preset, paths: Paths) -> dict:
    t: dict = {}
    set_dotted(t, "actor_rollout_ref.model.path", str(paths.hf))
    set_dotted(t, "data.train_files", str(paths.data / "train.parquet"))
    set_dotted(t, "data.val_files", str(paths.data / "test.parquet"))
    set_dotted(t, "trainer.default_local_dir", str(paths.ckpt))
    set_dotted(t, "reward.custom_reward_function.path", str(REWARD_FILE))
    set_dotted(t, "reward.custom_reward_function.name", "compute_score")
    if preset.weights.get("dist_ckpt"):
        for m in (M, REF_M):
            set_dotted(t, f"{m}.use_dist_checkpointing", True)
            set_dotted(t, f"{m}.dist_checkpointing_path", str(paths.mcore))
    return t


def env_from_file(path: Path, base: dict[str, str]) -> dict[str, str]:
    """Variables set or changed by sourcing PATH in bash (so ``${X:-default}`` semantics hold)."""
    r = subprocess.run(["bash", "-c", 'set -a; source "$1" >/dev/null; env -0', "bash", str(path)],
                       env=base, capture_output=True)
    if r.returncode != 0:
        raise PresetError(f"env preset {path} failed to source: {r.stderr.decode(errors='replace').strip()}")
    out = {}
    for item in r.stdout.split(b"\0"):
        if b"=" in item:
            k, _, v = item.decode(errors="replace").partition("=")
            if k not in ("_", "SHLVL", "PWD", "OLDPWD") and base.get(k) != v:
                out[k] = v
    return out


@dataclasses.dataclass
class Launch:
    preset: Preset
    paths: Paths
    model_cfg: dict
    model_src: str
    env: dict[str, str]
    """variables the launcher adds to the environment (env preset, logging)"""
    tree: dict
    overrides: list[str]
    user: list[str]
    argv: list[str]
    stages: list[stages_mod.Stage]
    findings: list[checks.Finding]
    notes: list[str]
    sizes: checks.Sizes | None = None
    cfg: Any = None

    @property
    def errors(self) -> list[checks.Finding]:
        return [f for f in self.findings if f.level == "error"]

    def full_env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if environ is None else environ)
        env.update(self.env)
        if self.preset.is_cpu:  # local attention on CPU: TE's switches would fail megatron's check
            pop_te_attention_env(env)
        else:  # TE in verl's workers loads torch's cuDNN, not another it finds first (docs/gpu-setup.md)
            from dsv3_rl.mcore.te_env import child_cudnn_env

            env.update(child_cudnn_env(env))
        return env


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _apply_user(tree: dict, user: list[Override]) -> list[str]:
    """Fold command-line overrides of keys the preset sets into TREE; return the rest as given."""
    keys = {k for k, _ in flatten(tree)}
    rest = []
    for o in user:
        if o.prefix == "~" and o.key in keys:
            parent, _, leaf = o.key.rpartition(".")
            node = deep_get(tree, parent) if parent else tree
            if isinstance(node, dict):
                node.pop(leaf, None)
            continue
        if o.prefix in ("", "+", "++") and o.key in keys:
            set_dotted(tree, o.key, o.value)
            continue
        rest.append(o.text)
    return rest


def check_value_types(cfg, base, tree: dict, user: list[Override], preset: str) -> None:
    """A value of the wrong kind for verl's key (``data.train_batch_size=abc``: verl's default is a number) is bad
    input, from the command line and from the preset alike: VerlConfigError (one line, exit 2) naming the key and
    where the value came from; the checks would otherwise crash on it."""
    from omegaconf import OmegaConf

    want = dict(flatten(OmegaConf.to_container(base, resolve=False)))
    got = dict(flatten(OmegaConf.to_container(cfg, resolve=False)))
    from_user = {o.key for o in user}
    from_preset = {k for k, _ in flatten(tree)}
    errs = []
    for k in sorted(from_user | from_preset):
        if k not in want or k not in got or want[k] is None or got[k] is None:
            continue
        w, v = want[k], got[k]
        if isinstance(v, str) and v.startswith("${"):
            continue  # an interpolation: resolved by verl
        if isinstance(w, bool):
            ok = isinstance(v, bool)
        elif isinstance(w, (int, float)):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)  # (verl's yaml writes 0 for floats too)
        else:
            continue
        if not ok and isinstance(v, str) and admits_text(declared_type(base, k)):
            ok = True  # verl's dataclass takes text too (IcePop's rollout_is_threshold "0.5_5.0"; the yaml says 2.0)
        if not ok:
            src = "the command line" if k in from_user else f"preset {preset}"
            kind = "true/false" if isinstance(w, bool) else "a number"
            errs.append(f"{k}={v!r} (from {src}): verl's {k} is {kind} (its default: {w!r})")
    if errs:
        raise VerlConfigError("; ".join(errs[:3]) + (f"; +{len(errs) - 3} more" if len(errs) > 3 else ""))


def resolve(preset_name: str, user_overrides: list[str] | None = None, environ: dict[str, str] | None = None,
            *, validate: bool = True) -> Launch:
    """Everything about a run, checked. Raises PresetError / VerlConfigError for unusable input; findings
    (errors and warnings) are collected in ``Launch.findings``."""
    environ = dict(os.environ if environ is None else environ)
    preset = load_preset(preset_name)
    notes: list[str] = []
    from dsv3_rl.models import presets as mp

    preset_cfg = {"model_type": "deepseek_v3", **mp.preset_kwargs(preset.model)}
    paths = resolve_paths(preset, environ, preset_cfg)
    model_cfg, model_src, findings = model_facts(preset, paths.hf)

    mode, why = train_mode(preset)
    if why:
        notes.append(f"train_precision auto -> {mode} ({why})")
    if preset.is_cpu and any(k in environ for k in TE_ATTENTION_ENV):
        notes.append(f"unsetting {', '.join(k for k in TE_ATTENTION_ENV if k in environ)} for this CPU run "
                     "(TransformerEngine attention switches; the CPU model uses attention_backend=local)")

    # environment ---------------------------------------------------------------------------------
    env: dict[str, str] = {}
    if preset.env_path():
        env.update(env_from_file(preset.env_path(), environ))
    logs = paths.logs
    env.setdefault("VERL_FILE_LOGGER_PATH", str(logs / METRICS_FILE))
    env.setdefault("TENSORBOARD_DIR", environ.get("TENSORBOARD_DIR") or str(logs / "tensorboard"))
    env.setdefault("WANDB_MODE", environ.get("WANDB_MODE") or "offline")
    env.setdefault("WANDB_DIR", environ.get("WANDB_DIR") or str(logs))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HYDRA_FULL_ERROR", "1")
    env = {k: v for k, v in env.items() if environ.get(k) != v}

    # verl overrides ---------------------------------------------------------------------------------
    base = base_config(preset.config_name)
    tree = deep_merge(derived_tree(preset, model_cfg), preset.verl)
    tree = deep_merge(tree, path_tree(preset, paths))
    user = parse_overrides(list(user_overrides or []))
    errs = check_cli_overrides(user, base)
    if errs:
        raise VerlConfigError("\n".join(errs))
    rest = _apply_user(tree, user)
    overrides = to_overrides(tree, base, f"preset {preset.name}", error=PresetError)
    from dsv3_rl.recipes import algorithms

    argv = [sys.executable, "-m", preset.entry, f"--config-name={preset.config_name}",
            *hydra_args(preset.trainer_mode), *overrides, *rest]
    launch = Launch(preset, paths, model_cfg, model_src, env, tree, overrides, rest, argv, [], findings, notes)

    # compose + check ------------------------------------------------------------------------------------
    cfg = compose(preset.config_name, overrides + rest)
    check_value_types(cfg, base, tree, user, preset.name)
    launch.cfg = cfg
    from omegaconf import OmegaConf

    max_prompt = OmegaConf.select(cfg, "data.max_prompt_length")
    launch.stages = stages_mod.build_stages(preset, paths, max_prompt_length=max_prompt, model_cfg=preset_cfg)
    s = checks.sizes_from_config(cfg)
    launch.sizes = s
    if not validate:
        return launch
    f = launch.findings
    f += [checks.Finding("error", "verl_keys", m) for m in check_open_dicts(cfg)]
    f += checks.check_parallel(model_cfg, s)
    f += checks.check_lengths_and_batches(cfg, model_cfg, s)
    f += checks.check_megatron_options(cfg)
    try:
        f += checks.check_router(cfg, router_facts(model_cfg, preset.router))
    except Exception as e:  # noqa: BLE001  (config_map refuses the model: that is an error too)
        f.append(checks.Finding("error", "model", f"dsv3_rl.models.config_map refuses {model_src}: {e}"))
    f += [checks.Finding("error", "algorithm", m) for m in algorithms.check_config(cfg, algorithms.choice_of(preset))]
    if s.world != algorithms.trainer_world(preset):
        f.append(checks.Finding("warning", "hardware", f"trainer.nnodes*n_gpus_per_node = {s.world} GPUs differs from the "
                                                       f"preset's hardware ({preset.hardware_name})"))
    for st in launch.stages:
        status, detail = st.status()
        if status == "error":
            f.append(checks.Finding("error", f"stage:{st.name}", detail))
    if not REWARD_FILE.is_file():
        f.append(checks.Finding("error", "paths", f"reward function {REWARD_FILE} does not exist"))
    model_exists = (paths.hf / "config.json").is_file()
    with _environ(launch.env):  # verl reads some settings (VERL_PLATFORM, ...) from the environment
        f += [checks.Finding("error", "verl", m) for m in validate_like_main_ppo(cfg, model_exists=model_exists)]
    f += checks.planner_check(model_cfg, cfg, s, preset.hardware["gpu"], preset.planner, cpu=preset.is_cpu,
                              hardware=preset.hardware)
    f += checks.async_estimate(preset, cfg, s)
    return launch
