"""verl's real Hydra config: compose it as ``python -m verl.trainer.main_ppo --config-name=...`` would,
refuse unknown keys, and run what ``main_ppo`` and its workers validate before GPUs are allocated.

* Composition uses verl's own ``verl/trainer/config`` directory and Hydra's compose API; the config is in
  struct mode, so ``key=value`` on a key verl does not have is an error (Hydra's "Could not override").
  The launcher reports it first, with the nearest existing keys and, for keys verl dropped, why
  (``actor_rollout_ref.actor.megatron.grad_offload``: verl 0.9.1 has none; ``param_offload`` also
  releases the gradient buffers).
* ``+key=value`` (add) is accepted only below the free-form dicts verl forwards elsewhere
  (``override_transformer_config`` -> Megatron's ``TransformerConfig``, ``override_optimizer_config`` ->
  ``OptimizerConfig``, ``override_ddp_config`` -> ``DistributedDataParallelConfig``, ``engine_kwargs``,
  reward kwargs, Ray init kwargs, and any dict that is empty in verl's defaults). Keys below the
  Megatron ones are checked against the Megatron dataclass fields: verl itself only *warns* and drops an
  unknown ``override_transformer_config`` key (``check_and_construct_configs``), so a misspelt recompute
  or router setting would otherwise be silently ignored. ``++key=value`` is the unchecked escape hatch.
* Validation: ``verl.utils.config.validate_config`` exactly as ``main_ppo.main`` calls it (this builds the
  actor's ``McoreActorConfig`` and runs its ``validate``), then the dataclasses the workers build from the
  resolved config (``RolloutConfig`` with its TP/DP/EP assertions, ``McoreEngineConfig`` for actor and
  ref, the optimizer, checkpoint and algorithm configs), and ``HFModelConfig`` when the model exists.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

from dsv3_rl.errors import close
from dsv3_rl.verl_glue.compose import exists, node_at, unknown_key_message
from dsv3_rl.verl_glue.overrides import Override, is_open

#: Megatron dataclasses that verl builds from the open dicts (import path, class name).
MEGATRON_TARGETS = {
    ".override_transformer_config": ("megatron.core.transformer.transformer_config", "MLATransformerConfig"),
    ".override_optimizer_config": ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    ".override_ddp_config": ("megatron.core.distributed.distributed_data_parallel_config",
                             "DistributedDataParallelConfig"),
}


def check_cli_overrides(overrides: list[Override], cfg) -> list[str]:
    """Errors for command-line overrides verl would refuse or silently not read."""
    errors = []
    for o in overrides:
        if o.prefix in ("++", "~") or o.is_group:
            continue
        if o.prefix == "":
            if not exists(cfg, o.key):
                errors.append(unknown_key_message(cfg, o.key, f"override {o.text!r}"))
        elif o.prefix == "+":
            if exists(cfg, o.key):
                errors.append(f"override {o.text!r}: {o.key!r} already exists in verl's config; drop the '+'")
            elif not is_open(cfg, o.key):
                errors.append(unknown_key_message(cfg, o.key, f"override {o.text!r}")
                              + "; '+' adds keys only below the dicts verl forwards (override_transformer_config, "
                                "override_optimizer_config, engine_kwargs, ...); use '++' to add it unchecked")
    return errors


# ------------------------------------------------------------------------------- after composition


def _megatron_source_key() -> str | None:
    """A digest of megatron-core's installed source tree (path, size, mtime of every ``megatron/core/**/*.py``),
    found without importing it (``find_spec("megatron.core")`` runs no megatron-core code); None when absent."""
    import hashlib

    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    roots = [Path(spec.origin).parent] if spec and spec.origin else []
    h = hashlib.sha256()
    n = 0
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            n += 1
    return h.hexdigest()[:32] if n else None


def _fields_cache_path(key: str) -> Path:
    import os

    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv3_rl" / f"megatron-fields-{key}.json"


def _megatron_fields(module: str, cls: str, key: str | None = None) -> set[str] | None:
    """Field names of megatron-core's dataclass MODULE.CLS. Importing megatron-core costs ~4 s of CPU, paid by
    every launch before main_ppo starts (issue 28): the names are cached per megatron-core source tree (KEY, by
    default :func:`_megatron_source_key`; an edited or re-patched file is another key) in the user's cache
    directory."""
    import json

    key = key or _megatron_source_key()
    path = _fields_cache_path(key) if key else None
    if path is not None:
        try:
            cached = json.loads(path.read_text()).get(f"{module}.{cls}")
        except (OSError, ValueError, AttributeError):
            cached = None
        if isinstance(cached, list):
            return set(cached)
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001  (megatron-core missing: cannot check)
        return None
    fields = {f.name for f in dataclasses.fields(getattr(mod, cls))}
    if path is not None:
        from dsv3_rl.fs import write_json_atomic

        try:
            try:
                table = json.loads(path.read_text())
            except (OSError, ValueError):
                table = {}
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {**(table if isinstance(table, dict) else {}), f"{module}.{cls}": sorted(fields)})
        except OSError:
            pass  # a read-only home: the check still ran, only without the cache
    return fields


def check_open_dicts(cfg) -> list[str]:
    """Keys under override_transformer_config / override_optimizer_config / override_ddp_config that the
    Megatron dataclass does not have (verl would drop them with a warning, or fail after allocation)."""
    from omegaconf import DictConfig, OmegaConf

    errors = []
    source_key = None  # megatron-core's source digest: walked once for all sections, and only if one needs it
    for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        for suffix, (module, cls) in MEGATRON_TARGETS.items():
            sub = "optim" + suffix if "optimizer" in suffix else "megatron" + suffix
            key = f"{section}.{sub}"
            node = node_at(cfg, key)
            if not isinstance(node, DictConfig) or node._is_interpolation() or len(node) == 0:
                continue
            source_key = source_key or _megatron_source_key()
            fields = _megatron_fields(module, cls, source_key)
            if fields is None:
                errors.append(f"cannot check {key}: {module} does not import (is megatron-core installed?)")
                continue
            for k in OmegaConf.to_container(node, resolve=False):
                if k not in fields:
                    errors.append(f"{key}.{k}: not a field of megatron-core's {cls}{close(k, fields)}; verl would "
                                  f"{'drop it with only a warning' if 'transformer' in suffix else 'fail after allocating GPUs'}")
    return errors


def need_ref_and_critic(cfg) -> tuple[bool, bool]:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    return bool(need_reference_policy(cfg)), bool(need_critic(cfg))


#: Config nodes the workers turn into dataclasses (after ``OmegaConf.resolve``) before any model exists.
WORKER_NODES = (
    "actor_rollout_ref.rollout",
    "actor_rollout_ref.actor.megatron",
    "actor_rollout_ref.ref.megatron",
    "actor_rollout_ref.actor.optim",
    "actor_rollout_ref.actor.checkpoint",
    "actor_rollout_ref.rollout.checkpoint_engine",
    "algorithm",
)


def validate_like_main_ppo(cfg, *, model_exists: bool) -> list[str]:
    """Run verl's own checks on a copy of CFG; return error messages (empty = passed)."""
    import contextlib
    import io

    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass, validate_config

    errors: list[str] = []
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(cfg, True)
    try:
        from verl.utils.device import auto_set_device

        auto_set_device(cfg)
    except Exception:  # noqa: BLE001  (device probing is informational here)
        pass
    use_ref, use_critic = need_ref_and_critic(cfg)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            validate_config(config=cfg, use_reference_policy=use_ref, use_critic=use_critic)
    except Exception as e:  # noqa: BLE001  (verl raises AssertionError/ValueError/...)
        errors.append(f"verl validate_config (as main_ppo runs it): {type(e).__name__}: {_one_line(e)}")
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001
        errors.append(f"verl config does not resolve: {_one_line(e)}")
        return errors
    for key in WORKER_NODES:
        node = OmegaConf.select(cfg, key)
        if node is None:
            continue
        try:
            omega_conf_to_dataclass(node)
        except Exception as e:  # noqa: BLE001
            msg = _one_line(e)
            if not any(msg in prev or _core(msg) in prev for prev in errors):  # validate_config said it already
                errors.append(f"{key}: verl's {_target(node)} rejects it: {msg}")
    if model_exists:
        try:
            with contextlib.redirect_stdout(buf):
                omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
        except Exception as e:  # noqa: BLE001
            errors.append(f"actor_rollout_ref.model: verl's HFModelConfig cannot load {cfg.actor_rollout_ref.model.path}: "
                          f"{_one_line(e)}")
    return errors


def _core(msg: str) -> str:
    """The assertion text inside an InstantiationException message."""
    import re

    m = re.search(r"(\w+Error\(.*?\))", msg)
    return m.group(1) if m else msg


def _target(node) -> str:
    try:
        return str(node.get("_target_", "config")).rpartition(".")[2]
    except Exception:  # noqa: BLE001
        return "config"


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    if hasattr(e, "__cause__") and e.__cause__ is not None and len(text) < 20:
        text = f"{text} {e.__cause__}"
    return " ".join(text.split())[:600]


def select(cfg, key: str, default: Any = None) -> Any:
    """Resolved value at KEY or DEFAULT."""
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key, default=default)
    if hasattr(v, "_is_none") or type(v).__name__ in ("DictConfig", "ListConfig"):
        return OmegaConf.to_container(v, resolve=True)
    return v
