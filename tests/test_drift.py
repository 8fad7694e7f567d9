"""Mask drift (§6.4): disjoint token-matched draws, Jaccard distances, zero drift for identical specs."""

import itertools
import random
import re
import warnings

import pytest

from moecompress.data import disjoint_resamples, load_tokenizer
from moecompress.data.sources import FIXTURE_DOMAINS, fixture_documents, fixture_path, text_documents
from moecompress.errors import MoECompressError
from moecompress.models.loading import resolve_fixture
from moecompress.workflows.drift import drift_summary, jaccard_distance, mask_drift

DOMAINS = [f"fixture-calib/{d}" for d in FIXTURE_DOMAINS["fixture-calib"]]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_fixture("fixture:olmoe-tiny"))


def test_fixture_corpora_are_the_runs_the_build_script_writes():
    for fixture, runs in FIXTURE_DOMAINS.items():
        docs = text_documents(fixture_path(fixture).read_text(encoding="utf-8"))
        assert [r[:2] for r in runs.values()] == [
            (0, runs["technical"][1]),
            (runs["technical"][1], runs["scripture"][1]),
            (runs["scripture"][1], len(docs)),
        ]
        headword = re.compile(r"^[A-Z][A-Z'-]+, [a-z]+\.", re.M)  # "BAAL, n." opens a dictionary entry
        a, b, _ = runs["technical"]
        assert not any("Yahweh" in d or headword.search(d) for d in docs[a:b])
        a, b, _ = runs["scripture"]
        assert all(any(w in d for w in ("God", "Yahweh", "Lord", "Israel")) for d in docs[a:b])
        assert not any(headword.search(d) for d in docs[a:b])
        a, b, _ = runs["aphorisms"]
        assert all(headword.search(d) or d.startswith("X in our alphabet") for d in docs[a:b])
    passages = fixture_documents("fixture-calib/aphorisms")
    assert len(passages) > 100 and passages[0].startswith("BAAL, n.")


def test_draws_use_disjoint_documents_at_the_same_token_count(tok):
    for spec in DOMAINS:
        draws = disjoint_resamples(spec, tok, seq_len=128, sequences=6, resamples=3, seed=5)
        assert [d.data.num_tokens for d in draws] == [6 * 128] * 3
        for a, b in itertools.combinations(draws, 2):
            assert not set(a.documents) & set(b.documents)
        again = disjoint_resamples(spec, tok, seq_len=128, sequences=6, resamples=3, seed=5)
        assert [d.documents for d in again] == [d.documents for d in draws]
        assert all((x.data.input_ids == y.data.input_ids).all() for x, y in zip(draws, again))
    with pytest.raises(MoECompressError, match="fills at most"):
        disjoint_resamples("fixture-calib/aphorisms", tok, seq_len=256, sequences=50, resamples=4)


def _direct(masks, layers):
    """The definitions, computed plainly: set sizes, no shared helpers."""

    def j(x, y):
        u = len(x | y)
        return 0.0 if u == 0 else (u - len(x & y)) / u

    flat = {s: [{(l, e) for l in layers for e in m[l]} for m in draws] for s, draws in masks.items()}
    R = len(next(iter(masks.values())))
    w = {
        s: sum(j(f[r], f[q]) for r in range(R) for q in range(r + 1, R)) / (R * (R - 1) / 2)
        for s, f in flat.items()
    }
    d = {
        (a, b): sum(j(flat[a][r], flat[b][r]) for r in range(R)) / R
        for a, b in itertools.combinations(masks, 2)
    }
    return w, d


def test_distances_equal_a_direct_computation():
    rng = random.Random(0)
    layers = [0, 1, 2]
    masks = {
        s: [{l: sorted(rng.sample(range(16), rng.randint(0, 8))) for l in layers} for _ in range(5)]
        for s in "ABC"
    }
    s = drift_summary(masks, layers, bootstrap=50, seed=1)
    w, d = _direct(masks, layers)
    for spec in "ABC":
        assert s["resampling"][spec]["overall"] == pytest.approx(w[spec])
    for (a, b), v in d.items():
        assert s["domain"][f"{a} | {b}"]["overall"] == pytest.approx(v)
        assert s["ratio"][f"{a} | {b}"] == pytest.approx(v / ((w[a] + w[b]) / 2))
    assert s["overall"]["ratio"] == pytest.approx((sum(d.values()) / 3) / (sum(w.values()) / 3))
    lo, hi = s["interval"]["overall"]
    assert lo <= hi
    assert jaccard_distance({1, 2, 3}, {2, 3, 4}) == pytest.approx(0.5) and jaccard_distance([], []) == 0.0


def test_identical_specs_drift_zero_and_masks_are_compress_masks():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = mask_drift(
            "fixture:olmoe-tiny",
            ["fixture-calib/scripture", "fixture-calib/scripture"],
            ["frequency"],
            [0.5],
            draws=2,
            sequences=2,
            seq_len=128,
            bootstrap=20,
        )
    s = res.summary["frequency@0.5"]
    (pair,) = s["domain"]
    assert s["domain"][pair]["overall"] == 0.0 and s["overall"]["domain"] == 0.0
    a, b = res.masks["frequency@0.5"].values()
    assert a == b
    for mask in a:
        assert all(len(p) == 8 for p in mask.values())  # 50 % of 16 experts pruned in every layer
    assert res.calibration["fixture-calib/scripture #1"][0]["tokens"] == 2 * 128
    with pytest.raises(MoECompressError, match="two draws"):
        mask_drift("fixture:olmoe-tiny", ["fixture-calib"], ["frequency"], [0.5], draws=1)


def test_one_pass_over_groups_equals_one_calibration_per_group(tmp_path, tok):
    """calibrate_groups: each group's statistics are bit-identical to calibrating that group alone."""
    import torch

    from moecompress.calibrate import calibrate
    from moecompress.calibrate.groups import calibrate_groups
    from moecompress.data import CalibrationData

    model = resolve_fixture("fixture:qwen3-moe-tiny")
    draws = disjoint_resamples("fixture-calib/aphorisms", tok, seq_len=64, sequences=4, resamples=2, seed=1)
    joined = CalibrationData(
        torch.cat([d.data.input_ids for d in draws]),
        torch.cat([d.data.attention_mask for d in draws]),
        "joined",
        64,
    )
    stats = ["reap", "out_norm_sq_mean"]
    groups = calibrate_groups(model, joined, [4, 4], stats, batch_size=2)
    for r, d in enumerate(draws):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = calibrate(
                model, d.data, seq_len=64, out=tmp_path / f"s{r}", stats=stats, batch_size=2, progress=False
            )
        for layer in store.layers:
            for name in ("counts", "reap", "out_norm_sq_mean"):
                assert torch.equal(groups[r][layer][name], store.get(layer, name)), (r, layer, name)
    with pytest.raises(MoECompressError, match="multiple of the batch size"):
        calibrate_groups(model, joined, [3, 5], stats, batch_size=2)


def test_analyze_mask_drift_cli_writes_the_study(tmp_path, capsys):
    import json

    from moecompress.testing import run_cli

    code, out, err = run_cli(
        [
            "analyze",
            "fixture:qwen3-moe-tiny",
            "--mask-drift",
            "--criterion",
            "frequency",
            "--ratio",
            "0.25",
            "--draws",
            "2",
            "--sequences",
            "2",
            "--seq-len",
            "128",
            "--bootstrap",
            "20",
            "--out",
            str(tmp_path / "d"),
        ],
        capsys,
    )
    assert code == 0, err
    res = json.loads((tmp_path / "d" / "drift.json").read_text())
    assert res["specs"] == [f"fixture-calib/{d}" for d in FIXTURE_DOMAINS["fixture-calib"]]
    assert (
        set(res["summary"]) == {"frequency@0.25"} and (tmp_path / "d" / "drift_frequency_0.25.png").is_file()
    )
    assert "drift ratio" in out and (tmp_path / "d" / ".moecompress").is_file()
