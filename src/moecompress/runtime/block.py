"""`CompressedMoEBlock`: executes one layer of any `CompressionPlan` in place of the HF MoE block.

For hidden states h (tokens x):

1. route with the ORIGINAL router (weights, bias, score-correction bias) through
   `moecompress.models.route`, with the plan's gate semantics as masks: ``renorm`` -> dropped
   slots absent (deleted before normalisation); ``keep`` -> dropped slots not allowed (kept in
   the normalisation, never selected); ``aggregate`` / ``replace`` -> the original top-k;
2. map each selected slot to its stored expert (``slot_to_stored``; K = not a stored expert);
   under ``aggregate`` the weights of selected slots sharing a stored expert are summed and the
   expert runs once per token (ConMoE): y = sum_s (sum_{p: slot_p -> s} g_p) f_s(x);
3. the K stored experts run from one fused tensor set (`StoredExperts`), the replacement
   operators from `SlotOperators`; slots mapped to ``drop`` contribute nothing;
4. shared experts are untouched and added as in the HF block.

The router and shared-expert modules are kept under their original attribute names, so the
block's state_dict names match the HF block's for everything but the routed experts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..models import MoELayer, route
from ..plan import LayerPlan
from .experts import StoredExperts
from .operators import SlotOperators


def aggregate_slots(stored_idx: torch.Tensor, weight: torch.Tensor, sentinel: int):
    """Sum the gate weights of positions that select the same stored expert into its first occurrence.

    stored_idx, weight [N, k] -> (stored_idx with duplicates set to `sentinel`, summed weights).
    """
    k = stored_idx.shape[1]
    eq = stored_idx[:, :, None] == stored_idx[:, None, :]  # [N, k, k]
    earlier = torch.ones(k, k, dtype=torch.bool, device=stored_idx.device).tril(-1)
    first = ~(eq & earlier).any(-1)
    summed = (eq.to(weight.dtype) * weight[:, None, :]).sum(-1)
    return torch.where(first, stored_idx, sentinel), torch.where(first, summed, torch.zeros_like(summed))


class CompressedMoEBlock(nn.Module):
    """One MoE layer of a compressed model; returns what the HF block returns."""

    def __init__(self, layer: MoELayer, lp: LayerPlan, stored: StoredExperts, ops: SlotOperators | None,
                 returns_tuple: bool = False):
        super().__init__()
        self.layer_index = layer.index
        self.spec = layer.spec
        self.semantics = lp.gate
        self.returns_tuple = returns_tuple
        self._router_name, self._shared_name, self._shared_gate_name = "router", None, None
        named = dict(layer.block.named_children())
        for name, child in named.items():
            if child is layer.router:
                self._router_name = name
            elif layer.shared is not None and child is layer.shared:
                self._shared_name = name
            elif layer.shared_gate is not None and child is layer.shared_gate:
                self._shared_gate_name = name
        setattr(self, self._router_name, layer.router)
        if layer.shared is not None:
            self._shared_name = self._shared_name or "shared_experts"
            setattr(self, self._shared_name, layer.shared)
        if layer.shared_gate is not None:
            self._shared_gate_name = self._shared_gate_name or "shared_expert_gate"
            setattr(self, self._shared_gate_name, layer.shared_gate)
        self.stored = stored
        self.ops = ops if ops is not None and ops.order else None
        w = layer.router.weight
        dev = None if w.is_meta else w.device
        k = stored.num_experts
        s2s = torch.tensor([t if isinstance(t, int) else k for t in lp.slots], dtype=torch.long, device=dev)
        self.register_buffer("slot_to_stored", s2s, persistent=False)
        routable = lp.routable()
        mask = None if all(routable) else torch.tensor(routable, dtype=torch.bool, device=dev)
        self.register_buffer("routable_mask", mask, persistent=False)

    def extra_repr(self) -> str:
        return f"layer={self.layer_index}, gate={self.semantics}, slots={self.slot_to_stored.numel()}"

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        router = getattr(self, self._router_name)
        masks = {}
        if self.routable_mask is not None:
            masks["present" if self.semantics == "renorm" else "allowed"] = self.routable_mask
        r = route(self.spec, x, router.weight, getattr(router, "bias", None),
                  getattr(router, "e_score_correction_bias", None), **masks)
        stored_idx = self.slot_to_stored[r.index]
        weight = r.weight
        if self.semantics == "aggregate" and stored_idx.shape[1] > 1:
            stored_idx, weight = aggregate_slots(stored_idx, weight, self.stored.num_experts)
        out = self.stored(x, stored_idx, weight)
        if self.ops is not None:
            extra = self.ops(x, r.index, r.weight)
            if extra is not None:
                out = out + extra
        if self._shared_name is not None:
            shared = getattr(self, self._shared_name)(x)
            if self._shared_gate_name is not None:
                shared = torch.sigmoid(getattr(self, self._shared_gate_name)(x)) * shared
            out = out + shared
        out = out.reshape(shape)
        return (out, r.weight) if self.returns_tuple else out
