"""The GPU box's environment without internet: what it needs beyond its image, fetched by hash, carried in parts.

A cluster (or this project's GPU box) often reaches no package registry, and a copy to it may be limited in size
(64 MiB a call on the project's box). This module makes the environment reproducible from ``scripts/gpu-box.lock``:

* ``lock``: resolve vLLM, Ray, verl's engine, our reward and their dependencies for the box's Python/platform with
  pip's own resolver (``pip install --dry-run --report``), drop what the box's image already has and what is not
  needed (``EXCLUDED``, with the reason), and write the lock: one file per line with its sha256 and size.
* ``fetch DIR``: ``pip download --no-deps --require-hashes`` of every locked file (pip checks the hashes), plus the
  Transformer Engine bundle's files (``--te-dir``), each checked against the lock. Resumable: what is there and
  matches is kept.
* ``split DIR PARTS``: one tar stream of the locked files, cut into parts of ``--part-mib``, and ``MANIFEST.json``
  (every part's and file's size and sha256). Written under a temporary name and renamed.
* ``check PARTS`` / ``install PARTS --target T`` (on the box; standard library only, no pydantic there yet):
  every part is checked first; a missing or damaged part is named and nothing is installed. Then the parts are
  joined, every file is checked against the manifest, the wheels are installed with ``pip install --no-index
  --no-deps --target T/site`` (Transformer Engine into ``T/te``, used only where asked for), and ``T`` appears by
  one rename. A second ``install`` of the same manifest is a no-op.

``scripts/gpu_env.sh`` puts ``T/site`` (and ``T/te`` with ``DSV3_GPU_TE=1``) on ``PYTHONPATH``. docs/gpu-setup.md
walks through it as a user without internet on the cluster would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from dsv3_rl.errors import Dsv3Error, cli_main
from dsv3_rl.fs import sha256_file

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "scripts" / "gpu-box.lock"
MANIFEST = "MANIFEST.json"
FORMAT = "dsv3-gpubox-1"
#: the box: CPython 3.12 on manylinux x86-64 (torch 2.11.0+cu130 in its image)
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_31_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64", "linux_x86_64")
#: what the lock asks pip to resolve: vLLM and Ray at verl 0.9.1's GPU pins, the two pins vLLM 0.24.0's metadata
#: misses (seen on the box 2026-11-28), verl's engine (its `verl-core`, `math` extras; scripts/requirements-cpu.txt
#: has the same list for the CPU box), cupy for verl's nccl checkpoint engine, transformers/tokenizers at the CPU
#: suite's versions, our reward and tools
REQUIREMENTS = (
    "vllm==0.24.0", "ray==2.60.0",
    "openai<3",          # openai 3.x imports httpx2 at `import vllm` (No module named 'httpx2')
    "xgrammar==0.2.3",   # 0.2.8 calls apache-tvm-ffi's load_lib_module(extra_lib_paths=), which vLLM's pin 0.1.9 lacks
    # verl's nccl checkpoint engine (one-step-off / fully async on GPUs, patch 0042) imports cupy (without it:
    # `Checkpoint engine nccl not registered ... No module named 'cupy'`). Not pinned: the project's box image has
    # cupy-cuda13x 14.2.0, so the lock resolves it and does not carry it (a cluster without it carries it: pin it)
    "cupy-cuda13x>=14",
    "transformers==5.10.4", "tokenizers==0.22.2", "pydantic==2.14.4", "tensordict==0.10.0", "omegaconf==2.3.1",
    "hydra-core==1.3.8", "codetiming", "datasets", "dill", "pylatexenc", "torchdata", "TransferQueue>=0.1.10",
    "pyzmq", "msgspec", "fastapi", "uvicorn", "mathruler", "qwen_vl_utils", "cachetools", "nvtx", "math-verify",
    "safetensors", "tqdm", "einops", "matplotlib",
)
#: pinned here: carried even where the image has the package (the image's transformers is newer than verl's < 5.11)
PINNED = frozenset(_n.split("==")[0].lower() for _n in REQUIREMENTS if "==" in _n)
#: resolved by pip but not carried: the box's image has a build of it, or no import on our path needs it (the
#: 2026-11-28 box ran `import vllm, ray` and vLLM generation with the tiny DeepSeek-V3 without any of these)
EXCLUDED = {
    "torch": "the image's torch 2.11.0+cu130 (vLLM 0.24.0's pin) is used",
    "flashinfer-cubin": "447 MB of prebuilt flashinfer kernels; flashinfer JIT-compiles with the image's nvcc instead",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (Blackwell paths of vLLM); not imported on Hopper",
    "nvidia-cutlass-dsl-libs-base": "see nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-cu13": "see nvidia-cutlass-dsl",
    "tokenspeed-triton": "a second Triton for tokenspeed-mla kernels vLLM does not pick for this model",
    "tokenspeed-mla": "see tokenspeed-triton",
    "tilelang": "DeepSeek-V3.2 sparse-attention kernels; V3 does not use them",
    "z3-solver": "tilelang's dependency",
    "nvidia-nvvm": "the image has CUDA's compiler toolchain",
    "nvidia-cuda-nvcc": "the image has nvcc",
    "nvidia-cuda-crt": "the image has CUDA's headers",
    "nvidia-cuda-cccl": "the image has CUDA's headers",
    "nvidia-cuda-tileiras": "CUDA tile IR compiler for cuda-tile (Blackwell)",
    "cuda-tile": "see nvidia-cuda-tileiras",
    "humming-kernels": "optional vLLM kernels, not on the DeepSeek-V3 path",
    "quack-kernels": "optional CuTe-DSL kernels (needs nvidia-cutlass-dsl)",
    "av": "video decoding for qwen_vl_utils' vision inputs; text-only GRPO never imports it (36 MB)",
}
#: Transformer Engine 2.11 for the box (../shared/gpu-te, docs/gpu-setup.md): not on PyPI in this form
TE_FILES = ("transformer_engine_cu13-2.11.0-py3-none-manylinux_2_28_x86_64.whl",
            "transformer_engine-2.11.0-py3-none-any.whl",
            "transformer_engine_torch-2.11.0-cp312-cp312-linux_x86_64.whl")


class GpuBoxError(Dsv3Error, ValueError):
    """The lock, a part, a file or the target is not what it should be; the message names it."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------------------------ the lock


class Entry:
    """One locked file: ``name==version  file  sha256  size  source`` (source: pypi | sdist | te)."""

    def __init__(self, spec: str, file: str, sha256: str, size: int, source: str = "pypi"):
        self.spec, self.file, self.sha256, self.size, self.source = spec, file, sha256, int(size), source

    @property
    def name(self) -> str:
        return _norm(self.spec.split("==")[0])

    def line(self) -> str:
        return f"{self.spec}  {self.file}  {self.sha256}  {self.size}  {self.source}"


def read_lock(path: Path = LOCK) -> list[Entry]:
    entries = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise GpuBoxError(f"lock file {path} does not exist (python -m dsv3_rl.gpubox lock writes it)") from None
    for i, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        f = line.split()
        if len(f) != 5 or "==" not in f[0] or not re.fullmatch(r"[0-9a-f]{64}", f[2]) or not f[3].isdigit() \
                or f[4] not in ("pypi", "sdist", "te"):
            raise GpuBoxError(f"{path}:{i}: expected 'name==version  file  sha256  size  pypi|sdist|te', got {raw!r}")
        entries.append(Entry(*f))
    seen: dict[str, str] = {}
    for e in entries:
        if e.name in seen:
            raise GpuBoxError(f"{path}: {e.name} is locked twice ({seen[e.name]} and {e.spec}): pip --target "
                              "would install both")
        seen[e.name] = e.spec
    return entries


def _pip_platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi",
            "cp" + PYTHON_VERSION.replace(".", "")]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def _image_packages() -> set[str]:
    """Package names the box's image holds, from the device tool's list (names only) where it is readable."""
    kinds = Path(os.environ.get("DSV3_GPU_IMAGE_PACKAGES", "/work/.library/device/KINDS.md"))
    text = kinds.read_text()
    i = text.index("Packages: ")
    return {_norm(n) for n in text[i + len("Packages: "):text.index("\n", i)].strip().rstrip(".").split(", ")}


def make_lock(out: Path = LOCK, report: Path | None = None) -> int:
    """Resolve REQUIREMENTS for the box with pip and write the lock (needs the internet; minutes). REPORT: a pip
    ``--report`` of that resolution made earlier (the resolver takes ~4 minutes)."""
    if report is not None:
        return _write_lock(out, json.loads(Path(report).read_text())["install"])
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "local"
        local.mkdir()
        # antlr4 4.9.3 (hydra/omegaconf's pin) is an sdist only: a wheel built here lets the resolver go on
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(local),
                        "antlr4-python3-runtime==4.9.3"], check=True)
        _stub_wheel(local, "torch", "2.11.0+image")  # the image's torch: its CUDA wheels are not resolved
        report = Path(tmp) / "report.json"
        req = Path(tmp) / "req.txt"
        req.write_text("\n".join((*REQUIREMENTS, "torch==2.11.0")) + "\n")
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "--find-links", str(local), *_pip_platform_args(),
                        "--target", str(Path(tmp) / "t"), "-r", str(req)], check=True)
        resolved = json.loads(report.read_text())["install"]
    return _write_lock(out, resolved)


def _write_lock(out: Path, resolved: list[dict]) -> int:
    image = _image_packages()
    lines, dropped = [], []
    for it in resolved:
        m = it["metadata"]
        name = _norm(m["name"])
        if name in EXCLUDED or (name in image and name not in PINNED):
            dropped.append(name)
            continue
        url = it["download_info"]["url"]
        if name == "antlr4-python3-runtime":
            spec, source = "antlr4-python3-runtime==4.9.3", "sdist"
            file, sha, size = _pypi_sdist("antlr4-python3-runtime", "4.9.3")
        else:
            spec, source, file = f"{m['name']}=={m['version']}", "pypi", url.rsplit("/", 1)[-1]
            sha = it["download_info"]["archive_info"]["hashes"]["sha256"]
            size = _remote_size(url)
        lines.append(Entry(spec, file, sha, size, source).line())
    te = Path(os.environ.get("DSV3_GPU_TE_DIR", REPO.parent / "shared" / "gpu-te"))
    for f in TE_FILES:
        p = te / f
        lines.append(Entry(f"{f.split('-')[0]}=={f.split('-')[1]}", f, sha256_file(p), p.stat().st_size, "te").line())
    head = [f"# {FORMAT}: what the GPU box (CPython {PYTHON_VERSION}, manylinux x86-64, torch 2.11.0+cu130 in its image)",
            "# needs beyond its image. Written by `python -m dsv3_rl.gpubox lock` (pip's resolver); see docs/gpu-setup.md.",
            "# columns: name==version  file  sha256  size  source (pypi: a binary wheel; sdist: built on the box; te: the",
            "# Transformer Engine bundle of ../shared/gpu-te). Resolved but not carried (image or not needed):",
            "#   " + " ".join(sorted(set(dropped)))]
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(head + sorted(lines, key=str.lower)) + "\n")
    tmp.replace(out)
    print(f"[gpubox] lock: {len(lines)} files -> {out}")
    return 0


def _stub_wheel(where: Path, name: str, version: str) -> None:
    import zipfile

    tag = f"cp{PYTHON_VERSION.replace('.', '')}-cp{PYTHON_VERSION.replace('.', '')}-manylinux_2_28_x86_64"
    di = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(where / f"{name}-{version}-{tag}.whl", "w") as z:
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{di}/WHEEL", f"Wheel-Version: 1.0\nGenerator: dsv3-gpubox\nRoot-Is-Purelib: false\nTag: {tag}\n")
        z.writestr(f"{di}/RECORD", "")


def _remote_size(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
        return int(r.headers["Content-Length"])


def _pypi_sdist(name: str, version: str) -> tuple[str, str, int]:
    """The sdist pip downloads for NAME==VERSION: file name, sha256, size."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", "-d", d,
                        f"{name}=={version}"], check=True)
        (f,) = Path(d).iterdir()
        return f.name, sha256_file(f), f.stat().st_size


# ------------------------------------------------------------------------------------------------ fetch


def check_file(path: Path, e: Entry) -> str | None:
    """None when PATH is E's file, else what is wrong."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != e.size:
        return f"{size} bytes, the lock says {e.size}"
    got = sha256_file(path)
    return None if got == e.sha256 else f"sha256 {got[:16]}..., the lock says {e.sha256[:16]}..."


def fetch(dest: Path, te_dir: Path | None, lock: Path = LOCK) -> int:
    entries = read_lock(lock)
    dest.mkdir(parents=True, exist_ok=True)
    todo = [e for e in entries if check_file(dest / e.file, e) is not None]
    t0 = time.monotonic()
    for source, extra in (("pypi", _pip_platform_args()), ("sdist", ["--no-binary=:all:"])):
        group = [e for e in todo if e.source == source]
        if not group:
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
            req.write("".join(f"{e.spec} --hash=sha256:{e.sha256}\n" for e in group))
        try:
            print(f"[gpubox] pip download {len(group)} {source} file(s) into {dest}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--quiet",
                            "-d", str(dest), *extra, "-r", req.name], check=True)
        finally:
            os.unlink(req.name)
    for e in (e for e in todo if e.source == "te"):
        if te_dir is None:
            raise GpuBoxError(f"{e.file} is Transformer Engine's bundle, not on PyPI: give --te-dir (../shared/gpu-te)")
        src = te_dir / e.file
        bad = check_file(src, e)
        if bad:
            raise GpuBoxError(f"{src}: {bad}")
        shutil.copyfile(src, dest / (e.file + ".tmp"))
        os.replace(dest / (e.file + ".tmp"), dest / e.file)
    bad = [f"{e.file}: {why}" for e in entries if (why := check_file(dest / e.file, e))]
    if bad:
        raise GpuBoxError(f"{len(bad)} file(s) in {dest} do not match the lock: " + "; ".join(bad[:5]))
    total = sum(e.size for e in entries)
    print(f"[gpubox] fetch: {len(entries)} files, {total / 1e6:.0f} MB in {dest} match the lock "
          f"({len(todo)} fetched in {time.monotonic() - t0:.0f} s)")
    return 0


# ------------------------------------------------------------------------------------------------ split


def split(src: Path, out: Path, part_mib: float, lock: Path = LOCK) -> int:
    entries = read_lock(lock)
    bad = [f"{e.file}: {why}" for e in entries if (why := check_file(src / e.file, e))]
    if bad:
        raise GpuBoxError(f"{src} does not hold the locked files (python -m dsv3_rl.gpubox fetch): " + "; ".join(bad[:5]))
    part_bytes = int(part_mib * 2**20)
    if part_bytes < 2**20:
        raise GpuBoxError(f"--part-mib {part_mib}: a part must be at least 1 MiB")
    if out.exists():
        raise GpuBoxError(f"{out} exists: give a new directory (parts of two bundles must never mix)")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = _PartWriter(tmp, part_bytes)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tar.gettarinfo(str(src / e.file), arcname=e.file)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(src / e.file, "rb") as f:
                tar.addfile(info, f)
    writer.finish()
    manifest = {"format": FORMAT, "parts": writer.parts, "total_size": writer.total, "total_sha256": writer.digest(),
                "files": [{"file": e.file, "spec": e.spec, "size": e.size, "sha256": e.sha256, "source": e.source}
                          for e in entries]}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.rename(out)
    print(f"[gpubox] split: {len(entries)} files, {writer.total / 1e6:.0f} MB -> {len(writer.parts)} parts of <= "
          f"{part_mib:g} MiB in {out}")
    return 0


class _PartWriter:
    """A file object that cuts what is written into part files of at most PART_BYTES."""

    def __init__(self, d: Path, part_bytes: int):
        self.d, self.part_bytes = d, part_bytes
        self.parts: list[dict] = []
        self.total = 0
        self._all = hashlib.sha256()
        self._f = None
        self._h = None
        self._n = 0

    def _open(self):
        name = f"part{len(self.parts) + 1:03d}"
        self._f, self._h, self._n = open(self.d / name, "wb"), hashlib.sha256(), 0
        self.parts.append({"name": name})

    def _close(self):
        if self._f is not None:
            self._f.close()
            self.parts[-1].update(size=self._n, sha256=self._h.hexdigest())
            self._f = None

    def write(self, b) -> int:
        mv = memoryview(b)
        while len(mv):
            if self._f is None or self._n >= self.part_bytes:
                self._close()
                self._open()
            k = min(len(mv), self.part_bytes - self._n)
            self._f.write(mv[:k])
            self._h.update(mv[:k])
            self._all.update(mv[:k])
            self._n += k
            self.total += k
            mv = mv[k:]
        return len(b)

    def flush(self):
        pass

    def finish(self):
        self._close()

    def digest(self) -> str:
        return self._all.hexdigest()


# ------------------------------------------------------------------------------------------------ on the box


def read_manifest(parts: Path) -> dict:
    p = parts / MANIFEST
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        raise GpuBoxError(f"{p} is missing: copy the bundle's {MANIFEST} beside its parts") from None
    except ValueError as e:
        raise GpuBoxError(f"{p} is not valid JSON ({e}): copy it again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise GpuBoxError(f"{p}: not a {FORMAT} manifest")
    return m


def check_parts(parts: Path) -> dict:
    """The manifest, once every part is present and intact; else one error naming every bad part."""
    m = read_manifest(parts)
    bad = []
    for p in m["parts"]:
        f = parts / p["name"]
        if not f.is_file():
            bad.append(f"{p['name']} is missing")
        elif f.stat().st_size != p["size"]:
            bad.append(f"{p['name']} is damaged ({f.stat().st_size} bytes, expected {p['size']})")
        elif sha256_file(f) != p["sha256"]:
            bad.append(f"{p['name']} is damaged (sha256 differs from the manifest)")
    if bad:
        raise GpuBoxError(f"{parts}: {len(bad)} of {len(m['parts'])} parts not usable: {'; '.join(bad)}; nothing was "
                          "installed (copy those parts again)")
    return m


class _PartReader:
    def __init__(self, parts: Path, names: list[str]):
        self.files = [parts / n for n in names]
        self._f = None

    def read(self, n: int = -1) -> bytes:
        out = b""
        while n < 0 or len(out) < n:
            if self._f is None:
                if not self.files:
                    break
                self._f = open(self.files.pop(0), "rb")
            chunk = self._f.read(-1 if n < 0 else n - len(out))
            if not chunk:
                self._f.close()
                self._f = None
                continue
            out += chunk
        return out


def install(parts: Path, target: Path, python: str = sys.executable) -> int:
    t0 = time.monotonic()
    m = check_parts(parts)
    done = target / "DONE.json"
    if done.is_file():
        try:
            same = json.loads(done.read_text()).get("total_sha256") == m["total_sha256"]
        except ValueError:
            same = False
        if same:
            print(f"[gpubox] install: {target} already holds this bundle ({len(m['files'])} files); nothing to do")
            return 0
        raise GpuBoxError(f"{target} holds another bundle: give a new --target, or remove it first")
    if target.exists():
        raise GpuBoxError(f"{target} exists and is not a finished install: remove it first")
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    wheels = staging / "files"
    wheels.mkdir(parents=True)
    joined = hashlib.sha256()
    reader = _PartReader(parts, [p["name"] for p in m["parts"]])

    class _Hashing:
        def read(self, n=-1):
            b = reader.read(n)
            joined.update(b)
            return b

    want = {f["file"]: f for f in m["files"]}
    with tarfile.open(fileobj=_Hashing(), mode="r|") as tar:
        for info in tar:
            if not info.isfile() or info.name not in want or "/" in info.name:
                raise GpuBoxError(f"the joined parts hold {info.name!r}, which the manifest does not list")
            with tar.extractfile(info) as src, open(wheels / info.name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        while reader.read(1 << 22):
            pass
    # the stream's digest covers the tar padding too
    if joined.hexdigest() != m["total_sha256"]:
        raise GpuBoxError("the joined parts differ from the bundle that was split (sha256): nothing was installed")
    bad = []
    for f in m["files"]:
        why = check_file(wheels / f["file"], Entry(f["spec"], f["file"], f["sha256"], f["size"], f["source"]))
        if why:
            bad.append(f"{f['file']}: {why}")
    if bad:
        raise GpuBoxError(f"{len(bad)} file(s) differ from the manifest after joining: {'; '.join(bad[:5])}; nothing "
                          "was installed")
    print(f"[gpubox] {len(m['parts'])} parts checked and joined, {len(m['files'])} files verified "
          f"({time.monotonic() - t0:.1f} s)", flush=True)
    for group, sub in (("main", "site"), ("te", "te")):
        files = [str(wheels / f["file"]) for f in m["files"] if (f["source"] == "te") == (group == "te")]
        if not files:
            continue
        cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--no-build-isolation", "--target", str(staging / sub), *files]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = " ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            raise GpuBoxError(f"pip could not install the {group} wheels into {staging / sub}: {tail}; nothing was "
                              "installed")
    shutil.rmtree(wheels)
    (staging / "DONE.json").write_text(json.dumps({"total_sha256": m["total_sha256"], "files": len(m["files"]),
                                                   "seconds": round(time.monotonic() - t0, 1)}) + "\n")
    staging.rename(target)
    print(f"[gpubox] install: {len(m['files'])} files into {target}/site (+ te) in {time.monotonic() - t0:.1f} s")
    return 0


# ------------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsv3_rl.gpubox", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("lock", help="resolve what the box needs and write the lock (internet)")
    s.add_argument("--out", type=Path, default=LOCK)
    s.add_argument("--report", type=Path, default=None, help="reuse a pip --report of the resolution")
    s = sub.add_parser("fetch", help="download the locked files into DIR, checked against the lock (internet)")
    s.add_argument("dir", type=Path)
    s.add_argument("--te-dir", type=Path, default=None, help="the Transformer Engine bundle (../shared/gpu-te)")
    s.add_argument("--lock", type=Path, default=LOCK)
    s = sub.add_parser("split", help="cut DIR's locked files into PARTS/partNNN + MANIFEST.json")
    s.add_argument("dir", type=Path)
    s.add_argument("parts", type=Path)
    s.add_argument("--part-mib", type=float, default=55.0)
    s.add_argument("--lock", type=Path, default=LOCK)
    s = sub.add_parser("check", help="check that every part is there and intact (on the box)")
    s.add_argument("parts", type=Path)
    s = sub.add_parser("install", help="check, join and install the parts into TARGET (on the box)")
    s.add_argument("parts", type=Path)
    s.add_argument("--target", type=Path, required=True)
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "lock":
        return make_lock(a.out, a.report)
    if a.cmd == "fetch":
        return fetch(a.dir, a.te_dir, a.lock)
    if a.cmd == "split":
        return split(a.dir, a.parts, a.part_mib, a.lock)
    if a.cmd == "check":
        m = check_parts(a.parts)
        print(f"[gpubox] check: {len(m['parts'])} parts, {m['total_size'] / 1e6:.0f} MB, all intact")
        return 0
    return install(a.parts, a.target)


if __name__ == "__main__":
    sys.exit(main())
