"""DeepSeek-V3 checkpoint cast: FP8 release -> BF16 (and the inverse), streaming, parallel, resumable.

``cast`` turns the official FP8 release (e.g. DeepSeek-V3-0324: 163 shards, ~690 GB) into a BF16
HF checkpoint that Megatron (via verl) and vLLM accept, in one step:

* every ``float8_e4m3fn`` weight is dequantized with its ``<name>_scale_inv`` (bit-identical to
  DeepSeek's formula, see ``fp8_kernels``); other tensors are copied byte for byte; the MTP layer
  (``model.layers.<num_hidden_layers>.*``) is dropped unless ``--keep-mtp``;
* one output shard per input shard, each streamed tensor by tensor (large tensors in row chunks), so
  memory stays at a few chunks per worker whatever the shard size; shards run in parallel threads,
  the dequant on the GPU when one is present;
* each shard is written to a temporary name, fsynced and renamed; a manifest in the output dir
  records source size/mtime and output size/sha256, so a rerun skips finished shards and does the
  rest; ``model.safetensors.index.json``, the fixed ``config.json`` (see ``hf_config``) and the
  tokenizer and other files are written last;
* the whole input is checked before anything is written: an error names the file or tensor.

``quantize`` is the inverse (BF16 -> DeepSeek blockwise FP8) for FP8 rollout.

CLI::

    dsv3-fp8-cast cast IN_FP8 --out OUT_BF16 [--keep-mtp] [--device auto|cpu|cuda] [--workers N] [--force]
    dsv3-fp8-cast quantize IN_BF16 --out OUT_FP8 [--scale-fmt pow2|amax]
    dsv3-fp8-cast IN_FP8 OUT_BF16                                          # `cast`, output positional
    dsv3-fp8-cast --input-fp8-hf-path IN --output-bf16-hf-path OUT        # DeepSeek's flags

(``python -m dsv3_rl.checkpoint.fp8`` is the same.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import fp8_kernels as K
# FP8_WEIGHT_RE: the linear weights DeepSeek ships in FP8 (not: embeddings, lm_head, norms, router gate, eh_proj):
# what `quantize` quantizes; `cast` dequantizes every FP8 weight that has its scale, whatever its name.
from .hf_config import (BIAS_SUFFIX, FP8_WEIGHT_RE, ConfigError, check_family, check_tensor_dtypes, fix_config,
                        load_config)
from .outputs import FP8_TOOL, MANIFEST, manifest_path, read_manifest, refuse_foreign_dir, write_manifest
from .outputs import NAMES as MANIFEST_NAMES
from .safetensors_io import (Header, SafetensorsError, ShardWriter, TensorInfo, itemsize, pread_exact, read_header,
                             read_tensor)
from dsv3_rl.cliargs import add_force, add_out, one_path, positive_int
from dsv3_rl.errors import Dsv3Error, check_space, cli_main
from dsv3_rl.fs import JsonFileError, atomic_path, sha256_file, write_json_atomic

INDEX = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
SCALE_DTYPES = ("F32", "BF16", "F16")
SKIP_DIRS = {".git", ".cache", ".huggingface"}
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [K.BLOCK, K.BLOCK]}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(Dsv3Error, ValueError):
    """Bad input or output location; the message names the file, tensor or option."""


class Interrupted(RuntimeError):
    pass


# ------------------------------------------------------------------------------------ planning


@dataclass
class Source:
    kind: str  # copy | dequant | quant_weight | quant_scale
    shard: Path
    info: TensorInfo
    scale_shard: Path | None = None
    scale: TensorInfo | None = None


@dataclass
class OutShard:
    name: str
    src: Path  # the input shard it mirrors
    entries: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    sources: dict[str, Source] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return sum(math.prod(shape) * itemsize(dt) for _, dt, shape in self.entries)

    @property
    def read_bytes(self) -> int:  # bytes read from input (quantize reads a weight twice)
        return sum(s.info.nbytes + (s.scale.nbytes if s.scale else 0) for s in self.sources.values())


@dataclass
class Plan:
    direction: str  # fp8_to_bf16 | bf16_to_fp8
    in_dir: Path
    out_dir: Path
    config: dict
    shards: list[OutShard]  # non-empty output shards, in input order
    in_sizes: dict[str, int]  # input shard name -> bytes
    options: dict
    n_converted: int = 0
    n_copied: int = 0
    n_dropped: int = 0
    warnings: list[str] = field(default_factory=list)


def _layer(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _load_input(in_dir: Path) -> tuple[dict, dict[str, Header], dict[str, tuple[Path, TensorInfo]], list[str]]:
    """config, headers by shard file name, tensor name -> (shard path, info), warnings."""
    if not in_dir.is_dir():
        raise CheckpointError(f"input dir {in_dir} does not exist")
    cfg_path = in_dir / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} not found: {in_dir} is not a HF checkpoint directory")
    try:
        config = load_config(cfg_path, family=False)  # plan_cast/plan_quantize check the family
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    warnings: list[str] = []
    index_path = in_dir / INDEX
    listed: dict[str, str] | None = None
    if index_path.is_file():
        try:
            listed = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: corrupt index ({e!r})") from None
        files = list(dict.fromkeys(listed.values()))
        for f in files:
            if not (in_dir / f).is_file():
                example = next(n for n, s in listed.items() if s == f)
                count = sum(1 for s in listed.values() if s == f)
                raise CheckpointError(f"{index_path} lists shard {f!r} ({count} tensors, e.g. {example!r}) "
                                      f"but {in_dir / f} does not exist (incomplete download?)")
        unlisted = sorted(p.name for p in in_dir.glob("*.safetensors") if p.name not in set(files))
        if unlisted:
            warnings.append(f"ignoring {len(unlisted)} *.safetensors not in {INDEX}: {', '.join(unlisted[:3])}")
    else:
        files = sorted(p.name for p in in_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors (and no {INDEX}) in {in_dir}")
    headers: dict[str, Header] = {}
    where: dict[str, tuple[Path, TensorInfo]] = {}
    for f in files:
        try:
            h = read_header(in_dir / f)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        headers[f] = h
        for name, info in h.tensors.items():
            if name in where:
                raise CheckpointError(f"tensor {name!r} is in both {where[name][0].name} and {f}")
            where[name] = (h.path, info)
    if listed is not None:
        for name, f in listed.items():
            if name not in headers[f].tensors:
                raise CheckpointError(f"{INDEX} lists tensor {name!r} in {f}, but that shard does not contain it")
        extra = [n for n in where if n not in listed]
        if extra:
            warnings.append(f"{len(extra)} tensors are in the shards but not in {INDEX} (kept), e.g. {extra[0]!r}")
    return config, headers, where, warnings


def _check_scale(name: str, info: TensorInfo, where: dict) -> tuple[Path, TensorInfo]:
    sname = name + SCALE_SUFFIX
    if len(info.shape) != 2:
        raise CheckpointError(f"FP8 tensor {name!r} has shape {list(info.shape)}; only 2-D weights are supported")
    if sname not in where:
        raise CheckpointError(f"FP8 tensor {name!r} has no scale: {sname!r} is missing from the checkpoint")
    spath, sinfo = where[sname]
    want = K.scale_shape(info.shape)
    if sinfo.shape != want:
        raise CheckpointError(f"scale {sname!r} ({spath.name}) has shape {list(sinfo.shape)}; expected {list(want)} "
                              f"(ceil(dim/128)) for FP8 weight {name!r} of shape {list(info.shape)}")
    if sinfo.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"scale {sname!r} ({spath.name}) has dtype {sinfo.dtype}; expected one of {SCALE_DTYPES}")
    return spath, sinfo


def _check_dtypes(headers: dict[str, Header], where: dict) -> None:
    """Every tensor's dtype is one the architecture allows: FP8 for a weight with its ``_scale_inv`` anywhere in
    the checkpoint (a ``_scale_inv`` is checked with its weight)."""
    scaled = {n[: -len(SCALE_SUFFIX)] for n in where if n.endswith(SCALE_SUFFIX)}
    for h in headers.values():
        try:
            check_tensor_dtypes({n: i.dtype for n, i in h.tensors.items() if not n.endswith(SCALE_SUFFIX)}, str(h.path),
                                scaled=scaled)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None


def plan_cast(in_dir, out_dir, *, drop_mtp: bool = True) -> Plan:
    """Validate an FP8 checkpoint and plan its BF16 output; raises CheckpointError naming the problem."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    config, headers, where, warnings = _load_input(in_dir)
    try:
        check_family(config, str(in_dir / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    fp8 = [n for n, (_, i) in where.items() if i.dtype == "F8_E4M3"]
    if not fp8:
        dtypes = sorted({i.dtype for _, i in where.values()})
        raise CheckpointError(
            f"{in_dir} is not an FP8 checkpoint: none of its {len(where)} tensors in {len(headers)} shard(s) is "
            f"float8_e4m3fn (dtypes: {', '.join(dtypes)}). Its weights are usable as they are: skip this step "
            f"(to fix only config.json: python -m dsv3_rl.checkpoint.hf_config {in_dir})"
        )
    other_fp8 = [n for n, (_, i) in where.items() if i.dtype.startswith("F8_") and i.dtype != "F8_E4M3"]
    if other_fp8:
        raise CheckpointError(f"tensor {other_fp8[0]!r} has dtype {where[other_fp8[0]][1].dtype}; "
                              f"only F8_E4M3 (float8_e4m3fn) weights can be cast")
    for n, (p, _info) in where.items():
        if n.endswith(SCALE_SUFFIX):
            w = n[: -len(SCALE_SUFFIX)]
            if w not in where or where[w][1].dtype != "F8_E4M3":
                raise CheckpointError(f"scale {n!r} ({p.name}) has no FP8 weight {w!r} to go with it")
    _check_dtypes(headers, where)
    n_layers = int(config["num_hidden_layers"])
    plan = Plan("fp8_to_bf16", in_dir, out_dir, config, [], {f: h.file_size for f, h in headers.items()},
                {"direction": "fp8_to_bf16", "drop_mtp": drop_mtp}, warnings=warnings)
    for f, h in headers.items():
        out = OutShard(f, h.path)
        for name, info in h.tensors.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            layer = _layer(name)
            if drop_mtp and layer is not None and layer >= n_layers:
                plan.n_dropped += 1
                continue
            if info.dtype == "F8_E4M3":
                spath, sinfo = _check_scale(name, info, where)
                out.entries.append((name, "BF16", info.shape))
                out.sources[name] = Source("dequant", h.path, info, spath, sinfo)
                plan.n_converted += 1
            else:
                out.entries.append((name, info.dtype, info.shape))
                out.sources[name] = Source("copy", h.path, info)
                plan.n_copied += 1
        if out.entries:
            plan.shards.append(out)
    return plan


def plan_quantize(in_dir, out_dir, *, scale_fmt: str = "pow2", drop_mtp: bool = False) -> Plan:
    """Plan BF16 -> DeepSeek blockwise FP8 (the linear weights DeepSeek ships in FP8)."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if scale_fmt not in K.SCALE_FMTS:
        raise CheckpointError(f"unknown scale format {scale_fmt!r} (allowed: {', '.join(K.SCALE_FMTS)})")
    config, headers, where, warnings = _load_input(in_dir)
    try:
        check_family(config, str(in_dir / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    already = [n for n, (_, i) in where.items() if i.dtype.startswith("F8_") or n.endswith(SCALE_SUFFIX)]
    if already:
        raise CheckpointError(f"{in_dir} is already FP8 (e.g. tensor {already[0]!r}); nothing to quantize")
    _check_dtypes(headers, where)
    n_layers = int(config["num_hidden_layers"])
    plan = Plan("bf16_to_fp8", in_dir, out_dir, config, [], {f: h.file_size for f, h in headers.items()},
                {"direction": "bf16_to_fp8", "drop_mtp": drop_mtp, "scale_fmt": scale_fmt}, warnings=warnings)
    for f, h in headers.items():
        out = OutShard(f, h.path)
        for name, info in h.tensors.items():
            layer = _layer(name)
            if drop_mtp and layer is not None and layer >= n_layers:
                plan.n_dropped += 1
                continue
            if FP8_WEIGHT_RE.match(name) and len(info.shape) == 2 and info.dtype in ("BF16", "F16", "F32"):
                sname = name + SCALE_SUFFIX
                out.entries += [(name, "F8_E4M3", info.shape), (sname, "F32", K.scale_shape(info.shape))]
                out.sources[name] = Source("quant_weight", h.path, info)
                out.sources[sname] = Source("quant_scale", h.path, info)
                plan.n_converted += 1
            else:
                out.entries.append((name, info.dtype, info.shape))
                out.sources[name] = Source("copy", h.path, info)
                plan.n_copied += 1
        if out.entries:
            plan.shards.append(out)
    return plan


# ----------------------------------------------------------------------------------- execution


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"--device {device}: CUDA is not available (use --device cpu or auto)")
    if dev.type not in ("cpu", "cuda"):
        raise CheckpointError(f"--device {device}: unsupported (allowed: auto, cpu, cuda, cuda:N)")
    return dev


class _Worker:
    """Converts one shard at a time; one per thread (own fds, CUDA stream)."""

    def __init__(self, plan: Plan, device: torch.device, chunk_bytes: int, progress, stop: threading.Event):
        self.plan, self.device, self.chunk_bytes, self.progress, self.stop = plan, device, chunk_bytes, progress, stop
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _rows_per_chunk(self, info: TensorInfo) -> int:
        row_bytes = max(1, info.nbytes // max(1, info.shape[0]))
        return max(K.BLOCK, (self.chunk_bytes // row_bytes) // K.BLOCK * K.BLOCK)

    def _row_chunks(self, info: TensorInfo):
        step = self._rows_per_chunk(info)
        for r0 in range(0, info.shape[0], step):
            if self.stop.is_set():
                raise Interrupted("stopped")
            yield r0, min(r0 + step, info.shape[0])

    def run(self, shard: OutShard) -> tuple[int, str]:
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                return self._run(shard)
        return self._run(shard)

    def _run(self, shard: OutShard) -> tuple[int, str]:
        fds: dict[Path, int] = {}

        def fd(p: Path) -> int:
            if p not in fds:
                fds[p] = os.open(p, os.O_RDONLY)
            return fds[p]

        writer = ShardWriter(self.plan.out_dir / shard.name, shard.entries)
        try:
            for name in writer.order:
                src = shard.sources[name]
                getattr(self, "_" + src.kind)(writer, name, src, fd)
            result = writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            for f in fds.values():
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f, 0, 0, os.POSIX_FADV_DONTNEED)  # we read each byte once
                os.close(f)
        return result

    def _copy(self, writer, name, src: Source, fd):
        pos, end = src.info.begin, src.info.end
        while pos < end:
            if self.stop.is_set():
                raise Interrupted("stopped")
            n = min(self.chunk_bytes, end - pos)
            writer.write(name, pread_exact(fd(src.shard), n, pos, src.shard))
            self.progress(n)
            pos += n

    def _dequant(self, writer, name, src: Source, fd):
        scale = read_tensor(fd(src.scale_shard), src.scale, src.scale_shard).to(torch.float32)
        self.progress(src.scale.nbytes)
        if self.device.type != "cpu":
            scale = scale.to(self.device)
        for r0, r1 in self._row_chunks(src.info):
            w = read_tensor(fd(src.shard), src.info, src.shard, rows=(r0, r1))
            s = scale[r0 // K.BLOCK: -(-r1 // K.BLOCK)]
            if self.device.type != "cpu":
                w = w.to(self.device)
            writer.write(name, K.dequant(w, s).cpu())
            self.progress(w.numel())

    def _read_float(self, src: Source, fd, r0, r1) -> torch.Tensor:
        x = read_tensor(fd(src.shard), src.info, src.shard, rows=(r0, r1))
        x = x.to(self.device) if self.device.type != "cpu" else x
        if not bool(torch.isfinite(x).all()):
            raise CheckpointError(f"tensor {src.info.name!r} ({src.shard.name}) has NaN/Inf values; cannot quantize")
        return x

    def _quant_scale(self, writer, name, src: Source, fd):
        fmt = self.plan.options["scale_fmt"]
        for r0, r1 in self._row_chunks(src.info):
            x = self._read_float(src, fd, r0, r1)
            writer.write(name, K.quant_scales(K.block_amax(x), fmt).cpu())
            self.progress((r1 - r0) * src.info.nbytes // src.info.shape[0])

    def _quant_weight(self, writer, name, src: Source, fd):
        fmt = self.plan.options["scale_fmt"]
        for r0, r1 in self._row_chunks(src.info):
            q, _ = K.quantize(self._read_float(src, fd, r0, r1), fmt)
            writer.write(name, q.cpu())
            self.progress((r1 - r0) * src.info.nbytes // src.info.shape[0])


@dataclass
class Summary:
    direction: str
    shards: int = 0
    shards_skipped: int = 0
    converted: int = 0
    copied: int = 0
    dropped: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    device: str = "cpu"
    workers: int = 1
    config_changes: list = field(default_factory=list)
    files_copied: int = 0

    def line(self) -> str:
        gb_in, gb_out, t = self.bytes_in / 1e9, self.bytes_out / 1e9, max(self.seconds, 1e-9)
        what = "dequantized" if self.direction == "fp8_to_bf16" else "quantized"
        return (f"{self.direction}: {self.shards} shards ({self.shards_skipped} already done), "
                f"{self.converted + self.copied} tensors ({self.converted} {what}, {self.copied} copied, "
                f"{self.dropped} MTP dropped), {gb_in:.2f} GB in -> {gb_out:.2f} GB out in {self.seconds:.1f} s: "
                f"{gb_in / t:.2f} GB/s in, {gb_out / t:.2f} GB/s out [{self.device}, {self.workers} workers]")


def _other_files(plan: Plan) -> list[Path]:
    """Input files to copy as they are (tokenizer, generation config, code, README...)."""
    out_resolved = plan.out_dir.resolve()
    skip = {INDEX, "config.json", *MANIFEST_NAMES}
    files = []
    for root, dirs, names in os.walk(plan.in_dir):
        rootp = Path(root)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and (rootp / d).resolve() != out_resolved)
        for n in sorted(names):
            if n in skip or n.endswith(".safetensors") or ".tmp-" in n:
                continue
            files.append((rootp / n).relative_to(plan.in_dir))
    return files


def _copy_file(src: Path, dst: Path) -> bool:
    if dst.is_file() and dst.stat().st_size == src.stat().st_size:
        return False
    with atomic_path(dst) as tmp:
        shutil.copy2(src, tmp)
    shutil.copymode(src, dst)  # atomic_path gives the default mode; keep the source's, as copy2 does
    return True


def _load_manifest(plan: Plan, overwrite: bool) -> dict:
    path = manifest_path(plan.out_dir)
    fresh = {"tool": FP8_TOOL, "version": 1, "input": str(plan.in_dir.resolve()),
             "options": plan.options, "shards": {}, "complete": False}
    try:
        manifest, corrupt = read_manifest(plan.out_dir, FP8_TOOL), False
    except JsonFileError:
        manifest, corrupt = None, True  # written atomically, so this is not ours half-written: start over
    if path is None or (manifest is None and not corrupt):  # none, or another tool's
        refuse_foreign_dir(plan.out_dir, MANIFEST, CheckpointError)
        return fresh
    if overwrite:
        _clear_previous(plan.out_dir, path)
        return fresh
    if corrupt:
        return fresh
    if manifest.get("options") != plan.options or manifest.get("input") != fresh["input"]:
        raise CheckpointError(
            f"output dir {plan.out_dir} holds a conversion of {manifest.get('input')} with options "
            f"{manifest.get('options')}; this run is {fresh['input']} with {plan.options}. "
            f"Use the same options, an empty dir, or --force")
    return manifest


def _clear_previous(out_dir: Path, manifest_path: Path) -> None:
    """--force: remove what a previous run of this tool wrote (its shards, index, manifest); nothing else."""
    try:
        old = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, OSError):
        old = {}
    ours = set(old.get("shards", {}))
    try:
        ours |= set(json.loads((out_dir / INDEX).read_text())["weight_map"].values())
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        pass
    for name in sorted(ours):
        if "/" not in name and name.endswith(".safetensors"):
            (out_dir / name).unlink(missing_ok=True)
    (out_dir / INDEX).unlink(missing_ok=True)
    manifest_path.unlink()


def _is_done(plan: Plan, shard: OutShard, manifest: dict, verify: bool) -> bool:
    rec = manifest["shards"].get(shard.name)
    if not rec:
        return False
    st = shard.src.stat()
    out = plan.out_dir / shard.name
    if rec.get("source_size") != st.st_size or rec.get("source_mtime_ns") != st.st_mtime_ns:
        return False
    if not out.is_file() or out.stat().st_size != rec.get("size"):
        return False
    return not verify or sha256_file(out) == rec.get("sha256")


def run(plan: Plan, *, device: str = "auto", workers: int | None = None, chunk_mb: int | None = None,
        verify_existing: bool = False, overwrite: bool = False, skip_space_check: bool = False,
        progress: bool = True, log=print) -> Summary:
    """Execute PLAN (from plan_cast / plan_quantize); returns the Summary."""
    t0 = time.perf_counter()
    in_dir, out_dir = plan.in_dir, plan.out_dir
    if out_dir.exists() and (out_dir.resolve() == in_dir.resolve() or os.path.samefile(out_dir, in_dir)):
        raise CheckpointError(f"output dir {out_dir} is the input dir; choose a different output path")
    dev = resolve_device(device)
    for w in plan.warnings:
        log(f"warning: {w}")
    manifest = _load_manifest(plan, overwrite)
    pending = [s for s in plan.shards if not _is_done(plan, s, manifest, verify_existing)]
    other = _other_files(plan)
    need = sum(s.data_bytes + 64 * 1024 for s in pending)
    need += sum((in_dir / f).stat().st_size for f in other if not (out_dir / f).is_file())
    if not skip_space_check:
        try:
            check_space(out_dir, need, f"{len(pending)} shards to write")
        except Dsv3Error as e:
            raise CheckpointError(str(e)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.tmp-*"):  # an interrupted run's partial files
        stale.unlink()
    n_workers = workers or (min(8, max(2, (os.cpu_count() or 2) // 2)) if dev.type == "cuda"
                            else max(1, min(8, os.cpu_count() or 1)))
    n_workers = max(1, min(n_workers, len(pending) or 1))
    chunk = (chunk_mb or (256 if dev.type == "cuda" else 32)) << 20
    summary = Summary(plan.direction, shards=len(plan.shards), shards_skipped=len(plan.shards) - len(pending),
                      converted=plan.n_converted, copied=plan.n_copied, dropped=plan.n_dropped,
                      device=str(dev), workers=n_workers)

    from tqdm import tqdm

    bar = tqdm(total=sum(s.read_bytes for s in pending), unit="B", unit_scale=True, disable=not progress,
               desc=plan.direction, file=sys.stderr)
    lock = threading.Lock()

    def tick(n):
        with lock:
            bar.update(n)

    stop = threading.Event()
    old_threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n_workers))
    elif pending and plan.direction == "fp8_to_bf16":
        problem = K.self_check(dev)  # also compiles the kernel once, before the threads start
        if problem:
            log(f"warning: the Triton dequant on {dev} is not usable ({problem}); using the eager formula")
            K.disable_triton()
            problem = K.self_check(dev)
            if problem:
                raise CheckpointError(f"dequant on {dev} does not reproduce the formula ({problem}); use --device cpu")
    local = threading.local()

    def convert(shard: OutShard):
        if not hasattr(local, "worker"):
            local.worker = _Worker(plan, dev, chunk, tick, stop)
        return local.worker.run(shard)

    def record(shard: OutShard, size: int, digest: str):
        st = shard.src.stat()
        manifest["shards"][shard.name] = {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns,
                                          "size": size, "sha256": digest,
                                          "tensors": len(shard.entries)}
        write_manifest(out_dir, FP8_TOOL, manifest)

    try:
        with ThreadPoolExecutor(n_workers, thread_name_prefix="fp8cast") as pool:
            futures = {pool.submit(convert, s): s for s in pending}
            try:
                for fut in as_completed(futures):
                    size, digest = fut.result()
                    record(futures[fut], size, digest)
            except BaseException:
                stop.set()
                for f in futures:
                    f.cancel()
                raise
    finally:
        bar.close()
        torch.set_num_threads(old_threads)

    # Finish: index, config, other files, manifest marked complete.
    weight_map = {name: s.name for s in plan.shards for name, _, _ in s.entries}
    total = sum(s.data_bytes for s in plan.shards)
    write_json_atomic(out_dir / INDEX, {"metadata": {"total_size": total},
                                        "weight_map": dict(sorted(weight_map.items()))})
    if plan.direction == "fp8_to_bf16":
        cfg, changes = fix_config(plan.config, keep_mtp=not plan.options["drop_mtp"],
                                  has_score_bias=any(n.endswith(BIAS_SUFFIX) for n in weight_map),
                                  where=str(in_dir / "config.json"))
    else:
        cfg = dict(plan.config)
        if plan.options["drop_mtp"] and cfg.get("num_nextn_predict_layers"):
            cfg["num_nextn_predict_layers"] = 0
        cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
        changes = []
    write_json_atomic(out_dir / "config.json", cfg)
    summary.config_changes = changes
    summary.files_copied = sum(_copy_file(in_dir / f, out_dir / f) for f in other)
    manifest["complete"] = True
    write_manifest(out_dir, FP8_TOOL, manifest)
    summary.bytes_in = sum(plan.in_sizes[s.src.name] for s in pending)
    summary.bytes_out = sum((out_dir / s.name).stat().st_size for s in pending)
    summary.seconds = time.perf_counter() - t0
    return summary


def cast_checkpoint(in_dir, out_dir, *, drop_mtp: bool = True, **run_kwargs) -> Summary:
    """FP8 release -> BF16 HF checkpoint (see module doc). Keyword args as for ``run``."""
    return run(plan_cast(in_dir, out_dir, drop_mtp=drop_mtp), **run_kwargs)


def quantize_checkpoint(in_dir, out_dir, *, scale_fmt: str = "pow2", drop_mtp: bool = False, **run_kwargs) -> Summary:
    """BF16 HF checkpoint -> DeepSeek blockwise FP8. Keyword args as for ``run``."""
    return run(plan_quantize(in_dir, out_dir, scale_fmt=scale_fmt, drop_mtp=drop_mtp), **run_kwargs)


# ----------------------------------------------------------------------------------------- CLI


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--workers", type=positive_int, help="shards converted in parallel (default: from CPU count)")
    p.add_argument("--chunk-mb", type=positive_int, help="rows read per step, MB (default 32 on CPU, 256 on GPU)")
    p.add_argument("--verify-existing", action="store_true",
                   help="re-hash finished output shards before skipping them (default: size check)")
    add_force(p, "--overwrite", help="ignore a previous run's manifest; redo every shard")
    p.add_argument("--skip-space-check", action="store_true", help="do not check free disk space up front")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv3-fp8-cast",
                                description="DeepSeek-V3 FP8 <-> BF16 checkpoint conversion.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cast", help="FP8 release -> BF16 (the RL starting point)")
    c.add_argument("input", nargs="?", help="FP8 checkpoint dir")
    c.add_argument("output", nargs="?", help="BF16 output dir (or --out)")
    c.add_argument("--input-fp8-hf-path", dest="input_flag", help="same as INPUT (DeepSeek's script flag)")
    add_out(c, "--output-bf16-hf-path", dest="output_flag", metavar="DIR",
            help="BF16 output dir, same as OUTPUT (DeepSeek's script flag --output-bf16-hf-path works too)")
    c.add_argument("--keep-mtp", action="store_true",
                   help="keep the MTP layer(s) and num_nextn_predict_layers (default: drop; verl asserts 0)")
    _add_run_args(c)
    q = sub.add_parser("quantize", help="BF16 -> DeepSeek blockwise FP8 (for FP8 rollout)")
    q.add_argument("input", help="BF16 checkpoint dir")
    q.add_argument("output", nargs="?", help="FP8 output dir (or --out)")
    add_out(q, dest="output_flag", metavar="DIR", help="FP8 output dir, same as OUTPUT")
    q.add_argument("--scale-fmt", default="pow2", choices=K.SCALE_FMTS,
                   help="pow2: power-of-two scale_inv, exact round trip (default); amax: amax/448 (V3-0324 style)")
    q.add_argument("--drop-mtp", action="store_true", help="drop model.layers.<num_hidden_layers>.*")
    _add_run_args(q)
    return p


@cli_main(interrupted="finished shards are kept; rerun the same command to resume")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("cast", "quantize", "-h", "--help"):
        argv = ["cast"] + argv  # `dsv3-fp8-cast IN OUT` and DeepSeek's flags
    args = build_parser().parse_args(argv)
    run_kwargs = dict(device=args.device, workers=args.workers, chunk_mb=args.chunk_mb,
                      verify_existing=args.verify_existing, overwrite=args.force,
                      skip_space_check=args.skip_space_check, progress=not args.no_progress)
    if args.cmd == "cast":
        src = one_path("INPUT", args.input, "--input-fp8-hf-path", args.input_flag)
        dst = one_path("OUTPUT", args.output, "--out/--output-bf16-hf-path", args.output_flag)
        summary = cast_checkpoint(src, dst, drop_mtp=not args.keep_mtp, **run_kwargs)
    else:
        summary = quantize_checkpoint(args.input, one_path("OUTPUT", args.output, "--out", args.output_flag),
                                      scale_fmt=args.scale_fmt,
                                      drop_mtp=args.drop_mtp, **run_kwargs)
    for ch in summary.config_changes:
        print(f"config: {ch}")
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
