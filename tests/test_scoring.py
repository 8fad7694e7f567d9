"""Known answers for scoring, D-optimal selection, budgets, distances and operator fits."""

import itertools
import math

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.methods.operators import fit_tilt, partial_copy_bias, partial_copy_size
from moecompress.models import ExpertWeights
from moecompress.scoring import (
    default_ridge,
    doptimal_kernel,
    greedy_doptimal,
    group_feasible,
    logdet_objective,
    mone,
    nonuniform_keep,
    super_experts,
    uniform_keep,
)
from moecompress.scoring.distance import pairwise_distance


def _moments(x, y):
    return len(x), x.sum(0), y.sum(0), x.T @ x, x.T @ y


def _data(n=400, d=6, p=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) + 0.3
    y = (
        x @ torch.randn(d, p, generator=g, dtype=torch.float64)
        + 0.1 * torch.randn(n, p, generator=g, dtype=torch.float64)
        + 1.0
    )
    return x, y


def test_full_rank_tilt_without_ridge_is_ols():
    x, y = _data()
    tilt = fit_tilt(*_moments(x, y), rank=5, ridge=0.0)
    design = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)
    coef = torch.linalg.lstsq(design, y).solution
    torch.testing.assert_close(tilt(x), design @ coef, atol=1e-9, rtol=1e-9)


def test_truncated_tilt_is_reduced_rank_regression():
    x, y = _data()
    for r in (1, 2, 3):
        tilt = fit_tilt(*_moments(x, y), rank=r, ridge=0.0)
        # direct RRR: project the OLS fitted values (centred) on their top-r right singular vectors
        xc, yc = x - x.mean(0), y - y.mean(0)
        ols = torch.linalg.lstsq(xc, yc).solution
        _, _, vh = torch.linalg.svd(xc @ ols, full_matrices=False)
        vr = vh[:r].T
        expected = y.mean(0) + xc @ ols @ vr @ vr.T
        torch.testing.assert_close(tilt(x), expected, atol=1e-8, rtol=1e-8)
        assert tilt.rank == r and tilt.num_params() == r * (6 + 5) + 5


def test_rank_zero_tilt_is_the_mean_output_constant():
    x, y = _data()
    tilt = fit_tilt(*_moments(x, y), rank=0)
    torch.testing.assert_close(tilt(x[:3]), y.mean(0).expand(3, -1))


def test_partial_copy_budget_and_bias():
    assert partial_copy_size(32, 128) == (32 * 256) // 384
    down = torch.arange(12.0).reshape(3, 4)
    bias = partial_copy_bias(torch.tensor([4.0, 8.0, 12.0, 16.0]), 4.0, down, torch.tensor([0, 2]))
    torch.testing.assert_close(bias, (down[:, [1, 3]] @ torch.tensor([2.0, 4.0])).double())


def _brute(kernel, k, lam):
    return max(logdet_objective(kernel, list(s), lam) for s in itertools.combinations(range(len(kernel)), k))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_doptimal_reaches_1_minus_1_over_e_of_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    e = 6 + seed % 5
    feats = torch.randn(e, 4, generator=g, dtype=torch.float64)
    kernel = doptimal_kernel(torch.rand(e, generator=g, dtype=torch.float64) + 0.1, feats @ feats.T)
    for k in (2, 3, 4):
        lam = default_ridge(kernel, k)
        chosen = greedy_doptimal(kernel, k)
        assert len(set(chosen)) == k
        assert logdet_objective(kernel, chosen, lam) >= (1 - 1 / math.e) * _brute(kernel, k, lam) - 1e-9


def test_greedy_doptimal_with_diagonal_kernel_is_top_k():
    diag = torch.tensor([0.3, 2.0, 0.1, 1.5, 0.7, 0.9], dtype=torch.float64)
    kernel = torch.diag(diag)
    for k in (1, 2, 3, 4):
        lam = default_ridge(kernel, k)
        chosen = sorted(greedy_doptimal(kernel, k))
        assert chosen == sorted(torch.argsort(diag, descending=True)[:k].tolist())
        assert math.isclose(logdet_objective(kernel, chosen, lam), _brute(kernel, k, lam))


def test_uniform_budget_ties_and_protection():
    scores = torch.tensor([1.0, 3.0, 3.0, 0.5, 2.0, 0.1, 0.2, 0.3])
    assert uniform_keep(scores, 0.5, top_k=2) == [0, 1, 2, 4]
    protected = torch.zeros(8, dtype=torch.bool)
    protected[5] = True
    assert uniform_keep(scores, 0.5, top_k=2, protected=protected) == [1, 2, 4, 5]
    with pytest.raises(MoECompressError, match="fewer than top-k"):
        uniform_keep(scores, 0.9, top_k=2)


def test_group_limited_budget_stays_feasible():
    # 8 experts in 4 groups of 2; the 4 best all sit in groups 0 and 1
    scores = torch.tensor([9.0, 8.0, 7.0, 6.0, 0.1, 0.2, 0.3, 0.4])
    kept = uniform_keep(scores, 0.5, top_k=2, n_group=4, topk_group=2)
    assert group_feasible(kept, 8, 2, 4, 2) and len(kept) == 4
    assert not group_feasible([0, 1, 2, 3], 8, 2, 4, 2)


def test_nonuniform_budget_keeps_floor():
    scores = {0: torch.tensor([1.0, 0.9, 0.8, 0.7]), 1: torch.tensor([1.0, 0.01, 0.01, 0.01])}
    assert nonuniform_keep(scores, 0.5, {0: 2, 1: 2}) == {0: [0, 1], 1: [0, 1]}
    assert nonuniform_keep(scores, 0.25, {0: 2, 1: 2}) == {0: [0, 1, 2, 3], 1: [0, 1]}


def test_mone_is_std_norm_times_mean_gate():
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (5, 9)]
    s = mone(
        torch.stack([o.sum(0) for o in outs]),
        torch.stack([(o * o).sum(0) for o in outs]),
        torch.tensor([5.0, 9.0]),
        torch.tensor([2.0, 3.0]),
        20,
    )
    expected = torch.stack([o.std(0, unbiased=False).norm() for o in outs]) * torch.tensor([2.0, 3.0]) / 20
    torch.testing.assert_close(s, expected)


def test_super_expert_rule_flags_only_outliers():
    count = torch.full((6,), 10.0)
    normal = torch.tensor([1.0, 1.2, 0.9, 1.1, 1.0, 0.8]) * count
    assert not super_experts(normal, count).any()
    outlier = normal.clone()
    outlier[2] = 500.0 * count[2]
    assert super_experts(outlier, count).tolist() == [False, False, True, False, False, False]


def test_pairwise_distance_definition():
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights(
        torch.randn(3, 4, 5, generator=g),
        torch.randn(3, 4, 5, generator=g),
        torch.randn(3, 5, 4, generator=g),
    )
    d = pairwise_distance(w)
    manual = (
        sum(
            2
            * (getattr(w, n)[0] - getattr(w, n)[2]).norm()
            / (getattr(w, n)[0].norm() + getattr(w, n)[2].norm() + 2e-8)
            for n in ("gate", "up", "down")
        )
        / 3
    )
    assert math.isclose(float(d[0, 2]), float(manual), rel_tol=1e-5)
    assert torch.equal(d, d.T) and float(d.diagonal().abs().max()) == 0.0


def test_safe_div_zero_fraction_broadcast_and_in_place():
    from moecompress.scoring.criteria import safe_div

    num = torch.tensor([[2.0, 4.0], [3.0, 6.0], [1.0, 1.0]], dtype=torch.float64)
    den = torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64)  # fractional (gate-weighted) and unreached
    want = torch.tensor([[4.0, 8.0], [0.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    assert torch.equal(safe_div(num, den), want)
    assert torch.equal(safe_div(num[:, 0], 4.0), num[:, 0] / 4)
    out = safe_div(num, den, out=num)
    assert out.data_ptr() == num.data_ptr() and torch.equal(num, want)
