"""The package's layers (pyproject.toml [tool.importlinter], docs/architecture.md) hold: `lint-imports` passes.

Run inside the suite so that a back-edge (say, calibration importing a method) fails the README's test
command and CI, not only a separate lint step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint(config: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing; install the dev extra (pip install -e '.[dev]').")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([exe, "--config", str(config), "--no-cache"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_import_contracts_are_kept():
    run = _lint(ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_a_back_edge_breaks_the_layers(tmp_path):
    """The same harness reports a contract the code breaks: models may not import errors under this one."""
    cfg = tmp_path / "contracts.toml"
    cfg.write_text('[tool.importlinter]\nroot_package = "moecompress"\n\n[[tool.importlinter.contracts]]\n'
                   'name = "inverted"\ntype = "layers"\nlayers = ["moecompress.errors", "moecompress.models"]\n')
    run = _lint(cfg)
    assert run.returncode == 1 and "BROKEN" in run.stdout and "moecompress.models" in run.stdout, run.stdout
