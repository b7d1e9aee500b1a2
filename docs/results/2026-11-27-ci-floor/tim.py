"""verl's per-step timings (timing_s/*) of the side-by-side launches (run1.sh NAME ...): python3 tim.py NAME ..."""

import glob
import json
import sys

for name in sys.argv[1:]:
    path = glob.glob(f"/tmp/s6/exp/{name}/logs/**/metrics.jsonl", recursive=True)[0]
    rows = [json.loads(line) for line in open(path)]
    keys = ["gen", "old_log_prob", "update_actor", "update_weights", "step", "testing"]
    print(name, {k: [round(r["data"].get("timing_s/" + k, 0), 2) for r in rows if r["step"] > 0] for k in keys})
