"""One typed request from the boundary to the method (issue 34): a `compress` run validates the method's config
and its quantization setting once, and everything below takes those objects; `QuantSpec` is parsed once, by
the `QuantConfig` that holds it."""

import pytest

from moecompress.methods import quantize as Q
from moecompress.methods.auto import config as A
from moecompress.quant.spec import QuantSpec
from moecompress.testing import calibrated_tiny, fixture_dir, run_cli


@pytest.fixture
def counted(monkeypatch):
    """Constructions of AutoConfig and QuantConfig (either way pydantic builds them) and QuantSpec.parse calls."""
    calls = {"AutoConfig": 0, "QuantConfig": 0, "QuantSpec.parse": 0}
    for cls in (A.AutoConfig, Q.QuantConfig):
        init, validate = cls.__init__, cls.model_validate.__func__

        def counting_init(self, *a, _init=init, _name=cls.__name__, **k):
            calls[_name] += 1
            _init(self, *a, **k)

        def counting_validate(c, *a, _validate=validate, _name=cls.__name__, **k):
            calls[_name] += 1
            return _validate(c, *a, **k)

        monkeypatch.setattr(cls, "__init__", counting_init)
        monkeypatch.setattr(cls, "model_validate", classmethod(counting_validate))
    parse = QuantSpec.parse.__func__

    def counting_parse(cls, *a, **k):
        calls["QuantSpec.parse"] += 1
        return parse(cls, *a, **k)

    monkeypatch.setattr(QuantSpec, "parse", classmethod(counting_parse))
    return calls


def test_quant_run_builds_its_config_and_spec_once(counted, tmp_path, capsys):
    code, _, err = run_cli(
        [
            "compress",
            str(fixture_dir("olmoe-tiny")),
            "--method",
            "quant",
            "--quant",
            "w4g32",
            "--quant-algo",
            "rtn",
            "--out",
            str(tmp_path / "q"),
        ],
        capsys,
    )
    assert code == 0, err
    assert counted == {"AutoConfig": 0, "QuantConfig": 1, "QuantSpec.parse": 1}


def test_recipe_setting_goes_down_as_it_was_validated(counted, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "method: prune\nparams: {criterion: frequency, ratio: 0.25}\nquant: {quant: w4g32, algo: rtn}\n"
    )
    code, _, err = run_cli(
        [
            "compress",
            str(fixture_dir("olmoe-tiny")),
            "--recipe",
            str(recipe),
            "--calib",
            "fixture-calib:2",
            "--seq-len",
            "32",
            "--out",
            str(tmp_path / "p"),
        ],
        capsys,
    )
    assert code == 0, err
    # the recipe's QuantConfig is built by pydantic as a nested field (no __init__ to count): every construction
    # parses its spec once (`QuantConfig._parsed`), so one parse is one construction
    assert counted["QuantConfig"] == 0 and counted["QuantSpec.parse"] == 1


def test_auto_run_builds_its_config_once(counted, tmp_path, capsys):
    _, store, _, _ = calibrated_tiny(tmp_path / "t", "olmoe", 3, A.needs_stats(A.AutoConfig()))
    counted["AutoConfig"] = 0
    code, _, err = run_cli(
        [
            "compress",
            str(tmp_path / "t" / "model"),
            "--method",
            "auto",
            "--budget",
            "0.5",
            "--budget-scope",
            "routed",
            "--param",
            "sensitivity=uniform",
            "--param",
            "measure=false",
            "--param",
            "bits=[16]",
            "--calib",
            str(store.path),
            "--out",
            str(tmp_path / "a"),
        ],
        capsys,
    )
    assert code == 0, err
    assert counted["AutoConfig"] == 1
