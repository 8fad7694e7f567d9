"""`auto`'s allocation (`methods/auto/solver.py`) against the exact optimum on seeded random problems large enough
(12 items of up to 10 states) that the exchange step, which changes one or two items at a time, cannot repair a
budget walk that went wrong (issue 50). The optimum: a multiple-choice knapsack over integer bytes, solved
exactly by dynamic programming over every byte total (the brute force over the states' byte sums)."""

from __future__ import annotations

import random

import numpy as np

from moecompress.methods.auto.solver import LayerPoint, _hull_walk, allocate, pareto


def _problem(rng: random.Random, items: int = 12, states: int = 10):
    """(fronts, scales, budget): per item a Pareto front of 5 to `states` points (bytes up by 1 to 8, loss down
    by a random factor), a scale in [0.5, 1.5), a budget between the smallest and the largest total."""
    fronts, scale = {}, {}
    for i in range(items):
        pts, nbytes, loss = [], rng.randint(1, 4), 10.0 * rng.random()
        for _ in range(rng.randint(states // 2, states)):
            pts.append(LayerPoint("replace", [], nbytes, loss))
            nbytes += rng.randint(1, 8)
            loss *= rng.random()
        fronts[i], scale[i] = pareto(pts), 0.5 + rng.random()
    lo = sum(f[0].bytes for f in fronts.values())
    hi = sum(f[-1].bytes for f in fronts.values())
    return fronts, scale, rng.randint(lo, hi)


def _optimum(fronts, scale, budget: int) -> float:
    """The least Σ scale·loss of one state per item within `budget` bytes: best[b] over every byte total b."""
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0
    for i in sorted(fronts):
        nxt = np.full(budget + 1, np.inf)
        for p in fronts[i]:
            if p.bytes <= budget:
                nxt[p.bytes :] = np.minimum(nxt[p.bytes :], best[: budget + 1 - p.bytes] + p.loss * scale[i])
        best = nxt
    return float(best.min())


def _cost(fronts, scale, pick) -> float:
    return sum(fronts[i][k].loss * scale[i] for i, k in pick.items())


def test_allocation_is_near_optimal_on_random_problems_the_exchanges_cannot_repair():
    """On 100 problems: every allocation within its budget and never below the optimum (the optimum is exact);
    the budget walk alone optimal for the bytes it ends at (each step the least loss per byte saved, down convex
    hulls: a Lagrangian solution); and the allocation within 1 % of the optimum on at least 90 of the problems,
    0.5 % above it on average. (Measured: 1 to 5 problems over 1 %, 0.05 to 0.15 % on average; a walk taking
    the worst step instead: 25 to 40 problems over 1 %, 1.4 to 2.3 % on average.)"""
    rng = random.Random(0)
    gaps = []
    for _ in range(100):
        fronts, scale, budget = _problem(rng)
        walk, walked = _hull_walk(fronts, scale, budget)
        assert walked <= budget and walked == sum(fronts[i][k].bytes for i, k in walk.items())
        assert _cost(fronts, scale, walk) <= _optimum(fronts, scale, walked) * (1 + 1e-9) + 1e-12
        pick = allocate(fronts, scale, budget)
        assert sum(fronts[i][k].bytes for i, k in pick.items()) <= budget
        got, best = _cost(fronts, scale, pick), _optimum(fronts, scale, budget)
        assert got >= best * (1 - 1e-9) and got <= _cost(fronts, scale, walk) * (1 + 1e-9)
        gaps.append(got / best - 1)
    gaps = np.array(gaps)
    assert (gaps > 0.01).sum() <= 10 and gaps.mean() <= 0.005, (int((gaps > 0.01).sum()), gaps.mean())
