"""The README is a front door: short, and its support matrix says what the registries say."""

import re
from pathlib import Path

from moecompress.export.gguf_arches import ARCHES
from moecompress.models.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _matrix() -> dict[str, list[str]]:
    """family model_type -> its row's cells after the family, from the 'What runs where' table."""
    section = README.split("## What runs where", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| [^|]*\(`(\w+)`\) \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_the_readme_is_at_most_120_lines_and_holds_the_two_commands():
    assert len(README.splitlines()) <= 120
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r'pip install -c constraints.txt -e "\.\[eval,dev,triton\]"', README)
    assert install and install.group(0) in ci
    assert (
        "OMP_WAIT_POLICY=PASSIVE python -m pytest" in README
        and "OMP_WAIT_POLICY=PASSIVE python -m pytest" in ci
    )
    assert "moecompress demo" in README


def test_the_support_matrix_names_every_family_and_agrees_with_the_registries():
    rows = _matrix()
    assert set(rows) == set(FAMILIES), set(rows) ^ set(FAMILIES)
    for name, (hf, hf_quant, gguf, runtime) in rows.items():
        assert hf == "✓" and runtime == "✓", name
        assert (hf_quant == "✓") == FAMILIES[name].hf_quantized, name
        assert (gguf == "✓") == (name in ARCHES), name


def test_the_demo_table_is_the_generated_block():
    block = README.split("<!-- demo-ranking:start", 1)[1].split("<!-- demo-ranking:end -->", 1)[0]
    lines = block.splitlines()[1:]
    assert lines[0] == "| arm | MiB | KL | ppl | mc acc |" and lines[2].startswith("| original |")
