"""Distillation objectives and the expanded teacher.

With p = softmax(z_teacher / T), q = softmax(z_student / T) per token t of the batch 𝒯:

    forward KL (default, Eq. 5):  L = T² · (1/|𝒯|) Σ_t Σ_v p_v (log p_v − log q_v)
    reverse KL:                   L = T² · (1/|𝒯|) Σ_t Σ_v q_v (log q_v − log p_v)
    KL + hidden (Muralidharan et al., 2024):  forward KL + λ · (1/L) Σ_{l=1..L} mean((h_l^S − h_l^T)²)

(T² keeps gradient magnitudes comparable across temperatures, Hinton et al.) The hidden term pairs
the outputs of every decoder layer: student and teacher share the hidden size and depth.

Expanded teacher (Eq. 6): during the teacher's forward every MoE layer routes each token to its
k' > k highest-probability experts, F(t) = Σ_{e∈S_k'(t)} g_e(t) f_e(t), with g the router's own
convention at top-k' (renormalised over the k' for renormalising routers) — installed as blocks
through `MoEAdapter.set_block`, never by editing the model's modules.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MoECompressError
from ..models import MoEAdapter

Loss = Literal["forward_kl", "reverse_kl", "kl_hidden"]
LOSSES: tuple[str, ...] = ("forward_kl", "reverse_kl", "kl_hidden")


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean per-token KL between teacher and student next-token distributions (module doc), float32."""
    if temperature <= 0:
        raise MoECompressError(f"Temperature {temperature} must be positive; pass e.g. --temperature 1.")
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise MoECompressError(
            f"Teacher vocabulary ({teacher_logits.shape[-1]}) and student vocabulary "
            f"({student_logits.shape[-1]}) differ; distillation needs the same tokenizer."
        )
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if kind == "reverse_kl":
        per_tok = (s.exp() * (s - t)).sum(-1)
    else:
        per_tok = (t.exp() * (t - s)).sum(-1)
    if mask is not None:
        m = mask.to(per_tok.dtype)
        return (per_tok * m).sum() / m.sum().clamp_min(1) * temperature**2
    return per_tok.mean() * temperature**2


def hidden_mse(student_hidden, teacher_hidden) -> torch.Tensor:
    """(1/L) Σ_l mean((h_l^S − h_l^T)²) over the decoder layers' outputs (the embeddings, index 0, skipped)."""
    s, t = list(student_hidden)[1:], list(teacher_hidden)[1:]
    if len(s) != len(t) or not s:
        raise MoECompressError(
            f"The student has {len(s)} layers and the teacher {len(t)}; the hidden-state loss "
            "needs the same depth (use --loss forward_kl)."
        )
    return torch.stack([F.mse_loss(a.float(), b.float().to(a.device)) for a, b in zip(s, t)]).mean()


class ExpandedMoEBlock(nn.Module):
    """A MoE block that routes every token to top_k experts (k' > k) through the adapter."""

    def __init__(self, adapter: MoEAdapter, layer: int, top_k: int):
        super().__init__()
        self._adapter = [adapter]  # a list: keep the adapter (and the model) out of this module's children
        self.layer, self.top_k = layer, top_k

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        adapter = self._adapter[0]
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        r = adapter.route(self.layer, x, top_k=self.top_k)
        out = torch.zeros_like(x)
        for e in r.index.unique().tolist():
            tok, slot = torch.where(r.index == e)
            y = adapter.expert_forward(self.layer, e, x[tok]) * r.weight[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        shared = adapter.shared_forward(self.layer, x)
        if shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, None) if adapter.returns_tuple else out


def check_expanded_top_k(adapter: MoEAdapter, top_k: int) -> None:
    for i in adapter.moe_layers:
        spec = adapter.router_spec(i)
        reachable = (
            spec.num_experts if spec.n_group <= 1 else spec.topk_group * (spec.num_experts // spec.n_group)
        )
        if not spec.top_k <= top_k <= reachable:
            raise MoECompressError(
                f"Expanded teacher top-k {top_k} is outside {spec.top_k}..{reachable} for layer {i} "
                f"(router top-k {spec.top_k}, {reachable} experts reachable); pick a k' in that range."
            )


@contextlib.contextmanager
def expanded_teacher(model, top_k: int | None):
    """Run `model` with every MoE layer routing to `top_k` experts; the original blocks return on exit."""
    if top_k is None:
        yield model
        return
    adapter = MoEAdapter(model)
    check_expanded_top_k(adapter, top_k)
    saved = {i: adapter.layer(i).block for i in adapter.moe_layers}
    try:
        for i in adapter.moe_layers:
            adapter.set_block(i, ExpandedMoEBlock(adapter, i, top_k))
        yield model
    finally:
        for i, block in saved.items():
            adapter.set_block(i, block)
