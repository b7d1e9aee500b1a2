"""Ray bring-up for multi-node runs (PAI-DLC, Slurm, or any set of nodes that can reach node 0).

Every node runs the same launcher. Node 0 starts the Ray head, runs the pipeline stages, waits until all
nodes have joined (a timeout names the nodes that are missing), runs the training command against the
cluster (``RAY_ADDRESS``), and stops Ray on exit. The other nodes wait for the head's port, join as
workers, and leave once the head is gone. Each Ray node is a ``ray start --block`` child process in its
own process group, stopped by signalling that group: nothing else on the machine is touched (no
``ray stop``, which would kill every Ray process of the user).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable

from dsv3_rl.ports import free_port, free_ports  # noqa: F401  (free_port: re-exported for callers)
from dsv3_rl.errors import Dsv3Error

#: ``ray start`` port options (``RayNodeSpec.ports`` keys) -- all of them, so tests can run two nodes on
#: one machine without colliding with anything else there.
PORT_OPTIONS = ("node_manager_port", "object_manager_port", "ray_client_server_port", "dashboard_agent_listen_port",
                "dashboard_agent_grpc_port", "runtime_env_agent_port", "metrics_export_port", "min_worker_port",
                "max_worker_port", "worker_port_list", "dashboard_port")


class RayClusterError(Dsv3Error, RuntimeError):
    pass


def ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    if exe.is_file():
        return str(exe)
    import shutil

    found = shutil.which("ray")
    if not found:
        raise RayClusterError("the `ray` command is not installed next to this Python (pip install 'ray[default]')")
    return found


def loopback_ports(n_workers: int = 4) -> dict[str, int | str]:
    """Every port ``ray start`` opens, chosen free on loopback (for running several nodes on one machine)."""
    keys = ("node_manager_port", "object_manager_port", "ray_client_server_port", "dashboard_agent_listen_port",
            "dashboard_agent_grpc_port", "runtime_env_agent_port", "metrics_export_port", "dashboard_port")
    ports = free_ports(len(keys) + n_workers)
    out: dict[str, int | str] = dict(zip(keys, ports))
    out["worker_port_list"] = ",".join(str(p) for p in ports[len(keys):])
    return out


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_host(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise RayClusterError(f"cannot resolve the head address {host!r}: {e}") from None


@dataclasses.dataclass
class RayNodeSpec:
    head: bool
    port: int
    """head: the GCS port to open; worker: the head's GCS port"""
    head_addr: str = "127.0.0.1"
    node_ip: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    temp_dir: str | None = None
    object_store_memory: int | None = None
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    """custom resources this node declares (``--resources``), e.g. verl's CPU trainer slots"""
    include_dashboard: bool = False
    ports: dict[str, int | str] = dataclasses.field(default_factory=dict)
    extra: list[str] = dataclasses.field(default_factory=list)

    def argv(self) -> list[str]:
        a = [ray_cli(), "start", "--block", "--disable-usage-stats"]
        if self.head:
            a += ["--head", f"--port={self.port}", f"--include-dashboard={'true' if self.include_dashboard else 'false'}"]
            if self.include_dashboard:
                a.append("--dashboard-host=0.0.0.0")
        else:
            a.append(f"--address={self.head_addr}:{self.port}")
        if self.node_ip:
            a.append(f"--node-ip-address={self.node_ip}")
        if self.num_cpus is not None:
            a.append(f"--num-cpus={self.num_cpus}")
        if self.num_gpus is not None:
            a.append(f"--num-gpus={self.num_gpus}")
        if self.temp_dir:
            a.append(f"--temp-dir={self.temp_dir}")
        if self.object_store_memory:
            a.append(f"--object-store-memory={self.object_store_memory}")
        if self.resources:
            a.append(f"--resources={json.dumps(self.resources, sort_keys=True)}")
        for k, v in self.ports.items():
            if k not in PORT_OPTIONS:
                raise RayClusterError(f"unknown ray port option {k!r}; allowed: {', '.join(PORT_OPTIONS)}")
            a.append(f"--{k.replace('_', '-')}={v}")
        return a + list(self.extra)


class RayNode:
    """A ``ray start --block`` child in its own session; ``stop()`` signals only that process group."""

    def __init__(self, spec: RayNodeSpec, env: dict[str, str] | None = None, log_path: str | os.PathLike | None = None):
        self.spec = spec
        self.env = dict(os.environ if env is None else env)
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> RayNode:
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        out = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(self.spec.argv(), env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the node's process group, SIGKILL what is left after GRACE seconds."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pgid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._log:
            self._log.close()
            self._log = None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def wait_for_port(host: str, port: int, timeout: float, what: str, *, alive: Callable[[], bool] | None = None,
                  poll: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        if alive is not None and not alive():
            raise RayClusterError(f"{what} exited before {host}:{port} opened")
        time.sleep(poll)
    raise RayClusterError(f"{what}: nothing listens on {host}:{port} after {timeout:.0f}s")


def alive_nodes(address: str) -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def wait_for_nodes(address: str, n: int, timeout: float, *, poll: float = 2.0, log=print,
                   expected: list[str] | None = None) -> list[dict]:
    """Connect to the cluster at ADDRESS and wait until N nodes are alive; disconnect. A timeout says how
    many joined and which addresses did (and, given EXPECTED hosts, which are missing)."""
    import ray

    deadline = time.monotonic() + timeout
    last = -1
    while True:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
            break
        except Exception as e:  # noqa: BLE001  (ConnectionError and friends while the GCS comes up)
            if time.monotonic() > deadline:
                raise RayClusterError(f"cannot connect to the Ray head at {address} within {timeout:.0f}s: {e}") from None
            time.sleep(poll)
    try:
        while True:
            nodes = alive_nodes(address)
            if len(nodes) != last:
                log(f"[ray] {len(nodes)}/{n} nodes joined")
                last = len(nodes)
            if len(nodes) >= n:
                return nodes
            if time.monotonic() > deadline:
                ips = sorted(str(x.get("NodeManagerAddress")) for x in nodes)
                msg = (f"only {len(nodes)} of {n} nodes joined the Ray cluster at {address} within {timeout:.0f}s "
                       f"(joined: {', '.join(ips) or 'none'})")
                if expected:
                    msg += f"; missing: {', '.join(h for h in expected if resolve_host(h) not in ips)}"
                msg += ". Check that every node runs the launcher and can reach the head's port (firewall, NCCL/GLOO_SOCKET_IFNAME)"
                raise RayClusterError(msg)
            time.sleep(poll)
    finally:
        ray.shutdown()


#: the ``ray.init`` arguments Ray refuses from a job that joins a running cluster ("When connecting to an existing
#: cluster, num_cpus and num_gpus must not be provided", ray/_private/worker.py): each node's ``ray start`` takes them
JOIN_REFUSED = ("num_cpus", "num_gpus", "resources", "object_store_memory")
RAY_INIT = "ray_kwargs.ray_init"
#: the Ray resource verl's CPU platform gives each trainer process (patch 0010, verl/plugin/platform/platform_cpu.py);
#: on one node main_ppo's ray.init declares it, in a cluster every node's ``ray start`` must
VERL_CPU_SLOT = "verl_cpu_slot"


#: the launcher's per-run variables (where the run logs, run.py) that every process of the job must see as node 0 does:
#: verl's TaskRunner (its file logger) and workers may land on any node, whose Ray was started with that node's own
#: environment; the job's runtime_env carries node 0's values to all of them
JOB_ENV = ("VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "WANDB_DIR", "WANDB_MODE")


def cluster_job(argv: list[str], ray_init: dict, *, cpu_slots: int | None,
                job_env: dict[str, str] | None = None) -> tuple[list[str], dict]:
    """The training command and the per-node ``ray start`` settings for a job that joins the cluster we start.

    ARGV is main_ppo's command line, RAY_INIT the composed ``ray_kwargs.ray_init``, CPU_SLOTS the trainer processes
    per node of a CPU preset (None on GPUs). Returns ARGV without the ``ray_kwargs.ray_init`` overrides Ray refuses
    when joining (:data:`JOIN_REFUSED`), and the ``RayNodeSpec`` fields that carry them to every node instead:
    ``num_cpus`` (each node gets the job's logical CPUs: a node must fit what the job places on it), ``num_gpus``,
    ``object_store_memory``, and ``resources`` with ``verl_cpu_slot: CPU_SLOTS``. The :data:`JOB_ENV` variables of
    JOB_ENV (node 0's environment) are added to the job's ``runtime_env.env_vars``.
    """
    from dsv3_rl.verl_glue.overrides import parse_overrides

    keep = []
    for text in argv:
        if RAY_INIT + "." in text and not text.startswith("-"):
            (o,) = parse_overrides([text])
            if o.key.startswith(RAY_INIT + ".") and o.key[len(RAY_INIT) + 1:].split(".")[0] in JOIN_REFUSED:
                continue
        keep.append(text)
    for k in JOB_ENV:
        v = (job_env or {}).get(k)
        if v:
            keep.append(f"++{RAY_INIT}.runtime_env.env_vars.{k}={json.dumps(v)}")
    node: dict = {}
    for k in ("num_cpus", "num_gpus", "object_store_memory"):
        if ray_init.get(k) is not None:
            node[k] = int(ray_init[k])
    res = {str(k): float(v) for k, v in dict(ray_init.get("resources") or {}).items()}
    if cpu_slots is not None:
        res.setdefault(VERL_CPU_SLOT, float(cpu_slots))
    if res:
        node["resources"] = res
    return keep, node


@dataclasses.dataclass
class Timeouts:
    head_start: float = 180.0
    """seconds for the local head's GCS port to open"""
    join: float = 1800.0
    """seconds for all nodes to join (head), or for the head to appear (workers)"""
    head_gone_polls: int = 3
    poll: float = 5.0


def run_head(spec: RayNodeSpec, nnodes: int, env: dict[str, str], before_wait: Callable[[], None],
             command: list[str], timeouts: Timeouts = Timeouts(), log=print, log_path=None) -> int:
    """Start the head, run BEFORE_WAIT (the pipeline stages), wait for NNODES, run COMMAND; stop Ray."""
    node = RayNode(spec, env, log_path).start()
    address = f"{spec.node_ip or spec.head_addr}:{spec.port}"
    log(f"[ray] head starting on {address} (pid {node.pid})")
    try:
        wait_for_port(spec.node_ip or spec.head_addr, spec.port, timeouts.head_start, "ray head", alive=node.alive)
        before_wait()
        wait_for_nodes(address, nnodes, timeouts.join, log=log)
        log(f"[ray] cluster ready: running {' '.join(command[:4])} ...")
        return subprocess.call(command, env={**env, "RAY_ADDRESS": address})
    except RayClusterError as e:
        tail = node.log_tail()
        raise RayClusterError(f"{e}" + (f"\n--- ray head log (tail) ---\n{tail}" if tail else "")) from None
    finally:
        log("[ray] stopping the head")
        node.stop()


def run_worker(spec: RayNodeSpec, env: dict[str, str], timeouts: Timeouts = Timeouts(), log=print, log_path=None) -> int:
    """Wait for the head, join, and stay until the head is gone. Returns 0 when the head went away."""
    log(f"[ray] waiting for the head at {spec.head_addr}:{spec.port} (up to {timeouts.join:.0f}s)")
    wait_for_port(spec.head_addr, spec.port, timeouts.join, "ray head")
    node = RayNode(spec, env, log_path).start()
    log(f"[ray] worker joined {spec.head_addr}:{spec.port} (pid {node.pid})")
    try:
        misses = 0
        while True:
            time.sleep(timeouts.poll)
            if port_open(spec.head_addr, spec.port):
                misses = 0
            else:
                misses += 1
                if misses >= timeouts.head_gone_polls:
                    log("[ray] head is gone: leaving")
                    return 0
            if not node.alive():
                if port_open(spec.head_addr, spec.port):
                    raise RayClusterError(f"the local Ray worker exited (status {node.proc.returncode}) while the head is "
                                          f"still up\n{node.log_tail()}")
                return 0
    finally:
        node.stop()
