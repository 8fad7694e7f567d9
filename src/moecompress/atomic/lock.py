"""One writer per output: an exclusive `flock` on the hidden sibling ``.NAME.lock`` for the whole run."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from ..errors import MoECompressError
from .checks import abs_path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, outputs are still written atomically
    fcntl = None


_LOCK_TAG = b"moecompress pid "


_held: dict[tuple[str, int], object] = {}  # (lock file, thread) -> the `_Lock` that thread holds on it


def lock_path(out: str | os.PathLike) -> Path:
    """The lock file of output `out`: its hidden sibling ``.NAME.lock``."""
    full = abs_path(out)
    return full.parent / f".{full.name}.lock"


class _Lock:
    """An exclusive, non-blocking `flock` on ``.NAME.lock``; the file records the holder's pid.

    The holder removes the file when it lets go (a file whose first bytes are not a moecompress lock
    is used but never written or removed). Between a holder's unlink and another run's lock that run
    may hold a lock on a deleted file, so after locking it checks the path still names its file, and
    otherwise tries again."""

    def __init__(self, out: Path, flag: str):
        self.path, self.out, self.flag = lock_path(out), out, flag
        self.fd, self.ours, self.made = None, False, []

    def acquire(self) -> None:
        parent = self.path.parent
        while not parent.exists():  # the parents --out needs; removed again if the run leaves them empty
            self.made.append(parent)
            parent = parent.parent
        for d in reversed(self.made):
            d.mkdir(exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 64, 0)
                os.close(fd)
                self._remove_made()
                pid = (
                    holder[len(_LOCK_TAG) :].split()[0].decode(errors="replace")
                    if holder.startswith(_LOCK_TAG) and holder[len(_LOCK_TAG) :].split()
                    else "unknown"
                )
                raise MoECompressError(
                    f"Another moecompress run is writing {self.out} (pid {pid}); wait for it or "
                    f"choose another {self.flag}."
                ) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        head = os.pread(fd, len(_LOCK_TAG), 0)
        self.ours = head in (b"", _LOCK_TAG)  # new, or left by a killed run
        if self.ours:
            os.ftruncate(fd, 0)
            os.pwrite(fd, _LOCK_TAG + f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if self.ours:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)  # while still locked: no other run can hold this file now
        finally:
            os.close(self.fd)
            self.fd = None
            self._remove_made()

    def _remove_made(self) -> None:
        for d in self.made:  # deepest first; stops at the first that holds something
            try:
                d.rmdir()
            except OSError:
                break


@contextlib.contextmanager
def claim(out: str | os.PathLike, flag: str = "--out"):
    """Hold the lock of output `out` for the block, or refuse in one sentence while another run holds it.

    Taken after the output checks pass and held until the output is renamed into place, so two runs
    given the same output can never write into it (or its ``.NAME.partial``) together. Re-entrant in
    one thread: a verb claims its output for the whole run and the `atomic_dir` that writes it claims
    it again; another thread opens the file anew and is refused like another process. Without `fcntl`
    (Windows) it does nothing."""
    key = (str(lock_path(out)), threading.get_ident())
    if fcntl is None or key in _held:
        yield
        return
    lock = _Lock(Path(out), flag)
    lock.acquire()
    _held[key] = lock
    try:
        yield
    finally:
        del _held[key]
        lock.release()
