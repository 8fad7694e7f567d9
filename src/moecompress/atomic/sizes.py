"""Sizes on disk, and how every verb and report prints them."""

from __future__ import annotations

import os
from pathlib import Path


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
