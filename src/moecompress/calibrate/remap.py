r"""Output mismatch between every pair of experts on each expert's routed tokens, on two folds.

remap_error_{k,e,p} = (1/|T_e^k|) \sum_{t\in T_e^k} ||f_e(h_t) - f_p(h_t)||_2^2     [2, E, E]
remap_count_{k,e} = |T_e^k|                                                          [2, E]
with T_e^k the tokens routed to e whose position in the batch's real-token order has parity k
(two disjoint folds). Functional slot remapping picks, among the nearest retained experts, the
one that best reproduces a removed expert's output, and accepts it only when both folds agree.
Needs every expert on every token (all-experts mode).
"""

from __future__ import annotations

import torch

from ..scoring.criteria import safe_div
from .collectors import Collector
from .observe import Observation


class RemapErrorCollector(Collector):
    name = "remap_error"
    provides = ("remap_error", "remap_count")
    needs = frozenset({"routing", "all_outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("err", 2, self.E, self.E)
        self.zeros("cnt", 2, self.E, dtype=torch.int64)

    def update(self, obs: Observation) -> None:
        """Everything happens in `update_all`, which sees every expert's outputs."""

    def update_all(self, obs: Observation, rows: slice, outputs: torch.Tensor) -> None:
        f = outputs.to(torch.float64)  # [E, c, H]
        index = obs.routing.index[rows]  # [c, k]
        parity = torch.arange(rows.start, rows.stop, device=index.device) % 2
        for e in range(self.E):
            sel = (index == e).any(-1)
            if not sel.any():
                continue
            d = (f[:, sel] - f[e, sel]).square().sum(-1)  # [E, n_e]: candidate p's error on e's tokens
            for k in (0, 1):
                fold = parity[sel] == k
                self.sums["err"][k, e] += d[:, fold].sum(-1)
                self.sums["cnt"][k, e] += int(fold.sum())

    def finalize(self) -> dict[str, torch.Tensor]:
        return {
            "remap_error": safe_div(self.sums["err"], self.sums["cnt"]),
            "remap_count": self.sums["cnt"].clone(),
        }

    def counts(self):
        return None
