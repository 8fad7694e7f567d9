"""PuzzleMoE dual-mask element-wise merging (PuzzleMoE §3.2) and its group generalisation.

For a pair of experts i, j and one projection W (gate/up [I, H], down [H, I]; nn.Linear's out x in):

    Δ       = | |W_i| − |W_j| | / (|W_i| + |W_j|)          (Eq. 1; 0/0 := 0)
    M_sim   = 1[Δ ≤ τ]                                      (τ = 0.4 default)
    A_e     = |W_e| ⊙ ‖X_e‖₂                                (‖X_e‖₂ [in]: per-input-channel L2 norm of the
                                                             expert's routed inputs, broadcast over rows)
    M_sal_i = 1[A_i ≥ A_j],  M_sal_j = 1 − M_sal_i
    W_merged = M_sim ⊙ (|W_i| + |W_j|)/2 + (1 − M_sim) ⊙ (M_sal_i ⊙ |W_i| + M_sal_j ⊙ |W_j|)
    M_i = M_sal_i ∨ M_sim,  M_j = M_sal_j ∨ M_sim,  S_e = 1[W_e < 0]
    Ŵ_e = (−1)^{S_e} ⊙ M_e ⊙ W_merged

Groups of G ≥ 2 experts (66.7 % at G = 3, 75 % at G = 4; PuzzleMoE App. 7.8.4 stores masks explicitly)
use the generalisation below, which reduces exactly to the pair rule at G = 2:

    anchor  a = argmax_e A_e                        (per element; ties -> lowest member index)
    M_e     = 1[ | |W_e| − |W_a| | / (|W_e| + |W_a|) ≤ τ ]   (the anchor always agrees with itself)
    W_merged = mean of |W_e| over the members with M_e = 1
    Ŵ_e     = (−1)^{S_e} ⊙ M_e ⊙ W_merged

(At G = 2: if Δ ≤ τ both members agree and W_merged is the mean, else only the salient member survives.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..errors import MoECompressError
from ..models import ExpertActivation, ExpertWeights, expert_intermediate

DEFAULT_TAU = 0.4


def _check_tau(tau: float) -> None:
    if not 0.0 <= float(tau) <= 1.0:
        raise MoECompressError(
            f"The PuzzleMoE similarity threshold tau={tau} is outside [0, 1]; use e.g. 0.4."
        )


def _norm_row(norm: torch.Tensor | None, w: torch.Tensor, who: str) -> torch.Tensor:
    """‖X‖₂ per input channel as a [1, in] float32 row (ones when no calibration norms are given)."""
    if norm is None:
        return torch.ones(1, w.shape[-1], dtype=torch.float32, device=w.device)
    norm = torch.as_tensor(norm)
    if norm.dim() != 1 or norm.shape[0] != w.shape[-1]:
        raise MoECompressError(
            f"Input-channel norms for {who} have shape {tuple(norm.shape)} but the weight has "
            f"{w.shape[-1]} input channels; pass a 1-D tensor with one L2 norm per input channel."
        )
    return norm.to(device=w.device, dtype=torch.float32)[None, :]


def symmetric_difference(w_i: torch.Tensor, w_j: torch.Tensor) -> torch.Tensor:
    """Δ = ||W_i| − |W_j|| / (|W_i| + |W_j|) in float32 (Eq. 1), with 0/0 defined as 0."""
    a_i, a_j = w_i.float().abs(), w_j.float().abs()
    den = a_i + a_j
    return torch.where(
        den > 0, (a_i - a_j).abs() / den.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(den)
    )


def similarity_fraction(
    w_i: torch.Tensor, w_j: torch.Tensor, tau: float = DEFAULT_TAU, strict: bool = True
) -> float:
    """Fraction of elements with Δ < τ (strict, as in Lemma 3.1) or Δ ≤ τ (the mask's rule)."""
    d = symmetric_difference(w_i, w_j)
    return float(((d < tau) if strict else (d <= tau)).float().mean())


def gaussian_similarity_rate(tau: float) -> float:
    """Lemma 3.1 for equal σ: P(Δ < τ) = 2/π · (arctan((1+τ)/(1−τ)) − arctan((1−τ)/(1+τ)))."""
    if not 0.0 < tau < 1.0:
        raise MoECompressError(f"The Gaussian similarity rate needs 0 < tau < 1, got {tau}.")
    return 2.0 / math.pi * (math.atan((1 + tau) / (1 - tau)) - math.atan((1 - tau) / (1 + tau)))


@dataclass
class PairMerge:
    """The result of merging one projection of a pair: W_merged ≥ 0 (float32) and bool masks/signs."""

    w_merged: torch.Tensor
    m_i: torch.Tensor
    m_j: torch.Tensor
    s_i: torch.Tensor
    s_j: torch.Tensor
    m_sim: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.w_merged.shape

    def reconstruct(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Ŵ_i, Ŵ_j) = ((−1)^{S_i} ⊙ M_i ⊙ W_merged, (−1)^{S_j} ⊙ M_j ⊙ W_merged)."""
        return reconstruct_pair(self.w_merged, self.m_i, self.m_j, self.s_i, self.s_j, dtype=dtype)

    def rounded(self, underflow: str = "nearest") -> PairMerge:
        """A copy whose W_merged is what the bf16 packing stores: bf16-rounded, exponent-clamped (as float32)."""
        from .packing import clamp_exponent

        w = clamp_exponent(self.w_merged.to(torch.bfloat16), underflow=underflow).float()
        return replace(self, w_merged=w)

    def stats(self) -> dict[str, float]:
        """Fractions of merged (similar) elements and of elements kept by each expert."""
        return {
            "merged_fraction": float(self.m_sim.float().mean()),
            "kept_i": float(self.m_i.float().mean()),
            "kept_j": float(self.m_j.float().mean()),
        }


def reconstruct_pair(
    w_merged: torch.Tensor,
    m_i: torch.Tensor,
    m_j: torch.Tensor,
    s_i: torch.Tensor,
    s_j: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense reconstruction Ŵ_e = (−1)^{S_e} ⊙ M_e ⊙ W_merged (PuzzleMoE §3.2, last equation)."""
    w = w_merged if dtype is None else w_merged.to(dtype)
    zero = torch.zeros_like(w)
    w_i = torch.where(m_i.bool(), torch.where(s_i.bool(), -w, w), zero)
    w_j = torch.where(m_j.bool(), torch.where(s_j.bool(), -w, w), zero)
    return w_i, w_j


def merge_pair(
    w_i: torch.Tensor,
    w_j: torch.Tensor,
    x_norm_i: torch.Tensor | None = None,
    x_norm_j: torch.Tensor | None = None,
    tau: float = DEFAULT_TAU,
) -> PairMerge:
    """Dual-mask merge of one projection of experts i and j (formulas in the module docstring).

    ``w_*`` are [out, in]; ``x_norm_*`` are [in] per-input-channel L2 norms of the expert's routed inputs
    (block input x for gate/up, intermediate activation for down). Without norms, saliency is |W| alone
    (the paper's "W" ablation variant). Ties A_i = A_j go to expert i.
    """
    _check_tau(tau)
    if w_i.shape != w_j.shape or w_i.dim() != 2:
        raise MoECompressError(
            f"Cannot merge weights of shapes {tuple(w_i.shape)} and {tuple(w_j.shape)}; "
            "both experts' projection must be 2-D [out, in] with the same shape."
        )
    a_i, a_j = w_i.float().abs(), w_j.float().abs()
    m_sim = symmetric_difference(w_i, w_j) <= tau
    sal_i = a_i * _norm_row(x_norm_i, w_i, "expert i") >= a_j * _norm_row(x_norm_j, w_j, "expert j")
    w_merged = torch.where(m_sim, (a_i + a_j) / 2, torch.where(sal_i, a_i, a_j))
    return PairMerge(
        w_merged=w_merged, m_i=sal_i | m_sim, m_j=~sal_i | m_sim, s_i=w_i < 0, s_j=w_j < 0, m_sim=m_sim
    )


@dataclass
class GroupMerge:
    """G experts merged into one magnitude tensor with explicit per-member masks and signs ([G, out, in])."""

    w_merged: torch.Tensor
    masks: torch.Tensor
    signs: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.masks.shape[0]

    def reconstruct(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """[Ŵ_e for each member] with Ŵ_e = (−1)^{S_e} ⊙ M_e ⊙ W_merged."""
        w = self.w_merged if dtype is None else self.w_merged.to(dtype)
        zero = torch.zeros_like(w)
        return [torch.where(m, torch.where(s, -w, w), zero) for m, s in zip(self.masks, self.signs)]

    def storage_bits(self, value_bits: int = 16) -> int:
        """Bits of the explicit layout: W_merged at value_bits + one mask bit + one sign bit per member."""
        n = self.w_merged.numel()
        return n * (value_bits + 2 * self.group_size)


def merge_group(
    weights: Sequence[torch.Tensor],
    x_norms: Sequence[torch.Tensor | None] | None = None,
    tau: float = DEFAULT_TAU,
) -> GroupMerge:
    """Anchor-based generalisation of the dual-mask merge to G ≥ 2 members (see the module docstring)."""
    _check_tau(tau)
    g = len(weights)
    if g < 2:
        raise MoECompressError(f"A merge group needs at least 2 experts, got {g}.")
    shape = weights[0].shape
    if any(w.shape != shape for w in weights) or len(shape) != 2:
        raise MoECompressError(
            "All members of a merge group must have 2-D weights of the same shape [out, in]."
        )
    norms = list(x_norms) if x_norms is not None else [None] * g
    if len(norms) != g:
        raise MoECompressError(
            f"Got {len(norms)} input-norm vectors for a group of {g} experts; pass one per member."
        )
    mags = torch.stack([w.float().abs() for w in weights])
    sal = torch.stack([mags[k] * _norm_row(norms[k], weights[k], f"member {k}") for k in range(g)])
    # argmax returns the first maximal index, matching the pair rule's tie-break (A_i ≥ A_j -> i).
    anchor = sal.argmax(dim=0, keepdim=True)
    a_anchor = mags.gather(0, anchor)
    den = mags + a_anchor
    delta = torch.where(
        den > 0,
        (mags - a_anchor).abs() / den.clamp_min(torch.finfo(torch.float32).tiny),
        torch.zeros_like(den),
    )
    masks = delta <= tau
    masks.scatter_(0, anchor, True)  # the anchor always agrees (guards tau = 0 edge cases too)
    w_merged = (mags * masks).sum(0) / masks.sum(0)
    signs = torch.stack([w < 0 for w in weights])
    return GroupMerge(w_merged=w_merged, masks=masks, signs=signs)


# ---------------------------------------------------------------------------------------- expert level


@dataclass
class InputNorms:
    """Per-input-channel L2 norms of one expert's routed inputs: block input x [H] and intermediate [I]."""

    hidden: torch.Tensor | None = None
    intermediate: torch.Tensor | None = None


def channel_norms(x: torch.Tensor) -> torch.Tensor:
    """‖X‖₂ per channel: sqrt(Σ_tokens x²) over all leading dims (Wanda's column norm; grows with usage)."""
    return x.float().reshape(-1, x.shape[-1]).pow(2).sum(0).sqrt()


def expert_input_norms(w: ExpertWeights, x: torch.Tensor, act: ExpertActivation) -> InputNorms:
    """Norms from the tokens routed to an expert: x [N, H] -> hidden norms and intermediate-activation norms.

    From a stats store holding Σ_tokens x² per channel (the diagonal of the un-normalised input second
    moment), the same norms are simply its square root.
    """
    with torch.no_grad():
        inter = expert_intermediate(w.map(lambda t: t.float()), x.float(), act)
    return InputNorms(hidden=channel_norms(x), intermediate=channel_norms(inter))


@dataclass
class ExpertPairMerge:
    """A merged pair of whole experts: gate and up merged as one [2I, H] tensor (gate rows first), down [H, I].

    Concatenating gate and up changes nothing (every operation is element-wise and both use the hidden
    norms) and lets the runtime run one packed GEMM for both. Biases (GPT-OSS) are kept per expert, unmerged.
    """

    gate_up: PairMerge
    down: PairMerge
    bias_i: ExpertWeights | None = None  # gate/up/down fields hold the biases of expert i (or None)
    bias_j: ExpertWeights | None = None

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[1]

    def reconstruct(self, dtype: torch.dtype | None = None) -> tuple[ExpertWeights, ExpertWeights]:
        """Dense Ŵ for both experts as ExpertWeights (gate [I, H], up [I, H], down [H, I])."""
        i_size = self.intermediate_size
        gu_i, gu_j = self.gate_up.reconstruct(dtype)
        d_i, d_j = self.down.reconstruct(dtype)
        out = []
        for gu, d, b in ((gu_i, d_i, self.bias_i), (gu_j, d_j, self.bias_j)):
            out.append(
                ExpertWeights(
                    gate=gu[:i_size],
                    up=gu[i_size:],
                    down=d,
                    gate_bias=None if b is None else b.gate,
                    up_bias=None if b is None else b.up,
                    down_bias=None if b is None else b.down,
                )
            )
        return out[0], out[1]

    def rounded(self, underflow: str = "nearest") -> ExpertPairMerge:
        return replace(self, gate_up=self.gate_up.rounded(underflow), down=self.down.rounded(underflow))


def _biases(e: ExpertWeights) -> ExpertWeights | None:
    if e.gate_bias is None and e.up_bias is None and e.down_bias is None:
        return None
    return ExpertWeights(gate=e.gate_bias, up=e.up_bias, down=e.down_bias)


def merge_expert_pair(
    e_i: ExpertWeights,
    e_j: ExpertWeights,
    norms_i: InputNorms | None = None,
    norms_j: InputNorms | None = None,
    tau: float = DEFAULT_TAU,
) -> ExpertPairMerge:
    """Dual-mask merge of two whole experts (gate [I, H], up [I, H], down [H, I]) -> ExpertPairMerge."""
    norms_i, norms_j = norms_i or InputNorms(), norms_j or InputNorms()
    gate_up = merge_pair(
        torch.cat([e_i.gate, e_i.up]), torch.cat([e_j.gate, e_j.up]), norms_i.hidden, norms_j.hidden, tau
    )
    down = merge_pair(e_i.down, e_j.down, norms_i.intermediate, norms_j.intermediate, tau)
    return ExpertPairMerge(gate_up=gate_up, down=down, bias_i=_biases(e_i), bias_j=_biases(e_j))


def merge_expert_group(
    experts: Sequence[ExpertWeights],
    norms: Sequence[InputNorms | None] | None = None,
    tau: float = DEFAULT_TAU,
) -> dict[str, GroupMerge]:
    """Group merge of whole experts -> {"gate_up": GroupMerge [2I, H], "down": GroupMerge [H, I]}."""
    norms = [n or InputNorms() for n in (norms or [None] * len(experts))]
    gate_up = merge_group([torch.cat([e.gate, e.up]) for e in experts], [n.hidden for n in norms], tau)
    down = merge_group([e.down for e in experts], [n.intermediate for n in norms], tau)
    return {"gate_up": gate_up, "down": down}
