"""Hydra override strings: formatting values, flattening nested dicts, parsing the command line.

verl's config is composed by Hydra in struct mode: ``key=value`` must name an existing key, ``+key=value``
adds one. The launcher writes ``+`` only below the free-form dicts verl forwards to Megatron or vLLM
(``override_transformer_config`` ...) and checks those keys itself (:mod:`dsv3_rl.launch.verl_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import shlex
from typing import Any

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
