"""Multi-node Ray bring-up on one machine: a head and a worker launcher process on loopback.

The head process runs ``ray_cluster.run_head`` (``ray start --head --block`` in its own process group,
waits for 2 nodes, runs a job that places one task on each node with NodeAffinitySchedulingStrategy,
stops Ray); the worker process runs ``ray_cluster.run_worker`` (waits for the head's port, ``ray start
--address=127.0.0.1:PORT --block``, leaves when the head is gone). Each Ray node gets its own temp dir and
every port it opens is chosen free, so other Ray users on the box are not disturbed; the cluster uses
token auth with a per-test token. Ray 2.60's ``ray start`` registers the host's own address instead of
127.0.0.1 (``services.resolve_ip_for_localhost``); all connections still stay on this machine.

Teardown never uses ``ray stop`` or process names: it signals the launcher processes this test started
(they stop their Ray nodes) and then the Ray nodes' own process groups, by the pids they printed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv3_rl.launch import ray_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODE = r"""
import json, signal, sys
from dsv3_rl.launch import ray_cluster as rc
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
cfg = json.loads(sys.argv[1])
spec = rc.RayNodeSpec(**cfg["spec"])
t = rc.Timeouts(**cfg["timeouts"])
log = lambda m: print(m, flush=True)
try:
    if cfg["role"] == "head":
        rc_ = rc.run_head(spec, cfg["nnodes"], cfg["env"], lambda: log("[stages] none"), cfg["command"], t, log=log,
                          log_path=cfg["log"])
    else:
        rc_ = rc.run_worker(spec, cfg["env"], t, log=log, log_path=cfg["log"])
except rc.RayClusterError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    rc_ = 1
sys.exit(rc_)
"""

JOB = r"""
import json, os, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
nodes = [n for n in ray.nodes() if n["Alive"]]
@ray.remote(num_cpus=1)
def where():
    return ray.get_runtime_context().get_node_id()
refs = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote() for n in nodes]
print("TASKS " + json.dumps({"nodes": sorted(n["NodeID"] for n in nodes), "ran_on": ray.get(refs, timeout=300)}), flush=True)
ray.shutdown()
"""


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="2", RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    return env


def _spec(head: bool, port: int, tmp: Path, name: str) -> dict:
    return dict(head=head, port=port, head_addr="127.0.0.1", node_ip="127.0.0.1", num_cpus=1, num_gpus=0,
                temp_dir=str(tmp / name), object_store_memory=80 * 2**20, ports=ray_cluster.loopback_ports(4))


class Launchers:
    """The launcher processes of one test, torn down by pid whatever happens."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cfg: dict, env: dict) -> subprocess.Popen:
        out = open(self.tmp / f"{name}.out", "w")
        p = subprocess.Popen([sys.executable, "-c", NODE, json.dumps(cfg)], env=env, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = p
        return p

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text(errors="replace")

    def ray_pids(self) -> list[int]:
        pids = []
        for name in self.procs:
            pids += [int(x) for x in re.findall(r"\(pid (\d+)\)", self.output(name))]
        return pids

    def teardown(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the launcher stops its Ray node in `finally`
        deadline = time.monotonic() + 60
        for p in self.procs.values():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for pid in self.ray_pids():  # Ray nodes run in their own process groups (pgid == pid)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(3)


@pytest.fixture
def short_tmp():
    """Ray's AF_UNIX socket paths live under the temp dir and must stay under 107 bytes: pytest's tmp_path
    is too deep."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dsv3ray-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_head_and_worker_on_loopback_run_a_task_on_each_node(short_tmp):
    tmp_path = short_tmp
    env = _env(tmp_path)
    port = ray_cluster.free_port()
    timeouts = dict(head_start=240, join=300, poll=1.0, head_gone_polls=3)
    L = Launchers(tmp_path)
    try:
        head = L.start("head", dict(role="head", spec=_spec(True, port, tmp_path, "h"), nnodes=2, env=env,
                                    command=[sys.executable, "-c", JOB], timeouts=timeouts, log=str(tmp_path / "h.log")), env)
        worker = L.start("worker", dict(role="worker", spec=_spec(False, port, tmp_path, "w"), env=env,
                                        timeouts=timeouts, log=str(tmp_path / "w.log")), env)
        head_rc = head.wait(timeout=540)
        out = L.output("head")
        assert head_rc == 0, out + "\n--- worker ---\n" + L.output("worker")
        m = re.search(r"^TASKS (.*)$", out, re.M)
        assert m, out
        res = json.loads(m.group(1))
        assert len(res["nodes"]) == 2 and sorted(res["ran_on"]) == res["nodes"], res  # one task on each node
        assert "[ray] 2/2 nodes joined" in out
        # the worker notices the head is gone and leaves cleanly
        assert worker.wait(timeout=120) == 0, L.output("worker")
        assert "head is gone" in L.output("worker")
        pids = L.ray_pids()
        assert len(pids) == 2, (pids, out)
        deadline = time.monotonic() + 30
        while any(_group_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(1)
        assert not any(_group_alive(p) for p in pids), "a Ray node outlived its launcher"
    finally:
        L.teardown()


def test_head_times_out_naming_how_many_nodes_joined(short_tmp):
    tmp_path = short_tmp
    env = _env(tmp_path)
    port = ray_cluster.free_port()
    L = Launchers(tmp_path)
    try:
        head = L.start("head", dict(role="head", spec=_spec(True, port, tmp_path, "h"), nnodes=2, env=env,
                                    command=[sys.executable, "-c", "print('never runs')"],
                                    timeouts=dict(head_start=240, join=20, poll=1.0), log=str(tmp_path / "h.log")), env)
        assert head.wait(timeout=400) == 1
        out = L.output("head")
        assert re.search(r"only 1 of 2 nodes joined the Ray cluster at 127\.0\.0\.1:\d+ within 20s", out), out
        assert "never runs" not in out
        pids = L.ray_pids()
        assert pids and not any(_group_alive(p) for p in pids), "the head's Ray node was not stopped"
    finally:
        L.teardown()


@pytest.mark.timeout(120)  # a worker that never gives up hangs: pytest-timeout fails it (no wall-clock assert)
def test_worker_gives_up_when_no_head_appears(tmp_path):
    spec = ray_cluster.RayNodeSpec(head=False, port=ray_cluster.free_port(), head_addr="127.0.0.1")
    with pytest.raises(ray_cluster.RayClusterError, match=r"ray head: nothing listens on 127\.0\.0\.1:\d+ after 3s"):
        ray_cluster.run_worker(spec, _env(tmp_path), ray_cluster.Timeouts(join=3, poll=0.5), log=lambda *_: None)
