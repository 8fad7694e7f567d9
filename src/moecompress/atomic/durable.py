"""Durable, all-or-nothing writes: fingerprints of the inputs, fsynced files, and the output directory
written into a hidden sibling that is renamed into place (`atomic_dir`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import MoECompressError
from .checks import abs_path, check_output, local_paths, write_marker
from .lock import claim
from .sizes import dir_bytes, human_bytes

_TMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[^.]*$")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def clean_stale(out: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove temporary siblings of `out` left by runs that no longer exist; report each with its size.

    Returns (path, bytes) of those removed. Siblings of live processes are left alone.
    """
    out = abs_path(out)
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
        self.taken = {str(p): self._fingerprint(p) for p in local_paths(paths)}

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
