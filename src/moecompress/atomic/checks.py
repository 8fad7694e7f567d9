"""Which output paths a run may write: outside what it reads, on a file system that can hold them, and
replaced by `--overwrite` only when a moecompress marker of the same kind says so."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from ..errors import MoECompressError

MARKER = ".moecompress"


def _is_within(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def abs_path(path: str | os.PathLike) -> Path:
    """An output path made absolute, `~` left as it is: the verbs write `--out '~/x'` to ./~/x (the shell
    expands an unquoted ~ itself), so the checks must look there too, not in $HOME."""
    return Path(os.path.abspath(Path(path)))


def local_paths(protect) -> list[Path]:
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
    for p in local_paths(protect):
        src = abs_path(p).resolve()
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
        return abs_path(out).resolve()
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
    full = abs_path(out)
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
    from ..safejson import try_load_json

    kind = (try_load_json(Path(directory) / MARKER) or {}).get("kind")  # bounded: a crafted marker is "none"
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
    full = abs_path(out)
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
        _check_movable(out, full, flag)
    return out


def dry_run_output(
    out: str | os.PathLike, overwrite: bool = False, protect=(), flag: str = "--out", kind: str | None = None
) -> str:
    """What a dry run says of its output `out`: new, replaced (``--overwrite``), or the sentence `check_output`
    would refuse the run with."""
    full = abs_path(out)
    exists = full.exists() or full.is_symlink()
    try:
        check_output(out, overwrite, protect, flag, kind)
    except MoECompressError as exc:
        return f"{out} would be refused: {exc}"
    if not exists:
        return f"{out} (new)"
    return f"{out} exists; --overwrite replaces it"


def _check_movable(out, full: Path, flag: str) -> None:
    """Refuse, before any compute, an existing output this user cannot move aside, as `--overwrite` does before
    putting the new one in place: a directory moved to another parent needs write permission on itself (its
    ``..`` entry), and one in a sticky directory must belong to this user. Otherwise the rename failed after all
    the compute. (What the permissions cannot tell, an immutable directory say, is still one sentence then.)"""
    if full.is_symlink():  # the link is moved, not its target
        return
    st, parent = full.stat(), full.parent.stat()
    if not os.access(full, os.W_OK):
        raise MoECompressError(
            f"--overwrite cannot replace {flag} {out}: moving it aside needs write permission on it, which "
            "this user lacks; fix its permissions or pass another output path."
        )
    euid = os.geteuid() if hasattr(os, "geteuid") else 0
    if parent.st_mode & stat.S_ISVTX and euid not in (0, st.st_uid, parent.st_uid):
        raise MoECompressError(
            f"--overwrite cannot replace {flag} {out}: it belongs to another user in a sticky directory; "
            "pass another output path."
        )


def _marker_readable(directory: Path) -> bool:
    """Whether `directory`'s marker says what it holds. A marker cut short or not ours tells nothing about the
    kind, so --overwrite must not take it as leave to replace the directory."""
    from ..safejson import try_load_json

    data = try_load_json(directory / MARKER)  # bounded (`safejson`): a file nested 200,000 deep is unreadable
    return isinstance(data, dict) and isinstance(data.get("kind"), str)


def write_marker(directory: str | os.PathLike, kind: str) -> None:
    from .._version import __version__

    (Path(directory) / MARKER).write_text(
        json.dumps({"kind": kind, "moecompress_version": __version__}) + "\n"
    )
