"""Pinned upstream backends: read ``backends.lock``, fetch sdists by hash, unpack with a pristine baseline.

``backends.lock`` (TOML) has one table per backend, named by its package name on the index::

    [megatron-core]
    version = "0.16.1"
    sha256 = "..."                                   # of the sdist megatron_core-0.16.1.tar.gz
    git_url = "..."; git_tag = "..."; git_commit = "..."   # provenance, optional

The schema is :class:`LockEntry` (pydantic, unknown keys forbidden); an error is one line naming the
table, the key and the allowed keys. No registry host is written down: ``fetch`` runs
``pip download NAME==VERSION --no-deps --no-binary :all:`` (so pip's own index, mirror and proxy
settings apply), verifies the sha256 (:class:`HashMismatchError` names the file and both hashes),
unpacks it into ``backends/<name>-<version>/`` and commits the pristine tree into a git repository
inside that folder, so that patch application, revert and refresh are exact. A verified sdist is
kept in ``backends/.cache/``; re-running is a no-op once the baseline exists.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

import pydantic

from dsv3_rl.errors import Dsv3Error
from dsv3_rl.fs import sha256_file

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINE_TAG = "pristine"
# Build outputs an editable install leaves in a backend tree; kept out of `git status`.
_BACKEND_EXCLUDES = ["build/", "*.egg-info/", "__pycache__/", "*.so", "*.pyc", ".pytest_cache/", "*.orig", "*.rej"]


class BackendError(Dsv3Error, RuntimeError):
    """A backend could not be fetched, verified or unpacked."""


class HashMismatchError(BackendError):
    def __init__(self, path: Path, expected: str, actual: str):
        super().__init__(
            f"sha256 mismatch for {path.name}: backends.lock pins {expected}, the file has {actual}. "
            f"Delete {path} and run `make backends` again; if upstream re-released the file, "
            f"update backends.lock deliberately."
        )
        self.path, self.expected, self.actual = path, expected, actual


class LockEntry(pydantic.BaseModel):
    """One ``[name]`` table of ``backends.lock``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    version: str
    sha256: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")
    git_url: str = ""
    git_tag: str = ""
    git_commit: str = ""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    version: str
    sha256: str
    git_url: str = ""
    git_tag: str = ""
    git_commit: str = ""

    @property
    def sdist(self) -> str:
        """The sdist's file name (PEP 625: normalised name, version, ``.tar.gz``)."""
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}.tar.gz"

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.version}"

    def path(self, root: Path = REPO_ROOT) -> Path:
        return root / "backends" / self.dirname

    def patch_dir(self, root: Path = REPO_ROOT) -> Path:
        return root / "patches" / self.name / self.version


def _lock_error(path: Path, name: str, e: pydantic.ValidationError) -> BackendError:
    """The first problem of a ``[name]`` table, on one line, naming the key (and the allowed keys)."""
    allowed = list(LockEntry.model_fields)
    err = e.errors()[0]
    key = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        unknown = sorted(str(x["loc"][0]) for x in e.errors() if x["type"] == "extra_forbidden")
        return BackendError(f"{path}: [{name}] has unknown key(s) {unknown}; allowed: {allowed}")
    if err["type"] == "missing":
        missing = sorted(str(x["loc"][0]) for x in e.errors() if x["type"] == "missing")
        return BackendError(f"{path}: [{name}] is missing {missing} (keys: {allowed})")
    if err["type"] == "string_pattern_mismatch":
        return BackendError(f"{path}: [{name}] {key}={err['input']!r} is not a sha256 (64 lowercase hex digits)")
    return BackendError(f"{path}: [{name}] {key}={err.get('input')!r}: {err['msg']}")


def load_lock(path: Path | None = None) -> dict[str, Backend]:
    """Parse ``backends.lock``; unknown or missing keys are errors naming the table and key."""
    path = path or REPO_ROOT / "backends.lock"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BackendError(f"{path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise BackendError(f"{path}: not valid TOML: {e}") from None
    backends = {}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise BackendError(f"{path}: top-level key {name!r} must be a table [{name}]")
        try:
            entry = LockEntry.model_validate(table)
        except pydantic.ValidationError as e:
            raise _lock_error(path, name, e) from None
        backends[name] = Backend(name=name, **entry.model_dump())
    return backends


def verify(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise HashMismatchError(path, expected, actual)


def pip_download_cmd(backend: Backend, dest: Path) -> list[str]:
    """``pip download NAME==VERSION --no-deps --no-binary :all:`` into DEST (pip's index settings apply)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest),
            f"{backend.name}=={backend.version}"]


def _download(backend: Backend, dest_dir: Path) -> Path:
    """The sdist of BACKEND into DEST_DIR/<sdist> (not yet verified)."""
    target = dest_dir / backend.sdist
    with tempfile.TemporaryDirectory(dir=dest_dir) as td:
        cmd = pip_download_cmd(backend, Path(td))
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(td).glob("*.tar.gz"))
        if r.returncode != 0 or len(got) != 1:
            tail = f"{r.stdout[-1500:]}{r.stderr[-1500:]}".strip().replace("\n", " | ")
            raise BackendError(f"could not download {backend.name}=={backend.version} (sdist): {' '.join(cmd[2:])} "
                               f"exited {r.returncode} with {[p.name for p in got]}: {tail}")
        os.replace(got[0], target)
    return target


def git(repo: Path, *args: str, check: bool = True, input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "GIT_AUTHOR_NAME": "dsv3-rl", "GIT_AUTHOR_EMAIL": "dsv3-rl@localhost",
                "GIT_COMMITTER_NAME": "dsv3-rl", "GIT_COMMITTER_EMAIL": "dsv3-rl@localhost",
                "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, input=input, env=full_env)
    if check and r.returncode != 0:
        raise BackendError(f"git {' '.join(args)} in {repo} failed:\n{r.stderr.strip()}")
    return r


def has_baseline(path: Path) -> bool:
    return (path / ".git").is_dir() and git(path, "rev-parse", "-q", "--verify", f"refs/tags/{BASELINE_TAG}", check=False).returncode == 0


def _safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    tar.extractall(dest, filter="data")


def fetch(backend: Backend, root: Path = REPO_ROOT, cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Make ``backends/<name>-<version>/`` exist with a pristine baseline. Idempotent."""
    dest = backend.path(root)
    say = (lambda *a: None) if quiet else (lambda *a: print("[backends]", *a))
    if has_baseline(dest):
        say(f"{backend.dirname}: present (baseline {BASELINE_TAG})")
        return dest
    if dest.exists():
        raise BackendError(
            f"{dest} exists but has no pristine baseline (an interrupted unpack?). Remove it and run `make backends`.")
    cache_dir = cache_dir or root / "backends" / ".cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdist = cache_dir / backend.sdist
    if not sdist.exists():
        say(f"downloading {backend.sdist}")
        sdist = _download(backend, cache_dir)
    verify(sdist, backend.sha256)
    say(f"{backend.sdist}: sha256 ok")

    # Unpack into a temporary sibling, commit the baseline, then rename: never a half tree.
    tmp = Path(tempfile.mkdtemp(prefix=f".{backend.dirname}.", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tar:
            _safe_extract(tar, tmp)
        tops = [p for p in tmp.iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise BackendError(f"{backend.sdist}: expected one top-level folder, found {[p.name for p in tops]}")
        tree = tops[0]
        git(tree, "init", "-q")
        (tree / ".git" / "info").mkdir(parents=True, exist_ok=True)
        (tree / ".git" / "info" / "exclude").write_text("\n".join(_BACKEND_EXCLUDES) + "\n")
        git(tree, "add", "-A", ".")
        git(tree, "commit", "-q", "--no-verify", "-m", f"pristine {backend.name} {backend.version} ({backend.sdist}, sha256 {backend.sha256})")
        git(tree, "tag", BASELINE_TAG)
        os.replace(tree, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"{backend.dirname}: unpacked to {dest.relative_to(root)} with baseline {BASELINE_TAG}")
    return dest
