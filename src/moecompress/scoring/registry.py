"""One registry of expert-selection criteria: each entry is a name, the statistics it reads, and its score.

A score function maps one layer's statistics to a per-expert score s ∈ R^E (float64, higher = kept), with
the equations of scoring/criteria.py. ``get(name)`` returns the layer's statistic as float64; ``layer`` and
``seed`` feed the random baseline. A *set* criterion (D-optimal, ``doptimal=True``) does not rank experts one
by one: its score is the base importance b of the kernel L = diag(√b)·Gram·diag(√b) whose log-determinant
the greedy selection maximises (scoring/doptimal.py).

Every method that scores experts reads this table, for selection and for what to calibrate: prune (its
``criterion``; ``calibrate --for-method prune`` gathers the union of the prune criteria's statistics), dense
(its ``criterion``, through `methods.dense_fit.CRITERION_ENTRY`) and ConMoE (its contribution a_e is the ``reap``
entry, its usage ablation the ``frequency`` entry). A *variant* (``variant_of``) is the same criterion
evaluated another way, registered under its own name so that no method's results change: the dense method
computes ACP from the store's means, prune from the sums it rebuilds (they differ in the last bits).
A new criterion is one `register_criterion` call here (plus its equation in criteria.py and its tests).
A *data-free* criterion (``weights=True``) scores the experts' weights themselves: its ``g.weights(e)`` gives
expert e's `ExpertWeights` (gate/up/down) of the layer, through the method's adapter (docs/architecture.md,
"Where to change what").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MoECompressError
from . import criteria as C


class LayerInputs:
    """What a criterion reads of one MoE layer: a statistic by name, ``g(name)`` (float64), and, for a data-free
    criterion, expert e's weights, ``g.weights(e)``, for e in ``range(g.num_experts)``."""

    def __init__(
        self,
        stat: Callable[[str], torch.Tensor],
        weights: Callable[[int], Any] | None = None,
        num_experts: int | None = None,
    ):
        self._stat, self._weights, self.num_experts = stat, weights, num_experts

    def __call__(self, name: str) -> torch.Tensor:
        return self._stat(name)

    def weights(self, e: int):
        if self._weights is None:
            raise MoECompressError(
                "This method scores experts from statistics only; a criterion that reads "
                "weights works with prune."
            )
        return self._weights(e)


Getter = LayerInputs | Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class CriterionEntry:
    name: str
    stats: tuple[str, ...]
    score: Callable[[Getter, int, int], torch.Tensor]  # (get, layer, seed) -> [E]
    doptimal: bool = False
    variant_of: str | None = None  # the criterion this entry computes another way (same equation)
    weights: bool = False  # data-free: reads the experts' weights (g.weights(e)) besides its statistics


CRITERIA: dict[str, CriterionEntry] = {}


def register_criterion(
    name: str,
    stats,
    score: Callable[[Getter, int, int], torch.Tensor],
    doptimal: bool = False,
    variant_of: str | None = None,
    weights: bool = False,
) -> None:
    CRITERIA[name] = CriterionEntry(name, tuple(stats), score, doptimal, variant_of, weights)


def criteria() -> list[str]:
    """The criteria by their own names (variants left out): what prune's ``criterion`` accepts."""
    return [n for n, c in CRITERIA.items() if c.variant_of is None]


def get_criterion(name: str) -> CriterionEntry:
    try:
        return CRITERIA[name]
    except KeyError:
        raise MoECompressError(f"Unknown criterion '{name}'; known: {', '.join(CRITERIA)}.") from None


def _acp(g: Getter) -> torch.Tensor:
    counts = g("counts")
    return C.acp(g("cp") * counts, counts, g("out_norm_sq_mean") * counts)


def _mone(g: Getter) -> torch.Tensor:
    counts, mean, var = g("counts"), g("out_mean"), g("out_var")
    c = counts[:, None]
    return C.mone(mean * c, (var + mean.square()) * c, counts, g("routing_mass"), float(g("tokens")))


_BASE = ("counts", "tokens")
register_criterion("random", _BASE, lambda g, layer, seed: C.random_scores(len(g("counts")), seed + layer))
register_criterion("frequency", _BASE, lambda g, layer, seed: C.frequency(g("counts")))
register_criterion("mass", (*_BASE, "routing_mass"), lambda g, layer, seed: C.routing_mass(g("routing_mass")))
register_criterion("pp", (*_BASE, "pp"), lambda g, layer, seed: g("pp"))
register_criterion(
    "ps", (*_BASE, "cp"), lambda g, layer, seed: C.ps(g("cp") * g("counts"), float(g("tokens")))
)
register_criterion("cp", (*_BASE, "cp"), lambda g, layer, seed: g("cp"))
register_criterion("acp", (*_BASE, "cp", "out_norm_sq_mean"), lambda g, layer, seed: _acp(g))
register_criterion("reap", (*_BASE, "reap"), lambda g, layer, seed: g("reap"))
register_criterion("ean", (*_BASE, "ean"), lambda g, layer, seed: C.ean(g("ean")))
register_criterion("mone", (*_BASE, "routing_mass", "out_mean", "out_var"), lambda g, layer, seed: _mone(g))
register_criterion("do-cp", (*_BASE, "cp", "gram"), lambda g, layer, seed: g("cp"), doptimal=True)
register_criterion(
    "do-acp", (*_BASE, "cp", "out_norm_sq_mean", "gram"), lambda g, layer, seed: _acp(g), doptimal=True
)

# the dense method's ACP / DO-ACP: the same equation evaluated on the store's means (criteria.acp_of_means)
register_criterion(
    "dense-acp",
    (*_BASE, "cp", "out_norm_sq_mean"),
    lambda g, layer, seed: C.acp_of_means(g("cp"), g("out_norm_sq_mean")),
    variant_of="acp",
)
register_criterion(
    "dense-do-acp",
    (*_BASE, "cp", "out_norm_sq_mean", "gram"),
    lambda g, layer, seed: C.acp_of_means(g("cp"), g("out_norm_sq_mean")),
    doptimal=True,
    variant_of="do-acp",
)
