"""`calibrate --for-method prune` writes a store that serves `compress --method prune` for every criterion.

The statistics a method needs are the methods layer's knowledge (methods/needs.py); calibration only
gathers names. A store directory is never recalibrated (pipeline.resolve_calibration), so a criterion
whose statistics were missing would be refused with "lack" — this is the test that they are not."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moecompress.calibrate import StatsStore
from moecompress.cli import app
from moecompress.methods import stats_for_method
from moecompress.methods.prune import PruneConfig, needs_stats
from moecompress.scoring.registry import criteria
from moecompress.testing import fixture_dir

CRITERIA = criteria()


@pytest.fixture(scope="module")
def prune_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("for-method") / "S"
    res = CliRunner().invoke(
        app,
        [
            "calibrate",
            str(fixture_dir("olmoe-tiny")),
            "--data",
            "fixture-calib:8",
            "--seq-len",
            "64",
            "--out",
            str(out),
            "--for-method",
            "prune",
        ],
    )
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("criterion", CRITERIA)
def test_prune_store_serves_every_criterion(prune_store, tmp_path, criterion):
    before = (prune_store / "meta.json").read_bytes() if (prune_store / "meta.json").exists() else None
    res = CliRunner().invoke(
        app,
        [
            "compress",
            str(fixture_dir("olmoe-tiny")),
            "--method",
            "prune",
            "--criterion",
            criterion,
            "--ratio",
            "0.25",
            "--calib",
            str(prune_store),
            "--out",
            str(tmp_path / "out"),
            "--format",
            "compact",
        ],
    )
    assert res.exit_code == 0, res.output
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["method"] == "prune" and plan["params"]["criterion"] == criterion
    # served from the store as written: nothing recalibrated next to the output
    assert not (tmp_path / "out-calib").exists()
    if before is not None:
        assert (prune_store / "meta.json").read_bytes() == before


def test_for_method_names_cover_the_method_needs():
    """`--for-method prune` is the union over criteria; `--for-method C` covers prune with criterion C."""
    union = set(stats_for_method("prune"))
    for criterion in CRITERIA:
        needs = set(needs_stats(PruneConfig(criterion=criterion)))
        assert needs <= union and needs <= set(stats_for_method(criterion)), criterion
    # the counter-example: prune with criterion=frequency also reads out_norm_sq_mean (super experts)
    assert "out_norm_sq_mean" in stats_for_method("frequency")


def test_every_registered_method_is_known_by_its_name_alone(monkeypatch):
    """No second table: `--for-method NAME` serves the default config of every registered method, and a
    method registered later is known with no further line."""
    from pydantic import BaseModel

    from moecompress.methods import known_methods
    from moecompress.methods.registry import METHODS, _load_builtin_methods, register_method

    _load_builtin_methods()
    for name, entry in METHODS.items():
        assert set(entry.stats_for(entry.config_cls())) <= set(stats_for_method(name)), name

    class Cfg(BaseModel):
        k: int = 1

    monkeypatch.setitem(METHODS, "test-new-method", METHODS["quant"])  # restored after the test
    register_method("test-new-method", Cfg, lambda c, ctx: None, ["counts", "gram"])
    assert stats_for_method("test-new-method") == ("counts", "gram")
    assert "test-new-method" in known_methods()
    assert set(stats_for_method("m-smoe")) == {"counts", "tokens", "router_logit_corr"}  # what it reads


def test_store_written_for_prune_holds_its_names(prune_store):
    assert set(stats_for_method("prune")) <= set(StatsStore.load(prune_store).names)


def test_prune_criteria_are_the_registry():
    """The config's criterion names and the scoring registry are one list (a new criterion: one entry)."""
    from moecompress.scoring.registry import CRITERIA as REGISTRY
    from moecompress.scoring.registry import criteria

    assert set(CRITERIA) == set(criteria())
    assert all(REGISTRY[n].variant_of in REGISTRY for n in set(REGISTRY) - set(criteria()))


def test_dense_and_conmoe_score_through_the_registry():
    """Dense's criteria are registry entries (ACP / DO-ACP as means-evaluated variants); its needs and
    ConMoE's come from those entries."""
    from moecompress.methods import conmoe
    from moecompress.methods import dense_fit as dense
    from moecompress.scoring.registry import get_criterion

    assert set(dense.CRITERION_ENTRY) == set(dense.CRITERIA)
    for name, entry in dense.CRITERION_ENTRY.items():
        e = get_criterion(entry)
        assert (e.variant_of or e.name) == name and e.doptimal == name.startswith("do-")
        assert set(e.stats) <= set(dense.needs_stats(dense.DenseConfig(criterion=name)))
    assert dense.needs_stats() == ["counts", "tokens", "routing_mass", "pp", "cp", "out_norm_sq_mean", "gram"]
    assert set(get_criterion(conmoe.CONTRIBUTION).stats) <= set(conmoe.needs_stats(conmoe.ConMoEConfig()))
    assert set(stats_for_method("conmoe")) == {"counts", "tokens", "reap", "routing_mass"}
