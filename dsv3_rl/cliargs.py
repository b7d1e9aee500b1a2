"""The shared pieces of every tool's argparse parser (the conventions are in docs/cli.md).

* :func:`alias`: an old spelling of an option (``--local_dir``, ``--overwrite``, ``-o``) still parses, to the same
  action, but ``--help`` lists only the new one;
* :func:`add_out` / :func:`add_force`: ``--out`` for where a tool writes, ``--force`` to replace or redo;
* :func:`add_layout` / :func:`layout`: one ``--layout tp=..,pp=..,ep=..`` syntax, parsed by
  :meth:`dsv3_rl.layout.Layout.parse`;
* :func:`one_path`: an output (or input) given positionally or by flag, not both differently;
* :func:`parse_set`: repeated ``--set KEY=VALUE`` (values parsed as JSON where they are JSON) as a dict;
* :func:`usage_errors`: a ``ValueError``/``KeyError`` about the input becomes a :class:`UsageError`, so the
  ``cli_main`` wrapper prints it as one ``error: ...`` line (exit 2); no tool prints ``error:`` itself.
* :func:`positive_int`, :func:`non_negative_int`, :func:`fraction`, :func:`open_fraction`: argparse ``type=``
  functions, so a flag's type and range are checked where it is read, once (argparse names the flag, exit 2);

:class:`dsv3_rl.errors.UsageError` and :func:`dsv3_rl.errors.env_flag` (the one reader of a yes/no environment
variable) live in the foundation's lowest module, :mod:`dsv3_rl.errors`, which reports errors with them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator

from dsv3_rl.errors import Dsv3Error, UsageError
from dsv3_rl.layout import Layout


def alias(parser: argparse.ArgumentParser, option: str, *old: str) -> None:
    """Make each OLD spelling parse as OPTION without listing it in ``--help`` (docs/cli.md lists them)."""
    action = parser._option_string_actions[option]
    for o in old:
        if o in parser._option_string_actions:
            raise ValueError(f"{parser.prog}: alias {o} is already an option")
        parser._option_string_actions[o] = action


def hidden_aliases(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{old spelling: option}`` of the aliases :func:`alias` added to PARSER (not its subparsers)."""
    return {s: a.option_strings[-1] for s, a in parser._option_string_actions.items() if s not in a.option_strings}


def add_out(parser: argparse.ArgumentParser, *old: str, help: str, **kw) -> argparse.Action:
    """``--out PATH``: where the tool writes. OLD spellings stay as hidden aliases."""
    action = parser.add_argument("--out", help=help, **kw)
    alias(parser, "--out", *old)
    return action


def add_force(parser: argparse.ArgumentParser, *old: str, help: str) -> argparse.Action:
    """``--force``: replace a complete output / redo finished work. OLD spellings stay as hidden aliases."""
    action = parser.add_argument("--force", action="store_true", help=help)
    alias(parser, "--force", *old)
    return action


def layout(text: str) -> Layout:
    """argparse ``type=`` for one layout spec, ``tp=2,pp=2,ep=2`` (any :class:`Layout` field)."""
    try:
        return Layout.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_layout(parser: argparse.ArgumentParser, default: str | None = "tp=1", help: str = "") -> argparse.Action:
    """``--layout tp=..,pp=..,ep=..,etp=..,vpp=..`` (the :class:`dsv3_rl.layout.Layout` fields)."""
    text = "megatron layout, e.g. tp=2,pp=2,ep=2,etp=1 (dsv3_rl.layout.Layout fields)"
    return parser.add_argument("--layout", type=layout, default=None if default is None else Layout.parse(default),
                               metavar="tp=..,pp=..,ep=..", help=f"{help} ({text}; default {default})" if help
                               else f"{text}; default {default}")


def parse_set(items: list[str] | None, flag: str = "--set") -> dict:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``: each value parsed as JSON where it is JSON, else kept as
    text; an item without ``=`` is a UsageError naming it."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def one_path(pos_name: str, pos: str | None, flag_name: str, flag: str | None) -> str:
    """The path given as positional POS_NAME or as FLAG_NAME; both (differing) or neither is refused."""
    if pos and flag and os.path.abspath(pos) != os.path.abspath(flag):
        raise UsageError(f"{pos_name} {pos!r} and {flag_name} {flag!r} disagree; give one of them")
    if not (pos or flag):
        raise UsageError(f"give {pos_name} (or {flag_name})")
    return pos or flag


@contextlib.contextmanager
def usage_errors(*types: type[Exception]) -> Iterator[None]:
    """Re-raise TYPES (default ``ValueError``, ``KeyError``) from the block as :class:`UsageError`."""
    catch: tuple[type[Exception], ...] = types or (ValueError, KeyError)
    try:
        yield
    except Dsv3Error:
        raise
    except catch as e:
        raise UsageError(e.args[0] if isinstance(e, KeyError) and e.args else str(e)) from None


def _number(text: str, kind: type, flag_hint: str):
    try:
        v = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {flag_hint}") from None
    if kind is float and v != v:  # NaN compares false with every bound
        raise argparse.ArgumentTypeError(f"{text!r} is not {flag_hint}")
    return v


def positive_int(text: str) -> int:
    """argparse ``type=`` for an integer >= 1 (argparse names the flag: ``--iters: 0 is not an integer >= 1``)."""
    v = _number(text, int, "an integer >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return v


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for an integer >= 0."""
    v = _number(text, int, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return v


def fraction(text: str) -> float:
    """argparse ``type=`` for a number within [0, 1]."""
    v = _number(text, float, "a number within 0..1")
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number within 0..1")
    return v


def open_fraction(text: str) -> float:
    """argparse ``type=`` for a number strictly between 0 and 1 (a probability threshold that can be crossed)."""
    v = _number(text, float, "a number strictly between 0 and 1")
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number strictly between 0 and 1")
    return v
