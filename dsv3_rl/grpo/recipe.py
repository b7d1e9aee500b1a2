"""A GRPO recipe (``examples/deepseek_v3/recipes/*.yaml``) -> hydra overrides for verl's ``main_ppo``.

A recipe is plain data: ``verl:`` is a nested piece of verl's own config tree, ``env:`` environment
variables for every process, ``checks:`` self-check tolerances, and a few run facts (model preset,
layout, processes, data sizes, steps). Unknown top-level keys are errors; keys under ``verl:`` are
checked against verl's composed config (:func:`validate_overrides`), so a misspelt verl key fails
before Ray starts, naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPE_DIR = REPO / "examples" / "deepseek_v3" / "recipes"
DEFAULT_RECIPE = RECIPE_DIR / "grpo_tiny_cpu.yaml"

TOP_KEYS = ("model", "layout", "processes", "data", "steps", "env", "checks", "verl")
LAYOUT_KEYS = ("tp", "pp", "ep", "etp")
DATA_KEYS = ("train_size", "test_size")
# verl sections that are free-form dicts passed through to megatron/vLLM/ray: new keys are legal there
OPEN_SECTIONS = ("override_", "engine_kwargs", "ray_init", "runtime_env", "env_vars", "reward_kwargs")
CHECK_KEYS = ("rollout_vs_trainer_prob_diff_max", "rollout_vs_trainer_pearson_min", "min_weight_change")

# TransformerEngine's attention switches. megatron-core's LanguageModule asserts they agree with the model's
# attention_backend (and exports them into os.environ whenever it builds a GPTModel); the CPU recipes use
# ``attention_backend: local``, so an NVTE_FLASH_ATTN=1 from a GPU shell (or left by an in-process model)
# fails every trainer with 'NVTE_FLASH_ATTN set to 1, but expected 0'. Without TE they select nothing.
TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def pop_te_attention_env(environ) -> dict[str, str]:
    """Remove TE's attention switches from ENVIRON (a CPU run's environment); return what was removed."""
    return {k: environ.pop(k) for k in TE_ATTENTION_ENV if k in environ}


class RecipeError(ValueError):
    """The recipe is malformed; the message names the file and the key."""


@dataclasses.dataclass
class Recipe:
    path: Path
    model: str
    layout: dict[str, int]
    processes: int
    data: dict[str, int]
    steps: int
    env: dict[str, str]
    checks: dict[str, float]
    verl: dict[str, Any]

    def overrides(self, extra: dict[str, Any] | None = None) -> list[str]:
        """``key.path=value`` hydra overrides for ``verl`` (plus ``extra``, a flat ``{key.path: value}``)."""
        flat = flatten(self.verl)
        flat["trainer.total_training_steps"] = self.steps
        flat.update(extra or {})
        # the config group that swaps FSDP defaults for the Megatron engine's (ppo_megatron_trainer.yaml)
        groups = ["model_engine=megatron"] if flat.get("actor_rollout_ref.actor.strategy") == "megatron" else []
        return groups + [f"{k}={format_value(v)}" for k, v in flat.items()]


def _check_keys(where: str, got: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(got) - set(allowed))
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(allowed)}")


def load(path: str | os.PathLike = DEFAULT_RECIPE) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist (recipes live in {RECIPE_DIR})")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping")
    _check_keys(str(path), raw, TOP_KEYS)
    missing = [k for k in ("model", "layout", "processes", "steps", "verl") if k not in raw]
    if missing:
        raise RecipeError(f"{path}: missing key(s) {missing}")
    layout = dict(raw["layout"])
    _check_keys(f"{path}: layout", layout, LAYOUT_KEYS)
    data = dict(raw.get("data") or {})
    _check_keys(f"{path}: data", data, DATA_KEYS)
    checks = dict(raw.get("checks") or {})
    _check_keys(f"{path}: checks", checks, CHECK_KEYS)
    env = {str(k): str(v) for k, v in (raw.get("env") or {}).items()}
    if not isinstance(raw["verl"], dict):
        raise RecipeError(f"{path}: verl must be a mapping of verl config keys")
    return Recipe(path=path, model=str(raw["model"]), layout={k: int(v) for k, v in layout.items()},
                  processes=int(raw["processes"]), data={k: int(v) for k, v in data.items()},
                  steps=int(raw["steps"]), env=env, checks={k: float(v) for k, v in checks.items()},
                  verl=raw["verl"])


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> ``{"a.b.c": leaf}``. Lists and empty mappings are leaves."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def format_value(v: Any) -> str:
    """A Python value as a hydra override value (lists as ``[a,b]``, None as ``null``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{format_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    if any(c in s for c in " ,[]{}()='\"\\:$") or s == "":
        return json.dumps(s).replace("'", "\\'")
    return s


def validate_overrides(overrides: list[str]) -> list[str]:
    """Compose verl's megatron trainer config with ``overrides``; keys the config lacks get hydra's ``+``
    where their parent is an open dict (e.g. ``override_transformer_config``), and are an error
    (naming the key) where it is a typed/struct section. Returns the overrides to pass to main_ppo."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import verl.trainer.main_ppo as main_ppo

    config_dir = str(Path(main_ppo.__file__).parent / "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        base = compose(config_name="ppo_trainer", overrides=["model_engine=megatron"])
    out = []
    for ov in overrides:
        if ov.startswith("model_engine="):
            out.append(ov)
            continue
        key = ov.split("=", 1)[0].lstrip("+")
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(base, parent_key, default=None) if parent_key else base
        if parent is not None and OmegaConf.is_dict(parent) and leaf in list(parent.keys()):
            out.append(ov)
            continue
        if parent is None or not OmegaConf.is_dict(parent):
            raise RecipeError(f"verl has no config key {key!r} (its parent {parent_key!r} is not a section)")
        if not any(part.startswith(OPEN_SECTIONS) for part in parent_key.split(".")):
            raise RecipeError(f"verl has no config key {key!r}; {parent_key!r} has: {', '.join(sorted(parent.keys()))}")
        out.append("+" + ov.lstrip("+"))
    GlobalHydra.instance().clear()
    return out
