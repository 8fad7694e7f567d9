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
