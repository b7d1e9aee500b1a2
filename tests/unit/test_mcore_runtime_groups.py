"""dsv3_rl.mcore.runtime.init_distributed, called once per job by the correctness worker, must not keep the previous
job's process groups alive: torch holds every group (with NCCL, its communicator and GPU buffers) until it is
destroyed, and megatron's destroy_model_parallel() only forgets them. Found on 4x H100 (2026-11-26): a dozen
layouts per launch ran the GPUs out of memory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import sys
from torch.distributed import distributed_c10d as c10d
from megatron.core import parallel_state as ps
from dsv3_rl.mcore import runtime
from dsv3_rl.models.config_map import Parallel
if sys.argv[1] == "twin":  # the old rebuild: forget the groups, keep them alive
    runtime.destroy_model_parallel_groups = ps.destroy_model_parallel
if sys.argv[1] == "env-twin":  # the old lone-process rendezvous: a free port written into os.environ
    import os
    from dsv3_rl.ports import free_port
    real = runtime.init_single_process_group
    def leaky(timeout_s=600):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        return real(timeout_s)
    runtime.init_single_process_group = leaky
counts = []
for job in range(4):
    runtime.init_distributed(Parallel())
    counts.append(len(c10d._world.pg_map))
runtime.destroy()
import os
print("groups per job", counts)
print("rendezvous left in os.environ:", sorted(k for k in ("MASTER_PORT", "MASTER_ADDR") if k in os.environ))
"""


def _run(mode: str) -> str:
    # a lone process: no rendezvous variables an earlier test of this pytest worker may have left behind
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, cwd=REPO, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _groups_per_job(mode: str) -> list[int]:
    line = next(x for x in _run(mode).splitlines() if x.startswith("groups per job"))
    return [int(x) for x in line.split("[", 1)[1].rstrip("]").split(",")]


def test_rebuilding_groups_does_not_keep_old_ones():
    counts = _groups_per_job("fixed")
    assert counts[0] > 1 and len(set(counts)) == 1, counts  # megatron's groups, the same number after every rebuild
    twin = _groups_per_job("twin")
    assert twin[-1] > twin[0], twin  # the old rebuild: the previous jobs' groups pile up


def test_lone_process_leaves_no_rendezvous_in_the_environment():
    """A lone process (no torchrun) gets its group on an in-memory store: nothing in os.environ that a subprocess
    started later by the same process (a pytest worker's next CLI test) could inherit while the port is still held."""
    assert "rendezvous left in os.environ: []" in _run("fixed")
    assert "rendezvous left in os.environ: ['MASTER_ADDR', 'MASTER_PORT']" in _run("env-twin")  # the old way: caught
