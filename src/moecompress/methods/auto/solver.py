"""`auto`'s solver (docs/auto.md, "The solver"): pure functions of (bytes, loss) points, no model or tensors.

A slot's representation is a `Candidate`; a layer's states are `LayerPoint`s; `pareto` keeps a layer's efficient
frontier; `allocate` picks one point per item (an MoE layer, or a non-expert tensor with a whole-file budget)
minimising Σ scale·loss within the bytes; `uniform_bits_check` compares the pick with uniform quantization.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ...errors import MoECompressError


@dataclass
class Candidate:
    """One way to serve slot e: its estimated loss and what the plan needs to realise it.

    kind: keep | quant | drop | reroute | constant | tilt | partial | remap | pair;
    param: tilt rank, partial width, remap prototype, pair partner or the bits of a quantized keep (0 otherwise);
    bytes: routed bytes it adds on its own (keep: the expert; quant: its packed codes and scales; pairs: half
    the packed pair).
    """

    kind: str
    loss: float
    param: int = 0
    bytes: int = 0
    op: object = None  # the plan operator (ConstantOp / TiltOp / PartialOp) for operator kinds
    gate: str = ""  # reroute: the gate scale (keep / renorm)
    tensors: dict = field(default_factory=dict)  # its plan tensors
    raw: float | None = None  # the unscaled estimated error when `loss` carries a per-kind sensitivity

    @property
    def error(self) -> float:
        """The estimated output error L_e (unscaled)."""
        return self.loss if self.raw is None else self.raw

    @property
    def kind_key(self) -> str:
        """What a per-kind sensitivity is keyed by: the kind, reroutes by gate."""
        return f"reroute:{self.gate}" if self.kind == "reroute" else self.kind

    @property
    def label(self) -> str:
        if self.kind == "quant":
            return f"keep-w{self.param}"  # the expert kept at `param` bits
        return f"{self.kind}{self.param}" if self.kind in ("tilt", "partial") else self.kind


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


def _check_fronts(fronts: dict[int, list[LayerPoint]], scale: dict[int, float], budget: int) -> None:
    """One sentence for a non-finite loss or sensitivity, or a budget below every layer's smallest state."""
    layers = sorted(fronts)
    bad = next(
        (
            l
            for l in layers
            if not math.isfinite(scale[l]) or any(not math.isfinite(p.loss) for p in fronts[l])
        ),
        None,
    )
    if bad is not None:  # NaN gains would never settle the exchange loop of `allocate`
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


def _hull_walk(
    fronts: dict[int, list[LayerPoint]], scale: dict[int, float], budget: int
) -> tuple[dict[int, int], int]:
    """(index per layer, total bytes): the Lagrangian walk down the convex hulls from every layer's largest
    state, each step the hull step with the least scaled loss per byte saved, until the bytes fit."""
    layers = sorted(fronts)
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
    return cur, total


_TOL = 1e-12


def _best_exchange(
    fronts: dict[int, list[LayerPoint]], scale: dict[int, float], budget: int, cur: dict[int, int], total: int
):
    """The single-layer change or two-layer exchange that lowers Σ scale·loss most within the budget, as
    (gain, tie-break, ((layer, index), ...)), or None."""
    sizes = {l: [p.bytes for p in fronts[l]] for l in fronts}  # fronts are sorted by bytes

    def cost(l, k):
        return fronts[l][k].loss * scale[l]

    best = None  # (gain, tie-break, changes)
    for a in sorted(fronts):
        fa = fronts[a]
        for k in range(len(fa)):
            gain = cost(a, cur[a]) - cost(a, k)
            if gain <= _TOL * (1 + abs(cost(a, cur[a]))):
                continue
            extra = fa[k].bytes - fa[cur[a]].bytes
            if total + extra <= budget:
                cand = (gain, (-a, -k), ((a, k),))
                if best is None or cand[:2] > best[:2]:
                    best = cand
                continue
            if k > cur[a] + 8:
                continue  # exchanges try the next few upgrades only
            for net, b, q in _exchanges(fronts, cost, cur, sizes, a, gain, total + extra - budget):
                if net > _TOL * (1 + abs(cost(a, cur[a]))):
                    cand = (net, (-a, -k), ((a, k), (b, q)))
                    if best is None or cand[:2] > best[:2]:
                        best = cand
    return best


def _exchanges(fronts, cost, cur, sizes, a: int, gain: float, need: int):
    """For an upgrade of layer `a` by `gain` that is `need` bytes over the budget: per other layer b, its largest
    state q that frees `need` bytes, as (net gain, b, q)."""
    for b in sorted(fronts):
        if b == a:
            continue
        limit = fronts[b][cur[b]].bytes - need
        q = bisect.bisect_right(sizes[b], limit) - 1
        if q < 0:
            continue
        yield gain - (cost(b, q) - cost(b, cur[b])), b, q


def allocate(fronts: dict[int, list[LayerPoint]], scale: dict[int, float], budget: int) -> dict[int, int]:
    """Pick one Pareto point per layer minimising Σ_l scale_l·loss_l subject to Σ_l bytes_l ≤ budget.

    Returns the chosen index into each layer's front. Lagrangian walk down the convex hulls, then
    single-layer upgrades and two-layer exchanges that lower the total within the budget.
    """
    _check_fronts(fronts, scale, budget)
    cur, total = _hull_walk(fronts, scale, budget)
    while True:
        best = _best_exchange(fronts, scale, budget, cur, total)
        if best is None:
            break
        for l, k in best[2]:
            total += fronts[l][k].bytes - fronts[l][cur[l]].bytes
            cur[l] = k
    return cur


def uniform_bits_check(
    fronts: dict[int, list[LayerPoint]],
    scale: dict[int, float],
    budget: int,
    chosen: dict[int, int],
    uniform: dict[int, dict[int, int]],
) -> dict[int, int]:
    """The allocation, or — when one is cheaper in scaled loss within the budget — for a bit width b whose
    uniform quantization fits, each layer's least-loss front state within its uniform-b bytes. The
    knapsack heuristic is near-optimal, this makes "never worse than uniform GPTQ" hold by construction
    (in estimated loss)."""

    def total(idx):
        return sum(fronts[l][k].loss * scale[l] for l, k in idx.items())

    best, best_cost = chosen, total(chosen)
    for b in sorted(uniform, reverse=True):
        per = uniform[b]
        if set(per) != set(fronts) or sum(per.values()) > budget:
            continue
        idx = {}
        for l, front in fronts.items():
            ok = [k for k, p in enumerate(front) if p.bytes <= per[l]]
            idx[l] = min(ok, key=lambda k: (front[k].loss, k))
        cost = total(idx)
        if cost < best_cost * (1 - 1e-12):
            best, best_cost = idx, cost
    return best
