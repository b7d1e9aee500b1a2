"""Versioned patch series applied onto pinned backends.

Layout: ``patches/<backend>/<version>/series`` lists patch files in apply order (``#`` comments and
blank lines allowed). Each patch is a DEP-3 style header followed by a ``git diff`` against the
backend's root (paths ``a/megatron/core/...``)::

    Description: one line saying what the patch does
    Why: the symptom it fixes, with the exact error text where there is one
    Upstream-Version: megatron-core 0.16.1
    Forwarded: https://github.com/NVIDIA/Megatron-LM/issues/1699   (or "not forwarded")
    Remove-When: what upstream change makes the patch unnecessary
    Verified-By: tests/unit/test_x.py::test_y
    ---
    diff --git a/... b/...

Operations (all strict, all idempotent):

* ``check``   apply the whole series to a scratch copy of the pristine tree; nothing is touched.
* ``apply``   skip patches already applied (reverse dry run succeeds), apply the rest, or stop at
              the first that does not apply, naming the patch, the upstream file and the hunk.
* ``revert``  reverse-apply in reverse order; the touched files end byte-identical to pristine.
* ``status``  applied / not applied / conflict, per patch, and drift: files where the live tree differs
              from pristine + series (a hand edit outside every hunk); exit 1 on a conflict or drift.
              ``check`` reports drift too.
* ``diff`` / ``new`` / ``refresh``   turn edits in ``backends/<name>-<version>/`` into patches.
* ``table``   regenerate PATCHES.md from the headers; ``lint`` checks series/files/headers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dsv3_rl.backends import (
    BASELINE_TAG,
    REPO_ROOT,
    Backend,
    fetch,
    git,
    has_baseline,
    load_lock,
)
from dsv3_rl.errors import Dsv3Error, cli_main
from dsv3_rl.fs import write_text_atomic

REQUIRED_FIELDS = ("Description", "Why", "Upstream-Version", "Forwarded", "Remove-When", "Verified-By")
OPTIONAL_FIELDS = ("Origin", "Author", "Bug", "Last-Update")
_PATCH_NAME = re.compile(r"^(\d{4})-[a-z0-9][a-z0-9.-]*\.patch$")


class PatchError(Dsv3Error, RuntimeError):
    """A patch or series is malformed or does not apply."""


@dataclasses.dataclass
class Patch:
    backend: Backend
    name: str
    path: Path
    header: dict[str, str]
    diff: str

    @property
    def number(self) -> int:
        return int(self.name[:4])

    def files(self) -> list[str]:
        """Files the diff touches (pre-image paths; new files by their post-image path)."""
        out = []
        for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", self.diff, re.M):
            out.append(m.group(2))
        return out

    def hunks(self, file: str) -> list[tuple[int, str]]:
        """(old start line, hunk header) for each hunk of ``file``."""
        out, current = [], None
        for line in self.diff.splitlines():
            m = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
            if m:
                current = m.group(2)
                continue
            if current == file and line.startswith("@@"):
                hm = re.match(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", line)
                if hm:
                    out.append((int(hm.group(1)), line))
        return out


def parse_patch(backend: Backend, path: Path) -> Patch:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PatchError(f"{path}: not a text patch (byte {e.start} is not UTF-8); a patch is a header and a "
                         f"'git diff' in text") from None
    m = re.search(r"^(diff --git |--- a/)", text, re.M)
    if not m:
        raise PatchError(f"{path}: no diff found (expected a 'diff --git' section after the header)")
    head, diff = text[: m.start()], text[m.start():]
    header: dict[str, str] = {}
    key = None
    for lineno, line in enumerate(head.splitlines(), 1):
        if line.strip() in ("---", ""):
            key = None if line.strip() == "---" else key
            continue
        if line[0] in " \t" and key:
            header[key] += "\n" + line.strip()
            continue
        km = re.match(r"^([A-Za-z][A-Za-z-]*):\s*(.*)$", line)
        if not km:
            raise PatchError(f"{path}:{lineno}: header line is not 'Field: value' nor a continuation: {line!r}")
        key = km.group(1)
        if key not in REQUIRED_FIELDS + OPTIONAL_FIELDS:
            raise PatchError(f"{path}:{lineno}: unknown header field {key!r}; allowed: {', '.join(REQUIRED_FIELDS + OPTIONAL_FIELDS)}")
        header[key] = km.group(2).strip()
    return Patch(backend=backend, name=path.name, path=path, header=header, diff=diff)


def read_series(backend: Backend, root: Path = REPO_ROOT) -> list[str]:
    series = backend.patch_dir(root) / "series"
    if not series.exists():
        raise PatchError(f"{series} does not exist (every pinned backend needs a series file, even an empty one)")
    names = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def lint(backend: Backend, root: Path = REPO_ROOT, headers: bool = True) -> list[Patch]:
    """Series and files agree, names are numbered in order, and (``headers``) every header is
    complete and names tests that exist. Applying needs only the structure; `lint`/CI need all."""
    pdir = backend.patch_dir(root)
    names = read_series(backend, root)
    errors = []
    on_disk = sorted(p.name for p in pdir.glob("*.patch"))
    for n in names:
        if not (pdir / n).is_file():
            errors.append(f"{pdir}/series lists {n}, but {pdir / n} does not exist")
    for n in on_disk:
        if n not in names:
            errors.append(f"{pdir / n} is not listed in {pdir}/series")
    if len(set(names)) != len(names):
        errors.append(f"{pdir}/series lists a patch twice: {sorted(n for n in names if names.count(n) > 1)}")
    numbers = []
    for n in names:
        m = _PATCH_NAME.match(n)
        if not m:
            errors.append(f"{pdir}/series: {n!r} is not named NNNN-lowercase-words.patch")
        else:
            numbers.append(int(m.group(1)))
    if numbers != sorted(numbers) or len(set(numbers)) != len(numbers):
        errors.append(f"{pdir}/series: patch numbers must be unique and increasing in apply order, got {numbers}")
    patches = []
    for n in names:
        if not (pdir / n).is_file():
            continue
        try:
            p = parse_patch(backend, pdir / n)
        except PatchError as e:
            errors.append(str(e))
            continue
        patches.append(p)
        if not headers:
            continue
        missing = [f for f in REQUIRED_FIELDS if not p.header.get(f)]
        if missing:
            errors.append(f"{p.path}: header lacks {', '.join(missing)}")
        want = f"{backend.name} {backend.version}"
        if p.header.get("Upstream-Version") and want not in p.header["Upstream-Version"]:
            errors.append(f"{p.path}: Upstream-Version {p.header['Upstream-Version']!r} does not name {want!r}")
        for ref in re.split(r"[,\s]+", p.header.get("Verified-By", "")):
            if not ref:
                continue
            fpath, _, test = ref.partition("::")
            tf = root / fpath
            if not tf.is_file():
                errors.append(f"{p.path}: Verified-By names {fpath}, which does not exist")
            elif test and not re.search(rf"^\s*(async\s+)?(def|class)\s+{re.escape(test.split('::')[-1].split('[')[0])}\b",
                                        tf.read_text(), re.M):
                errors.append(f"{p.path}: Verified-By names {ref}, but {fpath} has no {test}")
    if errors:
        raise PatchError("patch series problems:\n  " + "\n  ".join(errors))
    return patches


# --------------------------------------------------------------------------- applying

def _git_apply(tree: Path, patch: Patch, *flags: str) -> subprocess.CompletedProcess:
    # --unsafe-paths is not used: every path must stay inside the backend tree.
    return subprocess.run(
        ["git", "apply", "--whitespace=nowarn", *flags, str(patch.path)],
        cwd=tree, capture_output=True, text=True, env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1"},
    )


def _explain_failure(patch: Patch, stderr: str) -> str:
    lines = []
    for m in re.finditer(r"patch failed: (\S+):(\d+)", stderr):
        file, line = m.group(1), int(m.group(2))
        hunks = patch.hunks(file)
        idx = next((i for i, (start, _) in enumerate(hunks) if start == line), None)
        where = f"hunk #{idx + 1} of {len(hunks)} ({hunks[idx][1]})" if idx is not None else f"the hunk at line {line}"
        lines.append(f"{file}: {where} does not apply")
    for m in re.finditer(r"error: (\S+): (No such file or directory|does not exist in index|already exists in working directory)", stderr):
        lines.append(f"{m.group(1)}: {m.group(2)}")
    detail = "; ".join(dict.fromkeys(lines)) or stderr.strip()
    return f"patch {patch.backend.name}/{patch.backend.version}/{patch.name} does not apply: {detail}"


def state(tree: Path, patch: Patch) -> str:
    """'applied', 'not applied' or 'conflict' for one patch against ``tree``."""
    if _git_apply(tree, patch, "--check", "-R").returncode == 0:
        return "applied"
    if _git_apply(tree, patch, "--check").returncode == 0:
        return "not applied"
    return "conflict"


def _require_tree(backend: Backend, root: Path) -> Path:
    tree = backend.path(root)
    if not has_baseline(tree):
        raise PatchError(f"{tree} is missing or has no pristine baseline; run `make backends` first")
    return tree


def apply(backend: Backend, root: Path = REPO_ROOT, quiet: bool = False) -> tuple[int, int]:
    """Apply the series; returns (newly applied, already applied)."""
    patches = lint(backend, root, headers=False)
    tree = _require_tree(backend, root)
    states = dict(status(backend, root))
    new = old = 0
    for p in patches:
        if states[p.name] == "applied":
            old += 1
            if not quiet:
                print(f"[patches] {backend.name}: {p.name}: already applied, skipped")
            continue
        r = _git_apply(tree, p)
        if r.returncode != 0:
            raise PatchError(_explain_failure(p, r.stderr))
        new += 1
        if not quiet:
            print(f"[patches] {backend.name}: {p.name}: applied")
    return new, old


def revert(backend: Backend, root: Path = REPO_ROOT, quiet: bool = False) -> int:
    """Reverse-apply applied patches in reverse order and check the touched files are pristine."""
    patches = lint(backend, root, headers=False)
    tree = _require_tree(backend, root)
    n = 0
    for p in reversed(patches):
        if state(tree, p) != "applied":
            continue
        r = _git_apply(tree, p, "-R")
        if r.returncode != 0:
            raise PatchError(f"reverting {p.name} failed: {r.stderr.strip()}")
        n += 1
        if not quiet:
            print(f"[patches] {backend.name}: {p.name}: reverted")
    touched = sorted({f for p in patches for f in p.files()})
    if touched:
        existing = [f for f in touched if (tree / f).exists()]
        diff = git(tree, "diff", "--name-only", BASELINE_TAG, "--", *touched).stdout.split() if existing else []
        created = [f for f in touched if (tree / f).exists() and git(tree, "cat-file", "-e", f"{BASELINE_TAG}:{f}", check=False).returncode != 0]
        if diff or created:
            raise PatchError(
                f"after reverting, {backend.dirname} still differs from pristine in {sorted(set(diff + created))} "
                f"(edits outside the series?). `git -C {tree} diff {BASELINE_TAG}` shows them; "
                f"`git -C {tree} checkout {BASELINE_TAG} -- <file>` discards them.")
    return n


def _scratch_copy(backend: Backend, root: Path, dest: Path) -> None:
    """Pristine tree (from the baseline commit) into ``dest``."""
    tree = _require_tree(backend, root)
    archive = subprocess.run(["git", "-C", str(tree), "archive", "--format=tar", BASELINE_TAG], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def check(backend: Backend, root: Path = REPO_ROOT) -> int:
    """Dry run: apply the whole series onto a pristine scratch copy. Returns the number of patches."""
    patches = lint(backend, root, headers=False)
    with tempfile.TemporaryDirectory(prefix="dsv3-check-") as td:
        _scratch_copy(backend, root, Path(td))
        for p in patches:
            r = _git_apply(Path(td), p)
            if r.returncode != 0:
                raise PatchError(_explain_failure(p, r.stderr))
    return len(patches)


def status(backend: Backend, root: Path = REPO_ROOT) -> list[tuple[str, str]]:
    """``state`` of each patch, quilt-style: last to first in a copy of the live tree, each applied patch taken out
    before the earlier ones are looked at, so a later patch that edits next to an earlier one's hunk (its context)
    does not make the earlier one a conflict."""
    patches = lint(backend, root, headers=False)
    tree = _require_tree(backend, root)
    states: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dsv3-status-") as td:
        _copy_live(tree, Path(td))
        for p in reversed(patches):
            states[p.name] = state(Path(td), p)
            if states[p.name] == "applied" and _git_apply(Path(td), p, "-R").returncode != 0:
                states[p.name] = "conflict"
    return [(p.name, states[p.name]) for p in patches]


# --------------------------------------------------------------------------- making patches

def _tree_hash(backend: Backend, root: Path, work_tree: Path) -> str:
    """git tree object of ``work_tree`` (honouring the backend's excludes), via a throwaway index."""
    repo = _require_tree(backend, root)
    with tempfile.TemporaryDirectory() as td:
        env = {"GIT_INDEX_FILE": str(Path(td) / "index"), "GIT_WORK_TREE": str(work_tree), "GIT_DIR": str(repo / ".git")}
        git(repo, "add", "-A", ".", env=env)
        return git(repo, "write-tree", env=env).stdout.strip()


def _copy_live(tree: Path, dest: Path) -> None:
    shutil.copytree(tree, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "__pycache__", "build", "*.egg-info", "*.so"))


def diff_against_series(backend: Backend, root: Path = REPO_ROOT, upto: int | None = None) -> str:
    """Diff of the live backend tree against pristine + series[:upto] (default: the whole series).

    With ``upto`` set, patches after it are first reversed in a copy of the live tree, so the result
    is what patch number ``upto`` (0-based index) must contain -- quilt's refresh.
    """
    patches = lint(backend, root, headers=False)
    upto = len(patches) if upto is None else upto
    tree = _require_tree(backend, root)
    with tempfile.TemporaryDirectory(prefix="dsv3-diff-") as td:
        expected, live = Path(td) / "expected", Path(td) / "live"
        expected.mkdir()
        _scratch_copy(backend, root, expected)
        for p in patches[:upto]:
            r = _git_apply(expected, p)
            if r.returncode != 0:
                raise PatchError(_explain_failure(p, r.stderr))
        _copy_live(tree, live)
        for p in reversed(patches[upto + 1:] if upto < len(patches) else []):
            r = _git_apply(live, p, "-R")
            if r.returncode != 0:
                raise PatchError(f"cannot take {p.name} out of the live tree to refresh an earlier patch: {r.stderr.strip()}")
        a, b = _tree_hash(backend, root, expected), _tree_hash(backend, root, live)
        return git(tree, "diff-tree", "-p", "--no-renames", "--full-index", a, b).stdout


def drift(backend: Backend, root: Path = REPO_ROOT) -> list[tuple[str, str]]:
    """Files where the live backend tree differs from pristine + the whole series: ``(file, "+A -R lines")``
    (``binary`` for a binary file). Empty when the tree is exactly what the series makes. A hand edit to
    the installed (editable) backend shows here even when every patch still reports "applied"."""
    tree = _require_tree(backend, root)
    patches = lint(backend, root, headers=False)
    with tempfile.TemporaryDirectory(prefix="dsv3-drift-") as td:
        expected = Path(td) / "expected"
        expected.mkdir()
        _scratch_copy(backend, root, expected)
        for p in patches:
            r = _git_apply(expected, p)
            if r.returncode != 0:
                raise PatchError(_explain_failure(p, r.stderr))
        a, b = _tree_hash(backend, root, expected), _tree_hash(backend, root, tree)
        out = git(tree, "diff-tree", "-r", "--numstat", "--no-renames", a, b).stdout
    rows = []
    for line in out.splitlines():
        added, removed, f = line.split("\t", 2)
        rows.append((f, "binary" if added == "-" else f"+{added} -{removed} lines"))
    return rows


def _report_drift(b: Backend, root: Path) -> int:
    rows = drift(b, root)
    for f, what in rows:
        print(f"  drift        {f} ({what}): differs from pristine + series (an edit outside every patch)")
    if rows:
        print(f"[patches] {b.name} {b.version}: {len(rows)} file(s) drift from pristine + series; "
              f"`dsv3-patches diff {b.name}` (make patch-diff) shows the edits, `dsv3-patches new` turns them into a patch")
    return len(rows)


HEADER_TEMPLATE = """Description: {description}
Why: TODO the symptom this fixes, with the exact error text
Upstream-Version: {upstream}
Forwarded: not forwarded
Remove-When: TODO the upstream change that makes this unnecessary
Verified-By: TODO tests/unit/test_file.py::test_name
---
"""


def new_patch(backend: Backend, name: str, description: str, root: Path = REPO_ROOT) -> Path:
    """Write the live tree's edits (beyond the series) as a new patch and append it to the series."""
    patches = lint(backend, root, headers=False)
    nxt = (patches[-1].number + 1) if patches else 1
    fname = name if name.endswith(".patch") else f"{name}.patch"
    if not _PATCH_NAME.match(fname):
        fname = f"{nxt:04d}-{fname}"
    if not _PATCH_NAME.match(fname):
        raise PatchError(f"patch name {fname!r} must look like NNNN-lowercase-words.patch")
    body = diff_against_series(backend, root)
    if not body.strip():
        raise PatchError(f"{backend.dirname} has no edits beyond the series; nothing to put in {fname}")
    path = backend.patch_dir(root) / fname
    if path.exists():
        raise PatchError(f"{path} already exists; use `refresh` to update it")
    write_text_atomic(path, HEADER_TEMPLATE.format(description=description, upstream=f"{backend.name} {backend.version}") + body)
    series = backend.patch_dir(root) / "series"
    write_text_atomic(series, series.read_text().rstrip("\n") + f"\n{fname}\n" if series.read_text().strip() else f"{fname}\n")
    return path


def refresh_patch(backend: Backend, name: str, root: Path = REPO_ROOT) -> Path:
    """Regenerate an existing patch's diff from the live tree, keeping its header."""
    patches = lint(backend, root, headers=False)
    idx = next((i for i, p in enumerate(patches) if p.name == name), None)
    if idx is None:
        raise PatchError(f"{name} is not in {backend.patch_dir(root)}/series")
    body = diff_against_series(backend, root, upto=idx)
    if not body.strip():
        raise PatchError(f"refreshing {name} would leave it empty; remove it from the series instead")
    p = patches[idx]
    head = p.path.read_text()[: len(p.path.read_text()) - len(p.diff)]
    write_text_atomic(p.path, head + body)
    return p.path


# --------------------------------------------------------------------------- PATCHES.md

def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    m = re.match(r"^(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text).replace("|", "\\|")


def render_table(root: Path = REPO_ROOT) -> str:
    out = [
        "# Patches",
        "",
        "Generated by `make patches-table` from the patch headers; `tests/unit/test_patch_series.py` fails when it is stale.",
        "Each patch file carries the full Why, the exact error text and how it was verified.",
        "",
    ]
    for backend in load_lock(root / "backends.lock").values():
        patches = lint(backend, root)
        out += [f"## {backend.name} {backend.version}", ""]
        if not patches:
            out += ["(no patches yet)", ""]
            continue
        out += ["| # | patch | what | why | forwarded | remove when | verified by |", "|---|---|---|---|---|---|---|"]
        for p in patches:
            h = p.header
            rel = p.path.relative_to(root).as_posix()
            out.append(
                f"| {p.number:04d} | [{p.name}]({rel}) | {_first_sentence(h['Description'])} | {_first_sentence(h['Why'])} "
                f"| {_first_sentence(h['Forwarded'])} | {_first_sentence(h['Remove-When'])} "
                f"| {', '.join('`' + v + '`' for v in h['Verified-By'].split())} |")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI

def _selected(names: list[str] | None, root: Path) -> list[Backend]:
    lock = load_lock(root / "backends.lock")
    if not names:
        return list(lock.values())
    unknown = [n for n in names if n not in lock]
    if unknown:
        raise PatchError(f"unknown backend(s) {unknown}; backends.lock has {sorted(lock)}")
    return [lock[n] for n in names]


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-patches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, help_ in [("fetch", "download, verify and unpack the pinned sdists"),
                       ("check", "dry-run the series on a pristine scratch copy"),
                       ("apply", "apply the series (idempotent)"),
                       ("revert", "reverse-apply; touched files end pristine"),
                       ("status", "applied / not applied / conflict per patch"),
                       ("lint", "series vs files, numbering, headers")]:
        s = sub.add_parser(cmd, help=help_)
        s.add_argument("backends", nargs="*", help="backend names from backends.lock (default: all)")
    s = sub.add_parser("diff", help="print the live tree's edits beyond the series (drift), as a diff")
    s.add_argument("backends", nargs="*", help="backend names from backends.lock (default: all)")
    s = sub.add_parser("new", help="turn the live tree's edits into a new patch appended to the series")
    s.add_argument("backend")
    s.add_argument("name", help="e.g. 0007-my-fix (number optional)")
    s.add_argument("--description", required=True)
    s = sub.add_parser("refresh", help="regenerate one patch's diff from the live tree (header kept)")
    s.add_argument("backend")
    s.add_argument("patch")
    s = sub.add_parser("table", help="write PATCHES.md (or --check that it is current)")
    s.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.cmd == "fetch":
        for b in _selected(args.backends, root):
            fetch(b, root)
    elif args.cmd == "lint":
        for b in _selected(args.backends, root):
            print(f"[patches] {b.name} {b.version}: {len(lint(b, root))} patches, series and headers ok")
    elif args.cmd == "check":
        drifted = 0
        for b in _selected(args.backends, root):
            print(f"[patches] {b.name} {b.version}: all {check(b, root)} patches apply cleanly to pristine")
            if has_baseline(b.path(root)) and all(st == "applied" for _, st in status(b, root)):
                drifted += _report_drift(b, root)  # drift is measured against the whole series, applied
        return 1 if drifted else 0
    elif args.cmd == "apply":
        for b in _selected(args.backends, root):
            new, old = apply(b, root)
            print(f"[patches] {b.name} {b.version}: {new} applied, {old} already applied")
    elif args.cmd == "revert":
        for b in _selected(args.backends, root):
            print(f"[patches] {b.name} {b.version}: {revert(b, root)} reverted; touched files are pristine")
    elif args.cmd == "status":
        bad = 0
        for b in _selected(args.backends, root):
            rows = status(b, root)
            print(f"{b.name} {b.version} ({b.path(root).relative_to(root)})")
            for name, st in rows:
                print(f"  {st:<12} {name}")
                bad += st == "conflict"
            if all(st == "applied" for _, st in rows):  # drift is measured against the whole series
                bad += _report_drift(b, root)
        return 1 if bad else 0
    elif args.cmd == "diff":
        for b in _selected(args.backends, root):
            sys.stdout.write(diff_against_series(b, root))
    elif args.cmd == "new":
        path = new_patch(_selected([args.backend], root)[0], args.name, args.description, root)
        print(f"[patches] wrote {path.relative_to(root)}; fill in its header (Why, Remove-When, Verified-By), then `make patches-table`")
    elif args.cmd == "refresh":
        path = refresh_patch(_selected([args.backend], root)[0], args.patch, root)
        print(f"[patches] refreshed {path.relative_to(root)}")
    elif args.cmd == "table":
        text = render_table(root)
        target = root / "PATCHES.md"
        if args.check:
            if not target.exists() or target.read_text() != text:
                print("PATCHES.md is out of date with the patch headers; run `make patches-table`", file=sys.stderr)
                return 1
            print("[patches] PATCHES.md is current")
        else:
            write_text_atomic(target, text)
            print(f"[patches] wrote {target.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
