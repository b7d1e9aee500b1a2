"""A CPU preset on a Ray cluster the launcher starts (nnodes > 1): main_ppo joins it through RAY_ADDRESS.

Ray refuses ``num_cpus`` / ``num_gpus`` / ``resources`` / ``object_store_memory`` from a job that joins a running
cluster (``ValueError: When connecting to an existing cluster, ...``), and a node started by ``ray start`` has no
``verl_cpu_slot`` unless it declares one. So the launcher takes those ``ray_kwargs.ray_init`` overrides out of the
training command and gives them, with one CPU trainer slot per process of the node, to every node's ``ray start``
(``ray_cluster.cluster_job``); and verl's CPU platform (patch 0010) declares its slots in ``ray.init`` only when it
starts a cluster of its own. The reference for "refused" is Ray itself: ``ray.init(address=...)`` with the key
raises before it connects anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dsv3_rl.launch import ray_cluster

ARGV = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer", "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1", "ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.include_dashboard=false",
        "+ray_kwargs.ray_init.resources={extra:2}", "data.train_batch_size=16"]
RAY_INIT = {"num_cpus": 16, "include_dashboard": False, "resources": {"extra": 2}, "runtime_env": {}}


def _ray_refuses_when_joining(kwargs: dict) -> list[str]:
    """The keys of KWARGS that Ray's own ray.init refuses when it joins a cluster (an address given); Ray checks them
    before it connects, and the connection itself is stopped here (an accepted key gets that far)."""
    from unittest import mock

    import ray

    class Connecting(Exception):
        pass

    def no_connect(*a, **kw):
        raise Connecting

    refused = []
    with mock.patch.object(ray._private.node, "Node", no_connect):
        for k, v in kwargs.items():
            try:
                ray.init(address="127.0.0.1:1", **{k: v})
            except ValueError as e:
                if "existing cluster" in str(e):
                    refused.append(k)
            except Connecting:
                pass
            finally:
                ray.shutdown()
    return refused


def _ray_init_of(argv: list[str]) -> dict:
    """What main_ppo's ray.init gets from ``ray_kwargs.ray_init.*`` overrides of ARGV (values as Hydra parses them)."""
    from dsv3_rl.verl_glue.overrides import parse_overrides

    out = {}
    for o in parse_overrides([a for a in argv if a.lstrip("+").startswith("ray_kwargs.ray_init.")]):
        out[o.key.split(".")[2]] = o.value
    return out


def test_ray_refuses_exactly_the_keys_the_launcher_moves():
    probe = {"num_cpus": 16, "num_gpus": 1, "resources": {"x": 1.0}, "object_store_memory": 10**8,
             "include_dashboard": False}
    assert sorted(_ray_refuses_when_joining(probe)) == sorted(ray_cluster.JOIN_REFUSED)


@pytest.mark.timeout(120)
def test_cpu_cluster_job_joins_and_every_node_declares_the_slots():
    command, node = ray_cluster.cluster_job(ARGV, RAY_INIT, cpu_slots=1)
    assert _ray_refuses_when_joining(_ray_init_of(command)) == []
    assert [a for a in command if "ray_init" not in a] == [a for a in ARGV if "ray_init" not in a]
    assert "+ray_kwargs.ray_init.include_dashboard=false" in command
    assert node == {"num_cpus": 16, "resources": {"extra": 2.0, "verl_cpu_slot": 1.0}}
    argv = ray_cluster.RayNodeSpec(head=False, port=6379, **node).argv()
    assert "--num-cpus=16" in argv
    assert json.loads(next(a for a in argv if a.startswith("--resources=")).split("=", 1)[1]) == node["resources"]


def test_twin_the_training_command_unchanged_is_refused_when_joining():
    """Planted fault: the launcher hands main_ppo its one-node command (the state before the fix): Ray refuses it."""
    assert _ray_refuses_when_joining(_ray_init_of(ARGV)) == ["num_cpus", "resources"]


def test_gpu_cluster_job_declares_no_cpu_slot():
    command, node = ray_cluster.cluster_job(ARGV[:5], {"num_cpus": None}, cpu_slots=None)
    assert command == ARGV[:5] and node == {}


MAIN_PPO_RAY_INIT = """
    import json, ray
    from verl.trainer import main_ppo
    from dsv3_rl.verl_glue.compose import compose
    cfg = compose("ppo_megatron_trainer", ["trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                                           "ray_kwargs.ray_init.num_cpus=null"])
    class Stop(Exception):
        pass
    got = {}
    def fake_init(**kw):
        got[os.environ.get("RAY_ADDRESS", "own")] = kw.get("resources")
        raise Stop
    ray.is_initialized = lambda: False
    ray.init = fake_init
    for address in ("127.0.0.1:6379", None):  # joining a cluster (the launcher's RAY_ADDRESS), starting one
        if address:
            os.environ["RAY_ADDRESS"] = address
        else:
            os.environ.pop("RAY_ADDRESS", None)
        try:
            main_ppo.run_ppo(cfg, None)
        except Stop:
            pass
    print(json.dumps(got))
"""


@pytest.mark.slow  # ~9 s on 2 cores (imports verl's trainer in a fresh interpreter): out of make test-fast
@pytest.mark.timeout(300)
def test_verl_cpu_platform_declares_slots_only_for_a_cluster_of_its_own():
    """Patch 0010: main_ppo's ray.init declares the CPU slots when it starts Ray, nothing when it joins one; the
    one-node run is the twin (the declaration is still there, so the check sees it)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-c", "import os\n" + textwrap.dedent(MAIN_PPO_RAY_INIT)], capture_output=True,
                       text=True, env={**env, "VERL_PLATFORM": "cpu"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    joining, own = got["127.0.0.1:6379"], got["own"]
    assert _ray_refuses_when_joining({"resources": joining} if joining is not None else {}) == []
    assert own == {"verl_cpu_slot": 2.0}
    assert _ray_refuses_when_joining({"resources": own}) == ["resources"]


# --------------------------------------------------------------------- stages on node 0 of a PAI-DLC job
DLC_ENV = {"DSV3_PLATFORM": "dlc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "0"}
#: what a stage's process sees of torch.distributed's env:// rendezvous (the converter's init_dist reads WORLD_SIZE
#: and RANK, then MASTER_ADDR/PORT: with the job's WORLD_SIZE=2 it waits for a second converter rank that never comes)
SEES = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
        "('WORLD_SIZE', 'RANK', 'MASTER_ADDR', 'MASTER_PORT', 'DSV3_PLATFORM')}))")


def _stage_sees(tmp_path) -> dict:
    from dsv3_rl.launch.stages import Stage

    out = tmp_path / "seen.json"
    st = Stage(name="probe", needed=True, why="", out_dir=None, outputs=[], inputs=[],
               argv=[sys.executable, "-c", SEES.replace("print(", f"open({str(out)!r}, 'w').write(")])
    st.force()  # no outputs to verify: run it
    st.run({**os.environ, **DLC_ENV}, log=lambda m: None)
    return json.loads(out.read_text())


def test_a_stage_on_node_0_runs_as_one_process_not_as_the_job():
    seen = _stage_sees_tmp()
    assert seen == {"WORLD_SIZE": None, "RANK": None, "MASTER_ADDR": None, "MASTER_PORT": None, "DSV3_PLATFORM": "dlc"}


def test_twin_a_stage_given_the_job_env_sees_a_two_rank_world(monkeypatch):
    """Planted fault: the stage gets the launcher's environment as it is (the state before the fix)."""
    from dsv3_rl.launch import stages

    monkeypatch.setattr(stages, "stage_env", lambda env: dict(env))
    seen = _stage_sees_tmp()
    assert seen["WORLD_SIZE"] == "2" and seen["MASTER_PORT"] == "23456"


def _stage_sees_tmp() -> dict:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        return _stage_sees(Path(d))


# --------------------------------------------------------------------- node 0 ends like one node: the checks
def _after_head(monkeypatch, rc: int, checks_rc: int, checks) -> tuple[int, list]:
    from types import SimpleNamespace

    from dsv3_rl.launch import cli, train

    called = []
    monkeypatch.setattr(train, "check_finished", lambda launch: called.append(launch) or checks_rc)
    launch = SimpleNamespace(preset=SimpleNamespace(checks=checks))
    return cli.after_head(launch, rc), called


def test_node_0_runs_the_checks_after_main_ppo(monkeypatch):
    assert _after_head(monkeypatch, 0, 0, {"min_weight_change": 1e-6})[0] == 0
    rc, called = _after_head(monkeypatch, 0, 1, {"min_weight_change": 1e-6})
    assert rc == 1 and len(called) == 1  # twin: failing checks fail the job


def test_node_0_keeps_a_failed_main_ppo_and_a_preset_without_checks(monkeypatch):
    assert _after_head(monkeypatch, 3, 0, {"min_weight_change": 1e-6}) == (3, [])
    assert _after_head(monkeypatch, 0, 1, None) == (0, [])


# --------------------------------------------------------------------- node 0's log paths reach every node
def test_the_job_carries_node_0s_log_paths_to_every_node():
    """verl's TaskRunner (its file logger: metrics.jsonl) may land on any node, whose Ray runs in that node's own
    environment (2026-12-07, two nodes on loopback: metrics.jsonl went to node 1's LOG_DIR). The job's runtime_env
    carries node 0's paths; checked in verl's composed config, which main_ppo hands to ray.init."""
    from dsv3_rl.verl_glue.compose import compose

    node0 = {"VERL_FILE_LOGGER_PATH": "/runs/n0/logs/metrics.jsonl", "TENSORBOARD_DIR": "/runs/n0/logs/tensorboard",
             "WANDB_DIR": "/runs/n0/logs", "WANDB_MODE": "offline", "OTHER": "x"}
    command, _ = ray_cluster.cluster_job(ARGV, RAY_INIT, cpu_slots=1, job_env=node0)
    cfg = compose("ppo_megatron_trainer", [a for a in command[4:] if "ray_init.resources" not in a])
    got = dict(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
    assert got == {k: v for k, v in node0.items() if k != "OTHER"}
    # twin: without node 0's environment the job carries none, and each node's own values would apply
    command, _ = ray_cluster.cluster_job(ARGV, RAY_INIT, cpu_slots=1)
    cfg = compose("ppo_megatron_trainer", [a for a in command[4:] if "ray_init.resources" not in a])
    assert "env_vars" not in cfg.ray_kwargs.ray_init.runtime_env or not cfg.ray_kwargs.ray_init.runtime_env.env_vars


def test_the_checks_run_as_one_process_not_as_the_job(monkeypatch):
    """After a multi-node run node 0's launcher still has the job's WORLD_SIZE/RANK/MASTER_*; the checks' checkpoint
    reload (torch.distributed env://) must not see them (2026-12-07: "MASTER_PORT expected, but not set")."""
    from types import SimpleNamespace

    from dsv3_rl.launch import stages, train

    for k in stages.JOB_RENDEZVOUS_VARS:  # what an earlier test in this worker left (torch.distributed's LOCAL_RANK, ...)
        monkeypatch.delenv(k, raising=False)
    for k, v in DLC_ENV.items():
        monkeypatch.setenv(k, v)
    seen = []
    monkeypatch.setattr(train, "_check_finished", lambda launch: seen.append(
        {k: os.environ.get(k) for k in stages.JOB_RENDEZVOUS_VARS if os.environ.get(k)}) or 0)
    launch = SimpleNamespace(preset=SimpleNamespace(checks={}))
    assert train.check_finished(launch) == 0 and seen == [{}]
    assert os.environ["WORLD_SIZE"] == "2"  # the launcher's own environment is back afterwards
    # twin: the checks called as they were before (the job's environment as it is) see a two-rank world
    seen.clear()
    train._check_finished(launch)
    assert seen == [{"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"}]
