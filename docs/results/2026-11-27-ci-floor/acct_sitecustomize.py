"""Per-process CPU accounting (2026-11-27): put this file's directory on PYTHONPATH as ``sitecustomize.py``; every
Python process that exits normally appends one JSON line (argv, CPU seconds, which heavy packages it imported, the
pytest test that started it) to /tmp/acct/log.jsonl. Processes ended by ``os._exit`` (xdist workers) write nothing."""

import atexit
import json
import os
import sys
import time

_T0 = time.time()


def _dump() -> None:
    try:
        t = os.times()
        rec = {"pid": os.getpid(), "ppid": os.getppid(), "argv": [str(a)[:120] for a in sys.argv[:8]],
               "cpu": round(t.user + t.system, 2), "wall": round(time.time() - _T0, 2), "mods": len(sys.modules),
               "torch": "torch" in sys.modules, "megatron": "megatron.core" in sys.modules,
               "transformers": "transformers" in sys.modules, "test": os.environ.get("PYTEST_CURRENT_TEST", "")[:160]}
        with open("/tmp/acct/log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
    except Exception:  # noqa: BLE001 - accounting must never change a process's exit
        pass


atexit.register(_dump)
