"""`auto`'s solver (docs/auto.md, "The solver"): pure functions of (bytes, loss) points, no model or tensors.

A layer's states are `LayerPoint`s; `pareto` keeps a layer's efficient frontier; `allocate` picks one point per
item (an MoE layer, or a non-expert tensor with a whole-file budget) minimising Σ scale·loss within the bytes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..errors import MoECompressError
from .auto_estimate import Candidate


@dataclass
class LayerPoint:
    """One state of a layer: its mode, per-slot choices, routed bytes and raw (unscaled) loss."""

    mode: str  # "replace" or "reroute:<gate>"
    choice: list[Candidate]
    bytes: int
    loss: float


def pareto(points: list[LayerPoint]) -> list[LayerPoint]:
    """Points by increasing bytes with strictly decreasing loss (the efficient frontier)."""
    order = sorted(range(len(points)), key=lambda k: (points[k].bytes, points[k].loss, k))
    out: list[LayerPoint] = []
    for k in order:
        p = points[k]
        if not out or p.loss < out[-1].loss:
            if out and out[-1].bytes == p.bytes:
                out[-1] = p
            else:
                out.append(p)
    return out


def _hull(front: list[LayerPoint], scale: float) -> list[int]:
    """Indices of the lower convex hull of (bytes, scale·loss) over a Pareto front (increasing bytes)."""
    hull: list[int] = []
    for k, p in enumerate(front):
        while len(hull) >= 2:
            a, b = front[hull[-2]], front[hull[-1]]
            # drop b if it lies on or above the segment a -> p
            lhs = (b.loss - a.loss) * scale * (p.bytes - a.bytes)
            rhs = (p.loss - a.loss) * scale * (b.bytes - a.bytes)
            if lhs >= rhs:
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def allocate(fronts: dict[int, list[LayerPoint]], scale: dict[int, float], budget: int) -> dict[int, int]:
    """Pick one Pareto point per layer minimising Σ_l scale_l·loss_l subject to Σ_l bytes_l ≤ budget.

    Returns the chosen index into each layer's front. Lagrangian walk down the convex hulls, then
    single-layer upgrades and two-layer exchanges that lower the total within the budget.
    """
    layers = sorted(fronts)
    bad = next(
        (
            l
            for l in layers
            if not math.isfinite(scale[l]) or any(not math.isfinite(p.loss) for p in fronts[l])
        ),
        None,
    )
    if bad is not None:  # NaN gains would never settle the exchange loop below
        # auto computes in float32, so NaN weights (not a dtype) are the usual cause: say so first
        raise MoECompressError(
            f"auto estimated a non-finite loss or sensitivity for layer {bad}: the checkpoint's "
            "weights or its statistics hold NaN or infinite values; check the checkpoint (a "
            "16-bit calibration that overflowed is redone with calibrate --dtype float32)."
        )
    minimum = sum(fronts[l][0].bytes for l in layers)
    if minimum > budget:
        raise MoECompressError(
            f"The budget of {budget} routed-expert bytes is below the smallest reachable "
            f"({minimum}: every layer keeps what its router needs); raise the budget."
        )
    hulls = {l: _hull(fronts[l], scale[l]) for l in layers}
    pos = {l: len(hulls[l]) - 1 for l in layers}  # position on the hull; starts at the largest state
    cur = {l: hulls[l][pos[l]] for l in layers}
    total = sum(fronts[l][cur[l]].bytes for l in layers)
    while total > budget:
        best = None
        for l in layers:
            if pos[l] == 0:
                continue
            a, b = fronts[l][hulls[l][pos[l]]], fronts[l][hulls[l][pos[l] - 1]]
            slope = (b.loss - a.loss) * scale[l] / (a.bytes - b.bytes)
            if best is None or (slope, l) < best:
                best = (slope, l)
        l = best[1]
        pos[l] -= 1
        total -= fronts[l][cur[l]].bytes - fronts[l][hulls[l][pos[l]]].bytes
        cur[l] = hulls[l][pos[l]]

    def cost(l, k):
        return fronts[l][k].loss * scale[l]

    sizes = {l: [p.bytes for p in fronts[l]] for l in layers}  # fronts are sorted by bytes
    tol = 1e-12
    while True:
        best = None  # (gain, tie-break, changes)
        for a in layers:
            fa = fronts[a]
            for k in range(len(fa)):
                gain = cost(a, cur[a]) - cost(a, k)
                if gain <= tol * (1 + abs(cost(a, cur[a]))):
                    continue
                extra = fa[k].bytes - fa[cur[a]].bytes
                if total + extra <= budget:
                    cand = (gain, (-a, -k), ((a, k),))
                    if best is None or cand[:2] > best[:2]:
                        best = cand
                    continue
                if k > cur[a] + 8:
                    continue  # exchanges try the next few upgrades only
                need = total + extra - budget
                for b in layers:
                    if b == a:
                        continue
                    fb = fronts[b]
                    limit = fb[cur[b]].bytes - need
                    q = bisect.bisect_right(sizes[b], limit) - 1
                    if q < 0:
                        continue
                    net = gain - (cost(b, q) - cost(b, cur[b]))
                    if net > tol * (1 + abs(cost(a, cur[a]))):
                        cand = (net, (-a, -k), ((a, k), (b, q)))
                        if best is None or cand[:2] > best[:2]:
                            best = cand
        if best is None:
            break
        for l, k in best[2]:
            total += fronts[l][k].bytes - fronts[l][cur[l]].bytes
            cur[l] = k
    return cur
