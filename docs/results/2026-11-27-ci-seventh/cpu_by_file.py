"""CPU seconds per test file from cpuprof.py's records (one JSON line per test: wall, this process's CPU, reaped
children's CPU), side by side for two runs: ``python cpu_by_file.py BEFORE.jsonl AFTER.jsonl [N]``. The e2e files
(GRPO runs, whose Ray processes are not reaped children) are left out: the table is make test's first phase."""

import collections
import json
import sys

E2E = ("test_grpo_learning.py", "test_algorithm_demos.py", "test_launch_faults.py")


def per_file(path: str) -> collections.Counter:
    out = collections.Counter()
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            name = r["id"].split("::")[0]
            if not name.endswith(E2E):
                out[name] += r["self"] + r["child"]
    return out


def main() -> None:
    a, b = per_file(sys.argv[1]), per_file(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    print(f"{'before':>8} {'after':>8} {'change':>8}  file")
    for name, cpu in a.most_common(n):
        print(f"{cpu:8.1f} {b[name]:8.1f} {b[name] - cpu:+8.1f}  {name}")
    print(f"{sum(a.values()):8.1f} {sum(b.values()):8.1f} {sum(b.values()) - sum(a.values()):+8.1f}  all files")


if __name__ == "__main__":
    main()
