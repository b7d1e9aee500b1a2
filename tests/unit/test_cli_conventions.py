"""Every console script follows docs/cli.md (issue 18, item 6).

Each tool's parsers are captured in-process (``parse_known_args`` is stopped before it parses, so nothing
runs) and walked with their subcommands. Checked, for every parser of every console script in pyproject.toml:

* ``--help`` exits 0 and prints ``usage: <script name>``; every subcommand's usage starts with it too;
* long options are kebab-case; an old spelling (``--input_dir``, ``--overwrite``, ``-o``) is a hidden alias
  and is listed in docs/cli.md's table of old spellings (and that table lists nothing that is not one);
* the spellings the conventions replaced are gone: ``--output``/``--local-dir``/``--overwrite``/``-o`` (now
  ``--out``/``--force``), ``--tp``/``--pp``/``--ep``/``--layouts`` (now one ``--layout``), ``--preset`` outside
  ``dsv3-launch`` (a model preset is ``--model``);
* each tool that writes has ``--out`` (and ``--force`` where it refuses to replace or skips finished work);
* no tool prints ``error: ...`` itself (the ``cli_main`` wrapper does, from a ``Dsv3Error``).

Each check has a planted-fault twin: a fake parser or source line with the fault must be flagged.
"""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib
from pathlib import Path

import pytest

from dsv3_rl import cliargs

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "cli.md"
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]

#: parser prog -> the options it must have (it writes; --force where it refuses to replace / skips finished work)
WRITES = {
    "dsv3-fp8-cast cast": {"--out", "--force"},
    "dsv3-fp8-cast quantize": {"--out", "--force"},
    "dsv3-fix-config": {"--out"},
    "dsv3-mini-model": {"--out", "--force"},
    "dsv3-tokenizer": {"--out"},
    "dsv3-prep-data math-lighteval": {"--out"},
    "dsv3-prep-data gsm8k": {"--out"},
    "dsv3-prep-data synthetic": {"--out"},
    "dsv3-convert hf-to-mcore": {"--out", "--force"},
    "dsv3-convert mcore-to-hf": {"--out", "--force"},
    "dsv3-convert verify": {"--out"},
    "dsv3-layout-check": {"--out"},
    "dsv3-warm-start": {"--out"},
    "dsv3-measure-memory": {"--out"},
    "dsv3-consistency run": {"--out"},
    "dsv3-consistency check-faults": {"--out"},
    "dsv3-launch dlc": {"--out"},
}
#: spellings the conventions replaced: visible nowhere (old ones live on only as documented hidden aliases)
REPLACED = {"--output", "--output-dir", "--out-dir", "--local-dir", "--overwrite", "-o", "--tp", "--pp", "--ep",
            "--etp", "--vpp", "--layouts"}
KEBAB = re.compile(r"--[a-z0-9]+(-[a-z0-9]+)*")
SHORT = re.compile(r"-[a-zA-Z]")
ERROR_PRINT = re.compile(r"""print\(\s*f?["']error:""")


class _Captured(BaseException):  # not an Exception: cli_main lets it through
    def __init__(self, parser):
        self.parser = parser


def capture(fn, argv: list[str], monkeypatch) -> list[argparse.ArgumentParser]:
    """The parsers FN(argv) builds, stopped at its first parse (nothing runs)."""

    def stop(self, args=None, namespace=None):
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", stop)
        try:
            fn(argv)
        except _Captured as c:
            return [c.parser]
    return []


def entry(script: str):
    mod, _, attr = SCRIPTS[script].partition(":")
    return getattr(importlib.import_module(mod), attr)


def tool_parsers(script: str, monkeypatch) -> list[argparse.ArgumentParser]:
    """The top-level parser(s) of SCRIPT: the launcher builds one per command."""
    if script == "dsv3-launch":
        from dsv3_rl.launch.cli import COMMANDS

        return [p for cmd in COMMANDS for p in capture(entry(script), [cmd], monkeypatch)]
    return capture(entry(script), [], monkeypatch)


def walk(parser: argparse.ArgumentParser):
    """PARSER and its subcommands' parsers (an aliased subcommand once)."""
    seen: set[int] = set()
    todo = [parser]
    while todo:
        p = todo.pop(0)
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += list(a.choices.values())


def visible(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def documented_aliases(text: str) -> set[tuple[str, str, str]]:
    """``(prog, old spelling, option)`` rows of docs/cli.md's table of old spellings."""
    section = text.split("## Old spellings", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| `([^`]+)` \|", section, re.M))


def problems(script: str, parsers: list[argparse.ArgumentParser], doc_aliases: set) -> list[str]:
    """What breaks docs/cli.md in SCRIPT's parsers."""
    out = []
    for top in parsers:
        for p in walk(top):
            if p.prog != script and not p.prog.startswith(script + " "):
                out.append(f"{p.prog}: prog is not {script!r} (usage would read `usage: {p.prog}`)")
            for s in visible(p):
                if not (KEBAB.fullmatch(s) or SHORT.fullmatch(s)) or s in REPLACED:
                    out.append(f"{p.prog}: option {s} (kebab-case, --out/--force/--layout: docs/cli.md)")
                if s == "--preset" and not script == "dsv3-launch":
                    out.append(f"{p.prog}: --preset names a run preset (dsv3-launch); a model preset is --model")
            for old, opt in cliargs.hidden_aliases(p).items():
                if (p.prog, old, opt) not in doc_aliases:
                    out.append(f"{p.prog}: alias {old} -> {opt} is not in docs/cli.md's table of old spellings")
            missing = WRITES.get(p.prog, set()) - visible(p)
            if missing:
                out.append(f"{p.prog}: writes but has no {sorted(missing)}")
    return out


@pytest.fixture(scope="module")
def doc_text() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def all_parsers(doc_text):
    mp = pytest.MonkeyPatch()
    try:
        return {s: tool_parsers(s, mp) for s in SCRIPTS}
    finally:
        mp.undo()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_names_the_script(script, capsys):
    with pytest.raises(SystemExit) as e:
        rc = entry(script)(["--help"])
        raise SystemExit(rc)  # the launcher prints its own help and returns
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {script} ") or out.startswith(f"usage: {script}\n"), out[:200]


def test_every_script_follows_the_conventions(all_parsers, doc_text):
    assert all(all_parsers.values()), [s for s, p in all_parsers.items() if not p]
    aliases = documented_aliases(doc_text)
    bad = [line for s, ps in all_parsers.items() for line in problems(s, ps, aliases)]
    assert not bad, "\n".join(bad)


def test_docs_list_every_script_and_only_real_aliases(all_parsers, doc_text):
    for script in SCRIPTS:
        assert f"`{script}`" in doc_text, f"docs/cli.md does not list {script}"
    actual = {(p.prog, old, opt) for ps in all_parsers.values() for top in ps for p in walk(top)
              for old, opt in cliargs.hidden_aliases(p).items()}
    assert documented_aliases(doc_text) == actual  # the table lists each old spelling that parses, and only those
    progs = {p.prog for ps in all_parsers.values() for top in ps for p in walk(top)}
    assert set(WRITES) <= progs, set(WRITES) - progs  # a renamed tool cannot slip out of the --out check


def test_old_spellings_still_parse_where_callers_use_them():
    from dsv3_rl.checkpoint import fp8
    from dsv3_rl.data import cli as data_cli

    a = data_cli.build_parser().parse_args(["math_lighteval", "--input_dir", "IN", "--local_dir", "OUT"])
    assert (a.input_dir, a.local_dir) == ("IN", "OUT")
    a = fp8.build_parser().parse_args(["cast", "IN", "--output-bf16-hf-path", "OUT", "--overwrite"])
    assert (a.output_flag, a.force) == ("OUT", True)


def test_no_tool_prints_its_own_error_line():
    files = [f for d in ("dsv3_rl", "bench", "examples", "toolkits") for f in (REPO / d).rglob("*.py")]
    bad = [f"{f.relative_to(REPO)}:{i}" for f in files if f.name != "errors.py"
           for i, line in enumerate(f.read_text().splitlines(), 1) if ERROR_PRINT.search(line)]
    assert not bad, f"raise a Dsv3Error subclass and let cli_main print it: {bad}"


def test_layout_flag_parses_one_syntax():
    ap = argparse.ArgumentParser(prog="x")
    cliargs.add_layout(ap)
    lay = ap.parse_args(["--layout", "tp=2,pp=2,ep=4,etp=1"]).layout
    assert (lay.tp, lay.pp, lay.ep, lay.etp_, lay.sp_) == (2, 2, 4, 1, True)
    assert ap.parse_args([]).layout.tp == 1


# ----------------------------------------------------------------------------- planted-fault twins


def _fake(prog: str = "dsv3-fake", **kw) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, **kw)


def test_twin_snake_case_flag_is_flagged():
    p = _fake()
    p.add_argument("--max_len")
    assert any("--max_len" in b for b in problems("dsv3-fake", [p], set()))
    q = _fake()
    q.add_argument("--max-len")
    assert problems("dsv3-fake", [q], set()) == []  # and its twin passes


def test_twin_undocumented_alias_is_flagged():
    p = _fake()
    p.add_argument("--input-dir")
    cliargs.alias(p, "--input-dir", "--input_dir")
    assert any("not in docs/cli.md" in b for b in problems("dsv3-fake", [p], set()))
    assert problems("dsv3-fake", [p], {("dsv3-fake", "--input_dir", "--input-dir")}) == []


def test_twin_wrong_prog_is_flagged():
    p = _fake(prog="python -m dsv3_rl.checkpoint.fp8")  # the dsv3-fp8-cast bug the issue names
    assert any("prog" in b for b in problems("dsv3-fp8-cast", [p], set()))
    top = _fake(prog="dsv3-fp8-cast")
    top.add_subparsers().add_parser("show")
    assert problems("dsv3-fp8-cast", [top], set()) == []  # twin: the script's name, and its subcommand's
    bad = _fake(prog="dsv3-fp8-cast")
    bad.add_subparsers().add_parser("show", prog="python -m dsv3_rl.checkpoint.fp8 show")
    assert any("prog" in b for b in problems("dsv3-fp8-cast", [bad], set()))


def test_twin_replaced_spellings_are_flagged():
    for flags in (["-o", "--output"], ["--overwrite"], ["--tp"], ["--layouts"], ["--local-dir"]):
        p = _fake()
        p.add_argument(*flags)
        assert problems("dsv3-fake", [p], set()), flags
    p = _fake()
    p.add_argument("--preset")
    assert any("--model" in b for b in problems("dsv3-fake", [p], set()))
    p = _fake(prog="dsv3-launch run")
    p.add_argument("--preset")
    assert problems("dsv3-launch", [p], set()) == []  # a run preset is --preset


def test_twin_writer_without_out_or_force_is_flagged(monkeypatch):
    p = _fake(prog="dsv3-mini-model")
    p.add_argument("--out")
    assert any("--force" in b for b in problems("dsv3-mini-model", [p], set()))
    cliargs.add_force(p, help="replace")
    assert problems("dsv3-mini-model", [p], set()) == []


def test_twin_error_print_is_flagged():
    assert ERROR_PRINT.search('        print(f"error: {e}", file=sys.stderr)')
    assert ERROR_PRINT.search("print('error: no preset')")
    assert not ERROR_PRINT.search('raise UsageError(f"--steps must be >= 1")')


def test_twin_capture_finds_a_real_parser(monkeypatch):
    """The capture sees what the tool builds: a tool with a snake_case flag is caught through it too."""

    def tool(argv):
        ap = argparse.ArgumentParser(prog="dsv3-fake")
        ap.add_argument("--bad_flag")
        ap.parse_args(argv)
        raise AssertionError("the capture must stop before the tool runs")

    parsers = capture(tool, [], monkeypatch)
    assert parsers and any("--bad_flag" in b for b in problems("dsv3-fake", parsers, set()))
