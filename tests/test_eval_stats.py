"""Paired bootstrap and Holm: a numpy re-implementation, degenerate cases with known answers, a worked example."""

import numpy as np
import pytest

from moecompress.errors import MoECompressError
from moecompress.eval.stats import (
    A_BETTER,
    B_BETTER,
    NOT_DIFFERENT,
    apply_holm,
    holm,
    paired_bootstrap,
    paired_bootstrap_tasks,
    verdict,
)


def reference_bootstrap(d, B, seed, alpha=0.05):
    """The documented algorithm, written out independently."""
    n = len(d)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(B, n))
    boot = np.array([sum(d[j] for j in row) / n for row in draws])
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    le, ge = int((boot <= 0).sum()), int((boot >= 0).sum())
    p = min(1.0, 2 * (1 + min(le, ge)) / (B + 1))
    return float(np.mean(d)), lo, hi, p


def test_bootstrap_matches_reimplementation():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 30).astype(float)
    b = rng.integers(0, 2, 30).astype(float)
    ids = list(range(30))
    r = paired_bootstrap(ids, a, ids, b, B=50, seed=7, metric="acc")
    delta, lo, hi, p = reference_bootstrap(a - b, 50, 7)
    assert (r.delta, r.ci_low, r.ci_high, r.p) == pytest.approx((delta, lo, hi, p))
    assert r.n == 30 and r.mean_a == pytest.approx(a.mean()) and r.mean_b == pytest.approx(b.mean())
    again = paired_bootstrap(ids, a, ids, b, B=50, seed=7)
    assert (again.ci_low, again.ci_high, again.p) == (r.ci_low, r.ci_high, r.p)


def test_hand_computed_two_item_case():
    # d = (0, 1): every replicate mean is 0, 0.5 or 1; with these draws the percentiles are known by hand
    rng = np.random.default_rng(3)
    draws = rng.integers(0, 2, size=(4, 2))
    means = [(0.0 if i == 0 else 1.0) / 2 + (0.0 if j == 0 else 1.0) / 2 for i, j in draws]
    r = paired_bootstrap(["x", "y"], [0.0, 1.0], ["x", "y"], [0.0, 0.0], B=4, seed=3)
    assert r.delta == 0.5
    assert r.ci_low == pytest.approx(np.quantile(means, 0.025))
    assert r.ci_high == pytest.approx(np.quantile(means, 0.975))
    zeros = sum(m <= 0 for m in means)
    assert r.p == pytest.approx(min(1.0, 2 * (1 + zeros) / 5))


def test_degenerate_cases_have_known_answers():
    ids = list(range(10))
    same = paired_bootstrap(ids, [0.3] * 10, ids, [0.3] * 10, B=200, seed=0)
    assert (same.delta, same.ci_low, same.ci_high, same.p) == (0.0, 0.0, 0.0, 1.0)
    assert same.verdict == NOT_DIFFERENT  # never "equal"
    up = paired_bootstrap(ids, [1.0] * 10, ids, [0.0] * 10, B=199, seed=0)
    assert (up.delta, up.ci_low, up.ci_high) == (1.0, 1.0, 1.0) and up.p == pytest.approx(2 / 200)
    assert up.verdict == A_BETTER
    lower = paired_bootstrap(ids, [1.0] * 10, ids, [0.0] * 10, B=199, seed=0, higher_is_better=False)
    assert lower.verdict == B_BETTER


def test_items_pair_by_id_not_position():
    a = paired_bootstrap(["a", "b", "c"], [1.0, 0.0, 0.0], ["c", "a", "b"], [0.0, 1.0, 0.0], B=20, seed=1)
    assert a.delta == 0.0 and a.ci_low == a.ci_high == 0.0


def test_unpaired_arms_are_refused():
    with pytest.raises(MoECompressError, match="not evaluated on the same items"):
        paired_bootstrap([0, 1, 2], [1, 0, 1], [0, 1, 3], [1, 1, 1])
    with pytest.raises(MoECompressError, match="task sets differ"):
        paired_bootstrap_tasks({"t1": ([0], [1.0])}, {"t2": ([0], [1.0])})
    with pytest.raises(MoECompressError, match="repeat"):
        paired_bootstrap([0, 0], [1, 0], [0, 0], [1, 1])


def test_task_average_bootstraps_tasks_jointly():
    rng = np.random.default_rng(5)
    t1a, t1b = rng.random(12), rng.random(12)
    t2a, t2b = rng.random(7), rng.random(7)
    r = paired_bootstrap_tasks(
        {"t1": (range(12), t1a), "t2": (range(7), t2a)},
        {"t1": (range(12), t1b), "t2": (range(7), t2b)},
        B=64,
        seed=9,
    )
    g = np.random.default_rng(9)
    b1 = (t1a - t1b)[g.integers(0, 12, size=(64, 12))].mean(1)
    b2 = (t2a - t2b)[g.integers(0, 7, size=(64, 7))].mean(1)
    avg = (b1 + b2) / 2
    assert r.delta == pytest.approx(((t1a - t1b).mean() + (t2a - t2b).mean()) / 2)
    assert (r.ci_low, r.ci_high) == pytest.approx(tuple(np.quantile(avg, [0.025, 0.975])))
    assert r.per_task["t1"]["ci_low"] == pytest.approx(np.quantile(b1, 0.025))
    assert r.per_task["t2"]["ci_high"] == pytest.approx(np.quantile(b2, 0.975))
    assert r.n == 19


def test_holm_worked_example():
    # Wikipedia / Holm (1979) style example: alpha 0.05, four hypotheses
    adj, reject = holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    assert adj == pytest.approx([0.03, 0.06, 0.06, 0.02])  # sorted: 4*0.005, 3*0.01, 2*0.03, max(0.06, 0.04)
    assert reject == [True, False, False, True]
    assert holm([0.5], 0.05) == ([0.5], [False])
    assert holm([0.9, 0.8], 0.05)[0] == [1.0, 1.0]  # capped at 1


def test_apply_holm_rewords_verdicts():
    rows = [
        dict(delta=0.2, ci_low=0.05, ci_high=0.3, p=0.01, higher_is_better=True, alpha=0.05),
        dict(delta=0.1, ci_low=0.01, ci_high=0.2, p=0.04, higher_is_better=True, alpha=0.05),
    ]
    assert verdict(0.1, 0.01, 0.2, 0.04, 0.05, True) == A_BETTER  # alone it would be significant
    apply_holm(rows, 0.05)
    assert rows[0]["p_adjusted"] == pytest.approx(0.02) and rows[0]["verdict"] == A_BETTER
    assert rows[1]["p_adjusted"] == pytest.approx(0.04) and rows[1]["verdict"] == A_BETTER
    rows[1]["p"] = 0.03
    rows[0]["p"] = 0.03
    apply_holm(rows, 0.05)
    assert [r["verdict"] for r in rows] == [NOT_DIFFERENT, NOT_DIFFERENT]
    # an interval containing zero is never a win, whatever p says
    assert verdict(0.1, -0.01, 0.2, 0.001, 0.05, True) == NOT_DIFFERENT
