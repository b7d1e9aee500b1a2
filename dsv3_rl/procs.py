"""Processes of this machine, found by what they carry rather than by name: a process renames itself (Ray's
``raylet``, ``ray::TaskRunner``), its environment stays. The foundation: the launcher's run monitor
(:mod:`dsv3_rl.launch.monitor`) and the backend test runner (:mod:`dsv3_rl.backend_tests`) both look processes up here.
"""

from __future__ import annotations

import os


def processes_with(env_entry: str) -> list[int]:
    """PIDs of live processes whose environment has the exact entry ENV_ENTRY (``"NAME=value"``; this process
    excluded): what one launch, or one test's Ray (its ``RAY_TMPDIR``), started, whatever they renamed themselves."""
    needle = env_entry.encode()
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d))
        except OSError:
            continue
    return out
