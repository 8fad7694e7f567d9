"""`compare` evaluates in the checkpoint's dtype (bf16 fixtures) and offloads a model that does not fit."""

import json

import pytest
import yaml

from moecompress.testing import fixture_dir, run_cli


def _run(tmp_path, name, capsys, **ev):
    path = fixture_dir("olmoe-tiny")
    if not (path / "config.json").is_file():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    recipe = dict(
        model="fixture:olmoe-tiny",
        calibration={"data": "fixture-calib:4", "seq_len": 64},
        eval=dict(
            ppl="fixture-heldout",
            window=64,
            max_tokens=256,
            tasks=[],
            latency=False,
            quant_baselines=[],
            **ev,
        ),
        method="prune",
        params=dict(criterion="reap", ratio=0.5, gate="renorm"),
    )
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / name
    code, _, err = run_cli(["compare", str(tmp_path / f"{name}.yaml"), "--out", str(out)], capsys)
    assert code == 0, err
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def _ppl(arm):
    return arm["metrics"]["ppl:fixture-heldout"]["aggregate"]


def test_bf16_evaluation_and_offloading_give_the_same_numbers(tmp_path, capsys):
    res, report = _run(tmp_path, "resident", capsys)
    assert res["settings"]["eval_dtype"] == "bfloat16" and res["model"]["dtype"] == "bfloat16"
    assert [a["eval"]["offloaded"] for a in res["arms"]] == [False, False]
    assert abs(_ppl(res["arms"][0])["kl"]) < 1e-6 and _ppl(res["arms"][1])["kl"] > 1e-4
    assert "offloaded" not in report.lower()
    # a budget below any model's bytes: both the reference and the arm are evaluated offloaded to disk
    off, report = _run(tmp_path, "offloaded", capsys, max_memory="1KB")
    assert [a["eval"]["offloaded"] for a in off["arms"]] == [True, True]
    assert (
        "Evaluated offloaded" in report and "prune-reap-renorm-50" in report.split("Evaluated offloaded")[1]
    )
    for a, b in zip(res["arms"], off["arms"]):
        assert _ppl(a) == pytest.approx(_ppl(b), rel=1e-5, abs=1e-7), a["name"]


def test_eval_dtype_float32_keeps_the_old_upcast(tmp_path, capsys):
    res, _ = _run(tmp_path, "f32", capsys, dtype="float32")
    assert res["settings"]["eval_dtype"] == "float32" and res["model"]["dtype"] == "float32"
    assert all(a["eval"]["dtype"] == "float32" and not a["eval"]["offloaded"] for a in res["arms"])
