"""The run directory's lock, and SIGTERM as an interrupt.

The live run holds an exclusive lock on ``<run>/.lock`` (``fcntl.flock``; ``msvcrt`` on Windows),
released by the operating system when the process dies; the holder's PID is written into it once
every check has passed (:meth:`RunLock.claim`), so a refused second run names the live one and
leaves every file as it was.  While a study runs, SIGTERM raises :class:`Terminated` (a
``KeyboardInterrupt``), so a terminated run checkpoints and reports like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Optional, Tuple

from ..utils.resources import lock_fd

__all__ = ["RunLockedError", "Terminated", "LOCK_FILE"]

# shared with runs and sweep (named internal API)
__internal__ = ["RunLock", "DirLock", "lock_holder", "wait_for_creator", "sigterm_as_interrupt"]

LOCK_FILE = ".lock"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# ---------------------------------------------------------------------------- run-directory safety
class RunLockedError(ValueError):
    """The run directory is in use by a live run (``pid`` holds the lock; None when unknown)."""

    def __init__(self, path: Path, pid: Optional[int]):
        self.path, self.pid = Path(path), pid
        who = f"process {pid}" if pid is not None else "another process"
        stop = f" (kill {pid} to stop it)" if pid is not None else ""
        super().__init__(f"run directory {path} is in use by a live run, {who}; wait for it to finish{stop} "
                         f"or use --name NEW for another run")


class Terminated(KeyboardInterrupt):
    """SIGTERM received while a study ran: handled like Ctrl-C (``signum`` is the signal number)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum



class RunLock:
    """Exclusive lock on ``run_path/.lock`` (fcntl.flock; msvcrt on Windows) with the holder's PID inside."""

    def __init__(self, run_path: Path):
        self.path = Path(run_path) / LOCK_FILE
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock (RunLockedError when a live run holds it); the file is not changed: :meth:`claim` writes
        this process's PID once every check has passed, so a refused run leaves the directory as it found it."""
        flags = os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:  # a symlink (ELOOP) or another non-file in place of the lock
            raise ValueError(f"{self.path} is not a plain lock file ({e.strerror or e}); remove it and run "
                             f"again") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                raise ValueError(f"{self.path} is a hard link or not a regular file; a lock file is never shared: "
                                 f"remove it and run again")
            lock_fd(fd)
        except BlockingIOError:
            try:
                text = os.pread(fd, 64, 0).decode("ascii", "replace").strip() if hasattr(os, "pread") else ""
                pid = int(text) if text.isdigit() else None
            finally:
                os.close(fd)
            raise RunLockedError(self.path.parent, pid) from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def claim(self) -> None:
        """Write this process's PID into the held lock file (what a refused second run reports)."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0) if hasattr(os, "pwrite") else os.write(
            self.fd, f"{os.getpid()}\n".encode())
        self.claimed = True

    def release(self) -> None:
        if self.fd is not None:
            if getattr(self, "claimed", False):
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None


def lock_holder(run_path: Path) -> Tuple[bool, Optional[int]]:
    """(locked?, holder PID or None) for ``run_path/.lock``, without creating or changing anything."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the claim in _open_run_dir decides
        return False, None
    p = Path(run_path) / LOCK_FILE
    if p.is_symlink() or not p.is_file():
        return False, None
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None
    except BlockingIOError:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return True, int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def wait_for_creator(run_path: Path, timeout: float = 2.0) -> None:
    """A folder holding nothing (or only an unlocked lock file) may be being created by a concurrent run (it
    makes the folder, then takes its lock, then writes its marker): wait up to ``timeout`` seconds for that lock
    or marker, so that the refusal names the live run instead of calling the folder foreign."""
    deadline = time.monotonic() + timeout
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline:
            if {e.name for e in os.scandir(run_path)} - {LOCK_FILE} or lock_holder(run_path)[0]:
                return
            time.sleep(0.01)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block (main thread only), the first SIGTERM raises :class:`Terminated` (a second one gets the
    previous handler, by default: terminate at once); the previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    old = signal.SIG_DFL if previous is None else previous

    def handler(signum, _frame):
        signal.signal(signal.SIGTERM, old)  # one-shot
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


DirLock = RunLock  # the sweep directory's lock (sweep.py)


