"""Run a patched backend's own upstream CPU tests and compare with the pristine baseline.

    python -m dsv3_rl.backend_tests verl                 # patched tree vs recorded baseline
    python -m dsv3_rl.backend_tests verl --record        # record the baseline from pristine sources

verl's sdist ships ``tests/``; its ``*_on_cpu.py`` files are the CPU suite, run from the backend's
root. A file that starts Ray (``needs_ray``, read from its source) runs in a pytest process of its
own (Ray cannot be re-initialised in one process) with a private ``RAY_TMPDIR``, and afterwards every
process carrying that ``RAY_TMPDIR`` is killed (a dying file leaves daemons behind; Ray's daemons and
workers inherit the driver's environment). Only that file's Ray is stopped: not the machine's other
clusters (``ray stop --force`` would stop every Ray of the user, a GRPO run beside included), and the
private directory keeps ``ray.init()`` from joining a cluster that ``ray start`` recorded in the shared
one. All the other files run in ONE pytest process on two pytest-xdist
workers (``--dist loadfile``): most of their time is verl's import, paid once per worker instead of
once per file. That group runs with a private ``RAY_TMPDIR``; a Ray session found there afterwards
(a file that started Ray although its source did not say so) fails the run. Files listed in
``RUN_ALONE`` get a process of their own although they start no Ray.

The baseline (tests/assets/backend-tests/<name>-<version>.txt) lists the test ids that pass on the
*pristine* sdist, recorded by the same runner; every one of them must pass on the patched tree.
Tests that fail on pristine too (repo-relative data paths, no GPU) are reported but do not fail
the run.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from dsv3_rl.errors import cli_main
from dsv3_rl.backends import BASELINE_TAG, REPO_ROOT, BackendError, load_lock
from dsv3_rl.fs import write_text_atomic
from dsv3_rl.procs import processes_with

PATTERN = "*_on_cpu.py"
BASELINE_DIR = REPO_ROOT / "tests" / "assets" / "backend-tests"
PER_FILE_TIMEOUT_S = 600  # also the limit of the one process that runs the files without Ray

# Files that start no Ray but must not run beside the others (the shared process runs two files at a
# time, in one working directory): path -> why. test_protocol*_on_cpu.py's test_torch_save_data_proto both
# write and remove ./test_data.pt: side by side, one removed the other's file (a pristine run, 2026-11-26).
RUN_ALONE: dict[str, str] = {
    "tests/test_protocol_v2_on_cpu.py": "shares ./test_data.pt with tests/test_protocol_on_cpu.py",
}
XDIST_WORKERS = 2
# a test's or fixture's parameter naming a Ray fixture: ray_init_shutdown, ray_start_regular, init_ray...
_RAY_FIXTURE = re.compile(r"(^|_)ray($|_)")


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


def _is_ray_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in ("ray", "verl.single_controller.ray"))


def needs_ray(source: str) -> str | None:
    """Why a test file starts Ray (it imports Ray or verl's Ray controller, calls ``ray.init``, or
    takes a Ray fixture), or None. Read from the source, not from a list of today's file names."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:  # pytest reports it; alone, it cannot take the other files down with it
        return f"does not parse: {e.msg}, line {e.lineno}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_ray_module(alias.name):
                    return f"imports {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for name in (node.module, *(f"{node.module}.{a.name}" for a in node.names)):
                if _is_ray_module(name):
                    return f"imports {name}"
        elif isinstance(node, ast.Attribute) and node.attr == "init" and isinstance(node.value, ast.Name) \
                and node.value.id == "ray":
            return "calls ray.init"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                if _RAY_FIXTURE.search(arg.arg):
                    return f"{node.name}() takes the fixture {arg.arg}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "usefixtures":
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and _RAY_FIXTURE.search(a.value):
                    return f"uses the fixture {a.value}"
    return None


def split_files(src: Path, files: list[Path]) -> tuple[list[Path], list[tuple[Path, str, bool]]]:
    """(files that run together, [(file, why it runs alone, whether it starts Ray)]), in the given order."""
    together, alone = [], []
    for f in files:
        ray = needs_ray(f.read_text())
        why = ray or RUN_ALONE.get(str(f.relative_to(src)))
        (alone.append((f, why, ray is not None)) if why else together.append(f))
    return together, alone


def _module_of(rel: Path) -> str:
    return ".".join(rel.with_suffix("").parts)


def _count_by_file(ids: set[str], rels: list[Path]) -> dict[Path, int]:
    """Test ids (``pkg.module.Class::name``: junit's classname; ``::pkg.module`` for a file that could
    not be collected) counted per test file."""
    mods = {_module_of(r): r for r in rels}
    counts = dict.fromkeys(rels, 0)
    for tid in ids:
        classname, name = tid.split("::", 1)
        classname = classname or name
        for mod, rel in mods.items():
            if classname == mod or classname.startswith(mod + "."):
                counts[rel] += 1
                break
    return counts


def _pytest(src: Path, env: dict, junit: Path, args: list[str], label: str) -> None:
    # the backend's own root and no config: the patched tree lives inside this repo, whose
    # pyproject.toml pytest would otherwise adopt (other rootdir -> other test ids, our addopts)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={src}",
                               "-c", os.devnull, f"--junitxml={junit}", *args], cwd=src, env=env,
                              capture_output=True, text=True, timeout=PER_FILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"[backend-tests] {label}: timed out after {PER_FILE_TIMEOUT_S}s", flush=True)
        return
    if not junit.exists():  # pytest itself failed (a bad option, a missing plugin): show why
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        print(f"[backend-tests] {label}: pytest wrote no report (exit {proc.returncode}):", *tail, sep="\n  ",
              flush=True)


def _ray_stop(ray_tmp: Path) -> None:
    """Kill every process of the Ray that a test file started under RAY_TMP (its private ``RAY_TMPDIR``)."""
    for _ in range(3):  # a worker the raylet was starting as we looked may show up once
        pids = processes_with(f"RAY_TMPDIR={ray_tmp}")
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.5)


def run_suite(src: Path, import_root: Path | None, jobs_out: Path) -> tuple[set[str], set[str]]:
    """Run every *_on_cpu.py under src/tests; import the backend from import_root (PYTHONPATH) or
    from the installed (patched, editable) package when None."""
    files = sorted((src / "tests").rglob(PATTERN))
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "RAY_DEDUP_LOGS": "0", "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if import_root is not None:
        env["PYTHONPATH"] = f"{import_root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    together, alone = split_files(src, files)
    passed, failed = set(), set()
    t0 = time.time()
    if together:
        rels = [f.relative_to(src) for f in together]
        ray_tmp = jobs_out / "r"  # short: Ray's socket paths (at most 107 bytes) live under it
        ray_tmp.mkdir()
        junit = jobs_out / "together.xml"
        label = f"{len(rels)} files without Ray"
        print(f"[backend-tests] {label}: one pytest process, {XDIST_WORKERS} xdist workers ...", flush=True)
        _pytest(src, {**env, "RAY_TMPDIR": str(ray_tmp)}, junit,
                ["-n", str(XDIST_WORKERS), "--dist", "loadfile", "--continue-on-collection-errors",
                 *map(str, rels)], label)
        p, fl = _passed_ids(junit)
        passed |= p
        failed |= fl
        n_p, n_f = _count_by_file(p, rels), _count_by_file(fl, rels)
        for rel in rels:
            print(f"[backend-tests]   {rel}: {n_p[rel]} passed, {n_f[rel]} failed", flush=True)
        print(f"[backend-tests] {label}: {len(p)} passed, {len(fl)} failed in {time.time() - t0:.0f}s", flush=True)
        started = sorted(ray_tmp.glob("ray/session_2*"))
        if started:
            _ray_stop(ray_tmp)
            raise BackendError(f"a test file run without Ray started a Ray session ({started[0]}); "
                               f"make dsv3_rl.backend_tests.needs_ray see it, or add the file to RUN_ALONE")

    # one at a time: two side by side took as long and ~20 % more CPU on 2 cores (2026-11-27: 177 s, 310 CPU-s
    # against 178 s, 260): each file's Ray already keeps the cores busy
    for i, (f, why, starts_ray) in enumerate(alone, 1):
        rel = f.relative_to(src)
        t_file = time.time()
        junit = jobs_out / (str(rel).replace("/", "__") + ".xml")
        ray_tmp = jobs_out / f"r{i}"  # short: Ray's socket paths (at most 107 bytes) live under it
        ray_tmp.mkdir()
        try:
            _pytest(src, {**env, "RAY_TMPDIR": str(ray_tmp)}, junit, [str(rel)], str(rel))
        finally:
            if starts_ray:  # Ray leaves daemons behind when a test file dies; never let one leak into the next file
                _ray_stop(ray_tmp)
        p, fl = _passed_ids(junit)
        passed |= p
        failed |= fl
        # this file's own time; the whole suite's is printed once, after the loop
        print(f"[backend-tests] {i}/{len(alone)} alone ({why}) {rel}: {len(p)} passed, {len(fl)} failed "
              f"in {time.time() - t_file:.0f}s", flush=True)
    n_ray = sum(starts_ray for *_, starts_ray in alone)
    print(f"[backend-tests] {len(files)} files in {time.time() - t0:.0f}s ({len(together)} in one xdist session, "
          f"{len(alone)} alone: {n_ray} with Ray, stopped after each)", flush=True)
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
            write_text_atomic(baseline_file, f"# tests of {backend.sdist} (*_on_cpu.py, dsv3_rl.backend_tests' runner) passing "
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
