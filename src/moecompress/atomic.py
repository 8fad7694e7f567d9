"""Output directories appear complete or not at all, and `--overwrite` never deletes what moecompress did not write.

The policy (docs/architecture.md, "Outputs"):

- every output directory is written into a hidden sibling ``.NAME.tmp-PID-XXXX`` and renamed into
  place when complete; any exception, Ctrl-C or SIGTERM removes the sibling;
- every output directory carries the marker file ``.moecompress`` (written before the rename), which
  records its kind (``stats``, ``checkpoint:FORMAT``, ``report``, ``analysis``, ``distill-run``);
- an output may never be, contain or sit inside a path the run reads (the model, a reference, a stats
  store, a checkpoint to evaluate), with or without ``--overwrite`` (`check_apart`); ``--overwrite``
  replaces only a directory with the marker of the same kind, never the current directory or one of
  its ancestors (`check_output`);
- one run at a time writes an output: `claim` holds an exclusive lock on the hidden sibling
  ``.NAME.lock`` for the whole run, so a second writer refuses in one sentence instead of mixing its
  files with the first's (a calibration's ``.NAME.partial`` is covered by the same lock);
- the inputs are fingerprinted when the run starts and again just before the rename
  (`fingerprint_inputs`, `Inputs.check`): an input replaced while the run read it fails the run instead
  of giving an output made of two different inputs;
- every file is fsynced before its rename (`fsync_tree`, `write_file`), so a crash right after a run
  cannot leave a complete-looking output with empty files;
- temporary siblings left by a killed run (SIGKILL: no cleanup can run) are removed by the next
  run that writes the same output, once their process is gone, and reported with their size;
- outputs get the permissions of an ordinary `mkdir` (the umask), not `mkdtemp`'s 0700.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from .errors import MoECompressError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, outputs are still written atomically
    fcntl = None

MARKER = ".moecompress"
_TMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[^.]*$")
_LOCK_TAG = b"moecompress pid "


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_within(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def _abs(path: str | os.PathLike) -> Path:
    """An output path made absolute, `~` left as it is: the verbs write `--out '~/x'` to ./~/x (the shell
    expands an unquoted ~ itself), so the checks must look there too, not in $HOME."""
    return Path(os.path.abspath(Path(path)))


def _local(protect) -> list[Path]:
    """The paths of `protect` that exist here (a hub id or a data spec has nothing on disk to protect)."""
    found = []
    for p in protect:
        if isinstance(p, (str, os.PathLike)):
            try:
                if Path(p).expanduser().exists():
                    found.append(Path(p).expanduser())
            except (OSError, ValueError):  # a data spec too long or odd to be a path
                pass
    return found


def check_apart(out: str | os.PathLike, protect=(), flag: str = "--out") -> None:
    """Refuse an output that is, contains or sits inside a path this run reads (`protect`).

    Writing it would delete or change the input while the run reads it (``eval ck --report ck``), or
    leave the output inside another directory's files (``--report ck/sub``); neither is ever wanted,
    so `--overwrite` does not lift this."""
    full = _resolve(out, flag)
    for p in _local(protect):
        src = _abs(p).resolve()
        if _is_within(src, full):
            raise MoECompressError(
                f"{flag} {out} is (or contains) {p}, which this run reads; pass another output path."
            )
        if _is_within(full, src):
            raise MoECompressError(
                f"{flag} {out} is inside {p}, which this run reads; pass an output path outside it."
            )


def _resolve(out, flag: str) -> Path:
    try:
        return _abs(out).resolve()
    except RuntimeError:  # Python < 3.13 reports a loop of symbolic links so
        raise MoECompressError(
            f"{flag} {out} passes through a loop of symbolic links; pass another output path."
        ) from None


# room a name needs for its hidden siblings: ".NAME.tmp-PID-XXXXXXXX", ".NAME.lock", "NAME-calib", ".NAME.partial"
_SIBLING_BYTES = 32


def check_path(out: str | os.PathLike, flag: str = "--out") -> Path:
    """Refuse an output path the file system cannot hold, in one sentence, before any compute; returns the
    nearest existing ancestor of its parent.

    A parent that is a file, a loop of symbolic links, a component or name too long, an unwritable parent:
    each was an OSError (a traceback) when the run first wrote, often after all its compute. A name must
    leave room for the hidden siblings a run writes beside it (`_SIBLING_BYTES`)."""
    full = _abs(out)
    parent = full.parent
    while True:
        try:
            os.stat(parent)
            break
        except FileNotFoundError:
            parent = parent.parent
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise MoECompressError(
                    f"{flag} {out} passes through a loop of symbolic links; pass another output path."
                ) from None
            if exc.errno == errno.ENAMETOOLONG:
                raise MoECompressError(
                    f"{flag} {out} is too long for the file system; pass a shorter output path."
                ) from None
            if exc.errno == errno.ENOTDIR:  # a component is a file: report the file
                while parent.parent != parent and not parent.is_file():
                    parent = parent.parent
                break
            raise
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise MoECompressError(
            f"Cannot write {out}: {parent} is not a writable directory; pass an output path you can write to."
        )
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    longest = max(len(os.fsencode(part)) for part in full.relative_to(parent).parts) if full != parent else 0
    if longest + _SIBLING_BYTES > limit:
        raise MoECompressError(
            f"{flag} {out} is too long: a name in it has {longest} bytes, and moecompress needs "
            f"one of at most {limit - _SIBLING_BYTES} to write hidden files beside it; pass a "
            "shorter output path."
        )
    return parent


def marker_kind(directory: str | os.PathLike) -> str | None:
    """The kind recorded in `directory`'s marker (None: no marker, or one too old to say)."""
    try:
        kind = json.loads((Path(directory) / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return (
        kind if isinstance(kind, str) and kind != "output" else None
    )  # "output": before kinds were recorded


def _family(kind: str) -> str:
    """``checkpoint:hf`` and ``checkpoint:compact`` are one kind of output: either replaces the other."""
    return kind.split(":", 1)[0]


def check_output(
    out: str | os.PathLike, overwrite: bool = False, protect=(), flag: str = "--out", kind: str | None = None
) -> Path:
    """Refuse, in one sentence and before any compute, an output directory this run may not write.

    `protect`: paths this run reads (the input model, a reference, a stats store in use); `out` may be
    none of them, contain none and sit inside none (`check_apart`). `kind`: what this run writes
    (`write_marker`); `--overwrite` replaces only a marked output of the same kind, so ``calibrate --out
    CHECKPOINT --overwrite`` cannot turn a checkpoint into a stats store. Returns `out` unchanged.
    """
    out = Path(out)
    full = _abs(out)
    check_path(out, flag)
    if (
        full.is_symlink() and not full.exists()
    ):  # renaming onto it would replace the link, not write its target
        raise MoECompressError(
            f"{flag} {out} is a dangling symbolic link (to {os.readlink(full)}); remove it or "
            "pass another output path."
        )
    if full.exists() and not full.is_dir():
        raise MoECompressError(
            f"{flag} {out} is an existing file, not a directory; pass a new directory path."
        )
    check_apart(out, protect, flag)
    if full.exists():
        if not overwrite:
            raise MoECompressError(f"{out} already exists; choose another output path or pass --overwrite.")
        if _is_within(Path.cwd().resolve(), full.resolve()):
            raise MoECompressError(
                f"{flag} {out} is the current directory or one of its ancestors; --overwrite "
                "never replaces it, so pass a new directory path."
            )
        if not (full / MARKER).is_file():
            raise MoECompressError(
                f"{out} was not written by moecompress (no {MARKER} marker), so --overwrite "
                "will not delete it; remove it yourself or pass another output path."
            )
        if not _marker_readable(full):
            raise MoECompressError(
                f"The {MARKER} marker of {out} cannot be read (not a JSON object with a kind), "
                "so --overwrite will not replace it; remove it yourself or pass another output "
                "path."
            )
        old = marker_kind(full)
        if kind not in (None, "output") and old is not None and _family(old) != _family(kind):
            raise MoECompressError(
                f"{out} holds moecompress output of kind '{_family(old)}', not "
                f"'{_family(kind)}', so --overwrite will not replace it; pass another output path."
            )
    return out


def _marker_readable(directory: Path) -> bool:
    """Whether `directory`'s marker says what it holds. A marker cut short or not ours tells nothing about the
    kind, so --overwrite must not take it as leave to replace the directory."""
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("kind"), str)


def clean_stale(out: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove temporary siblings of `out` left by runs that no longer exist; report each with its size.

    Returns (path, bytes) of those removed. Siblings of live processes are left alone.
    """
    out = _abs(out)
    if not out.parent.is_dir():
        return []
    removed = []
    for p in out.parent.iterdir():
        m = _TMP.match(p.name)
        if not m or m.group("name") != out.name or not p.is_dir() or _alive(int(m.group("pid"))):
            continue
        size = dir_bytes(p)
        shutil.rmtree(p, ignore_errors=True)
        removed.append((p, size))
        print(f"note: removed {p}, {human_bytes(size)} left by an interrupted run", file=sys.stderr)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def fix_permissions(root: str | os.PathLike) -> None:
    """Give `root` and everything under it the umask's permissions (mkdtemp/mkstemp make them private)."""
    mask = _umask()
    root = Path(root)
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def write_marker(directory: str | os.PathLike, kind: str) -> None:
    from ._version import __version__

    (Path(directory) / MARKER).write_text(
        json.dumps({"kind": kind, "moecompress_version": __version__}) + "\n"
    )


# ----------------------------------------------------------------------------- one writer per output
_held: dict[tuple[str, int], object] = {}  # (lock file, thread) -> the `_Lock` that thread holds on it


def lock_path(out: str | os.PathLike) -> Path:
    """The lock file of output `out`: its hidden sibling ``.NAME.lock``."""
    full = _abs(out)
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


# ----------------------------------------------------------------------------- inputs that must not change
class Inputs:
    """Fingerprints of what a run reads, taken when it starts (`fingerprint_inputs`); `check` refuses,
    just before the rename, when one changed since: the output would mix two versions of it (weights of
    the new model with statistics of the old, say).

    A file's fingerprint is its size and modification time; a directory's, those of each file in it
    plus `content(dir)` when given (the callers above the checkpoint layer pass
    `checkpoint.checkpoint_fingerprint`, the model identity stats stores record: config, shard headers,
    sampled tensor bytes)."""

    def __init__(self, paths, content=None):
        self.content = content
        self.taken = {str(p): self._fingerprint(p) for p in _local(paths)}

    def _fingerprint(self, path) -> str | None:
        p = Path(path).expanduser()
        if p.is_file():
            st = p.stat()
            return f"file:{st.st_size}:{st.st_mtime_ns}"
        if not p.is_dir():
            return None
        h = hashlib.sha256(str(self.content(p)).encode() if self.content is not None else b"")
        for f in sorted(p.iterdir()):
            if f.is_file() and not f.name.startswith("."):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def check(self) -> None:
        for p, fp in self.taken.items():
            if self._fingerprint(p) != fp:
                raise MoECompressError(
                    f"{p} changed while this run read it, so its output was not written; run "
                    "again once it no longer changes."
                )


def fingerprint_inputs(paths, content=None) -> Inputs:
    """`Inputs` of the paths in `paths` that exist here (hub ids and data specs have no files here)."""
    return Inputs(paths, content)


# ----------------------------------------------------------------------------- durable writes
def _fsync_path(path: Path, directory: bool = False) -> None:
    """fsync one file (its errors, a full disk among them, are real) or directory (best effort: some
    systems cannot open or sync one)."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under `root` (before it is renamed into place)."""
    root = Path(root)
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if not p.is_symlink():
                _fsync_path(p)
        _fsync_path(Path(dirpath), directory=True)


def write_file(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `path` complete or not at all: a hidden temporary sibling, fsynced, renamed over `path`;
    removed on any failure (a full disk leaves nothing behind)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; an output is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_path(path.parent, directory=True)


@contextlib.contextmanager
def atomic_dir(
    out: str | os.PathLike,
    overwrite: bool = False,
    protect=(),
    kind: str = "output",
    inputs: Inputs | None = None,
    flag: str = "--out",
):
    """Yield a temporary sibling of `out` to write into; rename it to `out` only on success.

    Any exception (including KeyboardInterrupt and the CLI's SIGTERM exception) removes the temporary
    directory, so a crash never leaves a half-written output. `out` is claimed (`claim`) until the
    rename; the inputs (`inputs`, from `fingerprint_inputs` when the run started, else `protect` as they
    are now) are checked unchanged and every file fsynced just before it. See the module docstring.
    """
    out = Path(out)
    check_output(out, overwrite, protect, flag, kind)
    with claim(out, flag):
        if inputs is None:
            inputs = fingerprint_inputs(protect)
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
        try:
            yield tmp
            write_marker(tmp, kind)
            fix_permissions(tmp)
            fsync_tree(tmp)
            inputs.check()
            if out.exists():
                check_output(out, overwrite, protect, flag, kind)  # still ours: nothing replaced it meanwhile
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
                os.replace(out, old / out.name)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
            _fsync_path(out.parent, directory=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes on disk of every regular file under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, named as such), for the sizes every verb and report prints."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
