"""Packed PuzzleMoE stored experts in the runtime: they stay packed in memory and decode per forward.

A plan's stored expert with ``construction: elementwise_merge`` and a ``packing`` code holds ONE
set of packed tensors for several original experts (its ``sources``, in member order). A slot that
maps to it computes its own member's reconstruction Ŵ_m = (−1)^{S_m} ⊙ M_m ⊙ W_merged times its gate
(the original router is unchanged), so the runtime gives every (stored expert, member) its own
*target* id:

    targets 0..D-1         the scope's dense stored experts (copies, dense merges), in stored-id order,
                           run from one fused `StoredExperts` exactly as in any other plan;
    targets D.. (per merge) one per member of each packed stored expert, in stored-id order.

`PackedScopeExperts.forward(x, index, weight)` takes target ids (``num_experts`` = sentinel, as for
`StoredExperts`), runs the dense part fused and every packed merge through `PackedPairExperts`
(`packed_pair_linear`: torch decode + matmul on CPU, the Triton decode-GEMM on CUDA) or
`GroupMergedExperts`, then adds the gate-weighted outputs: y = sum_{selected slots s} g_s f̂_s(x).

Packing codes and the tensors under a stored expert's prefix ``p`` (documented in docs/puzzlemoe.md):

    pair-bf16       p.gate_up.packed int16 [2I, H], p.down.packed int16 [H, I]
    pair-q{b}-g{S}  p.gate_up.codes uint8 [ceil(2IH/8)·(b+4)], p.gate_up.scales bf16 [2I, ceil(H/S)],
                    p.down.codes uint8 [ceil(HI/8)·(b+4)], p.down.scales bf16 [H, ceil(I/S)]
    group{G}-bf16   p.{gate_up,down}.w_merged bf16, p.{gate_up,down}.{masks,signs} uint8 [ceil(G·n/8)]
    (+ biases, when the family has them: pair p.gate_up_bias_{i,j} [2I], p.down_bias_{i,j} [H];
     group p.gate_up_bias_{m}, p.down_bias_{m} for m = 0..G-1; in the model's dtype)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..models import ExpertActivation, ExpertWeights
from ..puzzle import (
    GroupLinear,
    GroupMergedExperts,
    PackedPairExperts,
    PackedPairLinear,
    Packing,
    QuantPairLinear,
    expected_for,
)
from .experts import StoredExperts


def merged_module(
    spec: Packing, rel: Mapping[str, torch.Tensor], act: ExpertActivation, width: int, hidden: int
) -> nn.Module:
    """`PackedPairExperts` / `GroupMergedExperts` from its relative tensors (real or meta)."""

    def biases(tag: str, width: int) -> ExpertWeights | None:
        gub, db = rel.get(f"gate_up_bias_{tag}"), rel.get(f"down_bias_{tag}")
        if gub is None and db is None:
            return None
        return ExpertWeights(
            gate=None if gub is None else gub[:width], up=None if gub is None else gub[width:], down=db
        )

    if spec.kind == "pair":
        if spec.bits is None:
            gu, dn = PackedPairLinear(rel["gate_up.packed"]), PackedPairLinear(rel["down.packed"])
        else:
            gu = QuantPairLinear(
                rel["gate_up.codes"], rel["gate_up.scales"], (2 * width, hidden), spec.bits, spec.group_size
            )
            dn = QuantPairLinear(
                rel["down.codes"], rel["down.scales"], (hidden, width), spec.bits, spec.group_size
            )
        return PackedPairExperts(gu, dn, act, biases("i", width), biases("j", width))
    gu = GroupLinear(rel["gate_up.w_merged"], rel["gate_up.masks"], rel["gate_up.signs"], spec.members)
    dn = GroupLinear(rel["down.w_merged"], rel["down.masks"], rel["down.signs"], spec.members)
    return GroupMergedExperts(gu, dn, act, [biases(str(m), width) for m in range(spec.members)])


def module_for(
    plan, sc, s, tensors: Mapping[str, torch.Tensor] | None, act: ExpertActivation, device=None
) -> nn.Module:
    """The runtime module of packed stored expert `s`: from the plan tensors, or a meta shell (tensors None)."""
    spec, expected = expected_for(plan, sc, s)
    if tensors is None:
        rel = {k: torch.empty(shape, dtype=dt, device="meta") for k, (shape, dt) in expected.items()}
    else:
        rel = {k: tensors[f"{s.tensor}.{k}"] for k in expected}
        if device is not None:
            rel = {k: v.to(device) for k, v in rel.items()}
    return merged_module(spec, rel, act, plan.stored_width(sc, s), plan.model.hidden_size)


def run_members(module: nn.Module, xs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """[f̂_m(x_m)] for every member of a packed merge (x_m None: that member gets no tokens)."""
    if isinstance(module, PackedPairExperts):
        return list(module(xs[0], xs[1]))
    return module(xs)


def decode_members(module: nn.Module, dtype: torch.dtype) -> list[ExpertWeights]:
    """Dense Ŵ of every member (documented orientation) — for materializing and tests only."""
    out = module.decode(dtype)
    return list(out)


def packed_member_weights(
    plan, sc, s, tensors, act: ExpertActivation, dtype: torch.dtype
) -> list[ExpertWeights]:
    """Dense reconstructions of every member of packed stored expert `s`, in source order."""
    return decode_members(module_for(plan, sc, s, tensors, act), dtype)


class PackedScopeExperts(nn.Module):
    """A scope's stored experts when some are packed: dense ones fused, packed ones one module each.

    ``num_experts`` is the number of *targets* (see the module doc) and doubles as the skip sentinel.
    """

    def __init__(
        self,
        dense: StoredExperts | None,
        merged: dict[int, nn.Module],
        dense_ids: list[int],
        members: dict[int, list[tuple[int, int]]],
        dtype: torch.dtype,
    ):
        super().__init__()
        self.dense = dense
        self.merged = nn.ModuleDict({f"s{k}": m for k, m in merged.items()})
        self.dtype = dtype
        self._target: dict[tuple[int, tuple[int, int] | None], int] = {}
        for t, k in enumerate(dense_ids):
            self._target[(k, None)] = t
        base = len(dense_ids)
        self._ranges: list[tuple[str, int, int]] = []  # (module key, first target, members)
        for k in sorted(merged):
            srcs = members[k]
            for m, src in enumerate(srcs):
                self._target[(k, tuple(src))] = base + m
            self._ranges.append((f"s{k}", base, len(srcs)))
            base += len(srcs)
        self.num_experts = base
        self.num_dense = len(dense_ids)

    def extra_repr(self) -> str:
        return f"dense={self.num_dense}, packed={len(self.merged)}, targets={self.num_experts}"

    def slot_targets(self, lp) -> list[int]:
        """Target id of each slot of layer plan `lp` (``num_experts`` for operators / drops)."""
        out = []
        for e, t in enumerate(lp.slots):
            if not isinstance(t, int):
                out.append(self.num_experts)
            elif (t, None) in self._target:
                out.append(self._target[(t, None)])
            else:
                out.append(self._target[(t, (lp.layer, e))])
        return out

    def forward(
        self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, may_skip: bool = True
    ) -> torch.Tensor:
        """x [N, H]; index [N, k] target ids (num_experts = skip); weight [N, k] gate weights -> [N, H]."""
        d = self.num_dense
        if self.dense is not None:
            out = self.dense(x, torch.where(index < d, index, d), weight, True)
        else:
            out = torch.zeros_like(x)
        if not self._ranges:
            return out
        # one host sync for all packed merges: which (token, position) pairs hit which target
        flat = index.reshape(-1)
        hit = (flat >= d) & (flat < self.num_experts)
        if not bool(hit.any()):
            return out
        pos = hit.nonzero().squeeze(1)
        tgt = flat[pos]
        order = torch.argsort(tgt, stable=True)
        pos, tgt = pos[order], tgt[order]
        counts = torch.bincount(tgt - d, minlength=self.num_experts - d).tolist()
        k = index.shape[1]
        w_flat = weight.reshape(-1)
        start = 0
        starts = []
        for c in counts:
            starts.append(start)
            start += c
        for key, base, n in self._ranges:
            cs = counts[base - d : base - d + n]
            if not any(cs):
                continue
            sel = [
                pos[starts[base - d + m] : starts[base - d + m] + cs[m]] if cs[m] else None for m in range(n)
            ]
            xs = [None if p is None else x[p // k] for p in sel]
            ys = run_members(self.merged[key], xs)
            for p, y in zip(sel, ys):
                if p is not None:
                    out.index_add_(0, p // k, (y * w_flat[p].unsqueeze(-1).to(y.dtype)).to(out.dtype))
        return out
