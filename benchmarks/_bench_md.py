"""Replace (or append) one `## ` section of BENCHMARKS.md: each benchmark script owns its section."""

from __future__ import annotations

from pathlib import Path


def write_section(title: str, text: str, path: Path = Path(__file__).resolve().parents[1] / "BENCHMARKS.md") -> None:
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
