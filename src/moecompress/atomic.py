"""Output directories appear complete or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import MoECompressError


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary sibling of `out` to write into; rename it to `out` only on success.

    Any exception (including KeyboardInterrupt) removes the temporary directory, so a crash
    never leaves a half-written output.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise MoECompressError(f"{out} already exists; choose another output path or pass --overwrite.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes on disk of every regular file under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KB' (binary units), for the sizes every verb prints."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
