"""Where am I running: node rank, node count, head address, GPUs per node, from the platform's environment.

=========  ===================================================================================================
dlc        PAI-DLC PyTorchJob: ``MASTER_ADDR`` / ``MASTER_PORT`` (rank 0's pod), ``WORLD_SIZE`` = number of
           nodes (pods, not processes), ``RANK`` = node rank, ``KUBERNETES_CONTAINER_RESOURCE_GPU`` = GPUs per
           node. Volcengine-MLP-style variables win where both are set: ``MLP_WORKER_NUM``,
           ``MLP_ROLE_INDEX`` (or ``MLP_WORKER_RACK_RANK_INDEX``), ``MLP_WORKER_0_HOST`` (or
           ``MLP_WORKER_0_PRIMARY_HOST``), ``MLP_WORKER_0_PORT``, ``MLP_WORKER_GPU``.
slurm      ``SLURM_JOB_ID`` with ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``, ``SLURM_NODEID``, the head = first
           host of ``SLURM_JOB_NODELIST`` (``MASTER_ADDR`` if the sbatch script exported it),
           ``SLURM_GPUS_ON_NODE`` / ``SLURM_GPUS_PER_NODE``.
local      none of the above: one node, rank 0, 127.0.0.1.
=========  ===================================================================================================

``DSV3_PLATFORM=dlc|slurm|local`` forces a platform. A malformed value is an error naming the variable.
"""

from __future__ import annotations

import dataclasses
import re
from dsv3_rl.errors import Dsv3Error

PLATFORMS = ("dlc", "slurm", "local")
RAY_PORT = 6379


class PlatformError(Dsv3Error, ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    platform: str
    nnodes: int
    node_rank: int
    head_addr: str
    master_port: int | None
    gpus_per_node: int | None
    ray_port: int = RAY_PORT
    sources: tuple[str, ...] = ()
    """the environment variables the values came from"""

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    def describe(self) -> str:
        g = f", {self.gpus_per_node} GPUs/node" if self.gpus_per_node is not None else ""
        return (f"{self.platform}: node {self.node_rank} of {self.nnodes}{g}, head {self.head_addr} "
                f"(ray port {self.ray_port})" + (f" [from {', '.join(self.sources)}]" if self.sources else ""))


def _int(env: dict, name: str, *, minimum: int = 0) -> int:
    raw = env[name]
    try:
        v = int(str(raw).strip())
    except ValueError:
        raise PlatformError(f"{name}={raw!r} is not an integer") from None
    if v < minimum:
        raise PlatformError(f"{name}={v} must be >= {minimum}")
    return v


def _first(env: dict, *names: str) -> str | None:
    for n in names:
        if env.get(n) not in (None, ""):
            return n
    return None


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``gpu[003-010,012],cpu1`` -> ``gpu003``."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise PlatformError("SLURM_JOB_NODELIST is empty")
    m = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise PlatformError(f"SLURM_JOB_NODELIST={nodelist!r} is not a node list")
    prefix, rng = m.group(1), m.group(3)
    if not rng:
        return prefix
    first = rng.split(",")[0].split("-")[0]
    return prefix + first


def detect(env: dict[str, str]) -> str:
    forced = env.get("DSV3_PLATFORM")
    if forced:
        if forced not in PLATFORMS:
            raise PlatformError(f"DSV3_PLATFORM={forced!r}; allowed: {', '.join(PLATFORMS)}")
        return forced
    if _first(env, "MLP_WORKER_NUM") or all(env.get(k) for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK")):
        return "dlc"
    if env.get("SLURM_JOB_ID") and _first(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        return "slurm"
    return "local"  # includes a single DSW/DLC container that only sets KUBERNETES_CONTAINER_RESOURCE_GPU


def parse(env: dict[str, str]) -> NodeInfo:
    """NodeInfo from ENV; raises PlatformError naming the variable that is missing or malformed."""
    plat = detect(env)
    ray_port = _int(env, "RAY_PORT", minimum=1) if env.get("RAY_PORT") else RAY_PORT
    if plat == "dlc":
        return _parse_dlc(env, ray_port)
    if plat == "slurm":
        return _parse_slurm(env, ray_port)
    g_var = _first(env, "NGPUS_PER_NODE", "MLP_WORKER_GPU", "KUBERNETES_CONTAINER_RESOURCE_GPU")
    gpus = _int(env, g_var, minimum=0) if g_var else None
    return NodeInfo("local", 1, 0, env.get("RAY_HEAD_ADDR") or "127.0.0.1", None, gpus, ray_port,
                    (g_var,) if g_var else ())


def _parse_dlc(env: dict, ray_port: int) -> NodeInfo:
    src = []
    n_var = _first(env, "MLP_WORKER_NUM", "WORLD_SIZE")
    r_var = _first(env, "MLP_ROLE_INDEX", "MLP_WORKER_RACK_RANK_INDEX", "RANK")
    h_var = _first(env, "MLP_WORKER_0_PRIMARY_HOST", "MLP_WORKER_0_HOST", "MASTER_ADDR")
    p_var = _first(env, "MLP_WORKER_0_PORT", "MASTER_PORT")
    g_var = _first(env, "MLP_WORKER_GPU", "KUBERNETES_CONTAINER_RESOURCE_GPU")
    missing = [what for what, v in (("node count (MLP_WORKER_NUM or WORLD_SIZE)", n_var),
                                    ("node rank (MLP_ROLE_INDEX or RANK)", r_var),
                                    ("head address (MLP_WORKER_0_HOST or MASTER_ADDR)", h_var)) if v is None]
    if missing:
        raise PlatformError(f"PAI-DLC environment incomplete: no {'; no '.join(missing)}")
    nnodes = _int(env, n_var, minimum=1)
    rank = _int(env, r_var, minimum=0)
    if rank >= nnodes:
        raise PlatformError(f"{r_var}={rank} but {n_var}={nnodes}: the node rank must be below the node count")
    port = _int(env, p_var, minimum=1) if p_var else None
    gpus = _int(env, g_var, minimum=0) if g_var else None
    src = [v for v in (n_var, r_var, h_var, p_var, g_var) if v]
    return NodeInfo("dlc", nnodes, rank, env[h_var].strip(), port, gpus, ray_port, tuple(src))


def _parse_slurm(env: dict, ray_port: int) -> NodeInfo:
    n_var = _first(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nnodes = _int(env, n_var, minimum=1)
    r_var = _first(env, "SLURM_NODEID", "SLURM_PROCID")
    if r_var is None:
        raise PlatformError("Slurm environment without SLURM_NODEID: run the launcher under srun (one task per node)")
    rank = _int(env, r_var, minimum=0)
    if rank >= nnodes:
        raise PlatformError(f"{r_var}={rank} but {n_var}={nnodes}: run one task per node (srun --ntasks-per-node=1)")
    if env.get("MASTER_ADDR"):
        head, h_var = env["MASTER_ADDR"].strip(), "MASTER_ADDR"
    else:
        nl = _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nl is None:
            raise PlatformError("Slurm environment without SLURM_JOB_NODELIST or MASTER_ADDR: cannot find the head node")
        head, h_var = first_host(env[nl]), nl
    g_var = _first(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")
    gpus = None
    if g_var:
        raw = env[g_var].split(":")[-1].split("(")[0]  # "gpu:h100:8" / "8(x2)"
        try:
            gpus = int(raw)
        except ValueError:
            raise PlatformError(f"{g_var}={env[g_var]!r}: cannot read a GPU count") from None
    port = _int(env, "MASTER_PORT", minimum=1) if env.get("MASTER_PORT") else None
    src = tuple(v for v in (n_var, r_var, h_var, g_var) if v)
    return NodeInfo("slurm", nnodes, rank, head, port, gpus, ray_port, src)


def local_gpus() -> int:
    """CUDA GPUs this process can see (``torch.cuda.device_count()``, which honours ``CUDA_VISIBLE_DEVICES``)."""
    import torch

    return int(torch.cuda.device_count())


def mem_total_bytes(path: str = "/proc/meminfo") -> float | None:
    """This machine's MemTotal in bytes (what Ray's memory monitor takes as the node's limit), None where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


#: Ray's default for ``RAY_memory_usage_threshold``: its memory monitor kills workers once the node's used memory
#: passes this fraction of its total (the limit it reports is MemTotal: 125.85 GiB on the 128 GiB H100 box, 2026-12-07)
RAY_MEMORY_THRESHOLD = 0.95


def ray_memory_threshold(env: dict[str, str]) -> float:
    """``RAY_memory_usage_threshold`` from the run's environment, Ray's default 0.95 where unset."""
    raw = env.get("RAY_memory_usage_threshold")
    try:
        return float(raw) if raw else RAY_MEMORY_THRESHOLD
    except ValueError:
        raise PlatformError(f"RAY_memory_usage_threshold={raw!r}: not a number") from None
