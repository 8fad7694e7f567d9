"""PuzzleMoE packed pairs as `auto` candidates: both slots of a pair decided jointly (`PairRef`), their losses
estimated on the layer's token sample (`pair_options`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import MoECompressError
from .moments import LayerMoments


@dataclass
class PairRef:
    """A PuzzleMoE packed pair (i, j) of one layer as a joint candidate of its two slots.

    nbytes: what the plan stores for the pair (packed words + biases); losses: the sample estimates of
    L_i and L_j; `merge()` rebuilds the `MergeCandidate` (tensors) when the plan needs it.
    """

    layer: int
    members: tuple[int, int]
    nbytes: int
    losses: tuple[float, float]
    kwargs: dict = field(default_factory=dict, repr=False)
    adapter: object = field(default=None, repr=False)
    scale: float | None = None  # per-kind sensitivity applied to the losses in the solver
    _merge: object = field(default=None, repr=False)

    def drop_merge(self) -> None:
        """Forget the rebuilt merge (its tensors); `merge()` rebuilds it from the weights when the plan needs it."""
        self._merge = None

    def merge(self):
        if self._merge is None:
            from ..puzzle import pair_candidate

            self._merge = pair_candidate(self.adapter, self.layer, *self.members, **self.kwargs)
        return self._merge


def pair_options(adapter, stats, m: LayerMoments, partners: int, pairs: set | None = None) -> list[PairRef]:
    """Packed-pair candidates of a layer: each expert with its `partners` nearest experts (normalised parameter
    distance), losses estimated on the layer's uniform token sample (``auto_sample``, S tokens):

        L_i ≈ (1/S) Σ_{t ∈ sample, i ∈ K(t)} g_i(t)² ‖f_i(h_t) − f̂_i(h_t)‖²,

    an unbiased Monte-Carlo estimate of the closed-form quantity, f̂_i the pair's packed reconstruction of i
    run by the PuzzleMoE runtime (`MergeCandidate.forward`)."""
    from ..conmoe_distance import scope_distance
    from ..puzzle import UpcastExperts, layer_norms, pair_candidate

    layer = m.layer
    if m.sample is None:
        raise MoECompressError(
            "Pair candidates are estimated on a token sample; re-run calibration with the "
            "'auto_sample' statistic (--for-method auto)."
        )
    e_all = adapter.num_experts(layer)
    if pairs is None:  # `pairwise_distance` of the layer, read one projection at a time
        dist = scope_distance(lambda name: [adapter.expert_part_at_rest(layer, name)])
        pairs = set()
        for i in range(e_all):
            order = sorted((float(dist[i, j]), j) for j in range(e_all) if j != i)
            for _, j in order[:partners]:
                pairs.add((min(i, j), max(i, j)))
    norms = layer_norms(stats, layer, e_all)
    dtype = adapter.expert_dtype(layer)
    x = m.sample.to(dtype)
    n = len(x)
    with torch.no_grad():
        r = adapter.route(layer, x)
        routed = {}
        for e in range(e_all):
            tok, slot = torch.where(r.index == e)
            routed[e] = (
                tok,
                r.weight[tok, slot].double().square(),
                adapter.expert_forward(layer, e, x[tok]).double() if len(tok) else None,
            )
        # after the forwards: on a streamed view this evicts the computed layer, so it is not held beside these
        experts = UpcastExperts(adapter.experts_at_rest(layer), dtype, e_all)  # one expert upcast per read
        out = []
        for i, j in sorted(pairs):
            kwargs = dict(norms=norms, experts=experts)
            c = pair_candidate(adapter, layer, i, j, **kwargs)
            xs = [x[routed[e][0]] if len(routed[e][0]) else None for e in (i, j)]
            ys = c.forward(xs)
            losses = []
            for e, yhat in zip((i, j), ys):
                tok, g2, y = routed[e]
                losses.append(0.0 if y is None else float(g2 @ (y - yhat.double()).square().sum(-1)) / n)
            out.append(
                PairRef(layer, (i, j), int(c.nbytes), (losses[0], losses[1]), dict(norms=norms), adapter)
            )
    return out
