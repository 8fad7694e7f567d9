"""How many experts each layer keeps, separate from how experts are scored.

Budgets return, per layer, the sorted list of kept expert indices. Ties break deterministically
toward the lower expert index. A reduction ratio ρ is validated once, at the boundary (the method's
pydantic config: ``ratio`` in [0, 1)); these functions trust it.
"""

from __future__ import annotations

import torch

from ..errors import MoECompressError


def num_kept(num_experts: int, ratio: float) -> int:
    """round((1 − ρ)E), the uniform per-layer budget (at least one expert)."""
    return max(1, round((1.0 - ratio) * num_experts))


def rank(scores: torch.Tensor) -> list[int]:
    """Expert indices by descending score, lower index first on ties."""
    order = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))
    return order


def group_feasible(kept: list[int], num_experts: int, top_k: int, n_group: int, topk_group: int) -> bool:
    """Can group-limited routing still fill top-k? Any topk_group groups must hold ≥ top_k kept experts."""
    if n_group <= 1:
        return len(kept) >= top_k
    per = num_experts // n_group
    counts = sorted(sum(1 for e in kept if e // per == g) for g in range(n_group))
    return sum(counts[:topk_group]) >= top_k and all(c > 0 for c in counts)


def uniform_keep(
    scores: torch.Tensor,
    ratio: float,
    top_k: int,
    protected: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> list[int]:
    """Keep the round((1−ρ)E) best experts of one layer (protected experts first)."""
    e = len(scores)
    k = num_kept(e, ratio)
    if k < top_k:
        raise MoECompressError(
            f"Keeping {k} of {e} experts leaves fewer than top-k={top_k}; "
            f"use a ratio of at most {1 - top_k / e:.3f}."
        )
    order = rank(scores)
    if protected is not None:
        order = [i for i in order if protected[i]] + [i for i in order if not protected[i]]
    kept = sorted(order[:k])
    if not group_feasible(kept, e, top_k, n_group, topk_group):
        kept = _repair_groups(order, k, e, top_k, n_group, topk_group)
    return kept


def _repair_groups(order: list[int], k: int, e: int, top_k: int, n_group: int, topk_group: int) -> list[int]:
    """Smallest change to a top-k-by-score choice that keeps group-limited routing feasible:
    give every group its best expert first, then fill by score."""
    per = e // n_group
    need = max(1, -(-top_k // topk_group))
    kept: list[int] = []
    for g in range(n_group):
        kept += [i for i in order if i // per == g][:need]
    if len(kept) > k:
        raise MoECompressError(
            f"Keeping {k} experts cannot satisfy group-limited routing "
            f"({topk_group} of {n_group} groups, top-{top_k}); use a smaller ratio."
        )
    kept += [i for i in order if i not in kept][: k - len(kept)]
    return sorted(kept)


def nonuniform_keep(
    layer_scores: dict[int, torch.Tensor], ratio: float, top_k: dict[int, int]
) -> dict[int, list[int]]:
    """Global budget: rank all experts by per-layer-normalised score (score / layer max), keep the
    round((1−ρ)·ΣE) best overall, with a floor of top-k experts in every layer."""
    total = sum(len(s) for s in layer_scores.values())
    budget = round((1.0 - ratio) * total)
    kept = {layer: rank(s)[: top_k[layer]] for layer, s in layer_scores.items()}
    if budget < sum(len(v) for v in kept.values()):
        raise MoECompressError(
            f"Ratio {ratio} leaves fewer than top-k experts in some layer; use a smaller ratio."
        )
    pool = []
    for layer, s in layer_scores.items():
        norm = s.double() / s.double().abs().max().clamp_min(1e-300)
        pool += [(-float(norm[e]), layer, e) for e in range(len(s)) if e not in kept[layer]]
    for _, layer, e in sorted(pool)[: budget - sum(len(v) for v in kept.values())]:
        kept[layer].append(e)
    return {layer: sorted(v) for layer, v in kept.items()}
