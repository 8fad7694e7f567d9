"""Shared by the peer checks (peer_llmcompressor_*.py): package versions, and running one side in a child
process with one thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def versions(pkgs) -> dict:
    """{package: installed version or None}."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in pkgs:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def child(cmd: list[str], log: Path) -> None:
    """Run one side in a fresh process with one thread; exit with its log's tail if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", MKL_NUM_THREADS="1")
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed (exit {proc.returncode}); see {log}:\n"
                 + log.read_text()[-3000:])
