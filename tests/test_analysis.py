"""Cross-layer nearest-neighbour analysis: brute-force agreement, planted neighbours, the CLI's files."""

import json
import struct

import pytest
import torch

from moecompress.models import ExpertWeights, MoEAdapter
from moecompress.scoring.distance import pairwise_distance
from moecompress.testing import run_cli, save_tiny, tiny_model
from moecompress.workflows.analysis import analyze_model, nearest_neighbours


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe", seed=5, num_hidden_layers=4)


def test_neighbours_match_brute_force_within_scopes(model):
    ad = MoEAdapter(model)
    res = analyze_model("tiny", scope_size=2, model=model)
    assert res.scopes == [[0, 1], [2, 3]]
    by_src = {(r.layer, r.expert): r for r in res.neighbours}
    assert len(by_src) == 32
    for group in res.scopes:
        members = [(layer, e) for layer in group for e in range(8)]
        stack = ExpertWeights.stack([ad.get_expert(layer, e) for layer, e in members])
        d = pairwise_distance(stack)
        for i, src in enumerate(members):
            j = min((j for j in range(len(members)) if j != i), key=lambda j: (float(d[i, j]), j))
            rec = by_src[src]
            assert (rec.nn_layer, rec.nn_expert) == members[j]
            assert rec.distance == pytest.approx(float(d[i, j]))
            assert rec.nn_layer in group  # never outside the scope
    heat = torch.tensor(res.heatmap)
    torch.testing.assert_close(heat.sum(1), torch.ones(4, dtype=heat.dtype))
    for k, layer in enumerate(res.moe_layers):
        assert res.cross_fraction[layer] == pytest.approx(1 - float(heat[k, k]), abs=1e-6)
        assert heat[k, 2 * (k // 2) : 2 * (k // 2) + 2].sum() == pytest.approx(1.0)  # block-diagonal
    cross = sum(r.nn_layer != r.layer for r in res.neighbours) / 32
    assert res.overall_cross_fraction == pytest.approx(cross, abs=1e-6)
    local = analyze_model("tiny", scope_size=1, model=model)
    assert local.overall_cross_fraction == 0.0 and all(v == 0.0 for v in local.cross_fraction.values())


def test_a_planted_copy_is_found_in_the_neighbouring_layer():
    m = tiny_model("olmoe", seed=2, num_hidden_layers=3)
    ad = MoEAdapter(m)
    w = ad.get_expert(0, 5)
    ad.set_expert(1, 3, w.map(lambda t: t * 1.001))  # near-copy of layer 0 expert 5 in layer 1
    res = analyze_model("tiny", scope_size=4, model=m)
    rec = {(r.layer, r.expert): r for r in res.neighbours}
    assert (rec[(1, 3)].nn_layer, rec[(1, 3)].nn_expert) == (0, 5)
    assert (rec[(0, 5)].nn_layer, rec[(0, 5)].nn_expert) == (1, 3)
    assert rec[(0, 5)].distance == pytest.approx(0.001 / 1.0005, rel=1e-3)
    idx, _val = nearest_neighbours(torch.zeros(1, 1))
    assert idx == [-1]


def test_cli_writes_json_and_a_readable_png(tmp_path, capsys):
    src = save_tiny("qwen3_moe", tmp_path / "m", seed=1, num_hidden_layers=4)
    out = tmp_path / "an"
    code, text, _ = run_cli(["analyze", str(src), "--scope", "2", "--out", str(out)], capsys)
    assert code == 0 and "cross-layer" in text
    data = json.loads((out / "analysis.json").read_text())
    assert data["scope_size"] == 2 and len(data["neighbours"]) == 32 and len(data["heatmap"]) == 4
    png = (out / "nn_heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 800 and height >= 400
    code, _, err = run_cli(["analyze", str(src), "--scope", "2", "--out", str(out)], capsys)
    assert code == 2 and "already exists" in err  # one sentence, exit 2
    code, _, _ = run_cli(["analyze", str(src), "--scope", "0", "--out", str(tmp_path / "x")], capsys)
    assert code == 2
    code, _, err = run_cli(["analyze", str(tmp_path / "missing"), "--out", str(tmp_path / "y")], capsys)
    assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "olmoe-tiny"])
def test_analysis_of_the_trained_fixtures(name, tmp_path):
    from moecompress.testing import fixture_dir
    from moecompress.workflows.analysis import write_analysis

    path = fixture_dir(name)
    if not (path / "model.safetensors").exists():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    res = analyze_model(str(path), scope_size=4)
    write_analysis(res, tmp_path / "out")
    n = len(res.moe_layers)
    assert len(res.heatmap) == n and 0.0 <= res.overall_cross_fraction <= 1.0
    assert (tmp_path / "out" / "nn_heatmap.png").stat().st_size > 10_000
