"""The public Python API (`moecompress.api`): every verb function end to end on the shipped fixture (a few
hundred tokens each), the README's example as written, and the CLI verbs calling these same functions."""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moecompress
from moecompress import api
from moecompress.recipe import ArmSpec, CalibrationSpec, EvalSpec, Recipe
from moecompress.testing import fixture_dir, run_cli

README = Path(__file__).resolve().parents[1] / "README.md"
FIXTURE = "fixture:olmoe-tiny"


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's "Python" example, run as written in a fresh directory: (directory, its variables)."""
    section = README.read_text().split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    root = tmp_path_factory.mktemp("readme")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        namespace: dict = {}
        exec(compile(code, str(README), "exec"), namespace)
    finally:
        os.chdir(cwd)
    return root, namespace


def test_the_readme_example_calibrates_compresses_evaluates_and_loads(readme_run):
    root, ns = readme_run
    assert (root / "stats").is_dir() and (root / "pruned" / "plan.json").is_file()
    assert ns["result"].format == "compact" and Path(ns["result"].path) == Path("pruned")
    agg = ns["results"]["arms"][0]["metrics"]["ppl:fixture-heldout"]["aggregate"]
    assert agg["kl"] > 0 and agg["ppl"] > 1  # half the experts gone: measurably different from the original
    assert ns["results"]["arms"][0]["kind"] == "compressed"  # evaluate read the export's plan
    assert ns["pruned"]._moecompress_plan is not None  # moecompress.load put the plan into the runtime


def test_calibrate_for_method_gathers_what_the_method_reads(readme_run):
    from moecompress.calibrate import StatsStore
    from moecompress.methods import stats_to_gather

    store = StatsStore.load(readme_run[0] / "stats")
    assert set(stats_to_gather(None, "prune")) <= set(store.names)


def test_compress_writes_the_checkpoint_the_cli_writes(readme_run, capsys, monkeypatch):
    root, _ = readme_run
    monkeypatch.chdir(root)
    code, _, err = run_cli(
        [
            "compress",
            FIXTURE,
            "--method",
            "prune",
            "--criterion",
            "reap",
            "--ratio",
            "0.5",
            "--calib",
            "stats",
            "--out",
            "cli-pruned",
        ],
        capsys,
    )
    assert code == 0, err
    names = sorted(p.name for p in (root / "pruned").iterdir())
    assert names == sorted(p.name for p in (root / "cli-pruned").iterdir())
    for name in names:
        assert filecmp.cmp(root / "pruned" / name, root / "cli-pruned" / name, shallow=False), name


def test_evaluate_writes_the_results_file_and_the_report(readme_run, tmp_path):
    root, _ = readme_run
    results = moecompress.evaluate(
        str(root / "pruned"),
        ppl="fixture-heldout",
        window=64,
        max_tokens=256,
        out=tmp_path / "results.json",
        report=tmp_path / "report",
        progress=False,
    )
    assert json.loads((tmp_path / "results.json").read_text())["arms"][0]["metrics"].keys() == {
        "ppl:fixture-heldout"
    }
    assert results["schema"] == "moecompress.results/1" and (tmp_path / "report" / "report.md").is_file()
    with pytest.raises(moecompress.MoECompressError, match="Nothing to evaluate"):
        moecompress.evaluate(str(root / "pruned"))


def test_compare_runs_a_recipe_and_writes_the_report(tmp_path):
    recipe = Recipe(
        model=FIXTURE,
        calibration=CalibrationSpec(data="fixture-calib:4", seq_len=64),
        eval=EvalSpec(
            ppl="fixture-heldout", window=64, max_tokens=256, tasks=[], latency=False, quant_baselines=[]
        ),
        arms=[ArmSpec(method="prune", params={"criterion": "frequency", "ratio": 0.5})],
    )
    results = moecompress.compare(recipe, tmp_path / "report", keep_checkpoints=False, progress=False)
    assert [a["name"] for a in results["arms"]] == ["original", "prune-frequency-50"]
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "ranking.md").is_file()
    assert results["arms"][0]["path"] == str(fixture_dir("olmoe-tiny"))  # fixture: resolved by models.loading


def test_the_cli_verbs_call_the_public_functions():
    from moecompress.cli import calibrate, compare, compress, eval, grid

    assert calibrate.calibrate is moecompress.calibrate is api.calibrate
    assert compress.compress is moecompress.compress is api.compress
    assert eval.evaluate is moecompress.evaluate is api.evaluate
    assert compare.compare is grid.compare is moecompress.compare is api.compare


def test_eval_passes_its_options_to_evaluate(monkeypatch, capsys):
    from moecompress.cli import eval as eval_verb

    seen = {}

    def fake(model, **options):
        seen.update(options, model=model)
        return {
            "model": {"name": "m", "model_type": "olmoe"},
            "arms": [{"metrics": {"ppl:x": {"aggregate": {"ppl": 2.0}, "n": 3}}}],
        }

    monkeypatch.setattr(eval_verb, "evaluate", fake)
    code, out, err = run_cli(["eval", FIXTURE, "--ppl", "x", "--window", "64", "--limit", "5"], capsys)
    assert code == 0, err
    assert seen["model"] == FIXTURE and seen["ppl"] == "x" and seen["window"] == 64 and seen["limit"] == 5
    assert "2.0000" in out


def test_the_public_names_shadow_the_subpackages_they_share_a_name_with():
    import moecompress.calibrate.distributed  # noqa: F401  (a submodule imported late binds nothing on moecompress)
    import moecompress.export.writer  # noqa: F401
    from moecompress.calibrate import StatsStore  # the subpackage is still importable by name
    from moecompress.compare import run_compare  # the package too

    assert moecompress.calibrate is api.calibrate and moecompress.compare is api.compare
    assert callable(moecompress.export) and StatsStore and run_compare
    assert set(moecompress.__all__) >= {
        "calibrate",
        "compress",
        "evaluate",
        "compare",
        "load",
        "apply_plan",
        "export",
        "load_model",
        "MoEAdapter",
        "CompressionPlan",
    }


def test_python_dash_m_moecompress_is_the_cli(tmp_path):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(
        [sys.executable, "-m", "moecompress", "inspect", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
