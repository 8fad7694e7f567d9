"""Closed-form replacement operators for a pruned expert slot, fitted from calibration moments.

Moments of expert e over its routed tokens (float64): n, Σx [H], Σy [H], Σxxᵀ [H,H], Σxyᵀ [H,H]
with x the block input and y = f_e(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tilt:
    """f̂(x) = b + B (A x): the "tilted novice" of rank r (rank 0: b is MoNE's mean-output constant)."""

    A: torch.Tensor  # [r, H_in]
    B: torch.Tensor  # [H_out, r]
    b: torch.Tensor  # [H_out]

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def num_params(self) -> int:
        return self.A.numel() + self.B.numel() + self.b.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.b.to(x.dtype) + (x @ self.A.T.to(x.dtype)) @ self.B.T.to(x.dtype)


def fit_tilt(
    n: float,
    sum_x: torch.Tensor,
    sum_y: torch.Tensor,
    sum_xx: torch.Tensor,
    sum_xy: torch.Tensor,
    rank: int,
    ridge: float = 1e-3,
) -> Tilt:
    """Reduced-rank ridge regression of y on x (Mukherjee & Zhu 2011), closed form.

    With centred covariances S_xx, S_xy and λ = ridge · tr(S_xx)/H (scale-free ridge):
      W = (S_xx + λI)⁻¹ S_xy                      (ridge solution, [H_in, H_out])
      V_r = top-r eigenvectors of Wᵀ (S_xx + λI) W  (fitted-value covariance of the augmented problem)
      f̂(x) = μ_y + V_r (W V_r)ᵀ (x − μ_x)
    λ = 0 and r = H gives OLS; λ = 0 and r < H gives classical reduced-rank regression.
    """
    return tilt_of_rank(tilt_basis(n, sum_x, sum_y, sum_xx, sum_xy, ridge), rank)


@dataclass
class TiltBasis:
    """The rank-independent part of `fit_tilt`: means, the ridge solution W and the eigenvectors of the fitted
    covariance by decreasing eigenvalue (one solve and one eigendecomposition serve every rank)."""

    n: float
    mu_x: torch.Tensor
    mu_y: torch.Tensor
    w: torch.Tensor | None = None
    evecs: torch.Tensor | None = None


def tilt_basis(
    n: float,
    sum_x: torch.Tensor,
    sum_y: torch.Tensor,
    sum_xx: torch.Tensor,
    sum_xy: torch.Tensor,
    ridge: float = 1e-3,
) -> TiltBasis:
    sum_x, sum_y = sum_x.double(), sum_y.double()
    if n <= 0:
        return TiltBasis(n, sum_x, sum_y)
    mu_x, mu_y = sum_x / n, sum_y / n
    s_xx = sum_xx.double() / n - torch.outer(mu_x, mu_x)
    s_xy = sum_xy.double() / n - torch.outer(mu_x, mu_y)
    lam = ridge * float(s_xx.diagonal().mean().clamp_min(1e-12))
    reg = s_xx + lam * torch.eye(len(mu_x), dtype=torch.float64)
    w = torch.linalg.lstsq(reg, s_xy).solution if lam == 0 else torch.linalg.solve(reg, s_xy)
    fitted_cov = w.T @ reg @ w
    evals, evecs = torch.linalg.eigh(fitted_cov)
    return TiltBasis(n, mu_x, mu_y, w, evecs[:, torch.argsort(evals, descending=True)])


def tilt_of_rank(basis: TiltBasis, rank: int) -> Tilt:
    """`fit_tilt`'s rank-r tilt from its `TiltBasis`."""
    if basis.n <= 0:
        zeros = torch.zeros(0, basis.mu_x.shape[0], dtype=torch.float64)
        return Tilt(
            zeros, torch.zeros(basis.mu_y.shape[0], 0, dtype=torch.float64), torch.zeros_like(basis.mu_y)
        )
    mu_x, mu_y = basis.mu_x, basis.mu_y
    if rank == 0:
        return Tilt(
            torch.zeros(0, len(mu_x), dtype=torch.float64),
            torch.zeros(len(mu_y), 0, dtype=torch.float64),
            mu_y,
        )
    v = basis.evecs[:, :rank]
    a = (basis.w @ v).T  # [r, H_in]
    b = mu_y - v @ (a @ mu_x)
    return Tilt(a, v, b)


def neuron_energy(inter_sq_sum: torch.Tensor, count: float, down: torch.Tensor) -> torch.Tensor:
    """Energy of each intermediate neuron j of a SwiGLU expert: E[a_j²] · ‖down[:, j]‖²."""
    mean_sq = inter_sq_sum.double() / max(count, 1.0)
    return mean_sq * down.double().square().sum(0)


def partial_copy_size(rank: int, hidden: int, out: int | None = None) -> int:
    """Neurons a partial copy may keep for the parameter budget of a rank-r tilt.

    A tilt stores r·(H_in + H_out) + H_out numbers; a neuron costs gate row + up row + down column
    (3H) and the bias costs H_out, so m = floor(r·(H_in + H_out) / (3H)).
    """
    out = hidden if out is None else out
    return (rank * (hidden + out)) // (3 * hidden)


def partial_copy_bias(
    inter_sum: torch.Tensor,
    count: float,
    down: torch.Tensor,
    kept: torch.Tensor,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bias holding the mean output of the neurons left out: down[:, rest] · E[a_rest] (+ down bias)."""
    rest = torch.ones(down.shape[1], dtype=torch.bool)
    rest[kept] = False
    mean_a = inter_sum.double() / max(count, 1.0)
    bias = down.double()[:, rest] @ mean_a[rest]
    return bias if down_bias is None else bias + down_bias.double()
