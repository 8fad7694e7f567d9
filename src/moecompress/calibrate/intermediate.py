r"""Mean intermediate activation of each expert over its routed tokens (partial-copy bias).

mid_mean_{e,j} = (1/|T_e|) \sum_{t\in T_e} a_e(h_t)_j    [E, I]
A partial copy keeps some neurons of a pruned expert and replaces the rest by their mean output
down[:, rest] · mid_mean_e[rest].
"""

from __future__ import annotations

import torch

from ..scoring.criteria import safe_div
from .collectors import Collector
from .observe import Observation


class IntermediateMeanCollector(Collector):
    name = "intermediate_mean"
    provides = ("mid_mean",)
    needs = frozenset({"routing", "intermediate"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("count", self.E, dtype=torch.int64)
        self.zeros("mid", self.E, self.adapter.intermediate_size(self.layer))

    def update(self, obs: Observation) -> None:
        for e in range(self.E):
            tok, _ = obs.routed(e)
            if tok.numel():
                self.sums["count"][e] += tok.numel()
                self.sums["mid"][e] += obs.intermediate(e).to(torch.float64).sum(0)

    def finalize(self) -> dict[str, torch.Tensor]:
        return {"mid_mean": safe_div(self.sums["mid"], self.sums["count"])}
