"""ConMoE's selection, a pure function of tensors: scopes and their budget, the per-expert scores (contribution
ā, replaceability b̄), the prototypes chosen and every expert mapped to its nearest prototype."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import MoECompressError
from ..scoring.budget import num_kept
from ..scoring.criteria import reap

Selection = Literal["adaptive", "fixed_k"]
ScoreKind = Literal["conmoe", "usage", "reap", "distance"]


def scopes(moe_layers: list[int], scope_size: int) -> list[list[int]]:
    """Consecutive groups of `scope_size` MoE layers (the last one may be shorter)."""
    if scope_size < 1:
        raise MoECompressError(
            f"scope_size must be at least 1 (got {scope_size}); use 1 for layer-local consolidation."
        )
    layers = sorted(moe_layers)
    return [layers[i : i + scope_size] for i in range(0, len(layers), scope_size)]


def scope_budget(pool_size: int, ratio: float) -> int:
    """K = max(1, round((1 − ρ)|E_G|)); ρ in [0, 1) is the config's to check (ConMoEConfig.ratio)."""
    return num_kept(pool_size, ratio)


def minmax_normalise(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Norm_G(x) = (x − min x) / (max x − min x + ε) over the scope."""
    x = x.double()
    return (x - x.min()) / (x.max() - x.min() + eps)


def replaceability(distance: torch.Tensor) -> torch.Tensor:
    """b_e = min_{e' ≠ e} d(e, e'); a pool of one expert has b = 0."""
    n = distance.shape[0]
    if n < 2:
        return torch.zeros(n, dtype=torch.float64)
    d = distance.double().clone()
    d.fill_diagonal_(float("inf"))
    return d.min(dim=1).values


def contribution(gate_norm_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """a_e = Σ_{t ∈ D_e} g_e(t)‖e(h_t)‖₂ / |D_e| (0 when |D_e| = 0): REAP's score."""
    return reap(gate_norm_sum, count)


@dataclass
class ScopeScores:
    """Every quantity of one scope's prototype scoring, for inspection and reports."""

    a: torch.Tensor
    b: torch.Tensor
    a_bar: torch.Tensor
    b_bar: torch.Tensor
    score: torch.Tensor  # the selection score actually used (s_e for "conmoe")


def prototype_scores(
    a: torch.Tensor,
    distance: torch.Tensor,
    kind: ScoreKind = "conmoe",
    usage: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> ScopeScores:
    """ā, b̄ and the selection score: s_e = ā_e·b̄_e ("conmoe"), c_e ("usage"), ā_e ("reap"), b̄_e ("distance")."""
    a = a.double()
    b = replaceability(distance)
    a_bar, b_bar = minmax_normalise(a, eps), minmax_normalise(b, eps)
    if kind == "conmoe":
        s = a_bar * b_bar
    elif kind == "usage":
        if usage is None:
            raise MoECompressError(
                "The 'usage' selection needs expert selection counts; calibrate with counts."
            )
        s = usage.double()
    elif kind == "reap":
        s = a_bar
    elif kind == "distance":
        s = b_bar
    else:
        raise MoECompressError(f"Unknown prototype score '{kind}'; use conmoe, usage, reap or distance.")
    return ScopeScores(a, b, a_bar, b_bar, s)


def _order(scores: ScopeScores, candidates: list[int]) -> list[int]:
    """Candidates by descending score; ties by descending ā, then b̄, then scope position (deterministic)."""
    s, a, b = scores.score, scores.a_bar, scores.b_bar
    return sorted(candidates, key=lambda i: (-float(s[i]), -float(a[i]), -float(b[i]), i))


def select_prototypes(
    scores: ScopeScores,
    k: int,
    layer_of: list[int] | None = None,
    selection: Selection = "adaptive",
    ratio: float | None = None,
) -> list[int]:
    """P_G as sorted scope positions.

    adaptive: the top-K of the whole scope. fixed_k: each layer l keeps its own top round((1 − ρ)E_l)
    (ranked by the same scope-normalised score), so every layer stores an equal share.
    """
    n = len(scores.score)
    if selection == "adaptive" or layer_of is None or len(set(layer_of)) == 1:
        return sorted(_order(scores, list(range(n)))[:k])
    if selection != "fixed_k":
        raise MoECompressError(f"Unknown selection '{selection}'; use adaptive or fixed_k.")
    if ratio is None:
        raise MoECompressError("fixed_k selection needs the reduction ratio.")
    chosen: list[int] = []
    for layer in sorted(set(layer_of)):
        own = [i for i in range(n) if layer_of[i] == layer]
        chosen += _order(scores, own)[: scope_budget(len(own), ratio)]
    return sorted(chosen)


def assign_to_prototypes(distance: torch.Tensor, prototypes: list[int]) -> list[int]:
    """m_G(e) = argmin_{p ∈ P_G} d(e, p) as scope positions; ties go to the lower position and every
    prototype maps to itself (even if another prototype is at distance 0)."""
    if not prototypes:
        raise MoECompressError("A scope has no prototypes; use a smaller reduction ratio.")
    protos = sorted(prototypes)
    d = distance.double()[:, protos]
    best = d.argmin(dim=1).tolist()  # argmin returns the first minimum: the lower position on ties
    out = [protos[j] for j in best]
    for p in protos:
        out[p] = p
    return out


@dataclass
class ScopeConsolidation:
    """Result of ConMoE on one scope: members are (layer, expert) in scope order."""

    layers: list[int]
    members: list[tuple[int, int]]
    budget: int
    scores: ScopeScores
    prototypes: list[int]  # sorted scope positions
    assignment: list[int]  # scope position -> prototype scope position
    distance: torch.Tensor = field(repr=False)

    def clusters(self) -> dict[int, list[int]]:
        """A_p = {e : m_G(e) = p} for every prototype p (positions, ascending)."""
        out: dict[int, list[int]] = {p: [] for p in self.prototypes}
        for e, p in enumerate(self.assignment):
            out[p].append(e)
        return out

    def slot_map(self) -> dict[int, list[int]]:
        """Per layer: original slot -> index of its prototype in `prototypes` (the scope's stored order)."""
        index = {p: j for j, p in enumerate(self.prototypes)}
        out: dict[int, list[int]] = {layer: [] for layer in self.layers}
        for (layer, _e), p in zip(self.members, self.assignment):
            out[layer].append(index[p])
        return out


def consolidate_scope(
    layers: list[int],
    num_experts: list[int],
    distance: torch.Tensor,
    a: torch.Tensor,
    ratio: float,
    usage: torch.Tensor | None = None,
    score: ScoreKind = "conmoe",
    selection: Selection = "adaptive",
    eps: float = 1e-8,
) -> ScopeConsolidation:
    """ConMoE on one scope from plain tensors: distance [N, N] and a [N] over the scope's experts in
    (layer, expert) order, with `num_experts[j]` experts for `layers[j]`."""
    members = [(layer, e) for layer, n in zip(layers, num_experts) for e in range(n)]
    n = len(members)
    if distance.shape != (n, n) or a.shape[0] != n:
        raise MoECompressError(
            f"Scope {layers} has {n} experts but the distance/contribution tensors do not match."
        )
    k = scope_budget(n, ratio)
    sc = prototype_scores(a, distance, score, usage, eps)
    layer_of = [m[0] for m in members]
    protos = select_prototypes(sc, k, layer_of, selection, ratio)
    assignment = assign_to_prototypes(distance, protos)
    return ScopeConsolidation(list(layers), members, len(protos), sc, protos, assignment, distance)
