"""Durable, all-or-nothing writes: fingerprints of the inputs, fsynced files, and the output directory
written into a hidden sibling that is renamed into place (`atomic_dir`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from ..errors import MoECompressError
from .checks import abs_path, check_output, local_paths, write_marker
from .lock import claim
from .sizes import dir_bytes, human_bytes

_TMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[^.]*$")

TMP_MARKER = ".moecompress-tmp"
"""The file that proves a temporary directory is moecompress's: written into it when it is made (`temporary_dir`),
it records the temporary's role, the output it belongs to, and the host, pid and start time of the process
that made it. A temporary is removed as stale (`clean_marked`) only when it carries this marker, for the role
asked, from this host, and its process is gone: a directory that merely looks like one by name is left alone."""

SPILL_PREFIX = "moecompress-plan-tensors-"  # spilled plan tensors in the system's temporary directory


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, from /proc), to tell a reused pid from the
    process that wrote a marker; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def mark_temporary(
    directory: str | os.PathLike, role: str, out: str | None = None, pid: int | None = None
) -> None:
    """Write `TMP_MARKER` into `directory`: it is a temporary of this process (or of `pid`) in `role`."""
    pid = os.getpid() if pid is None else pid
    record = {
        "role": role,
        "out": out,
        "pid": pid,
        "started": _start_time(pid),
        "host": socket.gethostname(),
        "token": secrets.token_hex(8),
    }
    (Path(directory) / TMP_MARKER).write_text(json.dumps(record) + "\n")


def temporary_dir(parent: str | os.PathLike, prefix: str, role: str, out: str | None = None) -> Path:
    """A new private directory `parent/prefix...` carrying our marker (`mark_temporary`) from the start, so a
    later run can prove it ours if this process is killed before removing it."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        mark_temporary(tmp, role, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _marker_of(directory: Path) -> dict | None:
    from ..safejson import try_load_json

    return try_load_json(directory / TMP_MARKER)  # a JSON object within `safejson`'s limits, else None


def _stale(directory: Path, roles, out: str | None) -> bool:
    """Whether `directory` is a temporary of ours in one of `roles` (of output `out`, when given) whose process
    is gone."""
    record = _marker_of(directory)
    if record is None or record.get("role") not in roles or (out is not None and record.get("out") != out):
        return False
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if record.get("host") != socket.gethostname():  # another machine's (shared file system): not ours
        return False
    return not _alive(pid, record.get("started"))


def clean_marked(parent: str | os.PathLike, named, roles, out: str | None = None) -> list[tuple[Path, int]]:
    """Remove the directories of `parent` whose name `named(name)` accepts that are stale temporaries of ours
    (`_stale`); report each with its size. Returns (path, bytes) of those removed."""
    parent = Path(parent)
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    for p in entries:
        if not named(p.name) or p.is_symlink() or not p.is_dir() or not _stale(p, roles, out):
            continue
        size = dir_bytes(p)
        shutil.rmtree(p, ignore_errors=True)
        removed.append((p, size))
        print(f"note: removed {p}, {human_bytes(size)} left by an interrupted run", file=sys.stderr)
    return removed


def clean_stale(out: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove temporary siblings of `out` (``.NAME.tmp-*``, ``.NAME.old-*``) left by runs that no longer exist;
    report each with its size.

    Only a directory carrying our marker for output `out` (`TMP_MARKER`) whose process is gone is removed: a
    directory of the user's with such a name is left alone. Returns (path, bytes) of those removed.
    """
    out = abs_path(out)
    if not out.parent.is_dir():
        return []

    def named(name: str) -> bool:
        m = _TMP.match(name)
        return m is not None and m.group("name") == out.name

    return clean_marked(out.parent, named, ("output-tmp", "output-old"), out.name)


def clean_stale_spills() -> list[tuple[Path, int]]:
    """Remove the spilled plan tensors (`checkpoint.view.SpilledTensors`) of killed runs from the system's
    temporary directory."""
    return clean_marked(tempfile.gettempdir(), lambda name: name.startswith(SPILL_PREFIX), ("plan-tensors",))


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` (started at `started`, when known) still runs."""
    if pid == os.getpid():
        return started is None or _start_time(pid) in (None, started)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    except OverflowError:
        return False
    now = _start_time(pid)
    return started is None or now is None or now == started


def clear_partial(directory: str | os.PathLike, ours: bool, flag: str = "--out") -> None:
    """Make way for a fresh partial run in `directory` (a run's ``.NAME.partial``, kept for ``--resume``): removed
    when `ours` (the caller read our run.json in it) or empty; anything else is refused in one sentence, never
    deleted (``calibrate`` and ``compare`` alike)."""
    directory = Path(directory)
    if not (directory.exists() or directory.is_symlink()):
        return
    if directory.is_symlink():
        pass
    elif ours:
        shutil.rmtree(directory)
        return
    else:
        with contextlib.suppress(OSError):  # an empty directory holds nothing to lose (killed at its start)
            directory.rmdir()
            return
    raise MoECompressError(
        f"{directory} is in the way of this run's partial results and was not written by moecompress (no "
        f"readable run.json); remove it or choose another {flag}."
    )


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
    `checkpoint.checkpoint_fingerprint`, the model identity stats stores record: a sha256 of config, index and
    every byte of every shard, read once per process)."""

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


def stage_file(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` into a hidden temporary sibling of `path`, fsynced, with an ordinary file's permissions, and
    return it; `commit_file` renames it over `path`. Removed on any failure here (a full disk leaves nothing)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; an output is an ordinary file
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def commit_file(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename a file `stage_file` wrote over `path`; on failure the temporary is removed."""
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_path(Path(path).parent, directory=True)


def write_file(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `path` complete or not at all: a hidden temporary sibling, fsynced, renamed over `path`;
    removed on any failure (a full disk leaves nothing behind)."""
    commit_file(stage_file(path, data), path)


@contextlib.contextmanager
def atomic_dir(
    out: str | os.PathLike,
    overwrite: bool = False,
    protect=(),
    kind: str = "output",
    inputs: Inputs | None = None,
    flag: str = "--out",
):
    """Yield a temporary directory to write `out` into; rename it to `out` only on success.

    The directory lies inside a marked hidden sibling ``.NAME.tmp-PID-XXXX`` (`temporary_dir`), so a run killed
    before its cleanup leaves something the next run can prove ours (`clean_stale`). Any exception (including
    KeyboardInterrupt and the CLI's SIGTERM exception) removes the sibling, so a crash never leaves a
    half-written output. `out` is claimed (`claim`) until the rename; the inputs (`inputs`, from
    `fingerprint_inputs` when the run started, else `protect` as they are now) are checked unchanged and every
    file fsynced just before it. A rename the file system refuses is one sentence, the previous output left in
    place (`_put_in_place`). See the module docstring.
    """
    out = Path(out)
    check_output(out, overwrite, protect, flag, kind)
    with claim(out, flag):
        if inputs is None:
            inputs = fingerprint_inputs(protect)
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(out)
        clean_stale_spills()
        work = temporary_dir(out.parent, f".{out.name}.tmp-{os.getpid()}-", "output-tmp", out.name)
        try:
            tmp = work / out.name
            tmp.mkdir()
            yield tmp
            write_marker(tmp, kind)
            fix_permissions(tmp)
            fsync_tree(tmp)
            inputs.check()
            if out.exists() or out.is_symlink():
                check_output(out, overwrite, protect, flag, kind)  # still ours: nothing replaced it meanwhile
            _put_in_place(tmp, out, flag)
            _fsync_path(out.parent, directory=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _cannot_replace(out: Path, flag: str, exc: OSError) -> MoECompressError:
    return MoECompressError(
        f"Cannot put the new output in place of {out} ({exc.strerror or exc}); the previous one is left as it "
        f"was: fix its permissions or pass another {flag}."
    )


def _put_in_place(tmp: Path, out: Path, flag: str) -> None:
    """Rename `tmp` to `out`. An existing `out` is first moved aside into a marked ``.NAME.old-PID-XXXX`` and
    deleted once the new one is in place; if either rename fails (a directory the file system will not move), the
    previous output is moved back and the failure is one sentence."""
    if not (out.exists() or out.is_symlink()):
        try:
            os.replace(tmp, out)
        except OSError as exc:
            raise MoECompressError(
                f"Cannot write {out} ({exc.strerror or exc}); pass another {flag}."
            ) from None
        return
    old = temporary_dir(out.parent, f".{out.name}.old-{os.getpid()}-", "output-old", out.name)
    aside = old / out.name
    moved = False
    try:
        os.replace(out, aside)
        moved = True
        os.replace(tmp, out)
        moved = False  # the new output is in place: what is aside is the old one, to delete
    except BaseException as exc:
        if moved:
            try:
                os.replace(aside, out)
                moved = False
            except OSError:
                # the previous output stays aside: never deleted as a stale temporary, and named in the error
                with contextlib.suppress(OSError):
                    (old / TMP_MARKER).unlink()
                raise MoECompressError(
                    f"Cannot put the new output in place of {out}, nor move the previous one back; it is "
                    f"kept in {aside}."
                ) from None
        shutil.rmtree(old, ignore_errors=True)
        if isinstance(exc, OSError):
            raise _cannot_replace(out, flag, exc) from None
        raise
    shutil.rmtree(old, ignore_errors=True)
