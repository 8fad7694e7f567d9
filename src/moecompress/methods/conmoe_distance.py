"""ConMoE's distance d(e, e') over a scope of layers, computed one projection (and, for big experts, one block
of experts) at a time, and a scope's expert stacks joined into one."""

from __future__ import annotations

import torch

from ..errors import MoECompressError
from ..scoring.distance import projection_distance

_DIRECT_LIMIT = (
    1 << 24
)  # elements per projection below which the whole scope goes through one cdist (128 MB float64)


PROJECTIONS = ("gate", "up", "down")


def scope_distance(expert_stacks, eps: float = 1e-8, chunk: int = 16) -> torch.Tensor:
    """d over the concatenation of per-layer stacks ([E_l, ...] each), as `pairwise_distance` of the
    stacked scope, but in blocks of `chunk` experts (float64 per block) when the scope is large, so a
    scope of big experts never needs a float64 (or even a concatenated) copy of all its weights.

    `expert_stacks` is a list of per-layer ExpertWeights, or a callable ``name -> [per-layer [E_l, ...]
    tensors]`` of one projection (gate, up, down): the distance is a sum of per-projection terms, so a
    caller that reads the scope one projection at a time holds a third of its weights, not all of them.
    """
    if callable(expert_stacks):
        part = expert_stacks
    else:

        def part(name: str) -> list[torch.Tensor]:
            return [getattr(st, name) for st in expert_stacks]

    total = None
    for name in PROJECTIONS:
        tensors = part(name)
        if len({tuple(t.shape[1:]) for t in tensors}) > 1:
            raise MoECompressError(
                "Layers in one consolidation scope have experts of different shapes; use scope_size 1."
            )
        if total is None:
            sizes = [t.shape[0] for t in tensors]
            n = sum(sizes)
            direct = sum(t.numel() for t in tensors) <= _DIRECT_LIMIT
            if not direct:
                owner = [(j, e) for j, size in enumerate(sizes) for e in range(size)]
                total = torch.zeros(n, n, dtype=torch.float64)
        if direct:  # the whole scope in one cdist: exactly `pairwise_distance` of the stacked scope
            flat = torch.cat([t.detach() for t in tensors]).reshape(n, -1).double()
            term = projection_distance(flat, eps)
            total = term if total is None else total + term
            del flat
        else:
            _add_blockwise(total, [t.reshape(t.shape[0], -1) for t in tensors], owner, eps, chunk)
        del tensors
    d = total / 3.0
    d.fill_diagonal_(0.0)
    return d


def _add_blockwise(
    total: torch.Tensor, flats: list[torch.Tensor], owner: list[tuple[int, int]], eps: float, chunk: int
) -> None:
    """total += one projection's distance term, `chunk` × `chunk` blocks at a time (rows upcast per block)."""
    n = len(owner)

    def rows(lo: int, hi: int) -> torch.Tensor:
        return torch.stack([flats[j][e] for j, e in owner[lo:hi]]).double()

    norms = torch.stack([flats[j][e].double().norm() for j, e in owner])
    for i in range(0, n, chunk):
        a = rows(i, min(n, i + chunk))
        for j in range(i, n, chunk):
            b = a if j == i else rows(j, min(n, j + chunk))
            term = 2 * torch.cdist(a, b) / (norms[i : i + chunk, None] + norms[None, j : j + chunk] + 2 * eps)
            total[i : i + chunk, j : j + chunk] += term
            if j != i:
                total[j : j + chunk, i : i + chunk] += term.T


def stack_scope(expert_stacks: list) -> object:
    """Concatenate per-layer ExpertWeights stacks ([E_l, ...]) into one scope stack ([Σ E_l, ...])."""
    from ..models import ExpertWeights

    names = expert_stacks[0].tensors().keys()
    shapes = {tuple(s.gate.shape[1:]) for s in expert_stacks}
    if len(shapes) > 1:
        raise MoECompressError(
            "Layers in one consolidation scope have experts of different shapes; use scope_size 1."
        )
    return ExpertWeights(**{k: torch.cat([getattr(s, k).detach() for s in expert_stacks]) for k in names})
