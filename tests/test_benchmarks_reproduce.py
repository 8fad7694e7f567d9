"""Every BENCHMARKS.md section regenerates byte-identically from the committed results alone.

`python -m benchmarks all report` runs every section's report step in a copy holding only what a fresh clone has
(benchmarks/, BENCHMARKS.md, docs/; no build/ directory of earlier runs): the document and every results file
(JSON and plots) must come out unchanged. A report that read uncommitted files, or typed a figure that
disagrees with its JSON, fails here."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_every_section_regenerates_byte_identically_from_committed_results(tmp_path):
    ignore = shutil.ignore_patterns("__pycache__", "*.tmp")
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks", ignore=ignore)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=ignore)
    shutil.copy2(ROOT / "BENCHMARKS.md", tmp_path / "BENCHMARKS.md")
    shutil.copy2(ROOT / "README.md", tmp_path / "README.md")  # its demo table is generated too
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "report"],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not (tmp_path / "build").exists(), "a report wrote into build/"
    assert (tmp_path / "BENCHMARKS.md").read_text() == (ROOT / "BENCHMARKS.md").read_text()
    assert (tmp_path / "README.md").read_text() == (ROOT / "README.md").read_text()
    before, after = _files(ROOT / "benchmarks" / "results"), _files(tmp_path / "benchmarks" / "results")
    assert sorted(after) == sorted(before)
    changed = [name for name in before if before[name] != after[name]]
    assert not changed, changed
