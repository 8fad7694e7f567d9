"""Shared by the benchmark generators: each owns one `## ` section of BENCHMARKS.md and one results
file under benchmarks/results/ (committed), so `report` regenerates the section without recomputing."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def write_section(title: str, text: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    """`text` starts with the `title` heading line; everything up to the next `## ` heading is replaced."""
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    text = text.rstrip("\n") + "\n"
    if title in doc:
        start = doc.index(title)
        nxt = doc.find("\n## ", start + len(title))
        doc = doc[:start] + text + ("\n" + doc[nxt + 1:] if nxt >= 0 else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)


def results_path(name: str) -> Path:
    """benchmarks/results/NAME: where a generator's `run` writes and its `report` reads."""
    return RESULTS / name


def save_results(name: str, obj) -> Path:
    path = results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def load_results(name: str):
    path = results_path(name)
    if not path.is_file():
        raise SystemExit(f"{path.relative_to(ROOT)} is missing: run this section's `run` step first "
                         f"(python -m benchmarks --list).")
    return json.loads(path.read_text())


def machine() -> str:
    """The machine, as measured now (goes into each results file, so a report never hand-types it)."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores"


def rel(path: Path) -> str:
    """A results path as the report cites it (repository-relative)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
