"""Output directories appear complete or not at all, and `--overwrite` never deletes what moecompress did not write.

The policy (docs/architecture.md, "Outputs"):

- every output directory is written into a hidden sibling ``.NAME.tmp-PID-XXXX`` and renamed into
  place when complete; any exception, Ctrl-C or SIGTERM removes the sibling;
- every output directory carries the marker file ``.moecompress`` (written before the rename);
- ``--overwrite`` replaces only a directory with that marker, and never the current directory, one
  of its ancestors, the input model or a stats store in use (`check_output`);
- temporary siblings left by a killed run (SIGKILL: no cleanup can run) are removed by the next
  run that writes the same output, once their process is gone, and reported with their size;
- outputs get the permissions of an ordinary `mkdir` (the umask), not `mkdtemp`'s 0700.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import MoECompressError

MARKER = ".moecompress"
_TMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[^.]*$")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_within(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def check_output(out: str | os.PathLike, overwrite: bool = False, protect=(), flag: str = "--out") -> Path:
    """Refuse, in one sentence and before any compute, an output directory this run may not write.

    `protect`: paths this run reads (the input model, a stats store in use); `out` may be neither
    one of them nor an ancestor of one. Returns `out` unchanged.
    """
    out = Path(out)
    full = Path(os.path.abspath(out.expanduser()))
    if full.exists() and not full.is_dir():
        raise MoECompressError(f"{flag} {out} is an existing file, not a directory; pass a new directory path.")
    for p in protect:
        if p is None or not Path(str(p)).expanduser().exists():
            continue
        if _is_within(Path(os.path.abspath(Path(str(p)).expanduser())).resolve(), full.resolve()):
            raise MoECompressError(f"{flag} {out} is (or contains) {p}, which this run reads; pass another "
                                   "output directory.")
    if full.exists():
        if not overwrite:
            raise MoECompressError(f"{out} already exists; choose another output path or pass --overwrite.")
        if _is_within(Path.cwd().resolve(), full.resolve()):
            raise MoECompressError(f"{flag} {out} is the current directory or one of its ancestors; --overwrite "
                                   "never replaces it, so pass a new directory path.")
        if not (full / MARKER).is_file():
            raise MoECompressError(f"{out} was not written by moecompress (no {MARKER} marker), so --overwrite "
                                   "will not delete it; remove it yourself or pass another output path.")
    parent = full.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise MoECompressError(f"Cannot write {out}: {parent} is not a writable directory; pass an output path "
                               "you can write to.")
    return out


def clean_stale(out: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove temporary siblings of `out` left by runs that no longer exist; report each with its size.

    Returns (path, bytes) of those removed. Siblings of live processes are left alone.
    """
    out = Path(os.path.abspath(Path(out).expanduser()))
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

    (Path(directory) / MARKER).write_text(json.dumps({"kind": kind, "moecompress_version": __version__}) + "\n")


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False, protect=(), kind: str = "output"):
    """Yield a temporary sibling of `out` to write into; rename it to `out` only on success.

    Any exception (including KeyboardInterrupt and the CLI's SIGTERM exception) removes the temporary
    directory, so a crash never leaves a half-written output. See the module docstring for the policy.
    """
    out = Path(out)
    check_output(out, overwrite, protect)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        write_marker(tmp, kind)
        fix_permissions(tmp)
        if out.exists():
            check_output(out, overwrite, protect)  # still ours: nothing replaced it while we computed
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
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
