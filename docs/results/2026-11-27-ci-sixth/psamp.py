"""Sample every process's CPU (utime+stime) every 1 s until a file /tmp/s7/stop exists; at the end, per process:
its total CPU, split at the moment the file /tmp/s7/mark appeared (start-up vs steps). Writes one JSON file (argv[1]). Used for docs/ci.md "Sixth pass"."""
import os
import time
import json
import sys
HZ = os.sysconf('SC_CLK_TCK')
seen = {}  # pid -> dict(cmd, first, last, at_mark)
mark_t = None
def snap():
    out = {}
    for d in os.listdir('/proc'):
        if not d.isdigit(): continue
        try:
            st = open(f'/proc/{d}/stat').read()
            rest = st[st.rindex(')')+2:].split()
            cpu = (int(rest[11]) + int(rest[12])) / HZ
            out[int(d)] = cpu
        except Exception:
            pass
    return out
t0 = time.time()
while not os.path.exists('/tmp/s7/stop'):
    if mark_t is None and os.path.exists('/tmp/s7/mark'):
        mark_t = time.time()
        for p in seen.values(): p['at_mark'] = p['last']
    for pid, cpu in snap().items():
        p = seen.get(pid)
        if p is None:
            try: cmd = open(f'/proc/{pid}/cmdline','rb').read().replace(b'\0',b' ').decode(errors='replace')[:200]
            except Exception: cmd = '?'
            p = seen[pid] = dict(cmd=cmd, first=cpu, last=cpu, at_mark=None, born=time.time()-t0)
            if mark_t is not None: p['at_mark'] = 0.0 if p['born']>0 else cpu
        p['last'] = cpu
        if p['cmd'] in ('', '?') or 'default_worker' in p['cmd'] or p['cmd'].startswith('ray::IDLE'):
            try: p['cmd'] = open(f'/proc/{pid}/cmdline','rb').read().replace(b'\0',b' ').decode(errors='replace')[:200] or p['cmd']
            except Exception: pass
    time.sleep(1.0)
json.dump(dict(mark=mark_t and mark_t-t0, procs=seen), open(sys.argv[1],'w'))
