"""Trainer checkpoints a resume can trust: a manifest per checkpoint, verification before a resume, a fallback
to the previous complete checkpoint, and ``max_actor_ckpt_to_keep`` honoured without deleting the newest good one.
The rule (what is kept, moved aside, deleted) is stated in docs/failure-guarantees.md.

verl writes ``CKPT_DIR/global_step_N/`` in place (``actor/model|optimizer|extra/dist_ckpt/``, ``actor/ckpt_contents.json``
last per actor, ``data.pt``) and then ``CKPT_DIR/latest_checkpointed_iteration.txt`` (the tracker). The launcher adds,
from outside the trainer:

* :func:`write_manifest`: as soon as the tracker names step N, ``global_step_N/dsv3-manifest.json`` (written
  last, atomically): every file's size, and for megatron/torch dist checkpoints every tensor chunk (name, shape,
  the file and byte range it lives in, and its digest, :func:`dsv3_rl.refit.manifest.digest` over those bytes);
  other files get a whole-file digest.
* :func:`record_saves`: the step directories that appear while an attempt runs (``dsv3-saves.json``): the proof
  that a partial one is this run's own interrupted save.
* :func:`verify`: the manifest against the files (a truncated or changed file is named with the tensor it
  holds); without a manifest (the launcher was killed before writing it) the structure: every byte range that
  the dist checkpoint's ``.metadata`` lists lies inside its file.
* :func:`prepare_resume`: before an attempt resumes, completeness is judged by evidence (manifest, tracker, verl's
  completion markers), never by the tracker alone; the tracker is repaired from that evidence; what is incomplete
  or damaged is moved aside (``global_step_N.incomplete`` / ``.damaged``), deleted only when it is this run's own
  partial save. Then ``max_actor_ckpt_to_keep`` is applied to the complete checkpoints older than the one the
  resume uses (verl forgets its list across restarts).
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
    With a manifest: the files and tensors it lists; without one (or an unreadable one): the dist checkpoints'
    byte ranges."""
    step_dir = Path(step_dir)
    problems: list[str] = []
    man, _ = read_manifest(step_dir)  # an unreadable manifest counts as missing: it never condemns the weights
    if man is not None:
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
    for contents in sorted(step_dir.glob("*/ckpt_contents.json")):  # verl's list of what the save holds
        try:
            parts = json.loads(contents.read_text())["contents"]
            dcps = [v["path"] for v in parts.values() if v.get("format") == "megatron_dist_checkpoint"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{contents}: unreadable ({type(e).__name__}: {str(e)[:120]})")
            continue
        problems += [f"{contents.parent / rel}: missing (its {_DCP_META}; {contents.name} lists it)"
                     for rel in dict.fromkeys(dcps) if not (contents.parent / rel / _DCP_META).is_file()]
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


SAVES = "dsv3-saves.json"
"""CKPT_DIR: the step directories that appeared while this launcher's attempts ran (step, inode, attempt): the proof
that a partial one is this run's own interrupted save, which may be deleted; any other is moved aside"""
#: suffixes of directories moved aside (never loaded, never deleted by the launcher)
ASIDE = ("damaged", "incomplete", "unlogged")


def tracker_text(ckpt_dir: Path) -> str | None:
    """The tracker's text as written (None: no tracker)."""
    try:
        return (Path(ckpt_dir) / TRACKER).read_text(errors="replace")
    except OSError:
        return None


def read_manifest(step_dir: Path) -> tuple[dict | None, str]:
    """(the launcher's manifest of STEP_DIR, '') or (None, why: missing, or unreadable with the error)."""
    mf = Path(step_dir) / MANIFEST
    if not mf.is_file():
        return None, "missing"
    try:
        man = json.loads(mf.read_text())
        if not isinstance(man.get("files"), dict) or not isinstance(man.get("tensors"), dict):
            raise KeyError("files/tensors")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"unreadable ({type(e).__name__}: {str(e)[:120]})"
    return man, ""


def completion_markers(step_dir: Path) -> list[str]:
    """What verl writes last in a save that is not in STEP_DIR ([] = all there): each role's ``ckpt_contents.json``
    (rank 0 writes it after every dist-checkpoint write, async ones included) and the trainer's ``data.pt`` (written
    after the roles' saves, just before the tracker)."""
    d = Path(step_dir)
    missing = [f"{role}/ckpt_contents.json" for role in ("actor", "critic")
               if (d / role).is_dir() and not (d / role / "ckpt_contents.json").is_file()]
    if not (d / "data.pt").is_file():
        missing.append("data.pt")
    if not (d / "actor").is_dir():
        missing.insert(0, "actor/")
    return missing


def step_inodes(ckpt_dir: Path) -> dict[int, int]:
    """``{N: inode of CKPT_DIR/global_step_N}``: a directory by identity, not by name."""
    out = {}
    for n, d in step_dirs(ckpt_dir).items():
        try:
            out[n] = d.stat().st_ino
        except OSError:
            continue
    return out


def record_saves(ckpt_dir: Path, before: dict[int, int], attempt: str) -> dict[int, int]:
    """Record in ``CKPT_DIR/dsv3-saves.json`` every step directory that is not in BEFORE (``{step: inode}`` at the
    attempt's start): saves this run's attempt ATTEMPT began. Returns the directories now there (``{step: inode}``)."""
    ckpt_dir = Path(ckpt_dir)
    now = step_inodes(ckpt_dir)
    new = {n: ino for n, ino in now.items() if before.get(n) != ino}
    if new:
        led = _saves(ckpt_dir)
        if any(led.get(str(n), {}).get("ino") != ino for n, ino in new.items()):
            led.update({str(n): {"ino": ino, "attempt": attempt} for n, ino in new.items()})
            write_json_atomic(ckpt_dir / SAVES, led, indent=None)
    return now


def _saves(ckpt_dir: Path) -> dict:
    try:
        led = json.loads((Path(ckpt_dir) / SAVES).read_text())
        return led if isinstance(led, dict) else {}
    except (OSError, ValueError):
        return {}


def _forget_saves(ckpt_dir: Path, keep: set[int]) -> None:
    """Drop the ledger's entries of steps not in KEEP (handled or gone: an inode number is reused)."""
    led = _saves(ckpt_dir)
    if any(int(k) not in keep for k in led if k.isdigit()) or any(not k.isdigit() for k in led):
        write_json_atomic(Path(ckpt_dir) / SAVES, {k: v for k, v in led.items() if k.isdigit() and int(k) in keep},
                          indent=None)


def _own_save(ckpt_dir: Path, n: int, d: Path) -> bool:
    """Whether D is a save this run's launcher saw begin (the same directory: same step, same inode)."""
    try:
        return _saves(ckpt_dir).get(str(n), {}).get("ino") == d.stat().st_ino
    except (OSError, AttributeError):
        return False


def move_aside(d: Path, why: str) -> Path:
    """Rename step directory D to ``D.WHY`` (``.WHY.2``, ... when taken): out of verl's and the launcher's sight,
    nothing deleted."""
    aside = d.with_name(f"{d.name}.{why}")
    k = 2
    while aside.exists():
        aside = d.with_name(f"{d.name}.{why}.{k}")
        k += 1
    os.replace(d, aside)
    return aside


def _tracker_state(ckpt_dir: Path) -> tuple[int | None, str]:
    """(the step the tracker names, '') or (None, what is wrong with it)."""
    text = tracker_text(ckpt_dir)
    if text is None:
        return None, "is missing"
    if not text.strip():
        return None, "is empty"
    if not text.strip().isdigit():
        return None, f"is unreadable ({text.strip()[:40]!r})"
    return int(text.strip()), ""


def prepare_resume(ckpt_dir: Path, *, keep: int | None, mode: str = "digests",
                   say: Callable[[str], None] = print) -> int | None:
    """Make CKPT_DIR safe to resume from (docs/failure-guarantees.md); returns the step verl will resume from, or None.

    Completeness is decided by evidence, newest step first: the launcher's manifest (written only after verl's
    tracker named the step), else the tracker naming this step or a later one, else verl's completion markers
    (:func:`completion_markers`); a complete step must then verify (``mode``). The tracker is repaired to the
    newest complete step that verifies when it is missing, empty, unreadable, behind or ahead. A step without
    evidence is incomplete: deleted when this run's launcher saw the save begin (:data:`SAVES`), else moved aside
    (``.incomplete``); a complete one that fails verification is moved aside (``.damaged``). ``keep``
    (``max_actor_ckpt_to_keep``) deletes only complete steps older than the newest KEEP, never the resumed one."""
    ckpt_dir = Path(ckpt_dir)
    dirs = step_dirs(ckpt_dir)
    if (ckpt_dir / SAVES).is_file():
        _forget_saves(ckpt_dir, set(dirs))
    latest, bad_tracker = _tracker_state(ckpt_dir)
    good, how = None, ""
    for n in sorted(dirs, reverse=True):
        d = dirs[n]
        man, man_why = read_manifest(d)
        markers = completion_markers(d)
        if man is None and (latest is None or n > latest) and markers:
            where = f"the last complete one is step {latest}" if latest is not None else f"{TRACKER} {bad_tracker}"
            if _own_save(ckpt_dir, n, d):
                say(f"removing the incomplete checkpoint {d} (an interrupted or failed save of this run: no "
                    f"{markers[0]}; {where})")
                shutil.rmtree(d, ignore_errors=True)
            else:
                aside = move_aside(d, "incomplete")
                say(f"checkpoint step {n} is incomplete (no {markers[0]}, no {MANIFEST}; {where}): moved aside to "
                    f"{aside}")
            del dirs[n]
            _forget_saves(ckpt_dir, set(dirs))
            continue
        if good is not None:
            continue  # older steps: kept as they are (verified when they are needed)
        problems = verify(d, digests=mode == "digests") if mode != "off" else []
        if problems:
            aside = move_aside(d, "damaged")
            say(f"checkpoint step {n} is damaged: {problems[0]}"
                + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "") + f"; moved aside to {aside}")
            del dirs[n]
            continue
        good = n
        if mode == "off":
            how = ""
        elif man is None:
            how = (f"its {MANIFEST} is {man_why}" + (" (treated as missing)" if man_why != "missing" else ""))
        elif mode == "digests" and not man.get("digests"):
            how = f"its {MANIFEST} has no digests"
        elif mode == "structure":
            how = "run.verify_checkpoints=structure"
        evidence = ("its manifest" if man is not None else f"{TRACKER}" if latest is not None and n <= latest
                    else "verl's completion markers (ckpt_contents.json, data.pt) and its byte ranges")
    if good is None:
        if latest is not None or bad_tracker != "is missing":
            (ckpt_dir / TRACKER).unlink(missing_ok=True)
        if dirs or bad_tracker != "is missing":
            say(f"no complete checkpoint left under {ckpt_dir}: the run starts from the beginning")
        return None
    if good != latest:
        set_tracker(ckpt_dir, good)
        if latest is None:
            say(f"{TRACKER} {bad_tracker}: step {good} is the newest complete checkpoint (by {evidence}); "
                f"{TRACKER} now says {good}")
        elif good > latest:
            say(f"{TRACKER} says {latest} but step {good} is complete (by {evidence}): resuming from step {good} "
                f"({TRACKER} now says {good})")
        else:
            say(f"resuming from the previous complete checkpoint, step {good} ({TRACKER} now says {good}, was {latest})")
    if how:
        say(f"resuming step {good} without digests: {how}; its files' byte ranges verify, a changed byte would "
            f"not be seen")
    if keep and keep > 0:
        for n in [n for n in sorted(dirs) if n < good][: max(0, len(dirs) - keep)]:
            say(f"removing checkpoint step {n} (max_actor_ckpt_to_keep={keep}; step {good} is the newest complete)")
            shutil.rmtree(dirs[n], ignore_errors=True)
    return good
