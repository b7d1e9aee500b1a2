"""verl patch 0037: the colocated weight-sync socket is unique per Ray cluster.

verl names the trainer -> vLLM bucket socket ``/tmp/rl-colocate-zmq-<ray job id>-replica-<r>-rank-<l>.sock``. Job ids
restart at ``01000000`` in every Ray cluster, so two runs on one host, each with its own Ray (the GPU box's three
tiny_1xH100 runs side by side on 2026-11-28, CI's two e2e lanes), named the same socket: the later sender unlinks and
rebinds it, and the first run's vLLM connected to the other run's trainer (on the GPU box one of the three runs hung
before its first rollout). Two real Ray clusters, one per process: their job ids are equal (the collision, the
twin) and the patched keys differ."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROBE = r"""
import json, ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import ray_job_key

@ray.remote(num_cpus=0)
def worker_side():  # the key as a Ray worker (the rollout's actors) computes it: the same as the driver's
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import ray_job_key
    return ray_job_key()

print("KEY", json.dumps({"job": ray.get_runtime_context().get_job_id(), "key": ray_job_key(),
                         "worker": ray.get(worker_side.remote())}))
ray.shutdown()
"""


def _probes(n: int) -> list[dict]:
    """N Ray clusters at once, one per process (a cluster's start is mostly waiting on its daemons: one at a time took
    ~35 s each on a loaded 2-core box)."""
    import os

    procs = [subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RAY_TMPDIR": f"/tmp/dsv3ws{i}", "RAY_USAGE_STATS_ENABLED": "0"})
             for i in range(1, n + 1)]
    keys = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            line = next((x for x in out.splitlines() if x.startswith("KEY ")), None)
            assert line, out[-2000:] + err[-3000:]
            keys.append(json.loads(line[4:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return keys


def test_two_ray_clusters_get_two_sockets():
    a, b = _probes(2)
    assert a["job"] == b["job"], (a, b)  # twin: upstream's key (the job id alone) is the same in both clusters
    assert a["key"] != b["key"], (a, b)
    assert a["key"].startswith(a["job"] + "-") and len(a["key"]) == len(a["job"]) + 9
    assert a["worker"] == a["key"] and b["worker"] == b["key"]  # sender and receiver sides agree within a run
    longest = f"/tmp/rl-colocate-zmq-{a['key']}-replica-999-rank-99.sock"
    assert len(longest) < 107  # AF_UNIX path limit
