"""Run a patched backend's own upstream CPU tests and compare with the pristine baseline.

    python -m dsv3_rl.backend_tests verl                 # patched tree vs recorded baseline
    python -m dsv3_rl.backend_tests verl --record        # record the baseline from pristine sources

verl's sdist ships ``tests/``; its ``*_on_cpu.py`` files are the CPU suite. Each file runs in its
own pytest process from the backend's root (several start Ray, which cannot be re-initialised in
one process). The baseline (tests/assets/backend-tests/<name>-<version>.txt) lists the test ids
that pass on the *pristine* sdist; every one of them must pass on the patched tree. Tests that
fail on pristine too (repo-relative data paths, no GPU) are reported but do not fail the run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from dsv3_rl.errors import cli_main
from dsv3_rl.backends import BASELINE_TAG, REPO_ROOT, BackendError, load_lock
from dsv3_rl.fs import write_text_atomic

PATTERN = "*_on_cpu.py"
BASELINE_DIR = REPO_ROOT / "tests" / "assets" / "backend-tests"
PER_FILE_TIMEOUT_S = 600


def _passed_ids(junit: Path) -> tuple[set[str], set[str]]:
    passed, failed = set(), set()
    if not junit.exists():
        return passed, failed
    for case in ET.parse(junit).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            continue
        (failed if case.find("failure") is not None or case.find("error") is not None else passed).add(tid)
    return passed, failed


def run_suite(src: Path, import_root: Path | None, jobs_out: Path) -> tuple[set[str], set[str]]:
    """Run every *_on_cpu.py under src/tests; import the backend from import_root (PYTHONPATH) or
    from the installed (patched, editable) package when None."""
    files = sorted((src / "tests").rglob(PATTERN))
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "RAY_DEDUP_LOGS": "0", "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if import_root is not None:
        env["PYTHONPATH"] = f"{import_root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    passed, failed = set(), set()
    t0 = time.time()
    for i, f in enumerate(files, 1):
        rel = f.relative_to(src)
        t_file = time.time()
        junit = jobs_out / (str(rel).replace("/", "__") + ".xml")
        try:
            # the backend's own root and no config: the patched tree lives inside this repo, whose
            # pyproject.toml pytest would otherwise adopt (other rootdir -> other test ids, our addopts)
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={src}",
                            "-c", os.devnull, f"--junitxml={junit}", str(rel)], cwd=src, env=env, capture_output=True, text=True,
                           timeout=PER_FILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"[backend-tests] {rel}: timed out after {PER_FILE_TIMEOUT_S}s", flush=True)
        p, fl = _passed_ids(junit)
        passed |= p
        failed |= fl
        # this file's own time; the whole suite's is printed once, after the loop
        print(f"[backend-tests] {i}/{len(files)} {rel}: {len(p)} passed, {len(fl)} failed "
              f"in {time.time() - t_file:.0f}s", flush=True)
        # Ray leaves daemons behind when a test file dies; never let one leak into the next file.
        ray = Path(sys.executable).with_name("ray")  # the venv's, also when its bin/ is not on PATH
        if ray.exists():
            subprocess.run([str(ray), "stop", "--force"], capture_output=True, env=env)
    print(f"[backend-tests] {len(files)} files in {time.time() - t0:.0f}s (with `ray stop` after each)", flush=True)
    return passed, failed


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-backend-tests", description=__doc__.split("\n\n")[0])
    ap.add_argument("backend", nargs="?", default="verl")
    ap.add_argument("--record", action="store_true", help="record the baseline from the pristine sdist")
    args = ap.parse_args(argv)
    backend = load_lock()[args.backend]
    tree = backend.path()
    if not (tree / "tests").is_dir():
        raise BackendError(f"{tree}/tests does not exist (the {backend.sdist} sdist ships no tests?)")
    baseline_file = BASELINE_DIR / f"{backend.dirname}.txt"
    with tempfile.TemporaryDirectory(prefix="dsv3-backend-tests-") as td:
        td = Path(td)
        if args.record:
            pristine = td / "pristine"
            pristine.mkdir()
            archive = subprocess.run(["git", "-C", str(tree), "archive", "--format=tar", BASELINE_TAG],
                                     capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(pristine)], input=archive.stdout, check=True)
            passed, failed = run_suite(pristine, pristine, td)
            write_text_atomic(baseline_file, f"# tests of {backend.sdist} (*_on_cpu.py, one process per file) passing "
                                             f"on the pristine sdist\n" + "".join(f"{t}\n" for t in sorted(passed)))
            print(f"[backend-tests] recorded {len(passed)} passing ({len(failed)} failing) on pristine "
                  f"{backend.dirname} -> {baseline_file.relative_to(REPO_ROOT)}")
            return 0
        if not baseline_file.exists():
            raise BackendError(f"no baseline {baseline_file}; record it with --record")
        expected = {ln.strip() for ln in baseline_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
        # Run from the patched tree itself (the tests use repo-relative paths), importing it.
        passed, failed = run_suite(tree, tree, td)
    regressions = sorted(expected - passed)
    print(f"[backend-tests] {backend.dirname} patched: {len(passed)} passed, {len(failed)} failed; "
          f"baseline {len(expected)}; regressions {len(regressions)}")
    for t in regressions:
        print(f"  REGRESSION {t}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
