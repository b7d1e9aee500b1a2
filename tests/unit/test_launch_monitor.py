"""The launcher's watched run (dsv3_rl/launch/monitor.py) on stand-in children: progress lines from the metrics
file, the log without colour codes, a wall-clock limit that stops a silent hang, and a teardown that also
reaches processes that left the child's session (as Ray's daemons do). Each with a planted-fault twin."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv3_rl.launch import monitor

CHILD = textwrap.dedent("""
    import json, subprocess, sys, time
    metrics, mode = sys.argv[1], sys.argv[2]
    print("\\x1b[36m(TaskRunner pid=1)\\x1b[0m starting", flush=True)
    if mode == "hang":
        # a grandchild in a session of its own (Ray's raylet/GCS do this), then silence
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        time.sleep(600)
    with open(metrics, "ab") as f:
        for step in (1, 2, 3):
            rec = {"step": step, "data": {"critic/score/mean": 0.1 * step, "timing_s/step": 1.0}}
            f.write(json.dumps(rec).encode() + b"\\n"); f.flush()
            print(f"step:{step} - lots of metrics", flush=True)
            time.sleep(0.3)
""")


def _child(tmp_path: Path, mode: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [sys.executable, str(script), str(tmp_path / "metrics.jsonl"), mode]


def test_progress_lines_and_clean_log(tmp_path):
    lines: list[str] = []
    res = monitor.run_watched(_child(tmp_path, "ok"), dict(os.environ), log_path=tmp_path / "main_ppo.log",
                              metrics_path=tmp_path / "metrics.jsonl", total_steps=3, timeout_s=60, say=lines.append)
    assert res.code == 0 and res.reason == ""
    assert [ln.split()[2] for ln in lines] == ["1/3", "2/3", "3/3"]
    assert "reward 0.300" in lines[-1]
    log = (tmp_path / "main_ppo.log").read_text()
    assert "(TaskRunner pid=1) starting" in log and "step:3 - lots of metrics" in log
    assert "\x1b[" not in log  # twin below: the raw output has the codes
    assert "\x1b[36m" in CHILD.encode().decode("unicode_escape")
    assert res.peak_pss_bytes > 0


@pytest.mark.timeout(120)  # the limit not firing would hang: pytest-timeout fails it (no wall-clock assert)
def test_limit_stops_a_silent_hang_and_its_detached_grandchild(tmp_path):
    res = monitor.run_watched(_child(tmp_path, "hang"), dict(os.environ), log_path=tmp_path / "main_ppo.log",
                              metrics_path=tmp_path / "metrics.jsonl", total_steps=3, timeout_s=3, say=lambda s: None)
    assert res.code == 124 and res.reason == "timeout"
    assert res.run_id and not monitor.run_processes(res.run_id)


def test_twin_killpg_alone_leaves_the_detached_grandchild(tmp_path):
    """Planted fault: stopping only the child's process group (the old demo runner's teardown) leaves the
    grandchild that started its own session running; the marker-based teardown above is what finds it."""
    env = {**os.environ, monitor.RUN_ID_ENV: "twin-" + str(os.getpid())}
    proc = subprocess.Popen(_child(tmp_path, "hang"), env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(monitor.run_processes(env[monitor.RUN_ID_ENV])) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    left = monitor.run_processes(env[monitor.RUN_ID_ENV])
    try:
        assert left, "the grandchild should have survived killpg"
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)


def test_run_processes_and_pss_see_only_the_marked_run(tmp_path):
    env = {**os.environ, monitor.RUN_ID_ENV: "mark-" + str(os.getpid()), "LOG_DIR": f"/nonexistent/logs-{os.getpid()}"}
    p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"  # the interpreter is up (its PSS is past the exec stage)
        deadline = time.monotonic() + 10
        while p.pid not in monitor.run_processes(env[monitor.RUN_ID_ENV]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert monitor.run_processes(env[monitor.RUN_ID_ENV]) == [p.pid]
        assert monitor.run_processes("another-run") == []  # twin: another marker finds nothing
        assert env[monitor.RUN_ID_ENV] in monitor.run_ids()
        # scoped to one run's directory: found by an entry its environment has, not by one it lacks (twin)
        assert monitor.run_ids(f"LOG_DIR={env['LOG_DIR']}") == {env[monitor.RUN_ID_ENV]}
        assert env[monitor.RUN_ID_ENV] not in monitor.run_ids(f"LOG_DIR={env['LOG_DIR']}-other")
        assert env[monitor.RUN_ID_ENV] not in monitor.run_ids(f"LOG_DIR={env['LOG_DIR'][:-1]}")  # exact entry only
        assert monitor.pss_bytes([p.pid]) > 1 << 20
        assert monitor.pss_bytes([10**9]) == 0
    finally:
        p.kill()
        p.wait()


def test_resume_bookkeeping(tmp_path):
    """A fresh run removes an earlier attempt's metrics (no mix of two runs); a resumed one keeps them as
    metrics.attempt-N.jsonl, which the checks read back in order."""
    from dsv3_rl.launch.train import latest_checkpoint, prepare_metrics

    m = tmp_path / "metrics.jsonl"
    m.write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.1}}) + "\n")
    prepare_metrics(m, resume_step=1)
    assert not m.exists() and (tmp_path / "metrics.attempt-1.jsonl").is_file()
    m.write_text(json.dumps({"step": 2, "data": {"critic/score/mean": 0.2}}) + "\n")
    prepare_metrics(m, resume_step=2)
    assert (tmp_path / "metrics.attempt-2.jsonl").is_file()
    prepare_metrics(m, resume_step=None)  # a fresh run
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8\n")
    assert latest_checkpoint(tmp_path) == 8
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert latest_checkpoint(tmp_path) is None


def _pss_samples(tmp_path: Path, monkeypatch, every_s: float) -> int:
    tmp_path.mkdir(parents=True, exist_ok=True)
    calls = []
    real = monitor.pss_bytes
    monkeypatch.setattr(monitor, "PSS_EVERY_S", every_s)
    monkeypatch.setattr(monitor, "pss_bytes", lambda pids: calls.append(len(pids)) or real(pids))
    script = tmp_path / "sleeper.py"
    script.write_text("import time; time.sleep(4.5)\n")
    res = monitor.run_watched([sys.executable, str(script)], dict(os.environ), log_path=tmp_path / "main_ppo.log",
                              metrics_path=tmp_path / "metrics.jsonl", total_steps=1, timeout_s=60, say=lambda s: None)
    assert res.code == 0 and res.peak_pss_bytes > 0
    return len(calls)


@pytest.mark.slow  # 10-26 s on 2 cores: out of the developer loop (make test-fast < 5 min, issue 28)
def test_pss_is_sampled_every_pss_every_s_not_every_poll(tmp_path, monkeypatch):
    """Reading smaps_rollup of a CPU run's ~30 processes costs ~0.3 s of CPU (issue 28): the watch loop polls every
    second but samples PSS every PSS_EVERY_S (10 s): a 4.5-s child is sampled once. Twin: at 1 s it is sampled
    about every poll (what a 2-s or shorter interval costs)."""
    assert monitor.PSS_EVERY_S >= 10
    assert _pss_samples(tmp_path / "a", monkeypatch, monitor.PSS_EVERY_S) == 1
    assert _pss_samples(tmp_path / "b", monkeypatch, 1.0) >= 4  # twin


def test_fault_chain_judges_the_processes_of_its_own_attempts_only(tmp_path):
    """The fault chain's no-process-left checks (tests/unit/grpo_fault_chain.py ``RunMarkers``) ask for the runs whose
    markers its launcher recorded, one per main_ppo attempt: a live process of a recorded attempt is found, a live
    process of another run on the machine (the other e2e lane) is not (twin), and a finished attempt is not."""
    from grpo_fault_chain import RunMarkers

    from dsv3_rl.launch import workdir

    record = tmp_path / workdir.RECORD
    ours, other = f"chain-{os.getpid()}", f"other-lane-{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, monitor.RUN_ID_ENV: rid}) for rid in (ours, other)]
    markers = RunMarkers(tmp_path)
    markers.start()
    try:
        for rid in (ours, "finished-attempt"):
            record.write_text(json.dumps({"pid": os.getpid(), "run_id": rid}))
            deadline = time.monotonic() + 10
            while rid not in markers.seen and time.monotonic() < deadline:
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while ours not in markers.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert markers.seen == {ours, "finished-attempt"}
        assert markers.alive() == {ours}  # not the other run's process, not the attempt without one
        procs[0].kill()
        procs[0].wait()
        assert markers.alive() == set()
    finally:
        markers.done.set()
        for p in procs:
            p.kill()
            p.wait()
