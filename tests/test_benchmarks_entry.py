"""`python -m benchmarks`: every BENCHMARKS.md section has a command and a results file, and the
generators type no figures into their prose (a figure in a report is computed from results)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.__main__ import SECTIONS, commands

# an approximate or comparative figure typed into prose: "~0.25 s", "≈ 0.9", "under 0.5 s", "up to 1.8×",
# "1.06×", "12 ×", "51 of 51" — and verdicts typed as sentences ("the 2× target holds", "is the better shape",
# "because ...", "the cause is ..."), and explanations asserted about the data: the kinds of claims that went stale when the generators held them
CLAIM = re.compile(
    r"~\s?\d|≈\s?\d|\b(?:under|below|up to|within)\s~?\d|\d(?:\.\d+)?\s?×|\b\d+ of \d+\b"
    r"|\b(?:target|direction|claim|goal) (?:holds|is met)\b|\bis the (?:better|worse)\b"
    r"|\bbecause\b|\bthe cause\b"
    # explanations of the data that no figure backs ("concentrated in few windows, as a near-tie would be",
    # "as later roundings turn the other way", a tokenizer size typed instead of read)
    r"|\bnear-ties?\b|\bconcentrated in\b|\bthe other way\b|\d+-token tokenizer|\bas \w+ would be\b"
)


def _prose_strings(path: Path):
    """String literals of a generator, docstrings excluded (they document the script, not the results)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def test_every_benchmarks_md_section_has_a_command():
    headings = [line for line in (ROOT / "BENCHMARKS.md").read_text().splitlines() if line.startswith("## ")]
    titles = {s.title for s in SECTIONS.values() if s.title}
    assert headings and set(headings) <= titles, set(headings) - titles


def test_each_command_names_an_existing_generator_that_owns_its_section():
    for name, sec in SECTIONS.items():
        for step in ("run", "report"):
            for cmd in commands(name, step):
                script = next((c for c in cmd if c.startswith("benchmarks/")), None)
                if script is None:
                    continue
                text = (ROOT / script).read_text()  # exists
                if step == "report":  # the report step's generator writes exactly this section
                    assert sec.title in text, (name, script)
        assert sec.title is None or sec.results, name  # each section names its results file(s)


def test_dry_run_lists_run_then_report():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "demo", "--dry-run"],
        cwd=ROOT,
        text=True,
        capture_output=True,
        check=True,
    ).stdout
    assert out.splitlines() == [
        "[demo] python benchmarks/bench_demo.py run",
        "[demo] python benchmarks/bench_demo.py report",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "slow-tests", "--dry-run"],
        cwd=ROOT,
        text=True,
        capture_output=True,
        check=True,
    ).stdout
    assert out.strip() == "[slow-tests] python -m pytest -m slow"


def test_a_missing_results_file_is_one_sentence():
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_demo.py", "report"],
        cwd=ROOT,
        text=True,
        capture_output=True,
        env={"PATH": "", "PYTHONPATH": str(ROOT / "src")},
    )
    if (ROOT / "benchmarks" / "results" / "demo.json").is_file():
        assert proc.returncode == 0
    else:
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert "benchmarks/results/demo.json is missing" in proc.stderr


def test_generators_type_no_figures_into_their_prose():
    found = [
        f"{p.name}:{line}: {m.group(0)!r}"
        for p in sorted((ROOT / "benchmarks").glob("*.py"))
        for line, s in _prose_strings(p)
        for m in [CLAIM.search(s)]
        if m
    ]
    assert not found, found


def test_a_run_of_one_fixture_keeps_the_other_fixtures_committed_results(tmp_path, monkeypatch):
    from benchmarks import _bench_md

    monkeypatch.setattr(_bench_md, "RESULTS", tmp_path)
    _bench_md.save_results("r.json", {"fixtures": [{"fixture": "a", "kl": 1}, {"fixture": "b", "kl": 2}]})
    merged = _bench_md.kept_fixtures("r.json", {"b": {"fixture": "b", "kl": 3}}, ["a", "b"])
    assert merged == [{"fixture": "a", "kl": 1}, {"fixture": "b", "kl": 3}]
    assert _bench_md.kept_fixtures("none.json", {"b": {"fixture": "b"}}, ["a", "b"]) == [{"fixture": "b"}]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # written whole, no temporary left
