"""Sample every process's CPU (utime + stime) each second until /tmp/s7/stop exists, then write one JSON file
(argv[1]): per pid its command line, CPU when first and last seen, CPU when /tmp/s7/mark appeared (step 1's progress
line: start-up vs steps) and when it was born. Used for docs/ci.md "Sixth pass"."""

import json
import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def snap() -> dict[int, float]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d)] = (int(rest[11]) + int(rest[12])) / HZ
    return out


def main() -> None:
    seen: dict[int, dict] = {}
    mark_t, t0 = None, time.time()
    while not os.path.exists("/tmp/s7/stop"):
        if mark_t is None and os.path.exists("/tmp/s7/mark"):
            mark_t = time.time()
            for p in seen.values():
                p["at_mark"] = p["last"]
        for pid, cpu in snap().items():
            p = seen.get(pid)
            if p is None:
                born = time.time() - t0
                p = seen[pid] = dict(cmd=cmdline(pid), first=cpu, last=cpu, at_mark=None, born=born)
                if mark_t is not None:
                    p["at_mark"] = 0.0
            p["last"] = cpu
            if p["cmd"] in ("", "?") or "default_worker" in p["cmd"] or p["cmd"].startswith("ray::IDLE"):
                p["cmd"] = cmdline(pid) or p["cmd"]  # Ray renames a worker once it holds an actor
        time.sleep(1.0)
    with open(sys.argv[1], "w") as f:
        json.dump(dict(mark=mark_t and mark_t - t0, procs=seen), f)


if __name__ == "__main__":
    main()
