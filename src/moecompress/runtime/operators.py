"""Replacement operators of one layer, batched by kind.

What a slot computes when the router selects it and it is neither a stored expert nor dropped
("What We Keep of What We Forget"), for a token x with gate weight g:

* constant: ``y = g * c``                        (c: e.g. the expert's mean output)
* tilt:     ``y = g * (b + U (V^T x))``          (low-rank affine map, U, V [H, r])
* partial:  ``y = g * (down_S act(gate_S x, up_S x) + b)``  (a neuron subset S of an expert)

Constants are applied to all tokens at once (one [N, n_c] x [n_c, H] product); tilts and partial
copies loop over the operators actually hit, like HF's eager expert loop — never over tokens.
Ranks and widths are zero-padded to the layer's maximum (padding contributes exactly zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models import ExpertActivation
from ..plan import ConstantOp, LayerPlan, PartialOp, TiltOp
from .experts import glu_activation


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class SlotOperators(nn.Module):
    """All replacement operators of one MoE layer; `slot_op[e]` indexes them (-1: not an operator)."""

    def __init__(
        self,
        lp: LayerPlan,
        hidden_size: int,
        act: ExpertActivation,
        expert_bias: bool,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        ops = lp.operators()
        self.act = act
        consts = [(e, o) for e, o in ops if isinstance(o, ConstantOp)]
        tilts = [(e, o) for e, o in ops if isinstance(o, TiltOp)]
        parts = [(e, o) for e, o in ops if isinstance(o, PartialOp)]
        self.n_const, self.n_tilt, self.n_part = len(consts), len(tilts), len(parts)
        self.order = consts + tilts + parts  # (slot, op) in index order
        slot_op = torch.full((len(lp.slots),), -1, dtype=torch.long)
        for j, (e, _) in enumerate(self.order):
            slot_op[e] = j
        if (
            device is not None and torch.device(device).type != "meta"
        ):  # index buffers stay real even in a skeleton
            slot_op = slot_op.to(device)
        self.register_buffer("slot_op", slot_op, persistent=False)
        h = hidden_size
        kw = dict(dtype=dtype, device=device)
        if consts:
            self.constants = _param(torch.zeros(len(consts), h, **kw))
        if tilts:
            r = max(o.rank for _, o in tilts)
            self.tilt_U = _param(torch.zeros(len(tilts), h, r, **kw))
            self.tilt_V = _param(torch.zeros(len(tilts), h, r, **kw))
            self.tilt_bias = _param(torch.zeros(len(tilts), h, **kw))
        if parts:
            w = max(o.width for _, o in parts)
            self.part_gate = _param(torch.zeros(len(parts), w, h, **kw))
            self.part_up = _param(torch.zeros(len(parts), w, h, **kw))
            self.part_down = _param(torch.zeros(len(parts), h, w, **kw))
            self.part_bias = _param(torch.zeros(len(parts), h, **kw))
            if expert_bias:
                self.part_gate_bias = _param(torch.zeros(len(parts), w, **kw))
                self.part_up_bias = _param(torch.zeros(len(parts), w, **kw))

    @torch.no_grad()
    def fill(self, tensors) -> SlotOperators:
        """Copy the operators' parameters from PlanTensors (keys documented in the plan package, plan/schema.py)."""
        n_c, n_t = self.n_const, self.n_tilt
        for j, (_, op) in enumerate(self.order):
            p = op.tensor
            if isinstance(op, ConstantOp):
                self.constants[j].copy_(tensors[f"{p}.value"])
            elif isinstance(op, TiltOp):
                t = j - n_c
                self.tilt_U[t, :, : op.rank].copy_(tensors[f"{p}.U"])
                self.tilt_V[t, :, : op.rank].copy_(tensors[f"{p}.V"])
                self.tilt_bias[t].copy_(tensors[f"{p}.bias"])
            else:
                q, w = j - n_c - n_t, op.width
                self.part_gate[q, :w].copy_(tensors[f"{p}.gate"])
                self.part_up[q, :w].copy_(tensors[f"{p}.up"])
                self.part_down[q, :, :w].copy_(tensors[f"{p}.down"])
                self.part_bias[q].copy_(tensors[f"{p}.bias"])
                if hasattr(self, "part_gate_bias"):
                    for name in ("gate_bias", "up_bias"):
                        if f"{p}.{name}" in tensors:
                            getattr(self, f"part_{name}")[q, :w].copy_(tensors[f"{p}.{name}"])
        return self

    def forward(self, x: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x [N, H]; slots [N, k] selected original slots; weight [N, k] -> operator outputs [N, H]."""
        op = self.slot_op[slots]
        if not bool((op >= 0).any()):
            return None
        w = weight.to(x.dtype)
        out = torch.zeros_like(x)
        n_c, n_t = self.n_const, self.n_tilt
        if n_c:
            is_c = (op >= 0) & (op < n_c)
            wc = torch.zeros(x.shape[0], n_c, dtype=x.dtype, device=x.device)
            wc.scatter_add_(1, torch.where(is_c, op, 0), torch.where(is_c, w, 0))
            out = out + wc @ self.constants
        if n_t or self.n_part:
            hit = torch.unique(op[op >= n_c]).tolist()
            for j in hit:
                tok, pos = torch.where(op == j)
                xs = x[tok]
                if j < n_c + n_t:
                    t = j - n_c
                    y = self.tilt_bias[t] + (xs @ self.tilt_V[t]) @ self.tilt_U[t].T
                else:
                    q = j - n_c - n_t
                    gb = self.part_gate_bias[q] if hasattr(self, "part_gate_bias") else None
                    ub = self.part_up_bias[q] if hasattr(self, "part_up_bias") else None
                    g_pre, u_pre = F.linear(xs, self.part_gate[q], gb), F.linear(xs, self.part_up[q], ub)
                    hmid = (
                        glu_activation(self.act.act)(g_pre) * u_pre
                        if self.act.kind == "glu"
                        else self.act(g_pre, u_pre)
                    )
                    y = F.linear(hmid, self.part_down[q], self.part_bias[q])
                out.index_add_(0, tok, y * w[tok, pos, None])
        return out
