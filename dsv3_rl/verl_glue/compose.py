"""verl's real Hydra config, composed as ``python -m verl.trainer.main_ppo --config-name=...`` would compose it
(verl's own ``verl/trainer/config`` directory, Hydra's compose API, struct mode), and why a key is not in it.

Upstream glue for verl, below every tool: the launcher (:mod:`dsv3_rl.launch.verl_config` validates what main_ppo
and its workers would) and the planner (its candidate's overrides) compose through here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

from dsv3_rl.errors import Dsv3Error, close
from dsv3_rl.verl_glue.trainer_modes import MODES  # off-policy trainer modes: verl/experimental/*/config

#: verl keys that older examples use but verl 0.9.1 does not have, with what to use instead.
REMOVED_KEYS = {
    "grad_offload": "verl 0.9.1 has no megatron.grad_offload (its own DeepSeek-V3 example still passes it); "
                    "param_offload=True also releases the gradient buffers while the engine is inactive",
    "reward_model.reward_manager": "verl 0.9.1 moved it to reward.reward_manager.name",
}


class VerlConfigError(Dsv3Error, ValueError):
    """The verl config cannot be composed or does not validate; the message names the key."""


def node_at(cfg, key: str):
    """The OmegaConf node at KEY (no resolution), or None."""
    from omegaconf import DictConfig

    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_interpolation() or part not in node.keys():
            return None  # (`in node` is False for '???' values; keys() lists them)
        node = node._get_node(part)
    return node


def exists(cfg, key: str) -> bool:
    return node_at(cfg, key) is not None


def verl_config_dir() -> Path:
    """``verl/trainer/config`` of the installed verl, found without importing verl (which is slow)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise VerlConfigError("verl is not installed in this environment (make setup installs verl 0.9.1 editable)")
    d = Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config"
    if not d.is_dir():
        raise VerlConfigError(f"verl's config directory {d} does not exist")
    return d


def verl_version() -> str:
    try:
        from importlib.metadata import version

        return version("verl")
    except Exception:  # noqa: BLE001
        return "unknown"


def compose(config_name: str, overrides: list[str]):
    """verl's config with OVERRIDES applied (struct mode, interpolations unresolved)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    config_dir, search = config_search(config_name, verl_config_dir())
    try:
        with initialize_config_dir(str(config_dir), version_base=None):
            return hydra_compose(config_name=config_name, overrides=[*search, *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).strip().splitlines()
        raise VerlConfigError(f"verl {verl_version()} ({config_name}) refused the overrides: {' '.join(msg)}") from None


@functools.lru_cache(maxsize=4)
def base_config(config_name: str = "ppo_megatron_trainer"):
    return compose(config_name, [])


def declared_type(cfg, key: str):
    """The type verl's config dataclass declares for KEY of the composed CFG (the class of the nearest node above KEY
    with a ``_target_``, then its fields' types down to KEY; Optional unwrapped), or None where no dataclass says
    (a plain yaml node, a class that cannot be imported). ``algorithm.rollout_correction.rollout_is_threshold``:
    ``str | float`` (IcePop's "0.5_5.0"), though the yaml's default is 2.0."""
    import dataclasses
    import types
    import typing

    parts = key.split(".")
    for i in range(len(parts) - 1, -1, -1):
        node = node_at(cfg, ".".join(parts[:i])) if i else cfg
        target = node.get("_target_") if hasattr(node, "get") else None
        if not isinstance(target, str):
            continue
        module, _, name = target.rpartition(".")
        try:
            t = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
        for field in parts[i:]:
            if not dataclasses.is_dataclass(t):
                return None
            try:
                t = typing.get_type_hints(t).get(field)
            except Exception:  # noqa: BLE001  (an annotation verl's module cannot resolve)
                return None
            args = [a for a in typing.get_args(t) if a is not type(None)]
            if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1:
                t = args[0]
        return t
    return None


def admits_text(t) -> bool:
    """Whether a value of declared type T (:func:`declared_type`) may be a string."""
    import typing

    return t is str or t is typing.Any or str in typing.get_args(t)


def unknown_key_message(cfg, key: str, where: str) -> str:
    """Why KEY is not a verl key, with the nearest ones."""
    from omegaconf import DictConfig

    parts = key.split(".")
    i = 0
    while i < len(parts) and exists(cfg, ".".join(parts[: i + 1])):
        i += 1
    parent = ".".join(parts[:i])
    node = node_at(cfg, parent) if parent else cfg
    siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    missing = parts[i] if i < len(parts) else parts[-1]
    msg = f"{where}: {key!r} is not a key of verl {verl_version()}'s config"
    if parent:
        msg += f" (no {missing!r} under {parent!r})"
    msg += close(missing, siblings)
    for k, why in REMOVED_KEYS.items():
        if key.endswith(k):
            msg += f". {why}"
            break
    if siblings and not close(missing, siblings):
        shown = ", ".join(sorted(siblings)[:25])
        msg += f"; keys under {parent or 'the root'}: {shown}{' ...' if len(siblings) > 25 else ''}"
    return msg


def hydra_args(mode: str) -> list[str]:
    """Extra Hydra arguments the mode's entry point needs: the off-policy configs name ``ppo_megatron_trainer``
    through ``hydra.searchpath: file://verl/trainer/config``, a path relative to the working directory (verl's
    source tree); the launcher points it at the installed verl instead."""
    if MODES[mode].config_dir is None:
        return []
    return [f"hydra.searchpath=[file://{verl_config_dir()}]"]


def config_search(config_name: str, base_dir: Path) -> tuple[Path, list[str]]:
    """(the directory holding CONFIG_NAME, extra overrides) for Hydra's compose; BASE_DIR is verl/trainer/config."""
    for m in MODES.values():
        if m.config_name == config_name and m.config_dir is not None:
            return base_dir.parents[1] / m.config_dir, [f"hydra.searchpath=[file://{base_dir}]"]
    return base_dir, []
