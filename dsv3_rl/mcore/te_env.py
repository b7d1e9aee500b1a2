"""Transformer Engine beside torch: does megatron-core accept this TE, and is there one cuDNN per process.

**TE version.** megatron-core 0.16.1 pins ``transformer-engine[pytorch,core_cu13]>=2.9.0a0,<2.12.0`` (its
``dev`` extra); at run time it only asks ``is_te_min_version`` per feature, so a TE outside the pin imports
and fails later. :func:`te_support` reads the pin from megatron-core itself (its installed metadata, else the
``pyproject.toml`` beside the package when it is only on PYTHONPATH) and says whether the installed TE is
inside it, without importing TE.

**One cuDNN.** With torch and TE in one process two cuDNNs can end up loaded:

* torch (pip wheel) loads ``nvidia/cudnn/lib/libcudnn.so.9`` from site-packages at ``import torch``
  (``torch._load_global_deps`` -> ``_preload_cuda_deps``, ``ctypes.CDLL`` with the default RTLD_LOCAL);
* TE 2.11 (``transformer_engine/common/__init__.py``, ``_load_cuda_library("cudnn")``) looks *first* in
  ``$CUDNN_HOME``, ``$CUDNN_PATH``, ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda`` (``**/libcudnn.so*``),
  then ``libcudnn.so`` on the loader path, and only then in site-packages; it loads what it finds with
  RTLD_GLOBAL.

When TE finds another cuDNN first, that copy is in the global symbol scope, torch's is only in its local
scope, and torch's lazily bound cuDNN calls resolve to TE's copy: the first cuDNN call fails with torch's
``cuDNN version incompatibility: PyTorch was compiled against (9, 19, 0) but found runtime version (9, 14, 0)``
(seen on the GPU box, issue 26), or worse, runs against a cuDNN torch was not built for.

:func:`pin_torch_cudnn` (called before TE is imported: :mod:`dsv3_rl.mcore.runtime` does it at import)
makes TE load torch's file: it promotes torch's libcudnn to the global scope and, unless the user set
``CUDNN_HOME``/``CUDNN_PATH``, points ``CUDNN_HOME`` at torch's cuDNN directory. :func:`check_cudnn`
(run before any GPU work: ``runtime.init_distributed``, the benches, the MLA attention probe) lists every
libcudnn mapped into the process (``/proc/self/maps``) with its ``cudnnGetVersion``, compares them with the
version torch was compiled against (torch's own rule: same major, minor not older) and raises
:class:`CudnnMismatchError`, one line naming both versions and the fix. ``python -m dsv3_rl.mcore.te_env``
prints both checks (exit 2 on a mismatch).

cuDNN for MLA attention (TE 2.11 ``nvte_get_fused_attn_backend``, bf16/fp16, d_qk=192/d_v=128) is the
business of :mod:`dsv3_rl.mcore.mla_attention_guard`: Hopper training needs cuDNN >= 9.5, THD (packed)
needs >= 9.1 (>= 9.6 with GQA), 9.10.0/9.10.1 are excluded; :func:`mla_cudnn_line` applies it to this process.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import glob
import importlib.metadata as md
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, MutableMapping, Sequence
from pathlib import Path

from dsv3_rl.errors import Dsv3Error, cli_main
from dsv3_rl.mcore.mla_attention_guard import _fmt, _version_tuple, fused_attention_support

Version = tuple[int, int, int]
TE_DIST = "transformer-engine"
MCORE_DIST = "megatron-core"
CUDNN_ENV = ("CUDNN_HOME", "CUDNN_PATH")
_CUDNN_RE = re.compile(r"(/\S*/libcudnn\.so(?:\.\d+)*)\s*$")
_CUDNN_ANY_RE = re.compile(r"(/\S*/libcudnn(?:_\w+)?\.so(?:\.\d+)*)\s*$")
NVRTC_ENV = ("NVRTC_HOME", "NVRTC_PATH", "CURAND_HOME", "CURAND_PATH")


class CudnnMismatchError(Dsv3Error, RuntimeError):
    """More than one cuDNN, or one torch was not built for, in this process."""


# --------------------------------------------------------------------------- TE version vs megatron-core's pin


def _mcore_te_requirement() -> tuple[str | None, str]:
    """(specifier, where it was read) of megatron-core's transformer-engine requirement."""
    from packaging.requirements import Requirement

    try:
        reqs = md.requires(MCORE_DIST) or []
        where = f"{MCORE_DIST} {md.version(MCORE_DIST)} metadata"
    except md.PackageNotFoundError:
        reqs, where = [], ""
    if not reqs:  # on PYTHONPATH only (the GPU box): the pyproject.toml beside the package
        spec = importlib.util.find_spec("megatron.core")
        if spec is not None and spec.origin:
            pyproject = Path(spec.origin).resolve().parents[2] / "pyproject.toml"
            if pyproject.is_file():
                import tomllib

                data = tomllib.loads(pyproject.read_text())
                proj = data.get("project", {})
                reqs = list(proj.get("dependencies", []))
                for extra in proj.get("optional-dependencies", {}).values():
                    reqs += extra
                where = str(pyproject)
    for r in reqs:
        req = Requirement(r)
        if req.name.lower().replace("_", "-") == TE_DIST and str(req.specifier):
            return str(req.specifier), where
    return None, where or f"{MCORE_DIST} not found"


def installed_te_version() -> str | None:
    """The installed transformer-engine version (package metadata; TE is not imported)."""
    for dist in (TE_DIST, "transformer_engine"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


@dataclasses.dataclass(frozen=True)
class TESupport:
    te_version: str | None
    specifier: str | None
    accepted: bool | None
    """None: TE not installed (optional: the local spec runs without it)."""
    line: str


def te_support(te_version: str | None = None, specifier: str | None = None, where: str = "") -> TESupport:
    """Whether megatron-core accepts the installed (or given) TE version."""
    from packaging.specifiers import SpecifierSet

    te_version = installed_te_version() if te_version is None else te_version
    if specifier is None:
        specifier, where = _mcore_te_requirement()
    if te_version is None:
        return TESupport(None, specifier, None,
                         f"Transformer Engine: not installed (optional; the local spec is used; megatron-core wants "
                         f"{specifier or '?'})")
    if specifier is None:
        return TESupport(te_version, None, None,
                         f"Transformer Engine {te_version}: megatron-core's TE requirement not found ({where})")
    ok = SpecifierSet(specifier).contains(te_version, prereleases=True)
    verdict = "accepted by" if ok else "NOT accepted by"
    fix = "" if ok else f"; install transformer-engine[pytorch]{specifier} (docs/gpu-setup.md)"
    return TESupport(te_version, specifier, ok,
                     f"Transformer Engine {te_version}: {verdict} megatron-core ({specifier}, from {where}){fix}")


# --------------------------------------------------------------------------- one cuDNN per process


def mapped_cudnn_libs(maps_text: str, parts: bool = False) -> list[str]:
    """Paths of the libcudnn.so* mapped (the cuDNN front library; ``parts``: also its libcudnn_* libraries), in order."""
    rx = _CUDNN_ANY_RE if parts else _CUDNN_RE
    out = []
    for line in maps_text.splitlines():
        m = rx.search(line)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def cudnn_by_directory(maps_text: str) -> list[str]:
    """One library per directory that has cuDNN libraries mapped: its libcudnn.so* if mapped, else the first
    libcudnn_* part (a cuDNN 9 front library loads its parts by soname, so parts from a second directory are a
    second cuDNN too)."""
    fronts = mapped_cudnn_libs(maps_text)
    out: dict[str, str] = {}
    for p in mapped_cudnn_libs(maps_text, parts=True):
        d = os.path.dirname(p)
        if d not in out:
            out[d] = next((f for f in fronts if os.path.dirname(f) == d), p)
    return list(out.values())


def te_python_cudnn_dir(purelib: str) -> str | None:
    """Where TE 2.11's ``_load_cuda_library_from_python('cudnn')`` loads every cuDNN library from when it finds no
    CUDA toolkit (no system nvrtc/curand): nvidia/cu13/cudnn/lib, nvidia/cu13/lib (libcudnn*), nvidia/cudnn/lib."""
    nv = os.path.join(purelib, "nvidia")
    for d, pat in ((os.path.join(nv, "cu13", "cudnn", "lib"), "lib*.so.*[0-9]"),
                   (os.path.join(nv, "cu13", "lib"), "libcudnn*.so.*[0-9]"),
                   (os.path.join(nv, "cudnn", "lib"), "lib*.so.*[0-9]"),
                   (os.path.join(nv, "cuda_cudnn", "lib"), "lib*.so.*[0-9]")):
        if glob.glob(os.path.join(d, pat)):
            return d
    return None


def _torch_nvrtc_dir(maps_text: str, purelib: str) -> str | None:
    for line in maps_text.splitlines():
        m = re.search(r"(/\S*/libnvrtc\.so(?:\.\d+)*)\s*$", line)
        if m:
            return os.path.dirname(m.group(1))
    for d in (os.path.join(purelib, "nvidia", "cu13", "lib"), os.path.join(purelib, "nvidia", "cuda_nvrtc", "lib")):
        if glob.glob(os.path.join(d, "libnvrtc.so.*[0-9]")):
            return d
    return None


def _read_maps(maps_path: str = "/proc/self/maps") -> str:
    try:
        return Path(maps_path).read_text()
    except OSError:
        return ""


def library_cudnn_version(path: str) -> Version | None:
    """``cudnnGetVersion()`` of an already loaded libcudnn (RTLD_NOLOAD: nothing new is loaded)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        fn = lib.cudnnGetVersion
        fn.restype = ctypes.c_size_t
        return _version_tuple(int(fn()))
    except (OSError, AttributeError):
        return None


def torch_cudnn_compiled() -> Version | None:
    """The cuDNN torch was compiled against (None: a torch without cuDNN, e.g. the CPU wheel)."""
    import torch

    cud = getattr(torch._C, "_cudnn", None)
    if cud is None or not getattr(cud, "is_cuda", True):
        return None
    try:
        return tuple(int(x) for x in cud.getCompileVersion())[:3]
    except (AttributeError, RuntimeError):
        return None


def torch_cudnn_candidates(sys_path: Iterable[str] | None = None, cuda_major: str | None = None) -> list[str]:
    """The libcudnn torch's wheel preloads (torch/__init__.py ``_preload_cuda_deps``: the first sys.path
    entry with nvidia/cudnn/lib or nvidia/cu<major>/lib holding libcudnn.so.*[0-9])."""
    out = []
    for p in sys.path if sys_path is None else sys_path:
        found = sorted(glob.glob(os.path.join(p, "nvidia", "cudnn", "lib", "libcudnn.so.*[0-9]")))
        if cuda_major:
            found += sorted(glob.glob(os.path.join(p, "nvidia", f"cu{cuda_major}", "lib", "libcudnn.so.*[0-9]")))
        out += [f for f in found if f not in out]
    return out


def torch_cudnn_path(maps_text: str | None = None) -> str | None:
    """The libcudnn torch uses: the one mapped after ``import torch`` (before TE), else the wheel's."""
    import torch

    if torch.version.cuda is None:
        return None
    mapped = mapped_cudnn_libs(_read_maps() if maps_text is None else maps_text)
    if mapped:
        return mapped[0]
    cands = torch_cudnn_candidates(cuda_major=torch.version.cuda.split(".")[0])
    return cands[0] if cands else None


def pin_torch_cudnn(environ: MutableMapping[str, str] | None = None, path: str | None = None,
                    modules: Sequence[str] | None = None, load=ctypes.CDLL, purelib: str | None = None,
                    maps_text: str | None = None) -> str | None:
    """Make a later ``import transformer_engine`` use torch's cuDNN. Returns torch's libcudnn path, or
    None when there is nothing to do (no CUDA torch / no cuDNN, or TE is already imported: then
    :func:`check_cudnn` tells whether it went well).

    Two levers, both TE's own search order: ``CUDNN_HOME`` (searched first) at torch's cuDNN directory; and where
    TE's no-toolkit branch would load *all* cuDNN libraries from another site-packages directory than torch's
    (``te_python_cudnn_dir``), ``NVRTC_HOME`` at torch's nvrtc, so that TE finds a "system" nvrtc and skips
    that branch (torch has already loaded the cuBLAS/cudart/cuDNN it needs)."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "transformer_engine" in modules:
        return None
    path = torch_cudnn_path() if path is None else path
    if not path:
        return None
    # TE searches CUDNN_HOME, then CUDNN_PATH, before CUDA_HOME and /usr/local/cuda; a user's own choice stays.
    if not any(environ.get(k) for k in CUDNN_ENV):
        environ["CUDNN_HOME"] = os.path.dirname(path)
    if purelib is None:
        import sysconfig

        purelib = sysconfig.get_paths()["purelib"]
    te_dir = te_python_cudnn_dir(purelib)
    if te_dir and os.path.realpath(te_dir) != os.path.realpath(os.path.dirname(path)) \
            and not any(environ.get(k) for k in NVRTC_ENV):
        nvrtc = _torch_nvrtc_dir(_read_maps() if maps_text is None else maps_text, purelib)
        if nvrtc:
            environ["NVRTC_HOME"] = nvrtc
    # Already loaded by torch (RTLD_LOCAL): this only promotes it to the global scope, ahead of any copy
    # loaded later, so lazily bound cuDNN symbols of torch and TE resolve to it.
    load(path, mode=getattr(os, "RTLD_GLOBAL", 0x100))
    # cuDNN 9's front library opens its parts (libcudnn_graph, _heuristic, _engines_*, ...) by soname on first
    # use, through the loader's search: on the GPU box that found /usr/lib/x86_64-linux-gnu's cuDNN 9.14 parts
    # behind torch's 9.19 front library (seen 2026-11-26: both reported 9.14, torch then refuses). A soname
    # already loaded is reused, so load torch's own parts first.
    for part in torch_cudnn_parts(path):
        load(part, mode=getattr(os, "RTLD_GLOBAL", 0x100))
    return path


def torch_cudnn_parts(front: str) -> list[str]:
    """The other cuDNN libraries beside torch's front ``libcudnn.so.N`` (libcudnn_graph.so.N, ...), one per
    soname (the versioned file names, not the dev symlinks)."""
    d = os.path.dirname(front)
    return [f for f in sorted(glob.glob(os.path.join(d, "libcudnn_*.so.*[0-9]")))
            if os.path.basename(f).count(".so.") == 1 and f != front]


def child_cudnn_env(environ: MutableMapping[str, str], sys_path: Iterable[str] | None = None,
                    purelib: str | None = None, te_installed: bool | None = None) -> dict[str, str]:
    """The variables :func:`pin_torch_cudnn` would set, for processes this one starts (the launcher's verl/Ray
    processes, which import TE through verl before any of our code runs); without importing torch. Empty when
    TE is not installed, the user chose (CUDNN_HOME/CUDNN_PATH set), or torch's wheel cuDNN is not found."""
    te_installed = installed_te_version() is not None if te_installed is None else te_installed
    if not te_installed or any(environ.get(k) for k in CUDNN_ENV):
        return {}
    cands = torch_cudnn_candidates(sys_path)
    if not cands:
        return {}
    out = {"CUDNN_HOME": os.path.dirname(cands[0])}
    if purelib is None:
        import sysconfig

        purelib = sysconfig.get_paths()["purelib"]
    te_dir = te_python_cudnn_dir(purelib)
    if te_dir and os.path.realpath(te_dir) != os.path.realpath(out["CUDNN_HOME"]) \
            and not any(environ.get(k) for k in NVRTC_ENV):
        nvrtc = _torch_nvrtc_dir("", purelib)
        if nvrtc:
            out["NVRTC_HOME"] = nvrtc
    return out


@dataclasses.dataclass(frozen=True)
class CudnnReport:
    ok: bool
    compiled: Version | None
    loaded: tuple[tuple[str, Version | None], ...]
    line: str


def cudnn_report(compiled: Version | None, loaded: Sequence[tuple[str, Version | None]],
                 torch_version: str = "", torch_dir: str | None = None,
                 environ: MutableMapping[str, str] | None = None) -> CudnnReport:
    """Judge the cuDNNs mapped into the process against the one torch was built for.

    torch's own rule (torch/backends/cudnn/__init__.py): same major, runtime minor >= compiled minor.
    Two different versions loaded at once is a mismatch even when each would pass alone."""
    environ = os.environ if environ is None else environ
    loaded = tuple((p, v) for p, v in loaded)
    torch_name = f"torch {torch_version}".strip()
    if compiled is None:
        return CudnnReport(True, None, loaded, f"cuDNN: {torch_name} has no cuDNN (nothing to check)")
    if not loaded:
        return CudnnReport(True, compiled, loaded,
                           f"cuDNN: {torch_name} built against {_fmt(compiled)}, none loaded yet")
    versions = {v for _, v in loaded}
    bad = [(p, v) for p, v in loaded if v is None or v[0] != compiled[0] or v[:2] < compiled[:2]]
    listing = ", ".join(f"{_fmt(v)} ({p})" for p, v in loaded)
    if not bad and len(versions) == 1:
        return CudnnReport(True, compiled, loaded,
                           f"cuDNN: one cuDNN {_fmt(next(iter(versions)))} in this process ({loaded[0][0]}), "
                           f"{torch_name} built against {_fmt(compiled)}: ok")
    user = {k: environ[k] for k in CUDNN_ENV if environ.get(k)}
    where = torch_dir or "<the nvidia/cudnn/lib of torch's site-packages>"
    fix = (f"Fix: give Transformer Engine torch's cuDNN: export CUDNN_HOME={where}"
           + (f" (now {', '.join(f'{k}={v}' for k, v in user.items())})" if user else "")
           + " (TE searches CUDNN_HOME, CUDNN_PATH, CUDA_HOME, /usr/local/cuda and the loader path before "
           f"site-packages), or install cuDNN >= {compiled[0]}.{compiled[1]} (same major) where TE finds it; "
           "docs/gpu-setup.md#one-cudnn-per-process")
    return CudnnReport(False, compiled, loaded,
                       f"cuDNN mismatch: {torch_name} was built against cuDNN {_fmt(compiled)} but this process "
                       f"loaded {listing}. {fix}")


def check_cudnn(maps_text: str | None = None, raise_on_mismatch: bool = True, import_te: bool = True,
                torch_check=None) -> CudnnReport:
    """Import TE (when installed, after :func:`pin_torch_cudnn`) and judge the cuDNNs of this process.
    Raises :class:`CudnnMismatchError` (one line) on a mismatch unless ``raise_on_mismatch`` is False."""
    import torch

    compiled = torch_cudnn_compiled()
    torch_dir = None
    if compiled is not None:
        p = pin_torch_cudnn()
        if p is None:  # TE imported before us: where torch's wheel keeps its cuDNN, for the fix
            cands = torch_cudnn_candidates(cuda_major=(torch.version.cuda or "").split(".")[0] or None)
            p = cands[0] if cands else None
        torch_dir = os.path.dirname(p) if p else None
        if import_te and installed_te_version() is not None:
            try:
                import transformer_engine.pytorch  # noqa: F401 - loads TE's cuDNN, the thing checked here
            except Exception as e:  # noqa: BLE001 - TE present but broken (ImportError, OSError, RuntimeError from its loader): said in one line; the cuDNNs are judged all the same
                print(f"[te_env] transformer_engine.pytorch does not import ({type(e).__name__}: {' '.join(str(e).split())[:200]})",
                      file=sys.stderr)
    text = _read_maps() if maps_text is None else maps_text
    loaded = [(p, library_cudnn_version(p)) for p in cudnn_by_directory(text)]
    report = cudnn_report(compiled, loaded, torch.__version__, torch_dir)
    if not report.ok and (torch_check or torch_cudnn_verdict)() == "accepted":
        # torch's own check (the one that raised "cuDNN version incompatibility" in the bench) accepts the cuDNN it
        # runs on: two versions are mapped, but nothing will refuse; said, not fatal
        report = dataclasses.replace(report, ok=True, line=report.line.replace(
            "cuDNN mismatch:", "cuDNN note (torch's own check accepts its runtime):", 1))
    mode = os.environ.get("DSV3_CUDNN_CHECK", "error")
    if mode not in ("error", "warn"):
        raise CudnnMismatchError(f"DSV3_CUDNN_CHECK={mode!r}: allowed error (default), warn")
    if not report.ok and raise_on_mismatch:
        if mode == "error":
            raise CudnnMismatchError(report.line)
        print(f"warning (DSV3_CUDNN_CHECK=warn): {report.line}", file=sys.stderr)
    return report


def torch_cudnn_verdict() -> str:
    """torch's own cuDNN compatibility check (torch.backends.cudnn.version(), which raises on a runtime older than
    the build): "accepted", "refused", or "unknown" where torch has no usable cuDNN to ask (a CPU torch)."""
    import torch

    try:
        if not torch.backends.cudnn.is_available():
            return "unknown"
        return "accepted" if torch.backends.cudnn.version() is not None else "unknown"
    except RuntimeError:
        return "refused"


def mla_cudnn_line(cudnn: Version | None, compute_capability: tuple[int, int]) -> str:
    """Whether TE's fused (cuDNN) attention can train MLA (192/128, bf16) with this cuDNN on this GPU."""
    ok, reason = fused_attention_support(cudnn, compute_capability, 192, 128, "bf16", training=True)
    return f"MLA fused attention: {'yes' if ok else 'no'}: {reason}"


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv3_rl.mcore.te_env",
                                 description="Transformer Engine version vs megatron-core, and one cuDNN per process.")
    ap.add_argument("--te-only", action="store_true", help="only the TE version line (imports neither torch nor TE)")
    args = ap.parse_args(argv)
    print(te_support().line)
    if args.te_only:
        return 0
    report = check_cudnn()  # a mismatch: one `error: cuDNN mismatch: ...` line, exit 2
    print(report.line)
    import torch

    if report.loaded and torch.cuda.is_available():
        print(mla_cudnn_line(report.loaded[0][1], tuple(torch.cuda.get_device_capability())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
