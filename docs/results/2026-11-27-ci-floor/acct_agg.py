"""Summarise acct_sitecustomize.py's records: CPU by process kind and by test file, and import floors."""

import collections
import json
import statistics
import sys

recs = [json.loads(line) for line in open(sys.argv[1] if len(sys.argv) > 1 else "phase1-processes.jsonl")]


def is_worker(r: dict) -> bool:
    return "pytest" in r["argv"][0] or "xdist" in r["argv"][0] or (r["argv"][0] == "-c" and not r["test"])


children = [r for r in recs if not is_worker(r)]
print(f"{len(recs)} processes recorded, {sum(r['cpu'] for r in recs):.0f} CPU-s; "
      f"{len(children)} started by tests, {sum(r['cpu'] for r in children):.0f} CPU-s")
by_file = collections.defaultdict(list)
for r in children:
    by_file[r["test"].split("::")[0]].append(r["cpu"])
print("\nCPU-s  processes  mean  test file")
for f, cpu in sorted(by_file.items(), key=lambda kv: -sum(kv[1])):
    print(f"{sum(cpu):6.0f} {len(cpu):6d} {sum(cpu) / len(cpu):6.1f}  {f}")
kinds = {
    "torchrun launchers": lambda r: "torch/distributed/run.py" in r["argv"][0],
    "megatron-core + transformers": lambda r: r["megatron"] and r["transformers"],
    "megatron-core only": lambda r: r["megatron"] and not r["transformers"],
    "transformers only": lambda r: r["transformers"] and not r["megatron"],
    "torch only": lambda r: r["torch"] and not (r["megatron"] or r["transformers"])
    and "torch/distributed/run.py" not in r["argv"][0],
    "no torch": lambda r: not r["torch"],
}
print("\nkind: processes, CPU-s, min / median CPU-s (the min ~ the import cost of that kind)")
for name, pick in kinds.items():
    cpu = [r["cpu"] for r in children if pick(r)]
    if cpu:
        print(f"{name}: {len(cpu)}, {sum(cpu):.0f}, {min(cpu):.1f} / {statistics.median(cpu):.1f}")
