"""Per-phase seconds of each step of a GRPO run: python timings.py LOG_DIR/metrics.jsonl"""

import json
import sys

KEYS = ["timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights",
        "timing_s/testing", "timing_s/adv", "timing_s/save_checkpoint", "timing_s/step"]

rows = [json.loads(line) for line in open(sys.argv[1])]
print("step " + " ".join(k.split("/")[1][:10].rjust(10) for k in KEYS))
for r in rows:
    d = r.get("data", r)
    if "timing_s/step" in d:
        print(str(r.get("step")).rjust(4), " ".join(f"{d.get(k, float('nan')):10.2f}" for k in KEYS))
