"""Import time per Ray actor of one launch run with PYTHONPROFILEIMPORTTIME=1: reads SESSION/logs/worker-*.err
(an actor's EngineCore child writes into its server's file) and prints, per actor, the summed self time of its
imports (wall seconds, on a loaded 2-core box) and its six biggest top-level imports (cumulative)."""

import collections
import glob
import re
import sys

rows = []
for err in sorted(glob.glob(sys.argv[1] + "/logs/worker-*.err")):
    txt = open(err, errors="replace").read()
    out = open(err[:-4] + ".out", errors="replace").read()
    m = re.search(r":actor_name:(\S+)", out + txt)
    self_us, top = 0, collections.Counter()
    for line in txt.splitlines():
        mm = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if mm:
            self_us += int(mm.group(1))
            if len(mm.group(3)) <= 3:
                top[mm.group(4)] += int(mm.group(2))
    rows.append((self_us / 1e6, m.group(1) if m else "(idle worker)", top))
for s, name, top in sorted(rows, key=lambda r: -r[0]):
    print(f"{s:6.1f} s  {name:28s} " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in top.most_common(6)))
print(f"total {sum(r[0] for r in rows):.1f} s")
