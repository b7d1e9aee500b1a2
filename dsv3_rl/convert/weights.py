"""DeepSeek-V3 weights: HF safetensors <-> megatron-core distributed checkpoint (torch_dist).

``hf_to_mcore`` writes one checkpoint of *global* tensors that megatron-core loads at any
TP/PP/EP/ETP/VPP layout (and verl loads through ``actor.megatron.use_dist_checkpointing``);
``mcore_to_hf`` writes HF safetensors (hub layout: one tensor per expert) with index, config and
tokenizer files, from our checkpoints or from training checkpoints saved at any layout.

Both stream: a rank holds one output file (mcore: ``--file-gb``) or one read batch + one HF shard
(``--shard-gb``) of tensors, never the model. Both run as one process or under ``torchrun`` (any
number of ranks/nodes sharing a filesystem; gloo, CPU tensors: the work is I/O).

Nothing half-written ever looks complete: output goes to ``OUT.incomplete/`` and is renamed to
``OUT`` when every rank is done and the manifest is written. A rerun after an interruption restarts
hf->mcore from scratch and resumes mcore->hf at the first missing shard; a rerun onto a complete
output verifies it and stops (``--force`` redoes it).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import mcore_ckpt
from dsv3_rl.checkpoint.hf_config import ConfigError, check_family, check_tensor_dtypes, load_config
from dsv3_rl.checkpoint.outputs import CONVERT_TOOL, MANIFEST, manifest_path, read_manifest, write_manifest
from dsv3_rl.checkpoint.outputs import NAMES as MANIFEST_NAMES
from dsv3_rl.checkpoint.safetensors_io import (CheckpointFormatError, HFReader, read_header, shard_names, st_dtype,
                                              write_shard)
from dsv3_rl.errors import Dsv3Error, check_space, describe_oserror
from dsv3_rl.fs import fsync_dir, replace_dir, write_json_atomic

from dsv3_rl.models.config_map import UnsupportedConfigError
from .mcore_ckpt import Chunk
from .names import Item, MappingError, Plan, build_plan

HF_META = "hf_meta"
INCOMPLETE = ".incomplete"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".gguf")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Never cast: the router's expert bias is an fp32 buffer in megatron and F32 in DeepSeek's release.
KEEP_DTYPE = ("e_score_correction_bias", "mlp.router.expert_bias")


def _cast_for(name: str, cast: torch.dtype | None) -> torch.dtype | None:
    return None if cast is None or name.endswith(KEEP_DTYPE) else cast


class ConvertError(Dsv3Error, RuntimeError):
    """Conversion refused or failed; the message names the file/tensor/key and what was expected."""


# --------------------------------------------------------------------------- process group

@dataclasses.dataclass
class Dist:
    rank: int = 0
    world: int = 1
    owned: bool = False
    """This module created the process group (and destroys it in :meth:`close`)."""

    @property
    def on(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.on:
            torch.distributed.barrier()

    def broadcast(self, obj: Any) -> Any:
        if not self.on:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.owned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self.owned = False

    def gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out


def init_dist(timeout_h: float = 12.0) -> Dist:
    """gloo process group from torchrun's env (RANK/WORLD_SIZE/MASTER_*); one process when unset."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.distributed.is_initialized():
        return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size())
    timeout = datetime.timedelta(hours=timeout_h)
    if world > 1:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:  # megatron's DCP translation asks for the rank: a one-process group, no rendezvous
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             timeout=timeout)
    _import_megatron()
    return Dist(rank, world, owned=True)


def _import_megatron() -> None:
    """Import what the conversion uses up front (seconds on a loaded machine), outside the timed part."""
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401


# --------------------------------------------------------------------------- shared helpers

def load_hf_config(hf_dir: Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ConvertError(f"{path} does not exist (an HF model directory has a config.json)")
    try:
        cfg = load_config(path, family=False)
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "deepseek_v3" or (archs and archs != ["DeepseekV3ForCausalLM"]):
        raise ConvertError(f"{path}: model_type={cfg.get('model_type')!r}, architectures={archs}: this converter is for "
                           f"DeepSeek-V3 (model_type 'deepseek_v3', DeepseekV3ForCausalLM)")
    try:
        check_family(cfg, str(path))
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    return cfg


def _check_dtypes(dtypes: dict[str, str], where: Path, scaled=()) -> None:
    try:
        check_tensor_dtypes(dtypes, str(where), scaled)
    except ConfigError as e:
        raise ConvertError(str(e)) from None


def _preflight(out: Path, need: int, what: str) -> None:
    """Disk space (and writability) for NEED bytes more at OUT (its .incomplete sibling counts as written)."""
    work = out.with_name(out.name + INCOMPLETE)
    done = sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) if work.is_dir() else 0
    try:
        check_space(out.parent, max(0, need - done), what)
    except Dsv3Error as e:
        raise ConvertError(str(e)) from None


def _write_failed(e: BaseException, work: Path, d: Dist) -> ConvertError | None:
    """A handled write failure (disk full, read-only, torch.save's 'unexpected pos'): remove the partial
    output and return the error to raise; None for anything else (left as it is: never complete, and a
    rerun restarts hf->mcore or resumes mcore->hf)."""
    if isinstance(e, OSError):
        msg = describe_oserror(e) if e.filename else f"{work}: {describe_oserror(e)}"
    elif isinstance(e, RuntimeError) and ("unexpected pos" in str(e) or "enforce fail" in str(e)):
        msg = f"{work}: write failed, disk full? ({' '.join(str(e).split())[:200]})"
    else:
        return None
    if d.rank == 0:
        shutil.rmtree(work, ignore_errors=True)
    return ConvertError(f"{msg}; the partial output was removed")


def active_params(cfg: dict) -> tuple[float, float]:
    """(total, activated-per-token) parameters, in billions, without MTP layers."""
    g = cfg.get
    V, H, n = g("vocab_size"), g("hidden_size"), g("num_attention_heads")
    q, kv = g("q_lora_rank") or 0, g("kv_lora_rank")
    nope, rope, v = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
    attn = (H * q + q + q * n * (nope + rope) if q else H * n * (nope + rope)) + H * (kv + rope) + kv \
        + kv * n * (nope + v) + n * v * H + 2 * H
    L, kd = g("num_hidden_layers"), g("first_k_dense_replace") or 0
    E, Fm, k, ns = g("n_routed_experts") or 0, g("moe_intermediate_size") or 0, g("num_experts_per_tok") or 0, g("n_shared_experts") or 0
    dense = 3 * H * g("intermediate_size")
    base = 2 * V * H + H + L * attn + kd * dense + (L - kd) * (E * H + E)
    total = base + (L - kd) * 3 * H * Fm * (E + ns)
    active = base + (L - kd) * 3 * H * Fm * (k + ns)
    return total / 1e9, active / 1e9


def size_tag(cfg: dict) -> str:
    """Pai-Megatron-Patch's MODEL_SIZE name for a config: ``A37B`` for DeepSeek-V3 671B."""
    return f"A{int(active_params(cfg)[1])}B"


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def _copy_hf_aux(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Config, tokenizer, generation config, remote code: every small non-weight top-level file."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name in skip or p.name.endswith(WEIGHT_SUFFIXES) or p.name.startswith("."):
            continue
        if p.name in ("model.safetensors.index.json", "pytorch_model.bin.index.json", *MANIFEST_NAMES):
            continue
        if p.stat().st_size > 64 << 20:
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


def _prepare_out(out: Path, force: bool, d: Dist, kind: str) -> tuple[Path, dict | None]:
    """(work dir, manifest of an existing complete output or None). Rank 0 decides; all ranks follow."""
    work = out.with_name(out.name + INCOMPLETE)
    decision: dict = {}
    if d.rank == 0:
        if out.exists() and not force:
            try:
                existing = read_manifest(out, CONVERT_TOOL)
            except Dsv3Error as e:  # not JSON: decided here, so that every rank raises it
                existing, decision = None, {"error": f"{e}; remove it or pass --force"}
            if existing is not None:
                decision = {"existing": existing}
            elif not decision:
                decision = {"error": f"{out} exists and is not a conversion output of this tool (no {MANIFEST}); "
                                     f"remove it or pass --force"}
        if not decision:
            out.parent.mkdir(parents=True, exist_ok=True)
            if kind == "mcore" and work.exists():
                print(f"[convert] removing {work} left by an interrupted run; restarting", flush=True)
                shutil.rmtree(work)
            work.mkdir(exist_ok=True)
    decision = d.broadcast(decision)
    if "error" in decision:
        raise ConvertError(decision["error"])
    return work, decision.get("existing")


def _finish_out(work: Path, out: Path, d: Dist) -> None:
    d.barrier()
    if d.rank == 0:
        fsync_dir(work)
        replace_dir(work, out)
        fsync_dir(out.parent)
    d.barrier()


def _split_rows(rows: int, row_bytes: int, max_bytes: int) -> list[tuple[int, int]]:
    n = max(1, min(rows, math.ceil(rows * row_bytes / max_bytes)))
    bounds = [round(i * rows / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def _partition(sizes: list[int], world: int) -> list[int]:
    """Contiguous split of work items over ranks, balanced by bytes: the owner rank of each item."""
    total = sum(sizes) or 1
    owners, acc = [], 0
    for s in sizes:
        owners.append(min(world - 1, int((acc + s / 2) * world / total)))
        acc += s
    return owners


class _Progress:
    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                            mininterval=1.0, file=sys.stderr)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class Summary:
    direction: str
    tensors: int
    bytes: int
    seconds: float
    ranks: int
    peak_rss_gb: float
    out: str
    skipped: bool = False
    note: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)

    def line(self) -> str:
        if self.skipped:
            return f"[convert] {self.direction}: {self.out} is already complete ({self.note}); nothing to do (--force redoes it)"
        return (f"[convert] {self.direction}: {self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {self.seconds:.1f} s "
                f"= {self.gb_per_s:.3f} GB/s on {self.ranks} rank(s), peak RSS {self.peak_rss_gb:.2f} GB/rank -> {self.out}"
                + (f" ({self.note})" if self.note else ""))


# --------------------------------------------------------------------------- HF -> megatron

def check_hf(plan: Plan, reader: HFReader) -> dict[str, torch.dtype]:
    """Every tensor present, known and of the right shape; returns the dtype of each mcore key."""
    have = reader.tensors
    fp8 = [n for n, r in have.items() if n.endswith("weight_scale_inv") or r.dtype.startswith("F8")]
    if fp8:
        raise ConvertError(f"{reader.root}: FP8 checkpoint (e.g. {fp8[0]!r}); cast it to BF16 first "
                           f"(`python -m dsv3_rl.checkpoint.fp8`) and convert the BF16 copy")
    unknown = sorted(n for n in have if n not in plan.hf_shapes and n not in plan.hf_ignored
                     and not n.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ConvertError(f"{reader.root}: {len(unknown)} tensor(s) the DeepSeek-V3 mapping does not know, e.g. "
                           f"{unknown[:5]} (a checkpoint of another architecture or config?)")
    missing = [n for n in plan.hf_shapes if n not in have]
    if missing:
        raise ConvertError(f"{reader.root}: {len(missing)} tensor(s) missing, e.g. {missing[:5]} "
                           f"(config.json promises them; an incomplete download?)")
    for n, shape in plan.hf_shapes.items():
        if tuple(have[n].shape) != tuple(shape):
            raise ConvertError(f"{reader.root}: tensor {n!r} has shape {list(have[n].shape)}, the config says {list(shape)} "
                               f"({have[n].path.name})")
    dtypes = {}
    for it in plan.items:
        dts = {have[s].torch_dtype for s in it.sources}
        if len(dts) != 1:
            raise ConvertError(f"{it.key} would combine tensors of different dtypes {sorted(map(str, dts))}: {it.sources[:4]}")
        for k in it.keys:
            dtypes[k] = dts.pop() if len(dts) else dtypes[it.key]
    return dtypes


def _item_chunks(it: Item, dtype: torch.dtype, max_bytes: int) -> list[Chunk]:
    out = []
    for key in it.keys:
        if it.kind in ("experts", "experts_glu"):
            E = it.shape[0]
            for e in range(E):
                out.append(Chunk(key, it.shape, (e,) + (0,) * (len(it.shape) - 1), (1,) + it.shape[1:], dtype))
        else:
            row_bytes = math.prod(it.shape[1:]) * dtype.itemsize
            for r0, r1 in _split_rows(it.shape[0], row_bytes, max_bytes):
                out.append(Chunk(key, it.shape, (r0,) + (0,) * (len(it.shape) - 1), (r1 - r0,) + it.shape[1:], dtype))
    return out


def _produce_from_hf(it: Item, c: Chunk, reader: HFReader, cast: torch.dtype | None) -> torch.Tensor:
    if it.kind in ("experts", "experts_glu"):
        e = c.offset[0]
        if it.kind == "experts":
            t = reader.read(it.sources[e])
        else:
            t = torch.cat([reader.read(it.sources[2 * e]), reader.read(it.sources[2 * e + 1])], 0)
        t = t.unsqueeze(0)
    else:
        r0, r1 = c.offset[0], c.offset[0] + c.shape[0]
        parts = []
        for name, _, v0, v1 in it.hf_views():
            a, b = max(r0, v0), min(r1, v1)
            if a < b:
                parts.append(reader.read(name, (a - v0, b - v0)))
        t = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    return t if cast is None or t.dtype == cast else t.to(cast)


def _hf_to_mcore(hf_dir: Path, out: Path, keep_mtp: bool = False, spec: str = "both", dtype: str | None = None,
                chunk_mb: int = 512, file_gb: float = 1.0, force: bool = False, progress: bool = True,
                d: Dist | None = None) -> Summary:
    """Convert an HF DeepSeek-V3 checkpoint (BF16/FP32 safetensors) into a megatron torch_dist checkpoint."""
    assert d is not None
    t0 = time.perf_counter()
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = load_hf_config(hf_dir)
    try:
        plan = build_plan(cfg, keep_mtp=keep_mtp, spec=spec)
    except (UnsupportedConfigError, MappingError) as e:
        raise ConvertError(f"{hf_dir / 'config.json'}: {e}") from None
    reader = HFReader(hf_dir)
    by_file: dict[Path, dict[str, str]] = {}
    for n, r in reader.tensors.items():
        by_file.setdefault(r.path, {})[n] = r.dtype
    scaled = {n.removesuffix("_scale_inv") for n in reader.tensors if n.endswith("_scale_inv")}
    for f, dts in by_file.items():
        _check_dtypes(dts, f, scaled)
    if force or manifest_path(out) is None:
        need = sum(math.prod(shape) * (_DTYPES[dtype].itemsize if dtype else reader.tensors[n].torch_dtype.itemsize)
                   for n, shape in plan.hf_shapes.items() if n in reader.tensors)
        _preflight(out, need, "the megatron checkpoint")
    work, existing = _prepare_out(out, force, d, "mcore")
    if existing is not None:
        want = {"source": str(hf_dir.resolve()), "keep_mtp": keep_mtp, "spec": spec, "dtype": dtype}
        have = {k: existing.get(k) for k in want}
        if have != want:
            raise ConvertError(f"{out} holds a conversion with other settings ({have}, asked {want}); --force replaces it")
        verify_mcore(out, plan)
        return Summary("hf->mcore", existing.get("tensors", 0), existing.get("bytes", 0), 0.0, d.world, peak_rss_gb(),
                       str(out), skipped=True, note=f"{existing.get('tensors')} tensors verified against the config")
    key_dtype = check_hf(plan, reader)
    cast = _DTYPES[dtype] if dtype else None
    for name, main in plan.mtp_duplicates.items():  # megatron shares these with the main embedding/head
        if d.rank == 0 and not torch.equal(reader.read(name), reader.read(main)):
            raise ConvertError(f"{hf_dir}: MTP tensor {name!r} differs from {main!r}; megatron's MTP shares the main "
                               f"embedding/output layer and cannot hold a separate copy")
    chunks: list[tuple[Item, Chunk]] = []
    for it in plan.items:
        for c in _item_chunks(it, _cast_for(it.key, cast) or key_dtype[it.key], chunk_mb << 20):
            chunks.append((it, c))
    owners = _partition([c.nbytes for _, c in chunks], d.world)
    mine = [(it, c) for (it, c), r in zip(chunks, owners) if r == d.rank]
    objects = [(x.key, x.shape, x.offset) for i, x in enumerate(plan.extra_states) if i % d.world == d.rank]
    by_loc = {(c.key, c.offset): it for it, c in mine}
    bar = _Progress(sum(c.nbytes for _, c in mine), f"hf->mcore rank {d.rank}", progress and d.rank == 0)

    def produce(c: Chunk) -> torch.Tensor:
        t = _produce_from_hf(by_loc[(c.key, c.offset)], c, reader, _cast_for(c.key, cast))
        bar.update(c.nbytes)
        return t

    try:
        mcore_ckpt.save(work, [c for _, c in mine], objects, produce, file_bytes=int(file_gb * (1 << 30)))
    except Exception as e:  # disk full / read-only: remove the partial output (a crash leaves it; a rerun restarts)
        err = _write_failed(e, work, d)
        if err is not None:
            raise err from None
        raise
    bar.close()
    reader.close()
    stats = d.gather((len(mine), sum(c.nbytes for _, c in mine), peak_rss_gb()))
    n_tensors = sum(len(it.keys) for it in plan.items)
    total_bytes = sum(s[1] for s in stats)
    if d.rank == 0:
        aux = _copy_hf_aux(hf_dir, work / HF_META)
        cfg_out = dict(cfg)
        if not keep_mtp:
            cfg_out["num_nextn_predict_layers"] = 0
        write_json_atomic(work / HF_META / "config.json", cfg_out)
        write_manifest(work, CONVERT_TOOL, {
            "complete": True, "direction": "hf->mcore", "format": "megatron-core torch_dist, global tensors",
            "source": str(hf_dir.resolve()), "keep_mtp": keep_mtp, "spec": spec, "dtype": dtype, "size_tag": size_tag(cfg),
            "tensors": n_tensors, "chunks": len(chunks), "extra_states": len(plan.extra_states), "bytes": total_bytes,
            "hf_meta_files": aux, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        })
    _finish_out(work, out, d)
    return Summary("hf->mcore", n_tensors, total_bytes, time.perf_counter() - t0, d.world,
                   max(s[2] for s in stats), str(out))


def verify_mcore(path: Path, plan: Plan) -> None:
    """The checkpoint holds every tensor of ``plan`` with its global shape and its data files exist."""
    tensors, _ = mcore_ckpt.read_metadata(path)
    for it in plan.items:
        for k in it.keys:
            if k not in tensors:
                raise ConvertError(f"{path}: tensor {k!r} missing")
            if tensors[k].shape != it.shape:
                raise ConvertError(f"{path}: {k} has shape {list(tensors[k].shape)}, expected {list(it.shape)}")
    try:
        mcore_ckpt.check_data_files(path)
    except CheckpointFormatError as e:
        raise ConvertError(str(e)) from None


# --------------------------------------------------------------------------- megatron -> HF

@dataclasses.dataclass(frozen=True)
class _Source:
    key: str
    expert: int | None
    rows: tuple[int, int]


def _mcore_sources(plan: Plan, tensors: dict[str, mcore_ckpt.TensorMeta], path: Path) -> dict[str, _Source]:
    """HF tensor name -> (megatron key present in the checkpoint, expert, rows of that slice)."""
    out = {}
    for it in plan.items:
        present = [k for k in it.keys if k in tensors]
        if not present:
            hf = it.sources[0] if len(it.sources) < 3 else f"{it.sources[0]} ... ({len(it.sources)} tensors)"
            raise ConvertError(f"{path}: megatron tensor {it.key!r} missing"
                               + (f" (nor its TE-spec name {it.aliases[0]!r})" if it.aliases else "") + f"; HF {hf} needs it")
        key = present[0]
        if tensors[key].shape != it.shape:
            raise ConvertError(f"{path}: {key} has global shape {list(tensors[key].shape)}, the HF config needs {list(it.shape)}")
        for name, e, r0, r1 in it.hf_views():
            out[name] = _Source(key, e, (r0, r1))
    return out


def _check_mcore_keys(plan: Plan, tensors: dict, path: Path) -> list[str]:
    known = {k for it in plan.items for k in it.keys}
    model = [k for k in tensors if k.startswith(mcore_ckpt.MODEL_PREFIXES)]
    unknown = sorted(k for k in model if k not in known)
    if unknown:
        raise ConvertError(f"{path}: {len(unknown)} model tensor(s) the DeepSeek-V3 mapping does not know, e.g. "
                           f"{unknown[:5]} (another architecture, or a config that does not match the checkpoint?)")
    return sorted(k for k in tensors if not k.startswith(mcore_ckpt.MODEL_PREFIXES))


def _norm_aliases_agree(plan: Plan, reader: mcore_ckpt.Reader, path: Path) -> None:
    """Where a checkpoint holds both spec names of a norm, they must be the same tensor."""
    for it in plan.items:
        present = [k for k in it.keys if k in reader.tensors]
        if len(present) > 1:
            ts = reader.read([Chunk(k, it.shape, (0,) * len(it.shape), it.shape, reader.tensors[k].dtype) for k in present])
            if not all(torch.equal(ts[0], t) for t in ts[1:]):
                raise ConvertError(f"{path}: {present} hold different values; which one the model used is ambiguous")


def _shard_plan(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if shards[-1] and acc + sizes[n] > max_bytes:
            shards.append([])
            acc = 0
        shards[-1].append(n)
        acc += sizes[n]
    return shards


def _complete_shard(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bool:
    if not path.exists():
        return False
    try:
        hdr = read_header(path).tensors
    except (OSError, ValueError):  # unreadable or malformed: not a complete shard, write it again
        return False
    return list(hdr) == [n for n, _, _ in entries] and all(
        hdr[n].dtype == st_dtype(dt) and tuple(hdr[n].shape) == tuple(s) for n, dt, s in entries)


def _mcore_to_hf(mcore_dir: Path, out: Path, hf_dir: Path | None = None, dtype: str | None = None,
                shard_gb: float = 4.0, read_batch_mb: int = 1024, force: bool = False, progress: bool = True,
                d: Dist | None = None) -> Summary:
    """Convert a megatron torch_dist checkpoint (any layout) of DeepSeek-V3 into HF safetensors."""
    assert d is not None
    t0 = time.perf_counter()
    mcore_dir, out = Path(mcore_dir), Path(out)
    meta_dir = Path(hf_dir) if hf_dir else mcore_dir / HF_META
    if not (meta_dir / "config.json").exists():
        raise ConvertError(f"no HF config for {mcore_dir}: pass the original HF model directory (--hf-dir / HF_DIR); "
                           f"{meta_dir / 'config.json'} does not exist")
    cfg = load_hf_config(meta_dir)
    try:
        reader = mcore_ckpt.Reader(mcore_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ConvertError(str(e)) from None
    has_mtp = any(k.startswith("mtp.layers.") for k in reader.tensors)
    n_mtp = cfg.get("num_nextn_predict_layers", 0) or 0
    if has_mtp and not n_mtp:
        raise ConvertError(f"{mcore_dir} has MTP layers but {meta_dir / 'config.json'} has num_nextn_predict_layers=0")
    try:
        plan = build_plan(cfg, keep_mtp=has_mtp, spec="both")
    except (UnsupportedConfigError, MappingError) as e:
        raise ConvertError(f"{meta_dir / 'config.json'}: {e}") from None
    ignored = _check_mcore_keys(plan, reader.tensors, mcore_dir)
    sources = _mcore_sources(plan, reader.tensors, mcore_dir)
    cast = _DTYPES[dtype] if dtype else None
    hf_names = list(plan.hf_shapes)
    hf_dtype = {n: _cast_for(n, cast) or reader.tensors[sources[n].key].dtype if n in sources else None for n in hf_names}
    for n, main in plan.mtp_duplicates.items():
        hf_dtype[n] = hf_dtype[main]
    sizes = {n: math.prod(plan.hf_shapes[n]) * hf_dtype[n].itemsize for n in hf_names}
    shards = _shard_plan(hf_names, sizes, int(shard_gb * (1 << 30)))
    files = list(shard_names(len(shards)))
    fingerprint = hashlib.sha256(json.dumps([[n, str(hf_dtype[n]), plan.hf_shapes[n]] for n in hf_names]
                                            + [len(s) for s in shards]).encode()).hexdigest()
    _check_dtypes({n: st_dtype(dt) for n, dt in hf_dtype.items() if dt is not None}, mcore_dir)
    if force or manifest_path(out) is None:
        _preflight(out, sum(sizes.values()), "the HF checkpoint")
    work, existing = _prepare_out(out, force, d, "hf")
    if existing is not None:
        if existing.get("fingerprint") != fingerprint:
            raise ConvertError(f"{out} holds a conversion with other settings or from another checkpoint; --force replaces it")
        return Summary("mcore->hf", existing.get("tensors", 0), existing.get("bytes", 0), 0.0, d.world, peak_rss_gb(),
                       str(out), skipped=True, note="same tensors, dtypes and shards")
    if d.rank == 0:
        plan_file = work / "convert_plan.json"
        if plan_file.exists() and json.loads(plan_file.read_text()).get("fingerprint") != fingerprint:
            print(f"[convert] {work} is from a run with other settings; restarting", flush=True)
            shutil.rmtree(work)
            work.mkdir()
        write_json_atomic(plan_file, {"fingerprint": fingerprint, "files": files})
        _norm_aliases_agree(plan, reader, mcore_dir)
    d.barrier()

    owners = _partition([sum(sizes[n] for n in s) for s in shards], d.world)
    mine = [i for i, r in enumerate(owners) if r == d.rank]
    bar = _Progress(sum(sizes[n] for i in mine for n in shards[i]), f"mcore->hf rank {d.rank}", progress and d.rank == 0)
    resumed = 0
    batch_bytes = read_batch_mb << 20

    def chunk_for(n: str) -> Chunk:
        s = sources[plan.mtp_duplicates.get(n, n)]
        meta = reader.tensors[s.key]
        if s.expert is None:
            return Chunk(s.key, meta.shape, (0,) * len(meta.shape), meta.shape, meta.dtype)
        return Chunk(s.key, meta.shape, (s.expert,) + (0,) * (len(meta.shape) - 1), (1,) + meta.shape[1:], meta.dtype)

    for i in mine:
        names = shards[i]
        entries = [(n, hf_dtype[n], plan.hf_shapes[n]) for n in names]
        path = work / files[i]
        if _complete_shard(path, entries):
            resumed += 1
            bar.update(sum(sizes[n] for n in names))
            continue
        cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        pos = {n: j for j, n in enumerate(names)}

        def produce(n: str, cache=cache, names=names, pos=pos) -> torch.Tensor:  # called in this iteration only
            c = chunk_for(n)
            if (c.key, c.offset) not in cache:
                cache.clear()
                want, acc = [], 0
                for m in names[pos[n]:]:  # this tensor's chunk and the next ones, up to the batch size
                    cm = chunk_for(m)
                    if (cm.key, cm.offset) in {(w.key, w.offset) for w in want}:
                        continue
                    if want and acc + cm.nbytes > batch_bytes:
                        break
                    want.append(cm)
                    acc += cm.nbytes
                for cm, t in zip(want, reader.read(want)):
                    cache[(cm.key, cm.offset)] = t
            s = sources[plan.mtp_duplicates.get(n, n)]
            t = cache[(c.key, c.offset)]
            if s.expert is not None:
                t = t[0]
            t = t[s.rows[0]:s.rows[1]]
            return t if t.dtype == hf_dtype[n] else t.to(hf_dtype[n])

        try:
            write_shard(path, entries, produce, on_tensor=lambda _n, b: bar.update(b))
        except Exception as e:  # disk full / read-only: remove the partial output (an interrupt keeps it)
            err = _write_failed(e, work, d)
            if err is not None:
                raise err from None
            raise
        cache = {}
    bar.close()
    stats = d.gather((sum(len(shards[i]) for i in mine), sum(sizes[n] for i in mine for n in shards[i]),
                      peak_rss_gb(), resumed))
    total = sum(s[1] for s in stats)
    if d.rank == 0:
        weight_map = {n: files[i] for i, s in enumerate(shards) for n in s}
        write_json_atomic(work / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
        aux = _copy_hf_aux(meta_dir, work, skip=("config.json",))
        cfg_out = dict(cfg)
        cfg_out["num_nextn_predict_layers"] = len({k.split(".")[2] for k in reader.tensors if k.startswith("mtp.layers.")})
        write_json_atomic(work / "config.json", cfg_out)
        (work / "convert_plan.json").unlink()
        write_manifest(work, CONVERT_TOOL, {
            "complete": True, "direction": "mcore->hf", "source": str(mcore_dir.resolve()), "fingerprint": fingerprint,
            "tensors": len(hf_names), "bytes": total, "shards": len(files), "hf_meta_files": aux,
            "ignored_checkpoint_keys": len(ignored),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        })
    _finish_out(work, out, d)
    n_resumed = sum(s[3] for s in stats)
    note = (f"resumed: {n_resumed} shard(s) already written" if n_resumed else "") + \
        (f"{'; ' if n_resumed else ''}ignored {len(ignored)} non-model key(s)" if ignored else "")
    return Summary("mcore->hf", len(hf_names), total, time.perf_counter() - t0, d.world,
                   max(s[2] for s in stats), str(out), note=note)


def compare_hf(a: Path, b: Path) -> list[str]:
    """Differences between two HF checkpoints, tensor by tensor (names, dtypes, shapes, bytes)."""
    ra, rb = HFReader(a), HFReader(b)
    diffs = []
    for n in sorted(set(ra.tensors) | set(rb.tensors)):
        if n not in ra.tensors or n not in rb.tensors:
            diffs.append(f"{n}: only in {a if n in ra.tensors else b}")
            continue
        ta, tb = ra.tensors[n], rb.tensors[n]
        if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
            diffs.append(f"{n}: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}")
            continue
        if not torch.equal(ra.read(n).view(torch.uint8), rb.read(n).view(torch.uint8)):  # bytes, without copying them
            diffs.append(f"{n}: bytes differ")
    ra.close()
    rb.close()
    return diffs


def hf_to_mcore(*args, d: Dist | None = None, **kwargs) -> Summary:
    """Convert an HF DeepSeek-V3 checkpoint (BF16/FP32 safetensors) into a megatron torch_dist checkpoint
    that loads at any layout. See :func:`_hf_to_mcore` for the options."""
    own = d is None
    d = d or init_dist()
    try:
        return _hf_to_mcore(*args, d=d, **kwargs)
    finally:
        if own:
            d.close()


def mcore_to_hf(*args, d: Dist | None = None, **kwargs) -> Summary:
    """Convert a megatron torch_dist checkpoint (any layout) of DeepSeek-V3 into HF safetensors (hub
    layout, index, config, tokenizer). See :func:`_mcore_to_hf` for the options."""
    own = d is None
    d = d or init_dist()
    try:
        return _mcore_to_hf(*args, d=d, **kwargs)
    finally:
        if own:
            d.close()
