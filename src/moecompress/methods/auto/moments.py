"""Gate²-weighted moments of one MoE layer (`LayerMoments`, statistics of calibrate/auto_stats.py), read for
`auto`'s closed-form losses (estimate.py); square moments are read one expert at a time (`Rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Rows:
    """An [E, D, D] statistic read one expert at a time, float64: ``rows[e]`` is ``stats.get(layer, name)[e]``
    (minus ``minus[e]`` for a fold difference). Never read whole: it is many times the layer's weights."""

    def __init__(self, stats, layer: int, name: str, minus: Rows | None = None):
        self.stats, self.layer, self.name, self.minus = stats, layer, name, minus
        self._last: tuple[int, torch.Tensor] | None = None  # fits and losses read one expert several times

    def __getitem__(self, e: int) -> torch.Tensor:
        if self._last is None or self._last[0] != e:
            row = self.stats.get_row(self.layer, self.name, e).double()
            self._last = (e, row if self.minus is None else row - self.minus[e])
        return self._last[1]

    def __sub__(self, other: Rows) -> Rows:
        return Rows(self.stats, self.layer, self.name, minus=other)


SQUARE_MOMENTS = frozenset({"auto_g2_xx", "auto_g2_xy", "auto_g2_aa"})  # [E, D, D]: read as `Rows`


@dataclass
class LayerMoments:
    """Gate²-weighted statistics of one MoE layer (float64, per calibration token)."""

    layer: int
    w: torch.Tensor  # [E]
    s_y: torch.Tensor  # [E, H]
    s_yy: torch.Tensor  # [E]
    s_x: torch.Tensor | None = None  # [E, H]
    s_xx: Rows | torch.Tensor | None = None  # [E, H, H]
    s_xy: Rows | torch.Tensor | None = None  # [E, H, H]
    s_a: torch.Tensor | None = None  # [E, I]
    s_aa: Rows | torch.Tensor | None = None  # [E, I, I]
    remap: torch.Tensor | None = None  # [E, E]
    reroute: dict[str, torch.Tensor] = field(default_factory=dict)  # gate -> [E]
    sample: torch.Tensor | None = None  # [S, H] float32
    fold1: LayerMoments | None = None  # the moment sums over fold 1 only (same 1/N scale)
    _folds: tuple | None = field(default=None, repr=False, compare=False)  # `folds()`, made once
    _basis: tuple | None = field(
        default=None, repr=False, compare=False
    )  # ((slot, ridge), TiltBasis) of one slot

    _MOMENTS = ("w", "s_y", "s_yy", "s_x", "s_xx", "s_xy", "s_a", "s_aa")
    _NAMES = (
        "auto_g2",
        "auto_g2_y",
        "auto_g2_yy",
        "auto_g2_x",
        "auto_g2_xx",
        "auto_g2_xy",
        "auto_g2_a",
        "auto_g2_aa",
    )

    @classmethod
    def load(cls, stats, layer: int) -> LayerMoments:
        def get(name):
            if not stats.has(name):
                return None
            return (
                Rows(stats, layer, name)
                if name.removesuffix("_f1") in SQUARE_MOMENTS
                else stats.get(layer, name).double()
            )

        m = cls(layer, *(get(n) for n in cls._NAMES), get("auto_remap"))
        for gate in ("keep", "renorm"):
            t = get(f"auto_reroute_{gate}")
            if t is not None:
                m.reroute[gate] = t
        if stats.has("auto_sample"):
            m.sample = stats.get(layer, "auto_sample")
        if stats.has("auto_g2_f1"):
            m.fold1 = cls(layer, *(get(f"{n}_f1") if stats.has(n) else None for n in cls._NAMES))
        return m

    def folds(self) -> tuple[LayerMoments, LayerMoments] | None:
        """(fold 0, fold 1) moments, or None without fold statistics."""
        if self.fold1 is None:
            return None
        if self._folds is None:
            f0 = LayerMoments(
                self.layer,
                *(
                    None if getattr(self, k) is None else getattr(self, k) - getattr(self.fold1, k)
                    for k in self._MOMENTS
                ),
            )
            self._folds = (f0, self.fold1)
        return self._folds


def approximate_moments(stats, layer: int) -> LayerMoments:
    """The cheaper approximation the estimator could use instead of gate²-weighted moments: the plain
    moments over routed tokens (out_mean/out_var, moment_*) scaled by the mean g² of the expert's tokens,
    i.e. E[g²·err] ≈ E[g²]·E[err]. Kept for measuring what weighting buys (benchmarks/bench_auto.py);
    drop/constant/tilt losses only (no intermediate or substitute terms)."""
    counts = stats.get(layer, "counts").double()
    g2 = stats.get(layer, "auto_g2").double()  # (1/N) Σ g² = (|T_e|/N) · mean g² over T_e
    mean, var = stats.get(layer, "out_mean").double(), stats.get(layer, "out_var").double()
    m = LayerMoments(layer, g2, g2[:, None] * mean, g2 * (var.sum(-1) + mean.square().sum(-1)))
    if stats.has("input_moment"):
        sel = stats.get(layer, "moment_experts").tolist()
        h = mean.shape[1]
        m.s_x = torch.zeros(len(counts), h, dtype=torch.float64)
        m.s_xx = torch.zeros(len(counts), h, h, dtype=torch.float64)
        m.s_xy = torch.zeros(len(counts), h, h, dtype=torch.float64)
        for k, e in enumerate(sel):
            m.s_x[e] = g2[e] * stats.get_row(layer, "moment_in_mean", k).double()
            m.s_xx[e] = g2[e] * stats.get_row(layer, "input_moment", k).double()
            m.s_xy[e] = g2[e] * stats.get_row(layer, "cross_moment", k).double()
    return m
