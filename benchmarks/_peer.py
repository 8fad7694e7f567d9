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
        sys.exit(
            f"{' '.join(map(str, cmd))} failed (exit {proc.returncode}); see {log}:\n"
            + log.read_text()[-3000:]
        )


PEER_WHOLE = ROOT / "benchmarks" / "results" / "peer_gptq_whole.json"


def load_peer_whole(fixture: str, path: str | os.PathLike | None = None) -> list[dict]:
    """llm-compressor's whole-model GPTQ arms on `fixture`, as `peer_llmcompressor_whole.py` recorded them in
    benchmarks/results/peer_gptq_whole.json (schema in that script's docstring); [] when the file or the fixture is
    absent.

    Each arm: ``name`` ("w4-linear", "w2-all", ...), ``bits``, ``scope`` ("linear": every Linear but the router
    gates and lm_head; "all": lm_head and the embeddings too), ``whole_bytes`` and ``original_bytes`` (tensor
    bytes of the saved and the original safetensors files, from their dtypes and shapes), ``file_ratio``, ``kl``
    (token-weighted mean), ``kl_windows`` (KL(original || arm) per held-out window, in ``window_ids`` order) and
    ``window_ids`` / ``eval`` (the window spec: data, max_tokens, window, stride, batch_size, dtype) to check that
    another benchmark's windows are the same before pairing them."""
    import json

    p = Path(path) if path is not None else PEER_WHOLE
    if not p.is_file():
        return []
    data = json.loads(p.read_text())
    fx = next((f for f in data.get("fixtures", []) if f.get("fixture") == fixture), None)
    if fx is None:
        return []
    spec = dict(data["eval"], stride=fx["eval"]["stride"])
    return [
        {
            "name": a["name"],
            "bits": a["bits"],
            "scope": a["scope"],
            "whole_bytes": a["whole_bytes"],
            "original_bytes": a["original_bytes"],
            "file_ratio": a["whole_bytes"] / a["original_bytes"],
            "kl": a["kl"],
            "kl_windows": list(a["kl_windows"]),
            "window_ids": list(fx["eval"]["window_ids"]),
            "eval": spec,
        }
        for a in fx["arms"]
    ]
