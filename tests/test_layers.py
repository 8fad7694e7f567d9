"""The package's layers (pyproject.toml [tool.importlinter], docs/architecture.md) hold: `lint-imports` passes.

Run inside the suite so that a back-edge (say, calibration importing a method) fails the README's test
command and CI, not only a separate lint step."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint(config: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing; install the dev extra (pip install -e '.[dev]').")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(
        [exe, "--config", str(config), "--no-cache"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_are_kept():
    run = _lint(ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_a_back_edge_breaks_the_layers(tmp_path):
    """The same harness reports a contract the code breaks: models may not import errors under this one."""
    cfg = tmp_path / "contracts.toml"
    cfg.write_text(
        '[tool.importlinter]\nroot_package = "moecompress"\n\n[[tool.importlinter.contracts]]\n'
        'name = "inverted"\ntype = "layers"\nlayers = ["moecompress.errors", "moecompress.models"]\n'
    )
    run = _lint(cfg)
    assert run.returncode == 1 and "BROKEN" in run.stdout and "moecompress.models" in run.stdout, run.stdout


# dynamic imports that import-linter cannot see, each with its reason (docs/architecture.md, "Layers"):
# the methods registry loads the built-in method modules by name; eval/__init__ lazily re-exports its own
# submodules (relative names only)
DYNAMIC_IMPORTS = {"methods/registry.py", "eval/__init__.py"}


def _dynamic_imports(path: Path) -> list[int]:
    import ast

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__"):
                lines.append(node.lineno)
    return lines


def test_dynamic_imports_only_where_the_docs_say_why():
    """`importlib.import_module("moecompress.methods")` inside calibrate would pass every contract: a dynamic
    import anywhere else than the files named above fails here instead."""
    src = ROOT / "src" / "moecompress"
    found = {str(p.relative_to(src)): _dynamic_imports(p) for p in src.rglob("*.py")}
    stray = {k: v for k, v in found.items() if v and k not in DYNAMIC_IMPORTS}
    assert not stray, stray
    assert all(found.get(k) for k in DYNAMIC_IMPORTS)  # the allowance goes when the import goes


def test_every_cli_verb_module_is_in_the_verb_independence_contract():
    """A new `cli/<verb>.py` could import another verb unchecked if the contract named verbs by hand: it covers
    every module of `moecompress.cli` by wildcard instead (the shared helpers through `ignore_imports`)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    verbs = next(c for c in contracts if "moecompress.cli.*" in c.get("modules", []))
    assert verbs["type"] == "independence", verbs
