"""Normalised parameter distance between experts (ConMoE; slot remap).

d(e, e') = mean over W ∈ {gate, up, down} of 2‖W_e − W_e'‖_F / (‖W_e‖_F + ‖W_e'‖_F + 2ε).
It lies in [0, 2]; 0 means identical weights.
"""

from __future__ import annotations

import torch

from ..models import ExpertWeights


def projection_distance(flat: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """One projection's term 2‖W_e − W_e'‖_F / (‖W_e‖_F + ‖W_e'‖_F + 2ε) for rows `flat` [E, D] -> [E, E]."""
    norms = flat.norm(dim=1)
    diff = torch.cdist(flat, flat)
    return 2 * diff / (norms[:, None] + norms[None, :] + 2 * eps)


def pairwise_distance(experts: ExpertWeights, eps: float = 1e-8) -> torch.Tensor:
    """d for every pair of a stack of E experts (gate/up [E, I, H], down [E, H, I]) -> [E, E] float64.

    Experts may come from several layers (a cross-layer scope) as long as shapes agree.
    """
    total = None
    for w in (experts.gate, experts.up, experts.down):
        term = projection_distance(w.detach().reshape(w.shape[0], -1).double(), eps)
        total = term if total is None else total + term
    d = total / 3.0
    d.fill_diagonal_(0.0)
    return d
