"""verl's Hydra overrides, the one place they are written: a nested dict in verl's key space in, override
strings out (:func:`to_overrides`), one quoting rule (:func:`hydra_value`), one list of verl's open sections
(:data:`OPEN_SUFFIXES`, :data:`OPEN_PREFIXES`); and the command line's overrides parsed back.

verl's config is composed by Hydra in struct mode: ``key=value`` must name an existing key, ``+key=value``
adds one. ``+`` is written only below the free-form dicts verl forwards to Megatron or vLLM
(``override_transformer_config`` ...), whose keys the launcher checks itself (:mod:`dsv3_rl.launch.verl_config`).
The launcher (a run preset) and the planner (a candidate layout) both go through :func:`to_overrides`; so does
:func:`deep_merge`, the one merge of two such trees (a preset over the one it extends, a mode's keys over a tree).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import shlex
from typing import Any

from dsv3_rl.verl_glue.compose import VerlConfigError, exists, node_at, unknown_key_message

#: Dicts whose keys verl forwards as keyword arguments elsewhere; new keys need ``+``.
OPEN_SUFFIXES = (
    ".override_transformer_config", ".override_optimizer_config", ".override_ddp_config",
    ".override_mcore_model_config", ".engine_kwargs", ".reward_kwargs", ".mbridge_config",
)
OPEN_PREFIXES = ("ray_kwargs.ray_init", "reward.custom_reward_function.reward_kwargs",
                 "custom_reward_function.reward_kwargs", "actor_rollout_ref.model.override_config",
                 "reward.reward_kwargs")  # read by verl's reward managers (dapo: overlong_buffer_cfg, max_resp_len)


def is_open(cfg, key: str) -> bool:
    """May KEY be added with ``+``: is it below a free-form dict of verl's config?"""
    from omegaconf import DictConfig

    parts = key.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if any(prefix.endswith(s) for s in OPEN_SUFFIXES) or prefix in OPEN_PREFIXES:
            return True
        node = node_at(cfg, prefix)
        if isinstance(node, DictConfig) and len(node) == 0 and not node._is_interpolation():
            return True
    return False


def to_overrides(tree: dict, cfg, where: str, error: type[Exception] = VerlConfigError) -> list[str]:
    """Overrides for TREE, a nested dict in verl's key space, against CFG (verl's composed config,
    :func:`dsv3_rl.verl_glue.compose.base_config`): ``key=v`` for existing keys, ``+key=v`` below open
    sections; any other key is an ERROR (the launcher passes its PresetError) naming WHERE and the key, with the
    nearest existing ones."""
    out = []
    for key, value in flatten(tree):
        if exists(cfg, key):
            out.append(f"{key}={hydra_value(value)}")
        elif is_open(cfg, key):
            out.append(f"+{key}={hydra_value(value)}")
        else:
            raise error(unknown_key_message(cfg, key, where))
    return out


_PLAIN = re.compile(r"^[A-Za-z0-9_/][A-Za-z0-9_./-]*$")


@functools.lru_cache(maxsize=1)
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _parses_as_string(text: str) -> bool:
    """Does Hydra read the unquoted TEXT back as exactly that string?"""
    try:
        (o,) = _parser().parse_overrides([f"k={text}"])
        v = o.value()
    except Exception:  # noqa: BLE001
        return False
    return isinstance(v, str) and v == text


def hydra_value(v: Any) -> str:
    """The Hydra override grammar's spelling of V (round-trips through compose; see tests)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            raise ValueError(f"cannot pass {v!r} as a Hydra override value")
        r = repr(v)
        return r if ("." in r or "e" in r) else r + ".0"
    if isinstance(v, str):
        if _PLAIN.match(v) and _parses_as_string(v):
            return v
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot pass a {type(v).__name__} ({v!r}) as a Hydra override value")


def flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves of a nested dict as (dotted key, value); lists and empty dicts are leaves."""
    out: list[tuple[str, Any]] = []
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out += flatten(v, key)
        else:
            out.append((key, v))
    return out


def deep_merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``: dicts merge key by key, anything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def get_dotted(tree: dict, key: str, default: Any = None) -> Any:
    node: Any = tree
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


@dataclasses.dataclass(frozen=True)
class Override:
    """One command-line override: ``prefix`` is '', '+', '++' or '~'."""

    text: str
    key: str
    prefix: str
    value: Any = None

    @property
    def is_group(self) -> bool:
        return "@" in self.key or "/" in self.key


def parse_overrides(items: list[str]) -> list[Override]:
    """Parse with Hydra's own grammar; a syntax error names the override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    out = []
    for text in items:
        try:
            (o,) = parser.parse_overrides([text])
        except OverrideParseException as e:
            raise ValueError(f"override {text!r} is not valid Hydra syntax: {e}") from None
        prefix = "~" if o.is_delete() else "++" if o.is_force_add() else "+" if o.is_add() else ""
        value = None if o.is_delete() else o.value()
        out.append(Override(text=text, key=o.key_or_group, prefix=prefix, value=_plain(value)))
    return out


def _plain(v: Any) -> Any:
    """Hydra's parsed value as plain Python (QuotedString etc. -> str)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def shell_join(argv: list[str]) -> str:
    """A copy-pasteable command line, one override per line for long ones."""
    if len(argv) <= 4:
        return " ".join(shlex.quote(a) for a in argv)
    head = " ".join(shlex.quote(a) for a in argv[:3])
    return head + " \\\n    " + " \\\n    ".join(shlex.quote(a) for a in argv[3:])
