"""Trainer checkpoints a resume can trust: a manifest per checkpoint, verification before a resume, a fallback
to the previous complete checkpoint, and ``max_actor_ckpt_to_keep`` honoured without deleting the only good one.

verl writes ``CKPT_DIR/global_step_N/`` in place (``actor/model|optimizer|extra/dist_ckpt/``, ``actor/ckpt_contents.json``
last per actor, ``data.pt``) and then ``CKPT_DIR/latest_checkpointed_iteration.txt`` (the tracker) *last*: the
tracker is the completion marker. The launcher adds, from outside the trainer:

* :func:`write_manifest`: as soon as the tracker names step N, ``global_step_N/dsv3-manifest.json`` (written
  last, atomically): every file's size, and for megatron/torch dist checkpoints every tensor chunk (name, shape,
  the file and byte range it lives in, and its digest, :func:`dsv3_rl.refit.manifest.digest` over those bytes);
  other files get a whole-file digest.
* :func:`verify`: the manifest against the files (a truncated or changed file is named with the tensor it
  holds); without a manifest (the launcher was killed before writing it) the structure: every byte range that
  the dist checkpoint's ``.metadata`` lists lies inside its file.
* :func:`prepare_resume`: before an attempt resumes, partial directories newer than the tracker are removed
  (an interrupted or disk-full save), the tracker's checkpoint is verified; a damaged one is named, moved aside
  (``global_step_N.damaged``) and the tracker is pointed at the newest checkpoint that verifies, saying so.
  Then ``max_actor_ckpt_to_keep`` is applied to the complete checkpoints (verl forgets its list across
  restarts), never removing the one the resume uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from dsv3_rl.errors import Dsv3Error
from dsv3_rl.fs import write_json_atomic, write_text_atomic

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "dsv3-manifest.json"
STEP_RE = re.compile(r"^global_step_(\d+)$")
#: ``run.verify_checkpoints`` modes: digests (manifest with per-tensor digests), structure (sizes and byte
#: ranges only, no digest: for checkpoints too large to read twice), off (verl loads whatever the tracker names)
VERIFY_MODES = ("digests", "structure", "off")
_DCP_META = ".metadata"


class CheckpointDamaged(Dsv3Error, RuntimeError):
    """A checkpoint fails verification (the message names the file and the tensor)."""


def tracker_step(ckpt_dir: Path) -> int | None:
    """The step verl's tracker names (its last complete checkpoint), or None."""
    try:
        text = (Path(ckpt_dir) / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def set_tracker(ckpt_dir: Path, step: int) -> None:
    write_text_atomic(Path(ckpt_dir) / TRACKER, str(step))


def step_dirs(ckpt_dir: Path) -> dict[int, Path]:
    """``{N: CKPT_DIR/global_step_N}`` for every such directory."""
    out = {}
    if Path(ckpt_dir).is_dir():
        for p in Path(ckpt_dir).iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def _dcp_ranges(d: Path) -> dict[str, tuple[str, int, int, list[int] | None]]:
    """``{tensor chunk name: (file, offset, length, shape)}`` from a torch dist checkpoint's ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(d)).read_metadata()
    shapes = {fqn: list(m.size) for fqn, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    out = {}
    for idx, info in (meta.storage_data or {}).items():
        off = tuple(idx.offset) if idx.offset is not None else ()
        name = idx.fqn + (f"@{list(off)}" if any(off) else "")
        out[name] = (info.relative_path, int(info.offset), int(info.length), shapes.get(idx.fqn))
    return out


def _digest_bytes(data: bytes) -> str:
    import torch

    from dsv3_rl.refit.manifest import digest  # the one digest of the project (refit checksum manifest)

    return digest(torch.frombuffer(bytearray(data), dtype=torch.uint8)) if data else "0" * 32


def _read_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def build_manifest(step_dir: Path, *, digests: bool = True) -> dict:
    """Every file's size; every dist-checkpoint tensor chunk's file, range, shape (and digest)."""
    step_dir = Path(step_dir)
    files, tensors, in_dcp = {}, {}, set()
    for meta in sorted(step_dir.rglob(_DCP_META)):
        d = meta.parent
        for name, (rel, off, length, shape) in _dcp_ranges(d).items():
            f = (d / rel).relative_to(step_dir).as_posix()
            in_dcp.add(f)
            e = {"file": f, "offset": off, "length": length, "shape": shape}
            if digests:
                e["digest"] = _digest_bytes(_read_range(step_dir / f, off, length))
            tensors[f"{d.relative_to(step_dir).as_posix()}:{name}"] = e
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(step_dir).as_posix()
            e = {"size": p.stat().st_size}
            if digests and rel not in in_dcp:
                e["digest"] = _digest_bytes(p.read_bytes())
            files[rel] = e
    return {"format": 1, "step_dir": step_dir.name, "digests": digests, "files": files, "tensors": tensors}


def write_manifest(step_dir: Path, *, digests: bool = True) -> Path:
    """``STEP_DIR/dsv3-manifest.json``, atomically (written after everything it describes)."""
    out = Path(step_dir) / MANIFEST
    write_json_atomic(out, build_manifest(step_dir, digests=digests), indent=None)
    return out


def _tensors_in(man: dict, rel: str, beyond: int | None = None) -> list[str]:
    return [n for n, t in man["tensors"].items() if t["file"] == rel and (beyond is None or t["offset"] + t["length"] > beyond)]


def verify(step_dir: Path, *, digests: bool = True) -> list[str]:
    """Problems of one checkpoint directory, each naming the file (and the tensor); [] when it verifies.
    With a manifest: the files and tensors it lists; without one: the dist checkpoints' byte ranges."""
    step_dir = Path(step_dir)
    mf = step_dir / MANIFEST
    problems: list[str] = []
    if mf.is_file():
        try:
            man = json.loads(mf.read_text())
            man["files"], man["tensors"]  # noqa: B018 - the keys must be there
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [f"{mf}: unreadable manifest ({type(e).__name__}: {e})"]
        for rel, want in man["files"].items():
            p = step_dir / rel
            if not p.is_file():
                t = _tensors_in(man, rel)
                problems.append(f"{p}: missing" + (f" (holds {len(t)} tensor(s), first {t[0]})" if t else ""))
                continue
            size = p.stat().st_size
            if size != want["size"]:
                t = _tensors_in(man, rel, beyond=size)
                problems.append(f"{p}: {size} bytes, the manifest says {want['size']}"
                                + (f" (truncated inside tensor {t[0]})" if t and size < want["size"] else ""))
                continue
            if digests and want.get("digest") and _digest_bytes(p.read_bytes()) != want["digest"]:
                problems.append(f"{p}: contents differ from the manifest (digest)")
        if digests and man.get("digests"):
            for name, t in man["tensors"].items():
                p = step_dir / t["file"]
                if not p.is_file() or p.stat().st_size < t["offset"] + t["length"]:
                    continue  # reported above with the file
                if _digest_bytes(_read_range(p, t["offset"], t["length"])) != t.get("digest"):
                    problems.append(f"{p}: tensor {name} differs from the manifest (digest)")
        # the byte ranges too: a manifest written after the damage (a race with the save) must not vouch for it
        named = {q.split(":", 1)[0] for q in problems}
        return problems + [q for q in _verify_structure(step_dir) if q.split(":", 1)[0] not in named]
    if not list(step_dir.rglob(_DCP_META)):
        return [f"{step_dir}: no manifest ({MANIFEST}) and no dist checkpoint metadata"]
    return _verify_structure(step_dir)


def _verify_structure(step_dir: Path) -> list[str]:
    """Every byte range the dist checkpoints' ``.metadata`` lists lies inside its file (a truncated or deleted shard
    is found even when the manifest was written after the damage)."""
    problems: list[str] = []
    for meta in sorted(step_dir.rglob(_DCP_META)):
        d = meta.parent
        try:
            ranges = _dcp_ranges(d)
        except Exception as e:  # noqa: BLE001 - any unreadable metadata is a damaged checkpoint
            problems.append(f"{meta}: unreadable ({type(e).__name__}: {str(e)[:200]})")
            continue
        for name, (rel, off, length, _) in ranges.items():
            p = d / rel
            if not p.is_file():
                problems.append(f"{p}: missing (holds tensor {name})")
                break
            if p.stat().st_size < off + length:
                problems.append(f"{p}: {p.stat().st_size} bytes, tensor {name} needs bytes {off}..{off + length}")
                break
    return problems


def prepare_resume(ckpt_dir: Path, *, keep: int | None, mode: str = "digests",
                   say: Callable[[str], None] = print) -> int | None:
    """Make CKPT_DIR safe to resume from (module doc); returns the step verl will resume from, or None."""
    ckpt_dir = Path(ckpt_dir)
    dirs = step_dirs(ckpt_dir)
    latest = tracker_step(ckpt_dir)
    for n, d in dirs.items():
        if latest is None or n > latest:  # verl writes the tracker last: this save never completed
            say(f"removing the incomplete checkpoint {d} (an interrupted or failed save; "
                f"{'no complete checkpoint' if latest is None else f'the last complete one is step {latest}'})")
            shutil.rmtree(d, ignore_errors=True)
    dirs = {n: d for n, d in dirs.items() if latest is not None and n <= latest}
    if latest is None or mode == "off":
        return latest
    good = None
    for n in sorted(dirs, reverse=True):
        problems = verify(dirs[n], digests=mode == "digests")
        if not problems:
            good = n
            break
        aside = dirs[n].with_name(f"{dirs[n].name}.damaged")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(dirs[n], aside)
        say(f"checkpoint step {n} is damaged: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
            + f"; moved aside to {aside}")
        del dirs[n]
    if good is None:
        (ckpt_dir / TRACKER).unlink(missing_ok=True)
        say(f"no complete checkpoint left under {ckpt_dir}: the run starts from the beginning")
        return None
    if good != latest:
        set_tracker(ckpt_dir, good)
        say(f"resuming from the previous complete checkpoint, step {good} ({TRACKER} now says {good}, was {latest})")
    if keep and keep > 0:
        for n in [n for n in sorted(dirs) if n != good][: max(0, len(dirs) - keep)]:
            say(f"removing checkpoint step {n} (max_actor_ckpt_to_keep={keep})")
            shutil.rmtree(dirs[n], ignore_errors=True)
    return good
