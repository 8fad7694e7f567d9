"""Dynamic imports hide edges from import-linter: `importlib.import_module("moecompress.methods")` inside
calibrate passes every contract in pyproject.toml. So `import_module` / `__import__` may be called only in the
modules listed below, each with the reason a normal import statement does not do (issue 34)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moecompress"

DYNAMIC = {"import_module", "__import__"}

# path under src/moecompress -> why it imports by name
ALLOWED = {
    # a registry: imports the built-in method modules by name so that each registers itself
    "methods/registry.py": "loads the built-in methods by name",
    # not a registry: a PEP 562 lazy re-export of eval's own submodules (names from `_EXPORTS`), so that
    # `moecompress --help` does not import torch, lm-eval or matplotlib. A normal import statement cannot take
    # the submodule's name from a variable, and importing them all would make `import moecompress.eval`
    # eager (a behaviour change); it imports only `moecompress.eval.<submodule>` (relative names, checked
    # below), which import-linter already sees as part of `moecompress.eval`, so no contract is hidden.
    "eval/__init__.py": "lazy re-export of its own submodules",
}
RELATIVE_ONLY = {"eval/__init__.py"}  # every dynamic import there names a submodule relative to the package


def _dynamic_names(tree: ast.AST) -> set[str]:
    """Local names bound to a dynamic importer: `from importlib import import_module as im` and the like."""
    names = set(DYNAMIC)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("importlib", "builtins"):
            names |= {a.asname or a.name for a in node.names if a.name in DYNAMIC}
    return names


def _is_relative(call: ast.Call) -> bool:
    """The first argument is a string (or f-string) starting with '.', resolved against the package."""
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.JoinedStr) and arg.values:
        arg = arg.values[0]
    return isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(".")


def dynamic_import_calls(path: Path) -> list[ast.Call]:
    """Every call of `import_module` / `__import__` in a file, however it is spelled (attribute or alias)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = _dynamic_names(tree)
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in DYNAMIC) or (
                isinstance(f, ast.Name) and f.id in names
            ):
                calls.append(node)
    return calls


def stray_calls(root: Path, allowed=ALLOWED, relative_only=RELATIVE_ONLY) -> dict[str, list[int]]:
    """file -> line numbers of dynamic imports outside the allow-list (or non-relative where only relative)."""
    stray: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        calls = dynamic_import_calls(path)
        if rel in relative_only:
            calls = [c for c in calls if not _is_relative(c)]
        elif rel in allowed:
            calls = []
        if calls:
            stray[rel] = [c.lineno for c in calls]
    return stray


def test_dynamic_imports_only_in_the_allowed_modules():
    stray = stray_calls(SRC)
    assert not stray, (
        f"importlib.import_module/__import__ outside the allow-list (import-linter cannot see them): {stray}; "
        "use an import statement, or add the module to ALLOWED with the reason"
    )


def test_every_allowance_is_still_used():
    """The allowance goes when the dynamic import goes."""
    unused = [rel for rel in ALLOWED if not dynamic_import_calls(SRC / rel)]
    assert not unused, f"ALLOWED lists modules without a dynamic import: {unused}; remove them"


def test_the_scan_finds_every_spelling(tmp_path):
    """The scanner itself: each way of calling a dynamic import outside the allow-list is reported."""
    pkg = tmp_path / "pkg"
    (pkg / "calibrate").mkdir(parents=True)
    (pkg / "eval").mkdir()
    cases = {
        "calibrate/a.py": 'import importlib\n\nimportlib.import_module("moecompress.methods")\n',
        "calibrate/b.py": 'from importlib import import_module as load\n\nload("moecompress.methods")\n',
        "calibrate/c.py": 'from importlib import import_module\n\nimport_module("moecompress.methods")\n',
        "calibrate/d.py": '__import__("moecompress.methods")\n',
        "calibrate/e.py": 'import builtins\n\nbuiltins.__import__("moecompress.methods")\n',
        "eval/__init__.py": 'import importlib\n\nimportlib.import_module("moecompress.methods")\n',
    }
    for rel, text in cases.items():
        (pkg / rel).write_text(text)
    (pkg / "eval" / "ok.py").write_text('import importlib\n\nimportlib.import_module(f".{1}", __name__)\n')
    assert set(
        stray_calls(
            pkg,
            allowed={"eval/__init__.py": "", "eval/ok.py": ""},
            relative_only={"eval/__init__.py", "eval/ok.py"},
        )
    ) == set(cases)
