"""Router semantics of every supported MoE family as data (`RouterSpec`) plus one routing function.

The runtime, collectors and methods never call a HuggingFace router directly: they call
`route`, which reproduces the HF router exactly and additionally understands the two
pruning masks that give a compressed block its gate semantics:

* ``present`` (renorm): experts outside it are deleted from the router before any
  normalisation, as in a physically pruned checkpoint;
* ``allowed`` (keep): experts outside it stay in every normalisation but are never selected.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RouterSpec:
    """Exact routing semantics of one MoE layer.

    Attributes:
        num_experts: routed experts E.
        top_k: experts selected per token k.
        scoring: ``softmax`` or ``sigmoid`` applied to the router logits.
        topk_before_softmax: GPT-OSS / Granite style — top-k on raw logits, softmax over the k.
        norm_topk_prob: selected weights divided by their sum (Qwen3, Mixtral, DeepSeek-V3).
        has_bias: the router linear has a bias (GPT-OSS).
        has_correction_bias: DeepSeek-V3 ``e_score_correction_bias`` added for selection only.
        n_group, topk_group: group-limited routing (DeepSeek); 1/1 means none.
        group_score: ``max`` (DeepSeek-V2) or ``top2_sum`` (DeepSeek-V3) score per group.
        routed_scaling_factor: multiplier on the final weights.
        norm_eps: added to the top-k sum (DeepSeek-V3 uses 1e-20).
        fp32_logits: logits computed in float32 regardless of the hidden dtype.
    """

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    topk_before_softmax: bool = False
    norm_topk_prob: bool = False
    has_bias: bool = False
    has_correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: Literal["max", "top2_sum"] = "max"
    routed_scaling_factor: float = 1.0
    norm_eps: float = 0.0
    fp32_logits: bool = False

    def describe(self) -> str:
        """One line a report can print: the router convention."""
        if self.topk_before_softmax:
            core = f"top-{self.top_k} of logits, softmax over the {self.top_k}"
        else:
            core = f"{self.scoring} over {self.num_experts}, top-{self.top_k}"
            core += ", renormalised" if self.norm_topk_prob else ", not renormalised"
        if self.has_correction_bias:
            core += ", score-correction bias"
        if self.n_group > 1:
            core += f", group-limited {self.topk_group}/{self.n_group} ({self.group_score})"
        if self.routed_scaling_factor != 1.0:
            core += f", scaled x{self.routed_scaling_factor:g}"
        return core

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Routing:
    """Output of `route` for N tokens.

    logits [N, E] raw router logits; probs [N, E] softmax/sigmoid scores over all experts
    (for ``topk_before_softmax`` routers, the softmax over all logits, used only by statistics);
    index [N, k] selected experts; weight [N, k] gate weights applied to expert outputs.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    index: torch.Tensor
    weight: torch.Tensor


def router_logits(
    spec: RouterSpec, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if spec.fp32_logits:
        return F.linear(h.float(), weight.float(), None if bias is None else bias.float())
    return F.linear(h, weight, bias)


def _group_mask(spec: RouterSpec, choice: torch.Tensor) -> torch.Tensor:
    """Experts inside the topk_group best groups (DeepSeek group-limited routing)."""
    n, e = choice.shape
    grouped = choice.view(n, spec.n_group, e // spec.n_group)
    if spec.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    return group_mask.unsqueeze(-1).expand(n, spec.n_group, e // spec.n_group).reshape(n, e).bool()


def route(
    spec: RouterSpec,
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    top_k: int | None = None,
) -> Routing:
    """Route tokens h [N, H] exactly as the family's HF router does.

    present / allowed are bool [E] masks (see module docstring); ``top_k`` overrides k
    (an "expanded" teacher). With both masks None this equals the HF router.
    """
    k = spec.top_k if top_k is None else top_k
    logits = router_logits(spec, h, weight, bias)
    neg = torch.finfo(logits.dtype).min
    if present is not None:
        # renorm: a deleted router row is as if it never existed
        logits_eff = logits.masked_fill(~present, float("-inf"))
    else:
        logits_eff = logits
    selectable = None
    if present is not None or allowed is not None:
        selectable = torch.ones(spec.num_experts, dtype=torch.bool, device=h.device)
        if present is not None:
            selectable &= present
        if allowed is not None:
            selectable &= allowed

    if spec.topk_before_softmax:
        probs = torch.softmax(logits_eff.float(), dim=-1)
        choice = logits_eff if selectable is None else logits_eff.masked_fill(~selectable, neg)
        top_vals, index = torch.topk(choice, k, dim=-1)
        # keep and renorm coincide: the softmax only ever sees the selected logits
        weight_out = torch.softmax(top_vals.float(), dim=-1)
        return Routing(
            logits, probs, index, (weight_out * spec.routed_scaling_factor).to(_out_dtype(spec, h, logits))
        )

    if spec.scoring == "sigmoid":
        probs = torch.sigmoid(logits_eff.float())
    else:
        probs = torch.softmax(logits_eff, dim=-1, dtype=torch.float)
    choice = probs
    if spec.has_correction_bias and correction_bias is not None:
        choice = choice + correction_bias.float()
    if selectable is not None:
        choice = choice.masked_fill(~selectable, float("-inf"))
    if spec.n_group > 1:
        choice = choice.masked_fill(~_group_mask(spec, choice), float("-inf"))
    index = torch.topk(choice, k, dim=-1, sorted=spec.n_group <= 1 and not spec.has_correction_bias)[1]
    weight_out = probs.gather(1, index)
    if spec.norm_topk_prob:
        weight_out = weight_out / (weight_out.sum(dim=-1, keepdim=True) + spec.norm_eps)
    weight_out = weight_out * spec.routed_scaling_factor
    return Routing(logits, probs, index, weight_out.to(_out_dtype(spec, h, logits)))


def _out_dtype(spec: RouterSpec, h: torch.Tensor, logits: torch.Tensor) -> torch.dtype:
    # HF routers hand the experts weights in the hidden dtype, except DeepSeek's float32 routers
    return torch.float32 if spec.fp32_logits else h.dtype
