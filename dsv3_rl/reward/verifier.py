"""Symbolic equivalence with math-verify under a hard per-call time limit, from any thread.

Why a pool of child processes: math-verify's own timeouts use ``signal.alarm`` and therefore
only work in the main thread (from any other thread ``parse`` raises ``ValueError``), but verl
calls a custom reward from ``loop.run_in_executor`` threads. And some inputs (``9^{9^{9^9}}``)
make sympy run for hours, sometimes inside C code that no signal interrupts. So each check runs
in a long-lived worker process (:mod:`dsv3_rl.reward._verify_worker`):

* the worker arms a SIGALRM (soft limit, 80 % of the budget) around parse + verify;
* the caller waits on the pipe with ``select`` until the hard deadline, then kills the worker
  and starts a replacement in the background. A caller therefore never waits longer than its
  budget once it holds a worker, and a hung worker never stays in the pool (unlike a
  ``ProcessPoolExecutor`` with ``future.result(timeout=...)``, whose stuck workers keep their slot).

Workers are started with ``python -m`` (not multiprocessing "spawn", which re-imports the
caller's ``__main__``), get an address-space limit, and exit on EOF when their parent dies.
The pool is per process and rebuilt after ``fork``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_HDR = struct.Struct(">I")
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_MAX_WORKERS = int(os.environ.get("DSV3_REWARD_WORKERS", "0")) or min(4, os.cpu_count() or 1)
DEFAULT_START_TIMEOUT = float(os.environ.get("DSV3_REWARD_START_TIMEOUT", "120"))
DEFAULT_MEM_LIMIT_MB = int(os.environ.get("DSV3_REWARD_MEM_MB", "4096"))
SOFT_FRACTION = 0.8
# After a failed start, calls skip math-verify for this long before trying again.
RETRY_START_AFTER_S = 60.0


class WorkerError(RuntimeError):
    """A verify worker could not be started or talked to."""


@dataclass
class Verdict:
    equal: bool
    status: str  # "ok" | "timeout" | "error" | "crash" | "busy" | "unavailable"
    detail: str = ""
    seconds: float = 0.0


@dataclass
class PoolStats:
    calls: int = 0
    timeouts_soft: int = 0
    timeouts_hard: int = 0
    errors: int = 0
    crashes: int = 0
    workers_started: int = 0
    workers_killed: int = 0
    unavailable: int = 0
    extra: dict = field(default_factory=dict)


class _Worker:
    def __init__(self, start_timeout: float, mem_limit_mb: int):
        env = os.environ.copy()
        env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")
        self._stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "dsv3_rl.reward._verify_worker", "--mem-limit-mb", str(mem_limit_mb)]
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
                bufsize=0,
                close_fds=True,
                start_new_session=True,  # a Ctrl-C in the terminal goes to the trainer, not here
            )
        except OSError as e:
            raise WorkerError(f"cannot start verify worker {cmd}: {e}") from e
        self._next_id = 0
        try:
            hello = self._recv(time.monotonic() + start_timeout)
        except (TimeoutError, EOFError) as e:
            self.kill()
            raise WorkerError(
                f"verify worker did not start within {start_timeout:.0f}s ({type(e).__name__}); "
                f"stderr: {self.stderr_tail()}"
            ) from e
        if not hello.get("ok"):
            self.kill()
            raise WorkerError(f"verify worker failed to start: {hello.get('error')}; stderr: {self.stderr_tail()}")
        self.math_verify_version = hello.get("math_verify")

    def stderr_tail(self, n: int = 600) -> str:
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - n))
            return self._stderr.read().decode("utf-8", "replace").strip() or "<empty>"
        except (OSError, ValueError):
            return "<unavailable>"

    def _recv(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        hdr = self._read_exact(fd, _HDR.size, deadline)
        return json.loads(self._read_exact(fd, _HDR.unpack(hdr)[0], deadline))

    @staticmethod
    def _read_exact(fd: int, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def request(self, payload: dict, deadline: float) -> dict:
        self._next_id += 1
        payload = dict(payload, id=self._next_id)
        data = json.dumps(payload).encode("utf-8")
        try:
            self.proc.stdin.write(_HDR.pack(len(data)) + data)
        except (BrokenPipeError, OSError) as e:
            raise EOFError(str(e)) from e
        while True:
            resp = self._recv(deadline)
            if resp.get("id") == self._next_id:
                return resp

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except (subprocess.TimeoutExpired, OSError):
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except (OSError, AttributeError):
                pass
        try:
            self._stderr.close()
        except OSError:
            pass


class VerifierPool:
    """Up to ``max_workers`` verify workers shared by all threads of this process."""

    def __init__(
        self,
        max_workers: int = DEFAULT_MAX_WORKERS,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        mem_limit_mb: int = DEFAULT_MEM_LIMIT_MB,
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.start_timeout = start_timeout
        self.mem_limit_mb = mem_limit_mb
        self.pid = os.getpid()
        self.stats = PoolStats()
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._count = 0  # alive + starting
        self._broken_until = 0.0
        self._broken_reason = ""
        self._closed = False

    # -- worker lifecycle -------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        w = _Worker(self.start_timeout, self.mem_limit_mb)
        with self._cond:
            self.stats.workers_started += 1
            self._broken_until, self._broken_reason = 0.0, ""
        return w

    def _respawn_in_background(self) -> None:
        with self._cond:
            if self._closed or self._count >= self.max_workers:
                return
            self._count += 1

        def _run():
            try:
                w = self._start_worker()
            except WorkerError as e:
                with self._cond:
                    self._count -= 1
                    self._mark_broken(str(e))
                    self._cond.notify_all()
                return
            with self._cond:
                if self._closed:
                    self._count -= 1
                    w.kill()
                else:
                    self._idle.append(w)
                self._cond.notify_all()

        threading.Thread(target=_run, name="dsv3-verify-respawn", daemon=True).start()

    def _mark_broken(self, reason: str) -> None:
        self._broken_until = time.monotonic() + RETRY_START_AFTER_S
        if reason != self._broken_reason:
            logger.error("math-verify workers unavailable, scoring by exact/normalised match only: %s", reason)
        self._broken_reason = reason

    def _acquire(self, wait_deadline: float) -> _Worker | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                while self._idle:
                    w = self._idle.pop()
                    if w.alive():
                        return w
                    self._count -= 1
                    w.kill()
                if self._count < self.max_workers and time.monotonic() >= self._broken_until:
                    self._count += 1
                    break
                if self._count == 0:  # broken and nobody will ever release a worker
                    return None
                remaining = wait_deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
        try:
            return self._start_worker()
        except WorkerError as e:
            with self._cond:
                self._count -= 1
                self._mark_broken(str(e))
                self._cond.notify_all()
            return None

    def _release(self, w: _Worker, healthy: bool) -> None:
        with self._cond:
            if healthy and not self._closed:
                self._idle.append(w)
                self._cond.notify()
                return
            self._count -= 1
            self.stats.workers_killed += 1
            self._cond.notify_all()
        w.kill()
        self._respawn_in_background()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()

    # -- public ---------------------------------------------------------------------------
    def request(self, payload: dict, timeout: float, queue_timeout: float | None = None) -> Verdict:
        """Send one request; the worker gets ``timeout`` seconds once acquired.

        ``queue_timeout`` bounds the wait for a free worker (default: 4 x ``timeout`` plus
        the start-up allowance); past it the verdict is "busy" (not equal).
        """
        t0 = time.monotonic()
        with self._cond:
            self.stats.calls += 1
        if queue_timeout is None:
            queue_timeout = 4 * timeout + self.start_timeout
        w = self._acquire(t0 + queue_timeout)
        if w is None:
            with self._cond:
                self.stats.unavailable += 1
            status = "unavailable" if (self._broken_reason or self._closed) else "busy"
            return Verdict(False, status, self._broken_reason, time.monotonic() - t0)
        t1 = time.monotonic()
        payload = dict(payload, soft_timeout=timeout * SOFT_FRACTION)
        try:
            resp = w.request(payload, t1 + timeout)
        except TimeoutError:
            with self._cond:
                self.stats.timeouts_hard += 1
            self._release(w, healthy=False)
            return Verdict(False, "timeout", "hard deadline: worker killed", time.monotonic() - t0)
        except (EOFError, OSError, ValueError) as e:
            with self._cond:
                self.stats.crashes += 1
            detail = f"worker died ({type(e).__name__}); stderr: {w.stderr_tail(300)}"
            self._release(w, healthy=False)
            return Verdict(False, "crash", detail, time.monotonic() - t0)
        self._release(w, healthy=True)
        status = resp.get("status", "error")
        with self._cond:
            if status == "timeout":
                self.stats.timeouts_soft += 1
            elif status != "ok":
                self.stats.errors += 1
        detail = resp.get("error") or ("soft limit (SIGALRM in the worker)" if status == "timeout" else "")
        return Verdict(bool(resp.get("equal")) and status == "ok", status, detail, time.monotonic() - t0)

    def verify(self, gold: str, pred: str, timeout: float) -> Verdict:
        return self.request({"op": "verify", "gold": gold, "pred": pred}, timeout)


_POOL: VerifierPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool() -> VerifierPool:
    """The process-wide pool (a fresh one after ``fork``)."""
    global _POOL
    pool = _POOL
    if pool is not None and pool.pid == os.getpid():
        return pool
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = VerifierPool()
        return _POOL


def configure_pool(**kwargs) -> VerifierPool:
    """Replace the process-wide pool (closing the old one), e.g. ``configure_pool(max_workers=1)``."""
    global _POOL
    with _POOL_LOCK:
        old, _POOL = _POOL, VerifierPool(**kwargs)
    if old is not None and old.pid == os.getpid():
        old.close()
    return _POOL


@atexit.register
def _shutdown() -> None:
    pool = _POOL
    if pool is not None and pool.pid == os.getpid():
        pool.close()
