"""`CompressedMoEBlock`: executes one layer of any `CompressionPlan` in place of the HF MoE block.

For hidden states h (tokens x):

1. route with the ORIGINAL router (weights, bias, score-correction bias) through
   `moecompress.models.route`, with the plan's gate semantics as masks: ``renorm`` -> dropped
   slots absent (deleted before normalisation); ``keep`` -> dropped slots not allowed (kept in
   the normalisation, never selected); ``aggregate`` / ``replace`` -> the original top-k;
2. map each selected slot to its stored expert (``slot_to_stored``; K = not a stored expert; a packed
   PuzzleMoE merge gives each of its members its own id, see runtime/packed.py);
   under ``aggregate`` the weights of selected slots sharing a stored expert are summed and the
   expert runs once per token (ConMoE): y = sum_s (sum_{p: slot_p -> s} g_p) f_s(x);
3. the K stored experts run from one fused tensor set (`StoredExperts`), the replacement
   operators from `SlotOperators`; slots mapped to ``drop`` contribute nothing;
4. shared experts are untouched and added as in the HF block.

The router and shared-expert modules are kept under their original attribute names, so the
block's state_dict names match the HF block's for everything but the routed experts.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

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

    def __init__(
        self,
        layer: MoELayer,
        lp: LayerPlan,
        stored: StoredExperts,
        ops: SlotOperators | None,
        returns_tuple: bool = False,
    ):
        super().__init__()
        self.layer_index = layer.index
        self.spec = layer.spec
        self.semantics = lp.gate
        self.returns_tuple = returns_tuple
        self._adopt_children(layer)
        self.stored = stored
        self.ops = ops if ops is not None and ops.order else None
        w = layer.router.weight
        dev = None if w.is_meta else w.device
        k = stored.num_experts
        # packed (PuzzleMoE) scopes give each (stored expert, member) its own target id
        targets = (
            stored.slot_targets(lp)
            if hasattr(stored, "slot_targets")
            else [t if isinstance(t, int) else k for t in lp.slots]
        )
        s2s = torch.tensor(targets, dtype=torch.long, device=dev)
        self.register_buffer("slot_to_stored", s2s, persistent=False)
        routable = lp.routable()
        mask = None if all(routable) else torch.tensor(routable, dtype=torch.bool, device=dev)
        self.register_buffer("routable_mask", mask, persistent=False)
        # renorm = the dropped rows deleted from the router: route over the kept rows only (cheaper than
        # masking, and literally what a physically pruned router computes) whenever the kept slots still
        # form equal router groups; otherwise route() applies the `present` mask
        present = self._kept_routing(lp, routable, mask, targets, dev)
        self.register_buffer("kept_slots", present, persistent=False)
        self._kept_cache: tuple = (
            None,
            None,
        )  # (key, sliced router tensors), refreshed when the router changes
        # can a selected slot land on no stored expert (operator, drop, or an aggregated duplicate)?
        self._may_skip = lp.gate == "aggregate" or any(
            ok and not isinstance(t, int) for ok, t in zip(routable, lp.slots)
        )

    def _adopt_children(self, layer: MoELayer) -> None:
        """Keep the router and shared-expert modules of `layer`'s HF block under their original attribute names
        (so the state_dict names match the HF block's), defaults where the block does not hold them."""
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

    def _kept_routing(self, lp: LayerPlan, routable: list, mask, targets: list, dev):
        """The kept slots to route over directly (renorm whose kept slots still form equal router groups), or
        None; sets ``_direct`` (and ``_kept_spec`` when kept slots are returned)."""
        present, self._direct = None, False
        if mask is not None and lp.gate == "renorm":
            kept = [e for e, ok in enumerate(routable) if ok]
            g = self.spec.n_group
            size = self.spec.num_experts // g
            counts = {sum(1 for e in kept if e // size == j) for j in range(g)}
            if len(counts) == 1 and (self.spec.group_score != "top2_sum" or g == 1 or counts != {1}):
                present = torch.tensor(kept, dtype=torch.long, device=dev)
                self._kept_spec = replace(self.spec, num_experts=len(kept))
                # pure pruning (kept slot j -> stored j): the small router's indices ARE the stored ids
                self._direct = [targets[e] for e in kept] == list(range(len(kept)))
        return present

    def shared_module(self) -> nn.Module | None:
        """The shared experts (added to every token's output), or None."""
        return getattr(self, self._shared_name) if self._shared_name is not None else None

    def extra_repr(self) -> str:
        return f"layer={self.layer_index}, gate={self.semantics}, slots={self.slot_to_stored.numel()}"

    def _kept_router(self, *tensors):
        """The kept rows of (weight, bias, correction bias), sliced once per router version/device."""
        key = tuple(None if t is None else (t.data_ptr(), t._version, t.dtype) for t in tensors)
        if self._kept_cache[0] != key or torch.is_grad_enabled():
            sliced = tuple(None if t is None else t.index_select(0, self.kept_slots) for t in tensors)
            if torch.is_grad_enabled():  # training the router: keep the graph, no cache
                return sliced
            self._kept_cache = (key, sliced)
        return self._kept_cache[1]

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        router = getattr(self, self._router_name)
        bias, corr = getattr(router, "bias", None), getattr(router, "e_score_correction_bias", None)
        if self.kept_slots is not None:
            kept = self.kept_slots
            r = route(self._kept_spec, x, *self._kept_router(router.weight, bias, corr))
            index = kept[r.index]
        else:
            masks = {}
            if self.routable_mask is not None:
                masks["present" if self.semantics == "renorm" else "allowed"] = self.routable_mask
            r = route(self.spec, x, router.weight, bias, corr, **masks)
            index = r.index
        stored_idx = r.index if self.kept_slots is not None and self._direct else self.slot_to_stored[index]
        weight = r.weight
        if self.semantics == "aggregate" and stored_idx.shape[1] > 1:
            stored_idx, weight = aggregate_slots(stored_idx, weight, self.stored.num_experts)
        out = self.stored(x, stored_idx, weight, self._may_skip)
        if self.ops is not None:
            extra = self.ops(x, index, r.weight)
            if extra is not None:
                out = out + extra
        if self._shared_name is not None:
            shared = self.shared_module()(x)
            if self._shared_gate_name is not None:
                shared = torch.sigmoid(getattr(self, self._shared_gate_name)(x)) * shared
            out = out + shared
        out = out.reshape(shape)
        return (out, r.weight) if self.returns_tuple else out
