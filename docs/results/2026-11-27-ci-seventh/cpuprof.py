"""pytest plugin (measurement only, not committed): CPU seconds per test, this process + reaped children."""
import json
import os
import resource
import time

import pytest

_OUT = os.environ.get("CPUPROF_DIR", "/tmp/cpuprof")


def _cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, (s0, c0) = time.time(), _cpu()
    yield
    t1, (s1, c1) = time.time(), _cpu()
    os.makedirs(_OUT, exist_ok=True)
    with open(f"{_OUT}/{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"id": item.nodeid, "t0": t0, "wall": t1 - t0, "self": s1 - s0, "child": c1 - c0}) + "\n")
