"""One error base class for the package and one wrapper for every command-line ``main``.

Every error the tools raise about their input or environment subclasses :class:`Dsv3Error` (keeping
its older base, ``ValueError`` or ``RuntimeError``, so existing ``except`` clauses still match).
:func:`cli_main` wraps a ``main(argv) -> int`` so that

* a :class:`Dsv3Error` prints ``error: <message>`` (one line) and exits 2;
* an ``OSError`` prints ``error: <file>: <what>`` naming the file, with "read-only" for a read-only or
  unwritable location (EROFS, EACCES, EPERM) and "disk full" for ENOSPC/EDQUOT, and exits 2;
* Ctrl-C (SIGINT) and SIGTERM print ``interrupted: <what is kept>; rerun the same command to resume``
  and exit 130;
* any other exception is a bug: one line naming its type, exit 1.

A raw traceback is printed only with ``DSV3_DEBUG=1`` in the environment or ``--debug`` on the
command line (the wrapper removes ``--debug`` before the tool parses its arguments).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

EXIT_ERROR = 2  # bad input / environment
EXIT_BUG = 1  # an unexpected exception
EXIT_INTERRUPTED = 130  # SIGINT or SIGTERM (128 + SIGINT, as shells report Ctrl-C)
DEFAULT_INTERRUPTED = "nothing half-written is kept; rerun the same command to resume"

_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class Dsv3Error(Exception):
    """Bad input or environment; the message names the file, tensor or config key (and what is allowed)."""


class UsageError(Dsv3Error, ValueError):
    """Options that parse but do not make sense together (the wrapper prints ``error: ...``, exit 2)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered like Ctrl-C so that every ``except KeyboardInterrupt`` cleanup runs."""


TRUE_WORDS = ("1", "true", "yes", "y", "on")
FALSE_WORDS = ("0", "false", "no", "n", "off", "")


def env_flag(name: str, default: bool = False, environ=None) -> bool:
    """A boolean environment variable: one of :data:`TRUE_WORDS` / :data:`FALSE_WORDS` (any case); unset is
    DEFAULT; anything else is a :class:`UsageError` naming the variable and the accepted words (never read as no)."""
    v = (os.environ if environ is None else environ).get(name)
    if v is None:
        return default
    w = v.strip().lower()
    if w in TRUE_WORDS:
        return True
    if w in FALSE_WORDS:
        return False
    raise UsageError(f"{name}={v!r} is not a yes/no value (yes: {', '.join(TRUE_WORDS)}; "
                     f"no: {', '.join(w or repr('') for w in FALSE_WORDS)})")


def close(word: str, choices, n: int = 3) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the CHOICES closest to WORD (difflib), ``""`` when none is close: the
    tail of an error message that names an unknown key or value."""
    import difflib

    m = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(x) for x in m)}?" if m else ""


def debug_enabled() -> bool:
    """``DSV3_DEBUG`` read by the package's one yes/no parser (:func:`env_flag`); an unknown word turns
    tracebacks on (this runs while an error is reported: it must not raise one of its own)."""
    try:
        return env_flag("DSV3_DEBUG")
    except UsageError:
        return True


def describe_oserror(e: OSError) -> str:
    """``<file>: <what> (<strerror>)``; "read-only" / "disk full" where that is the cause."""
    where = e.filename if e.filename is not None else None
    if e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}"
    strerror = e.strerror or str(e)
    if e.errno in _DISK_FULL:
        what = f"disk full ({strerror}); free space or choose another location"
    elif e.errno in _READ_ONLY:
        what = f"read-only or not writable ({strerror}); choose a writable location"
    else:
        what = strerror
    return f"{where}: {what}" if where is not None else what


def is_read_only(path) -> bool:
    """Whether PATH (or its nearest existing parent) cannot be written by this process."""
    p = _existing(path)
    try:
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        pass
    return not os.access(p, os.W_OK)


def _existing(path) -> str:
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def free_bytes(path) -> int:
    """Free bytes on the file system that holds PATH (or its nearest existing parent)."""
    import shutil

    return shutil.disk_usage(_existing(path)).free


def check_space(path, need_bytes: int, what: str, margin_bytes: int = 64 << 20) -> None:
    """Raise Dsv3Error if PATH cannot take NEED_BYTES (plus a margin): says "read-only" when it is."""
    p = _existing(path)
    if is_read_only(p):
        raise Dsv3Error(f"{path}: read-only or not writable ({p}); choose a writable location for {what}")
    free = free_bytes(p)
    if need_bytes + margin_bytes > free:
        raise Dsv3Error(f"{path}: not enough disk space for {what}: need {need_bytes / 1e9:.2f} GB, "
                        f"{free / 1e9:.2f} GB free")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_main(fn: Callable[[list[str]], int | None], argv: list[str] | None = None, *,
             interrupted: str = DEFAULT_INTERRUPTED) -> int:
    """Call FN(argv) and map its failures to one line and an exit status (see the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled() or "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        with _sigterm_as_interrupt():
            rc = fn(argv)
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        what = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        print(f"interrupted ({what}): {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Dsv3Error as e:
        if debug:
            traceback.print_exc()
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {_one_line(describe_oserror(e))}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # noqa: BLE001 - an unexpected error is a bug: one line, traceback on request
        if debug:
            traceback.print_exc()
        print(f"error: unexpected {type(e).__name__}: {_one_line(e)} (a bug; rerun with DSV3_DEBUG=1 "
              f"for the traceback)", file=sys.stderr)
        return EXIT_BUG
    return 0 if rc is None else int(rc)


def cli_main(fn=None, *, interrupted: str = DEFAULT_INTERRUPTED):
    """Decorator for ``main(argv=None) -> int``: ``@cli_main`` or ``@cli_main(interrupted="...")``."""

    def wrap(f):
        @functools.wraps(f)
        def main(argv: list[str] | None = None) -> int:
            return run_main(f, argv, interrupted=interrupted)

        main.__wrapped_main__ = f
        return main

    return wrap(fn) if fn is not None else wrap


def _one_line(x) -> str:
    s = str(x.args[0]) if isinstance(x, KeyError) and x.args else str(x)
    return " ".join(s.split()) if "\n" in s else s
