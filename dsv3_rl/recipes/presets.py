"""Run presets: small YAML files under ``examples/deepseek_v3/presets/``, one per model x hardware.

A preset names its model (facts live in :mod:`dsv3_rl.models.presets`), its hardware, a trainer
``layout`` (the fields of :class:`dsv3_rl.layout.Layout`), a ``rollout`` layout, the RL ``router``
settings, the ``rollout_correction`` mode (:mod:`dsv3_rl.recipes.rollout_correction`), the ``router_replay`` and
``rollout_quantization`` modes (:mod:`dsv3_rl.recipes.router_replay`, :mod:`dsv3_rl.recipes.rollout_quantization`) and anything else as
``verl`` keys in verl's own config tree. ``extends`` pulls in shared
files (``_grpo_math.yaml``); files whose name starts with ``_`` are bases, not runnable presets.

Every key is checked: an unknown key is an error naming the file, the key and the allowed keys.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

import pydantic

from dsv3_rl.errors import Dsv3Error, close
from dsv3_rl.recipes import algorithms, rollout_correction, rollout_quantization, router_replay
from dsv3_rl.layout import RECOMPUTE, Layout
from dsv3_rl.verl_glue.overrides import deep_merge

REPO = Path(__file__).resolve().parents[2]
PRESET_DIR = REPO / "examples" / "deepseek_v3" / "presets"
ENV_DIR = REPO / "examples" / "deepseek_v3" / "env"


class PresetError(Dsv3Error, ValueError):
    """A preset (or an override of it) is wrong; the message names the file and the key."""


# -------------------------------------------------------------------------------------- schema

class _Section(pydantic.BaseModel):
    """A preset section: unknown keys are errors (values are checked after ``extends`` is merged)."""

    model_config = pydantic.ConfigDict(extra="forbid")


def _section(name: str, fields: dict[str, Any]) -> type[_Section]:
    return pydantic.create_model(name, __base__=_Section, **{k: (t, None) for k, t in fields.items()})


def _num(kind=float, **bounds):
    """A strict number (no ``"0.97"`` text, no ``true``, no NaN/inf) within BOUNDS (pydantic ``gt``/``ge``/``le``...)."""
    extra = {"allow_inf_nan": False} if kind is float else {}
    return typing.Annotated[kind, pydantic.Field(strict=True, **extra, **bounds)]


_Count, _Positive, _NonNeg = _num(int, ge=1), _num(float, gt=0), _num(float, ge=0)
_Fraction = _num(float, gt=0, le=1)  # (0, 1]: a share of memory, an agreement, a correlation that must be positive
_Str = typing.Annotated[str, pydantic.Field(strict=True)]

#: ``layout``: the fields of :class:`dsv3_rl.layout.Layout`, with its types
LayoutSection = _section("LayoutSection", {k: t | None for k, t in typing.get_type_hints(Layout).items()})
RolloutSection = _section("RolloutSection", dict(name=_Str, tp=_Count, dp=_Count, ep=_Count,
                                                 gpu_memory_utilization=_Fraction))
RouterSection = _section("RouterSection", dict(bias_update_rate=_NonNeg, load_balancing_type=_Str,
                                               aux_loss_coeff=_NonNeg, router_dtype=_Str))
HardwareSection = _section("HardwareSection", dict(gpu=str, nodes=int, gpus_per_node=int, gpu_memory_gib=_Positive))
WeightsSection = _section("WeightsSection", dict(source=str, name=str, path=str | None, download=str,
                                                 fp8=bool | str, dist_ckpt=bool))
DataSection = _section("DataSection", dict(dataset=str, raw=str, train_size=_Count, test_size=_Count,
                                           length_filter=bool))
DlcSection = _section("DlcSection", dict(image=str, worker_cpu=int, worker_memory=Any, worker_shared_memory=Any,
                                         gpu_type=str, priority=int, max_running_minutes=int))
SlurmSection = _section("SlurmSection", dict(partition=str, time=str, cpus_per_task=int, mem=Any, account=str, qos=str))
#: ``run``: ``timeout_s`` a wall-clock limit for main_ppo; ``max_restarts`` how often a run that lost a process
#: (a killed Ray worker, a dead vLLM engine, an OOM kill) is restarted from its last checkpoint (docs/launcher.md);
#: ``max_start_retries`` how often a failed start of Ray or vLLM is retried (its own budget, default 2);
#: ``verify_checkpoints`` how a checkpoint is checked before a resume loads it (dsv3_rl.launch.ckpt.VERIFY_MODES)
RunSection = _section("RunSection", dict(project=_Str, experiment=_Str, timeout_s=_Positive,
                                         max_restarts=_num(int, ge=0, le=100),
                                         max_start_retries=_num(int, ge=0, le=10),
                                         verify_checkpoints=typing.Literal["digests", "structure", "off"]))
LearningSection = _section("LearningSection", dict(min_gain=_Positive, window=_Count, reason_off=_Str))
#: the self-checks a finished run gets (dsv3_rl.grpo.checks); a preset without ``checks`` is not checked
ChecksSection = _section("ChecksSection", dict(rollout_vs_trainer_prob_diff_mean_max=_Positive,
                                               rollout_vs_trainer_pearson_min=_Fraction,
                                               # null: reported, not judged (a preset switching off an inherited gate)
                                               rollout_vs_trainer_token_mult_prob_error_max=_Positive | None,
                                               min_weight_change=_NonNeg | None,  # null: no checkpoint compared
                                               route_agreement_min=_Fraction, learning=Any))

#: the sections of a preset file; None: free-form (a value, or a mapping checked elsewhere)
SECTION_MODELS: dict[str, type[_Section] | None] = {
    "description": None, "extends": None, "model": None, "hardware": HardwareSection, "env": None,
    "weights": WeightsSection, "data": DataSection, "entry": None, "config_name": None,
    "layout": LayoutSection, "rollout": RolloutSection, "router": RouterSection, "planner": None, "verl": None,
    "dlc": DlcSection, "slurm": SlurmSection, "run": RunSection, "checks": ChecksSection, "rollout_correction": None,
    "router_replay": None, "rollout_quantization": None, "train_precision": None, "fp8_recipe": None,
    # trainer mode and algorithm by name, the hardware split of off-policy modes (dsv3_rl/recipes/algorithms.py)
    "trainer_mode": None, "algorithm": None, "off_policy": algorithms.OffPolicySection,
}
SECTIONS: dict[str, tuple[str, ...] | None] = {k: tuple(m.model_fields) if m else None for k, m in SECTION_MODELS.items()}
LAYOUT_KEYS = SECTIONS["layout"]
ROLLOUT_KEYS, ROUTER_KEYS, HARDWARE_KEYS = SECTIONS["rollout"], SECTIONS["router"], SECTIONS["hardware"]
WEIGHTS_KEYS, DATA_KEYS, DLC_KEYS, SLURM_KEYS = SECTIONS["weights"], SECTIONS["data"], SECTIONS["dlc"], SECTIONS["slurm"]
RUN_KEYS, CHECK_KEYS = SECTIONS["run"], SECTIONS["checks"]
LEARNING_KEYS = tuple(LearningSection.model_fields)

GPU_KINDS = ("cpu", "H100", "H200", "H20", "H800", "A100", "B200")
WEIGHT_SOURCES = ("synthetic", "download", "shipped")
DATASETS = ("math_lighteval", "gsm8k")


@dataclasses.dataclass
class Preset:
    """A resolved preset (``extends`` merged). ``files`` lists the files it was read from."""

    name: str
    path: Path
    files: list[Path]
    description: str
    model: str
    hardware: dict[str, Any]
    env: str | None
    weights: dict[str, Any]
    data: dict[str, Any]
    entry: str
    config_name: str
    layout: dict[str, Any]
    rollout: dict[str, Any]
    router: dict[str, Any]
    planner: dict[str, Any] | bool
    verl: dict[str, Any]
    dlc: dict[str, Any]
    slurm: dict[str, Any]
    run: dict[str, Any]
    checks: dict[str, Any] | None = None
    """self-check tolerances (:data:`CHECK_KEYS`); None: the run is not checked"""
    rollout_correction: str = "none"
    """a :data:`dsv3_rl.recipes.rollout_correction.MODES` name (verl's ``algorithm.rollout_correction``)"""
    router_replay: str = "none"
    """a :data:`dsv3_rl.recipes.router_replay.MODES` name (verl's ``actor.megatron.router_replay.mode``)"""
    rollout_quantization: str = "none"
    """a :data:`dsv3_rl.recipes.rollout_quantization.MODES` name (verl's ``rollout.quantization``)"""
    train_precision: str = "bf16"
    """bf16 | fp8 (:mod:`dsv3_rl.recipes.train_precision`: megatron's ``fp8``/``fp8_recipe`` through verl)"""
    fp8_recipe: str = "blockwise"
    """the FP8 recipe when ``train_precision: fp8`` (:data:`dsv3_rl.recipes.train_precision.RECIPES`)"""
    trainer_mode: str = "sync"
    """a :data:`dsv3_rl.recipes.algorithms.MODES` name (verl's entry point and config)"""
    algorithm: str = "grpo"
    """a :data:`dsv3_rl.recipes.algorithms.ALGORITHMS` name (verl's losses and filters)"""
    off_policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    """the rollout / trainer split of an off-policy trainer_mode (:class:`dsv3_rl.recipes.algorithms.OffPolicySection`)"""

    @property
    def nodes(self) -> int:
        return int(self.hardware["nodes"])

    @property
    def gpus_per_node(self) -> int:
        return int(self.hardware["gpus_per_node"])

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def is_cpu(self) -> bool:
        return self.hardware["gpu"] == "cpu"

    @property
    def hardware_name(self) -> str:
        return "cpu" if self.is_cpu else f"{self.world}x{self.hardware['gpu']}"

    def env_path(self) -> Path | None:
        return (ENV_DIR / f"{self.env}.sh") if self.env else None


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise PresetError(f"{path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PresetError(f"{path}: a preset is a mapping of sections, got {type(data).__name__}")
    return data


def _check_keys(path: Path, data: dict) -> None:
    """Every section and key of one preset file against :data:`SECTION_MODELS`; the first problem is one line
    naming the file, the key and the allowed keys."""
    for key, value in data.items():
        if key not in SECTIONS:
            raise PresetError(f"{path}: unknown section {key!r}{close(key, SECTIONS)} (allowed: {', '.join(SECTIONS)})")
        model, allowed = SECTION_MODELS[key], SECTIONS[key]
        if model is None:
            continue
        if not isinstance(value, dict):
            raise PresetError(f"{path}: section {key!r} must be a mapping of {', '.join(allowed)}")
        _validate(path, key, model, value)
        learning = value.get("learning") if key == "checks" else None
        if learning not in (None, False):
            if not isinstance(learning, dict):
                raise PresetError(f"{path}: checks.learning must be a mapping of {', '.join(LEARNING_KEYS)}")
            _validate(path, "checks.learning", LearningSection, learning)


def _validate(path: Path, name: str, model: type[_Section], value: dict) -> None:
    try:
        model.model_validate(value)
    except pydantic.ValidationError as e:
        err, allowed = e.errors()[0], tuple(model.model_fields)
        sub = str(err["loc"][0])
        if err["type"] == "extra_forbidden":
            raise PresetError(f"{path}: unknown key {name}.{sub}{close(sub, allowed)} "
                              f"(allowed in {name}: {', '.join(allowed)})") from None
        raise PresetError(f"{path}: {name}.{sub}={err['input']!r}: {err['msg'].lower()}") from None


def preset_file(name_or_path: str | os.PathLike) -> Path:
    """Path of a preset given by name (``671b_512xH100``) or by file path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p.resolve()
    cand = PRESET_DIR / f"{name_or_path}.yaml"
    if cand.is_file():
        return cand
    names = list_presets()
    raise PresetError(f"unknown preset {str(name_or_path)!r}{close(str(name_or_path), names)} "
                      f"(presets in {PRESET_DIR}: {', '.join(names)})")


def list_presets() -> list[str]:
    """Runnable presets (base files ``_*.yaml`` excluded), sorted by model then size."""
    names = [p.stem for p in PRESET_DIR.glob("*.yaml") if not p.name.startswith("_")]
    order = {"tiny": 0, "proxy": 1, "671b": 2}

    def key(n: str):
        model, _, hw = n.partition("_")
        digits = "".join(c for c in hw.split("x")[0] if c.isdigit())
        return (order.get(model, 9), int(digits) if digits else 0, n)

    return sorted(names, key=key)


def _load_raw(path: Path, seen: tuple[Path, ...] = ()) -> tuple[dict, list[Path]]:
    if path in seen:
        raise PresetError(f"{path}: 'extends' cycle through {' -> '.join(map(str, seen + (path,)))}")
    data = _read_yaml(path)
    _check_keys(path, data)
    ext = data.pop("extends", None) or []
    if isinstance(ext, str):
        ext = [ext]
    merged: dict = {}
    files: list[Path] = []
    for e in ext:
        base = (path.parent / e).resolve()
        if not base.is_file():
            raise PresetError(f"{path}: extends {e!r} but {base} does not exist")
        b, bf = _load_raw(base, seen + (path,))
        merged = deep_merge(merged, b)
        files += bf
    return deep_merge(merged, data), files + [path]


def _named_mode(where: str, data: dict, key: str, module) -> str:
    """A preset's mode chosen by name (``rollout_correction``, ``router_replay``, ``rollout_quantization``): one of
    ``module.MODES`` (dsv3_rl/launch/<key>.py), ``module.DEFAULT`` when the preset does not say."""
    v = data.get(key)
    v = module.DEFAULT if v is None else v
    if not isinstance(v, str) or v not in module.MODES:
        raise PresetError(f"{where}: {key}={v!r}{close(str(v), module.MODES)} (allowed: {', '.join(module.MODES)}; "
                          f"dsv3_rl/recipes/{key}.py says what each does)")
    return v


def _train_precision(where: str, data: dict, hw: dict) -> tuple[str, str]:
    """``train_precision`` (bf16|fp8) and ``fp8_recipe`` of a preset (dsv3_rl/recipes/train_precision.py)."""
    from dsv3_rl.recipes import train_precision as tp

    prec = _named_mode(where, data, "train_precision", tp)
    recipe = data.get("fp8_recipe", tp.DEFAULT_RECIPE)
    if recipe not in tp.RECIPES:
        raise PresetError(f"{where}: fp8_recipe={recipe!r}{close(str(recipe), tp.RECIPES)} (allowed: {', '.join(tp.RECIPES)})")
    if "fp8_recipe" in data and prec != "fp8":
        raise PresetError(f"{where}: fp8_recipe={recipe!r} with train_precision={prec!r}: the recipe applies to fp8 only")
    meg = (((data.get("verl") or {}).get("actor_rollout_ref") or {}).get("actor") or {}).get("megatron") or {}
    if "dtype" in meg and "train_precision" in data:
        raise PresetError(f"{where}: verl actor_rollout_ref.actor.megatron.dtype={meg['dtype']!r} beside "
                          f"train_precision={data['train_precision']!r}: say the precision once, with train_precision")
    if prec == "fp8" and hw["gpu"] == "cpu":
        raise PresetError(f"{where}: train_precision=fp8 on a CPU preset (hardware.gpu=cpu): {tp.CPU_REFUSAL}")
    return prec, recipe


def load_preset(name_or_path: str | os.PathLike) -> Preset:
    """Read, merge and check a preset. Raises :class:`PresetError` naming the file and key."""
    path = preset_file(name_or_path)
    data, files = _load_raw(path)
    where = f"preset {path.stem} ({path})"
    for req in ("model", "hardware", "layout"):
        if req not in data:
            raise PresetError(f"{where}: missing section {req!r}")
    from dsv3_rl.models import presets as model_presets

    try:
        model_presets.resolve(data["model"])
    except KeyError as e:
        raise PresetError(f"{where}: model: {e.args[0]}") from None
    hw = dict(data["hardware"])
    for k in ("gpu", "nodes", "gpus_per_node"):
        if k not in hw:
            raise PresetError(f"{where}: hardware.{k} is required")
    if hw["gpu"] not in GPU_KINDS:
        raise PresetError(f"{where}: hardware.gpu={hw['gpu']!r}{close(str(hw['gpu']), GPU_KINDS)} (allowed: {', '.join(GPU_KINDS)})")
    for k in ("nodes", "gpus_per_node"):
        if not isinstance(hw[k], int) or hw[k] < 1:
            raise PresetError(f"{where}: hardware.{k}={hw[k]!r} must be an integer >= 1")
    layout = dict(data["layout"])
    rc = layout.get("recompute", "none")
    if rc not in RECOMPUTE:
        raise PresetError(f"{where}: layout.recompute={rc!r} (allowed: {', '.join(RECOMPUTE)})")
    weights = dict(data.get("weights") or {})
    weights.setdefault("source", "download")
    if weights["source"] not in WEIGHT_SOURCES:
        raise PresetError(f"{where}: weights.source={weights['source']!r} (allowed: {', '.join(WEIGHT_SOURCES)})")
    weights.setdefault("name", data["model"])
    weights.setdefault("fp8", "auto")
    weights.setdefault("dist_ckpt", True)
    if weights["source"] == "shipped":
        if not weights.get("path"):
            raise PresetError(f"{where}: weights.source=shipped needs weights.path (a checkpoint in the repository)")
        if not (REPO / weights["path"]).is_dir():
            raise PresetError(f"{where}: weights.path={weights['path']!r}: no directory {REPO / weights['path']}")
    if weights["fp8"] not in ("auto", True, False):
        raise PresetError(f"{where}: weights.fp8={weights['fp8']!r} (allowed: auto, true, false)")
    dat = dict(data.get("data") or {})
    dat.setdefault("dataset", "math_lighteval")
    if dat["dataset"] not in DATASETS:
        raise PresetError(f"{where}: data.dataset={dat['dataset']!r} (allowed: {', '.join(DATASETS)})")
    env = data.get("env")
    if env and not (ENV_DIR / f"{env}.sh").is_file():
        have = sorted(p.stem for p in ENV_DIR.glob("*.sh"))
        raise PresetError(f"{where}: env={env!r}: no {ENV_DIR / (env + '.sh')}{close(env, have)} (have: {', '.join(have)})")
    verl = data.get("verl") or {}
    if not isinstance(verl, dict):
        raise PresetError(f"{where}: section 'verl' must be a mapping in verl's config tree")
    planner = data.get("planner", {})
    if planner is None:
        planner = {}
    if not isinstance(planner, (dict, bool)):
        raise PresetError(f"{where}: planner must be a mapping of dsv3_rl.planner.Options fields, or false")
    if isinstance(planner, dict) and "rollout_quantization" in planner:  # the planner reads it from verl's config
        raise PresetError(f"{where}: planner.rollout_quantization: set the preset's rollout_quantization instead "
                          "(it sets verl's rollout.quantization, which the planner reads)")
    run = dict(data.get("run") or {})
    run.setdefault("project", "dsv3_grpo")
    run.setdefault("experiment", path.stem)
    run.setdefault("max_restarts", 0)
    run.setdefault("verify_checkpoints", "digests")
    checks = data.get("checks")
    if checks is not None:
        checks = dict(checks)  # keys and types checked per file (_check_keys)
    if algorithms.default_correction(data):  # an off-policy trainer_mode gets TIS unless the preset names one
        data["rollout_correction"] = algorithms.default_correction(data)
    rcorr = _named_mode(where, data, "rollout_correction", rollout_correction)
    try:
        algo = algorithms.choose(data, hw, rcorr)
    except algorithms.AlgorithmError as e:
        raise PresetError(f"{where}: {e}") from None
    replay = _named_mode(where, data, "router_replay", router_replay)
    prec, recipe = _train_precision(where, data, hw)
    quant = _named_mode(where, data, "rollout_quantization", rollout_quantization)
    if quant == "fp8" and hw["gpu"] == "cpu":
        raise PresetError(f"{where}: rollout_quantization=fp8 on a CPU preset (hardware.gpu=cpu): "
                          f"{rollout_quantization.CPU_REFUSAL}")
    return Preset(
        name=path.stem, path=path, files=files, description=str(data.get("description", "")).strip(),
        model=data["model"], hardware=hw, env=env, weights=weights, data=dat,
        entry=data.get("entry", algo.mode.entry), config_name=data.get("config_name", algo.mode.config_name),
        layout=layout, rollout=dict(data.get("rollout") or {}), router=dict(data.get("router") or {}),
        planner=planner, verl=verl, dlc=dict(data.get("dlc") or {}), slurm=dict(data.get("slurm") or {}), run=run,
        checks=checks, rollout_correction=rcorr, router_replay=replay, rollout_quantization=quant,
        train_precision=prec, fp8_recipe=recipe,
        trainer_mode=algo.trainer_mode, algorithm=algo.algorithm, off_policy=algo.off_policy,
    )
