"""Child process that runs math-verify for :mod:`dsv3_rl.reward.verifier`.

Protocol on stdin/stdout: 4-byte big-endian length + UTF-8 JSON, one request at a time.
  hello (sent once at start): {"ok": bool, "math_verify": version | null, "error": str | null}
  request:  {"id": int, "op": "verify", "gold": str, "pred": str, "soft_timeout": float}
  response: {"id": int, "status": "ok" | "timeout" | "error", "equal": bool, "error": str | null}
The soft timeout is a SIGALRM inside this process (this is its main thread, so signals work);
the parent also kills this process at its hard deadline, which covers hangs inside C code that
a signal cannot interrupt. EOF on stdin (the parent exited) ends the process.

Other ops: "clear_cache" (drop parsed gold answers; used by bench/bench_reward.py). Test-only ops
(used by tests/unit/test_math_reward*.py to show the parent's guards bite):
  "hang"  - block SIGALRM and sleep (an uninterruptible hang); "crash" - exit without replying.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import struct
import sys
import time

_HDR = struct.Struct(">I")


class _SoftTimeout(BaseException):
    """BaseException so that libraries' ``except Exception`` cannot swallow it."""


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _SoftTimeout()


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _send(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode("utf-8")
    os.write(fd, _HDR.pack(len(data)) + data)


def _make_verify():
    from math_verify import parse, verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    gold_cfg = [LatexExtractionConfig()]
    pred_cfg = [LatexExtractionConfig(), ExprExtractionConfig()]

    # A GRPO group scores many responses against one gold answer: parse it once. (A parse cut
    # short by the alarm raises, and lru_cache does not store exceptions.)
    @functools.lru_cache(maxsize=2048)
    def parse_gold(gold: str) -> tuple:
        return tuple(parse("\\boxed{" + gold + "}", gold_cfg, parsing_timeout=None))

    def run(gold: str, pred: str) -> bool:
        # Timeouts are ours (SIGALRM here + hard kill in the parent); math-verify's own
        # signal-based ones are switched off so they cannot clobber our alarm.
        g = list(parse_gold(gold))
        p = parse("\\boxed{" + pred + "}", pred_cfg, parsing_timeout=None)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=None))

    run.cache_clear = parse_gold.cache_clear
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mem-limit-mb", type=int, default=0, help="RLIMIT_AS for this process (0 = none)")
    args = ap.parse_args(argv)

    out_fd = sys.stdout.fileno()
    in_fd = sys.stdin.fileno()
    # Anything printed by libraries must not corrupt the protocol stream.
    sys.stdout = sys.stderr
    logging.disable(logging.CRITICAL)
    try:
        if args.mem_limit_mb > 0:
            import resource

            lim = args.mem_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        run = _make_verify()
        import math_verify

        run("1", "1")  # warm the parser caches before saying hello
        _send(out_fd, {"ok": True, "math_verify": getattr(math_verify, "__version__", "?"), "error": None})
    except BaseException as e:  # noqa: BLE001 - report any start-up failure to the parent
        _send(out_fd, {"ok": False, "math_verify": None, "error": f"{type(e).__name__}: {e}"})
        return 1

    signal.signal(signal.SIGALRM, _on_alarm)
    while True:
        hdr = _read_exact(in_fd, _HDR.size)
        if hdr is None:
            return 0
        body = _read_exact(in_fd, _HDR.unpack(hdr)[0])
        if body is None:
            return 0
        req = json.loads(body)
        op = req.get("op")
        resp = {"id": req.get("id"), "status": "ok", "equal": False, "error": None}
        try:
            signal.setitimer(signal.ITIMER_REAL, max(float(req.get("soft_timeout", 1.0)), 0.001))
            try:
                if op == "verify":
                    resp["equal"] = run(req["gold"], req["pred"])
                elif op == "clear_cache":
                    run.cache_clear()
                elif op == "hang":
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                    time.sleep(float(req.get("seconds", 3600)))
                elif op == "crash":
                    os._exit(3)
                else:
                    resp.update(status="error", error=f"unknown op {op!r}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            resp.update(status="timeout", equal=False)
        except BaseException as e:  # noqa: BLE001 - RecursionError, MemoryError, sympy errors ...
            resp.update(status="error", equal=False, error=f"{type(e).__name__}: {str(e)[:200]}")
        _send(out_fd, resp)


if __name__ == "__main__":
    sys.exit(main())
