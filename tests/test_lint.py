"""ruff's lint (the rule set in pyproject.toml, [tool.ruff.lint]) and formatter are clean over src/, tests/ and
benchmarks/ (issue 34): part of the default test run, so a change that breaks either fails like a test."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["src", "tests", "benchmarks"]


@pytest.mark.parametrize("args", [["check", *PATHS], ["format", "--check", *PATHS]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is a dev dependency (pip install -e '.[dev]'); it is not on PATH"
    proc = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# Over 60 lines on purpose (docs/architecture.md says why): a CLI verb's Typer option declarations, a Triton kernel
LONG_ON_PURPOSE = {"packed_pair_linear_triton", "packed_pair_gemm_kernel"}


def test_modules_and_functions_are_small_enough_to_read_in_one_sitting():
    """No module of src/ over 500 lines, no function over 60 (issue 34), except the documented kinds."""
    import ast

    over = []
    for path in sorted((ROOT / "src" / "moecompress").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 500:
            over.append(f"{path.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = node.end_lineno - node.lineno + 1
            allowed = node.name in LONG_ON_PURPOSE or (
                path.parent.name == "cli" and node.name.endswith("_command")
            )
            if n > 60 and not allowed:
                over.append(f"{path.name}:{node.lineno} {node.name}: {n} lines")
    assert not over, over
