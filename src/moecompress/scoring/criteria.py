"""Per-expert importance scores: plain functions of calibration statistics (higher = keep).

Every function takes float64 tensors of one MoE layer's statistics (E experts) and returns a
score tensor [E]. Notation: N tokens (unpadded), c_e selections of expert e, g_e(t) its gate
weight on token t, p_e(t) its router probability, f_e(t) its output.
"""

from __future__ import annotations

import torch


def safe_div(num: torch.Tensor, den: torch.Tensor | float, out: torch.Tensor | None = None) -> torch.Tensor:
    """num / den with 0 where den is 0 (an expert no token reached). `den` lines up with `num`'s leading
    dimensions (one count per expert row) or is a scalar; ``out=num`` divides in place, so the [S, H, H]
    moment sums of calibration do not exist twice."""
    den = torch.as_tensor(den, dtype=num.dtype)
    while 0 < den.dim() < num.dim():
        den = den.unsqueeze(-1)
    q = torch.div(num, den.clamp(min=torch.finfo(num.dtype).tiny), out=out)
    return q.masked_fill_(den <= 0, 0.0)


def random_scores(num_experts: int, seed: int = 0) -> torch.Tensor:
    """Seeded uniform scores: the random-selection baseline."""
    return torch.rand(num_experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def frequency(count: torch.Tensor) -> torch.Tensor:
    """SF: c_e, how often e is in the router's top-k."""
    return count.double()


def routing_mass(mass: torch.Tensor) -> torch.Tensor:
    """Σ_t g_e(t) over the tokens that selected e."""
    return mass.double()


def pp(prob_sum: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """PP: (1/N) Σ_t p_e(t), the mean router probability over all tokens."""
    return safe_div(prob_sum.double(), num_tokens)


def ps(selected_prob_sum: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """PS: mean over all tokens of p_e(t) when e is selected, else 0 (= (1/N) Σ_{t: e∈top-k} p_e(t))."""
    return safe_div(selected_prob_sum.double(), num_tokens)


def cp(selected_prob_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """CP: (1/c_e) Σ_{t: e∈top-k} p_e(t), the mean probability over the tokens that selected e."""
    return safe_div(selected_prob_sum.double(), count.double())


def acp(selected_prob_sum: torch.Tensor, count: torch.Tensor, out_norm_sq_sum: torch.Tensor) -> torch.Tensor:
    """ACP = CP · sqrt((1/c_e) Σ_{t: e∈top-k} ‖f_e(t)‖²)."""
    return cp(selected_prob_sum, count) * safe_div(out_norm_sq_sum.double(), count.double()).sqrt()


def acp_of_means(cp_mean: torch.Tensor, out_norm_sq_mean: torch.Tensor) -> torch.Tensor:
    """ACP from the per-expert means a store holds: p̄_e · sqrt(E_{t: e∈top-k} ‖f_e(t)‖²).

    The same equation as `acp`, evaluated without going back to sums, so it rounds differently in the last
    bits; the dense method (MoE → dense, whose merge weights are normalised scores) uses this form.
    """
    return cp_mean.double() * out_norm_sq_mean.double().clamp_min(0).sqrt()


def reap(gate_norm_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """REAP: (1/c_e) Σ_{t: e∈top-k} g_e(t)·‖f_e(t)‖₂."""
    return safe_div(gate_norm_sum.double(), count.double())


def ean(out_norm_sum: torch.Tensor) -> torch.Tensor:
    """EAN: Σ_{t: e∈top-k} ‖f_e(t)‖₂."""
    return out_norm_sum.double()


def mone(
    out_sum: torch.Tensor,
    out_sq_sum: torch.Tensor,
    count: torch.Tensor,
    mass: torch.Tensor,
    num_tokens: float,
) -> torch.Tensor:
    """MoNE fusion score ‖σ_e‖₂ · r̄_e.

    σ_e [H] is the per-dimension standard deviation of f_e over its routed tokens
    (from Σ f and Σ f², each [E, H]); r̄_e = (1/N) Σ_t g_e(t) with g_e(t) = 0 when e is not selected.
    Low scores are pruned: an expert with a near-constant output (small σ) is replaceable by its mean.
    """
    c = count.double().unsqueeze(-1)
    mean = safe_div(out_sum.double(), c)
    var = (safe_div(out_sq_sum.double(), c) - mean.square()).clamp_min(0.0)
    return var.sum(-1).sqrt() * safe_div(mass.double(), num_tokens)


def super_experts(
    out_norm_sq_sum: torch.Tensor, count: torch.Tensor, threshold: float = 10.0
) -> torch.Tensor:
    """Bool [E]: experts whose RMS output norm exceeds `threshold` × the layer median.

    "Super experts" (massive output outliers, e.g. in DeepSeek-V2-Lite) must never be pruned.
    With the default threshold, layers without such outliers flag nothing, so protection on by
    default changes nothing for them.
    """
    rms = safe_div(out_norm_sq_sum.double(), count.double()).sqrt()
    med = rms[count > 0].median() if (count > 0).any() else torch.tensor(0.0, dtype=torch.float64)
    return (rms > threshold * med) & (med > 0)
