"""The one manifest convention for tools that write a checkpoint directory (FP8 cast, converter).

A tool that writes an output directory keeps ``dsv3_manifest.json`` in it: a JSON object with at least
``"tool"`` (the module that wrote it) and ``"complete"`` (true once every output file is in place). It
is written atomically (:func:`dsv3_rl.fs.write_json_atomic`), so a reader sees the previous state or the
new one. Other tools' manifests are not this tool's: :func:`read_manifest` returns None for them.

:func:`refuse_foreign_dir` is the one check that a tool writes only into an empty directory or one of its own
outputs (the FP8 cast, the warm start).

Outputs written before this convention carry ``.dsv3-convert-manifest.json`` (FP8 cast) or
``dsv3_convert.json`` (converter); they are still read, and the next write replaces them.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsv3_rl.errors import Dsv3Error
from dsv3_rl.fs import read_json, write_json_atomic

MANIFEST = "dsv3_manifest.json"
FP8_TOOL = "dsv3_rl.checkpoint.fp8"
CONVERT_TOOL = "dsv3_rl.convert"
# Names of the manifests written before MANIFEST, and the tool that wrote each (those lack "tool").
LEGACY = {".dsv3-convert-manifest.json": FP8_TOOL, "dsv3_convert.json": CONVERT_TOOL}
NAMES = (MANIFEST, *LEGACY)  # every file name a manifest may have (never copied as a model file)


def manifest_path(out_dir: str | os.PathLike) -> Path | None:
    """The manifest file in OUT_DIR (new name first, then the legacy ones), or None."""
    for name in NAMES:
        p = Path(out_dir) / name
        if p.is_file():
            return p
    return None


def read_manifest(out_dir: str | os.PathLike, tool: str) -> dict | None:
    """TOOL's manifest in OUT_DIR; None when OUT_DIR has none or it was written by another tool.
    Raises :class:`dsv3_rl.fs.JsonFileError` (naming the file) when it is not valid JSON."""
    p = manifest_path(out_dir)
    if p is None:
        return None
    data = read_json(p, what="manifest")
    if not isinstance(data, dict):
        return None
    if data.get("tool", LEGACY.get(p.name)) != tool:
        return None
    return data


def refuse_foreign_dir(out_dir: str | os.PathLike, marker: str, error: type[Exception] = Dsv3Error) -> None:
    """Call before writing into OUT_DIR when it holds no output of this tool (no MARKER, the file the tool
    writes into every output of its own): raise ERROR (a :class:`Dsv3Error`) when OUT_DIR is a file or a
    directory that is not empty, so that nothing of the user's is replaced; a missing or empty OUT_DIR is fine."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise error(f"output dir {out_dir} is a file; choose an empty or new dir")
    theirs = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if theirs:
        raise error(f"output dir {out_dir} is not empty ({len(theirs)} entries, e.g. {theirs[0]!r}) and holds no "
                    f"{marker}: not an output of this tool, so nothing in it is replaced; choose an empty or new dir")


def write_manifest(out_dir: str | os.PathLike, tool: str, data: dict) -> Path:
    """Write DATA (with ``"tool": TOOL`` first) as OUT_DIR's manifest and remove a legacy-named one."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST
    write_json_atomic(path, {"tool": tool, **{k: v for k, v in data.items() if k != "tool"}})
    for name in LEGACY:
        (out_dir / name).unlink(missing_ok=True)
    return path
