"""D-optimal (determinantal) expert selection: DO-CP / DO-ACP.

Kernel K_ij = sqrt(I_i I_j) · G_ij with I the base importance and G_ij = E_t⟨f_i(t), f_j(t)⟩ the
expert-output Gram matrix over all tokens. Choose S, |S| = K, maximising
log det(K_S + λI),  λ = (1/(K·E)) Σ_e K_ee,
greedily with incremental Cholesky (Schur-complement) updates: O(K²E) after the kernel.
"""

from __future__ import annotations

import torch


def doptimal_kernel(importance: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    s = importance.double().clamp_min(0).sqrt()
    return s[:, None] * gram.double() * s[None, :]


def default_ridge(kernel: torch.Tensor, k: int) -> float:
    e = kernel.shape[0]
    return float(kernel.diagonal().sum() / (k * e))


def greedy_doptimal(kernel: torch.Tensor, k: int, ridge: float | None = None) -> list[int]:
    """Greedy maximiser of log det(K_S + λI); returns the chosen indices in selection order.

    The marginal gain of adding j to S is log d_j² with d_j² = (K+λI)_jj − c_jᵀc_j, the Schur
    complement of S in S∪{j}; c_j is the new column of the incremental Cholesky factor.
    Ties go to the lower index (deterministic).
    """
    e = kernel.shape[0]
    lam = default_ridge(kernel, k) if ridge is None else ridge
    a = kernel.double() + lam * torch.eye(e, dtype=torch.float64)
    d2 = a.diagonal().clone()
    chol = torch.zeros(k, e, dtype=torch.float64)
    chosen: list[int] = []
    available = torch.ones(e, dtype=torch.bool)
    for step in range(k):
        gains = torch.where(available, d2, torch.full_like(d2, -torch.inf))
        j = int(torch.argmax(gains))  # argmax returns the first maximum: lowest index on ties
        chosen.append(j)
        available[j] = False
        dj = d2[j].clamp_min(1e-300).sqrt()
        row = (a[j] - chol[:step].T @ chol[:step, j]) / dj
        chol[step] = row
        d2 = d2 - row.square()
    return chosen


def logdet_objective(kernel: torch.Tensor, subset: list[int], ridge: float) -> float:
    """Normalised objective log det(I + K_S/λ) (0 for the empty set)."""
    if not subset:
        return 0.0
    idx = torch.tensor(subset)
    ks = kernel.double()[idx][:, idx]
    return float(torch.logdet(torch.eye(len(subset), dtype=torch.float64) + ks / ridge))
