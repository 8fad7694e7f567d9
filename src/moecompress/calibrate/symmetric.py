"""Symmetric [..., D, D] statistics kept as their upper triangle (stats store format 2).

The GPTQ Hessians (``hessian_in``, ``hessian_mid`` and their gate²-weighted variants) and the input moments
(``input_moment``) are sums of x xᵀ: symmetric, and the largest statistics a store holds. A collector names
them in ``Collector.symmetric`` and leaves them *exactly* symmetric (`mirror_`, a no-op where the float64
sums already are, as they are for x xᵀ on CPU BLAS); the store then writes only the upper triangle,
D(D + 1)/2 values per matrix instead of D², in `torch.triu_indices` order (row-major: row 0's D entries, row
1's D - 1 from the diagonal on, ...), in the statistic's own dtype, and `unpack` rebuilds the full matrix
bit for bit on every read (`StatsStore.get`, `get_row`, `get_rows`, `PartialRun.load_layer`). Which tensors
of a layer file are packed is in the file's own metadata (``packed``), so files of either format read
alike; see docs/calibration.md, "Stats store".
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def packed_size(d: int) -> int:
    """Values of one packed D x D matrix: D(D + 1)/2."""
    return d * (d + 1) // 2


def dim_of(k: int) -> int | None:
    """D with D(D + 1)/2 == k, or None when k is no triangular number."""
    d = (math.isqrt(8 * k + 1) - 1) // 2
    return d if packed_size(d) == k else None


@lru_cache(maxsize=8)
def _flat_indices(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper, lower): flat indices into a D x D matrix of its upper triangle in `torch.triu_indices` order, and
    of the mirrored lower-triangle positions (the diagonal appears in both)."""
    rows, cols = torch.triu_indices(d, d)
    return rows * d + cols, cols * d + rows


def is_symmetric(t: torch.Tensor) -> bool:
    """Whether every [D, D] matrix of `t` [..., D, D] equals its transpose exactly."""
    return t.dim() >= 2 and t.shape[-1] == t.shape[-2] and torch.equal(t, t.transpose(-1, -2))


def pack(t: torch.Tensor) -> torch.Tensor:
    """[..., D, D] -> [..., D(D + 1)/2]: the upper triangle of each matrix, row-major, same dtype."""
    d = t.shape[-1]
    upper, _ = _flat_indices(d)
    return t.reshape(*t.shape[:-2], d * d)[..., upper].contiguous()


def unpack(p: torch.Tensor) -> torch.Tensor:
    """[..., D(D + 1)/2] -> [..., D, D]: the symmetric matrices `pack` took the upper triangles of."""
    d = dim_of(p.shape[-1])
    if d is None:
        raise ValueError(f"{p.shape[-1]} values are no packed symmetric matrix")
    upper, lower = _flat_indices(d)
    out = p.new_empty(*p.shape[:-1], d * d)
    out[..., upper] = p
    out[..., lower] = p
    return out.reshape(*p.shape[:-1], d, d)


def mirror_(t: torch.Tensor) -> torch.Tensor:
    """Make each [D, D] matrix of `t` (contiguous) exactly symmetric in place by copying its upper triangle onto
    its lower one, one matrix at a time (no temporary larger than one matrix's triangle). Returns `t`."""
    d = t.shape[-1]
    if t.numel() == 0:
        return t
    upper, lower = _flat_indices(d)
    flat = t.view(-1, d * d)
    for m in flat:
        m[lower] = m[upper]
    return t
