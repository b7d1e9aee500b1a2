"""The pinned-backend and patch-series machinery, on a throwaway fake backend and on the real series."""

from __future__ import annotations

import difflib
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dsv3_rl import patching
from dsv3_rl.backends import BackendError, HashMismatchError, fetch, load_lock
from dsv3_rl.fs import sha256_file

REPO = Path(__file__).resolve().parents[2]

ORIGINAL = "def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x * 2\n\n\ndef h(x):\n    return x - 3\n"

PATCH_TEMPLATE = """Description: {desc}
Why: a test needs it.
Upstream-Version: fakepkg 1.0
Forwarded: not forwarded
Remove-When: never
Verified-By: tests/unit/test_patch_series.py::test_apply_is_idempotent_and_revert_restores_pristine_bytes
---
{diff}"""

def _diff(old: str, new: str, path: str = "fakepkg/mod.py") -> str:
    lines = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}", n=3)
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


DIFF_F = _diff(ORIGINAL, ORIGINAL.replace("return x + 1", "return x + 100"))
DIFF_H = _diff(ORIGINAL, ORIGINAL.replace("return x - 3", "return x - 300"))

DIFF_NEWFILE = """diff --git a/fakepkg/extra.py b/fakepkg/extra.py
new file mode 100644
--- /dev/null
+++ b/fakepkg/extra.py
@@ -0,0 +1 @@
+EXTRA = True
"""


def _make_sdist(path: Path) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in {"fakepkg-1.0/fakepkg/mod.py": ORIGINAL, "fakepkg-1.0/fakepkg/__init__.py": ""}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.fixture
def fake(tmp_path):
    """A repository root with one pinned fake backend and a two-patch series, fetched."""
    root = tmp_path / "repo"
    (root / "backends").mkdir(parents=True)
    sdist = tmp_path / "fakepkg-1.0.tar.gz"
    digest = _make_sdist(sdist)
    (root / "backends.lock").write_text(f'[fakepkg]\nversion = "1.0"\nsha256 = "{digest}"\n')
    # what `pip download fakepkg==1.0 --no-deps --no-binary :all:` would have left in the cache
    (root / "backends" / ".cache").mkdir()
    shutil.copy(sdist, root / "backends" / ".cache" / "fakepkg-1.0.tar.gz")
    pdir = root / "patches" / "fakepkg" / "1.0"
    pdir.mkdir(parents=True)
    (pdir / "0001-bump-f.patch").write_text(PATCH_TEMPLATE.format(desc="Bump f.", diff=DIFF_F))
    (pdir / "0002-add-extra.patch").write_text(PATCH_TEMPLATE.format(desc="Add extra.", diff=DIFF_NEWFILE))
    (pdir / "series").write_text("# fake series\n0001-bump-f.patch\n0002-add-extra.patch\n")
    # Verified-By must name a real file: point the fake root's tests at this file.
    (root / "tests" / "unit").mkdir(parents=True)
    (root / "tests" / "unit" / "test_patch_series.py").write_text(
        "def test_apply_is_idempotent_and_revert_restores_pristine_bytes():\n    pass\n")
    backend = load_lock(root / "backends.lock")["fakepkg"]
    fetch(backend, root, quiet=True)
    return root, backend


def _tree_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and ".git" not in p.parts}


def test_fetch_verifies_hash_and_records_baseline(fake):
    root, backend = fake
    tree = backend.path(root)
    assert (tree / "fakepkg" / "mod.py").read_text() == ORIGINAL
    log = subprocess.run(["git", "-C", str(tree), "log", "--format=%s"], capture_output=True, text=True).stdout
    assert log.startswith("pristine fakepkg 1.0")
    fetch(backend, root, quiet=True)  # rerun: a no-op
    assert (tree / "fakepkg" / "mod.py").read_text() == ORIGINAL


def test_hash_mismatch_names_file_and_both_hashes(fake, tmp_path):
    root, backend = fake
    cached = root / "backends" / ".cache" / backend.sdist
    cached.write_bytes(cached.read_bytes() + b"tampered")
    bad = sha256_file(cached)
    other_root = tmp_path / "other"
    (other_root / "backends" / ".cache").mkdir(parents=True)
    (other_root / "backends" / ".cache" / backend.sdist).write_bytes(cached.read_bytes())
    with pytest.raises(HashMismatchError) as e:
        fetch(backend, other_root, quiet=True)
    msg = str(e.value)
    assert backend.sdist in msg and backend.sha256 in msg and bad in msg


@pytest.mark.parametrize("table,match", [
    ('version = "1.0"\nsha256 = "%s"\nurl = "https://example.org/fakepkg-1.0.tar.gz"',
     r"\[fakepkg\] has unknown key\(s\) \['url'\]; allowed: \['version', 'sha256', 'git_url', 'git_tag', 'git_commit'\]"),
    ('version = "1.0"', r"\[fakepkg\] is missing \['sha256'\]"),
    ('version = "1.0"\nsha256 = "abc"', r"\[fakepkg\] sha256='abc' is not a sha256"),
])
def test_lock_schema_errors_are_one_line_naming_the_key(tmp_path, table, match):
    ok = tmp_path / "ok.lock"
    ok.write_text('[fakepkg]\nversion = "1.0"\nsha256 = "%s"\n' % ("0" * 64))
    assert load_lock(ok)["fakepkg"].sdist == "fakepkg-1.0.tar.gz"  # twin: a clean table loads
    bad = tmp_path / "bad.lock"
    bad.write_text("[fakepkg]\n" + (table % ("0" * 64) if "%s" in table else table) + "\n")
    with pytest.raises(BackendError, match=match) as e:
        load_lock(bad)
    assert "\n" not in str(e.value)


def test_the_real_lock_names_packages_not_hosts():
    text = (REPO / "backends.lock").read_text()
    assert "://" not in "".join(ln.split("#")[0] for ln in text.splitlines() if not ln.startswith("git_url"))
    lock = load_lock(REPO / "backends.lock")
    assert {b.sdist for b in lock.values()} == {"megatron_core-0.16.1.tar.gz", "verl-0.9.1.tar.gz"}


def test_fetch_downloads_by_name_and_version_with_pip_and_checks_the_hash(tmp_path, monkeypatch):
    """fetch runs `pip download NAME==VERSION --no-deps --no-binary :all:` (faked here: it copies a local sdist)
    and checks the hash; a download whose bytes differ from the lock stops with both hashes."""
    from dsv3_rl import backends

    sdist = tmp_path / "src" / "fake_pkg-1.0.tar.gz"
    sdist.parent.mkdir()
    digest = _make_sdist(sdist)
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        shutil.copy(sdist, Path(cmd[cmd.index("-d") + 1]) / sdist.name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(backends.subprocess, "run", fake_pip)
    b = backends.Backend(name="fake-pkg", version="1.0", sha256=digest)
    got = backends._download(b, tmp_path)
    assert calls[0][2:] == ["pip", "download", "--no-deps", "--no-binary", ":all:", "-d", calls[0][8], "fake-pkg==1.0"]
    assert got == tmp_path / "fake_pkg-1.0.tar.gz" and sha256_file(got) == digest
    monkeypatch.undo()
    monkeypatch.setattr(backends.subprocess, "run", fake_pip)
    root = tmp_path / "root"
    (root / "backends").mkdir(parents=True)
    wrong = backends.Backend(name="fake-pkg", version="1.0", sha256="1" * 64)  # twin: the pin differs
    with pytest.raises(HashMismatchError, match=f"pins {'1' * 64}, the file has {digest}"):
        fetch(wrong, root, quiet=True)
    assert not wrong.path(root).exists()


def test_apply_is_idempotent_and_revert_restores_pristine_bytes(fake):
    root, backend = fake
    tree = backend.path(root)
    pristine = _tree_bytes(tree)
    assert patching.apply(backend, root, quiet=True) == (2, 0)
    once = _tree_bytes(tree)
    assert "return x + 100" in (tree / "fakepkg" / "mod.py").read_text() and (tree / "fakepkg" / "extra.py").exists()
    assert patching.apply(backend, root, quiet=True) == (0, 2)
    assert _tree_bytes(tree) == once
    assert [s for _, s in patching.status(backend, root)] == ["applied", "applied"]
    assert patching.revert(backend, root, quiet=True) == 2
    assert _tree_bytes(tree) == pristine
    assert [s for _, s in patching.status(backend, root)] == ["not applied", "not applied"]


def test_patch_editing_next_to_an_earlier_one_keeps_it_applied(fake):
    """A later patch that edits inside an earlier patch's context: status and a second apply still see the earlier
    one as applied (the patches are looked at last to first, each taken out of a copy first); looked at alone in
    the live tree (the twin) the earlier one reads as a conflict."""
    root, backend = fake
    tree = backend.path(root)
    bumped = ORIGINAL.replace("return x + 1", "return x + 100")
    pdir = backend.patch_dir(root)
    (pdir / "0003-rename-g-arg.patch").write_text(PATCH_TEMPLATE.format(
        desc="Rename g's argument.", diff=_diff(bumped, bumped.replace("def g(x):\n    return x * 2", "def g(y):\n    return y * 2"))))
    (pdir / "series").write_text((pdir / "series").read_text() + "0003-rename-g-arg.patch\n")
    assert patching.apply(backend, root, quiet=True) == (3, 0)
    assert [s for _, s in patching.status(backend, root)] == ["applied"] * 3
    assert patching.apply(backend, root, quiet=True) == (0, 3)
    first = patching.lint(backend, root, headers=False)[0]
    assert patching.state(tree, first) == "conflict"


def test_check_is_a_dry_run_on_pristine(fake):
    root, backend = fake
    tree = backend.path(root)
    before = _tree_bytes(tree)
    assert patching.check(backend, root) == 2
    assert _tree_bytes(tree) == before


def test_conflicting_patch_names_patch_file_and_hunk(fake):
    root, backend = fake
    tree = backend.path(root)
    # Upstream drifted under the second hunk's context: h() changed.
    mod = tree / "fakepkg" / "mod.py"
    mod.write_text(ORIGINAL.replace("return x - 3", "return x - 4"))
    pdir = backend.patch_dir(root)
    (pdir / "0003-change-h.patch").write_text(PATCH_TEMPLATE.format(desc="Change h.", diff=DIFF_H))
    (pdir / "series").write_text((pdir / "series").read_text() + "0003-change-h.patch\n")
    with pytest.raises(patching.PatchError) as e:
        patching.apply(backend, root, quiet=True)
    msg = str(e.value)
    assert "0003-change-h.patch" in msg and "fakepkg/mod.py" in msg and "hunk #1 of 1" in msg
    assert dict(patching.status(backend, root))["0003-change-h.patch"] == "conflict"


def test_series_entry_without_file_and_file_not_in_series(fake):
    root, backend = fake
    pdir = backend.patch_dir(root)
    (pdir / "series").write_text("0001-bump-f.patch\n0002-add-extra.patch\n0009-missing.patch\n")
    (pdir / "0005-stray.patch").write_text(PATCH_TEMPLATE.format(desc="Stray.", diff=DIFF_H))
    with pytest.raises(patching.PatchError) as e:
        patching.lint(backend, root)
    msg = str(e.value)
    assert "lists 0009-missing.patch" in msg and "0005-stray.patch is not listed" in msg


def test_header_must_be_complete_and_name_real_tests(fake):
    root, backend = fake
    p = backend.patch_dir(root) / "0001-bump-f.patch"
    p.write_text(p.read_text().replace("Remove-When: never\n", "").replace(
        "test_apply_is_idempotent_and_revert_restores_pristine_bytes", "test_does_not_exist"))
    with pytest.raises(patching.PatchError) as e:
        patching.lint(backend, root)
    assert "lacks Remove-When" in str(e.value) and "has no test_does_not_exist" in str(e.value)


def test_new_and_refresh_turn_edits_into_patches(fake):
    root, backend = fake
    tree = backend.path(root)
    patching.apply(backend, root, quiet=True)
    mod = tree / "fakepkg" / "mod.py"
    mod.write_text(mod.read_text().replace("return x * 2", "return x * 20"))
    path = patching.new_patch(backend, "scale-g", "Scale g.", root)
    assert path.name == "0003-scale-g.patch"
    assert "return x * 20" in path.read_text() and "return x + 100" not in path.read_text()
    assert patching.read_series(backend, root)[-1] == "0003-scale-g.patch"
    # refresh an earlier patch from the live tree, keeping its header
    mod.write_text(mod.read_text().replace("return x + 100", "return x + 1000"))
    p1 = patching.refresh_patch(backend, "0001-bump-f.patch", root)
    assert "return x + 1000" in p1.read_text() and p1.read_text().startswith("Description: Bump f.")
    patching.revert(backend, root, quiet=True)
    assert patching.check(backend, root) == 3


def test_real_series_is_consistent_and_patches_md_current():
    for backend in load_lock(REPO / "backends.lock").values():
        patching.lint(backend, REPO)
    assert (REPO / "PATCHES.md").read_text() == patching.render_table(REPO), "run `make patches-table`"


def test_real_series_checks_on_pristine_and_is_applied():
    for b in load_lock(REPO / "backends.lock").values():  # not fetched FAILS, never skips
        assert b.path(REPO).exists(), f"{b.path(REPO)} is missing: {b.name} is not fetched; run `make setup`"
    for backend in load_lock(REPO / "backends.lock").values():
        patching.check(backend, REPO)
        states = patching.status(backend, REPO)
        assert all(s == "applied" for _, s in states), states


def test_cli_errors_exit_nonzero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsv3_rl.patching", "status", "no-such-backend"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "unknown backend(s) ['no-such-backend']" in r.stderr
