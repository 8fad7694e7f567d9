"""Byte accounting: the one byte count of a plan (`CompressionPlan.logical_bytes`), at the checkpoint's
on-disk dtypes, logical (as the plan says) or stored (as the compact/packed checkpoint writes it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from .schema import ByteReport, ConstantOp, LayerPlan, Scope, StoredExpert, TiltOp, fail


def logical_bytes(
    plan,
    tensors: Mapping[str, torch.Tensor] | None = None,
    accounting: Literal["logical", "stored"] = "logical",
) -> ByteReport:
    """Bytes the compressed model needs: stored experts + operator parameters + everything else
    (`CompressionPlan.logical_bytes` documents the rules)."""
    padded = accounting == "stored"
    el = plan.model.element_size  # computed once: it builds a tensor
    stored = sum(_scope_bytes(plan, sc, tensors, padded, el) for sc in plan.scopes)
    ops = sum(_operator_bytes(plan, lp, padded, el) for lp in plan.layers)
    other = plan.model.other_bytes + sum(
        tq.stored_bytes() - tq.original_bytes() for tq in plan.tensor_quant.values()
    )
    return ByteReport(
        stored_experts=stored,
        operators=ops,
        other=other,
        total=stored + ops + other,
        original=plan.model.expert_bytes + plan.model.other_bytes,
        original_routed=plan.model.expert_bytes,
    )


def _scope_bytes(plan, sc: Scope, tensors: Mapping[str, torch.Tensor] | None, padded: bool, el: int) -> int:
    """The stored experts of one scope; padded, dense experts are held at the scope's widest width."""
    # a scope holding quantized experts stores every expert at its own width (QuantizedStoredExperts)
    pad = padded and all(s.quant is None for s in sc.stored)
    width = plan.scope_width(sc) if pad else None
    return sum(_stored_expert_bytes(plan, sc, s, tensors, pad, width, el) for s in sc.stored)


def _stored_expert_bytes(
    plan,
    sc: Scope,
    s: StoredExpert,
    tensors: Mapping[str, torch.Tensor] | None,
    pad: bool,
    width: int | None,
    el: int,
) -> int:
    """One stored expert, `el` bytes per element of the experts' dtype."""
    h = plan.model.hidden_size
    bias = plan.model.expert_bias
    if s.quant is not None:
        shapes = plan.expert_shapes(sc, s)
        nbytes = sum(s.quant.tensor_bytes(*shape) for shape in shapes.values())
        return nbytes + ((2 * shapes["gate"][0] + h) * el if bias else 0)
    if (
        pad
        and s.packing is None
        and not (
            s.construction == "elementwise_merge" and (tensors is None or f"{s.tensor}.gate" not in tensors)
        )
    ):
        return (3 * width * h + (2 * width + h if bias else 0)) * el
    if s.construction == "copy":
        return plan.model.layer(s.sources[0][0]).bytes_per_expert
    if s.construction == "elementwise_merge" and (
        s.packing is not None or tensors is None or f"{s.tensor}.gate" not in tensors
    ):
        return _packed_bytes(sc, s, tensors)
    w = plan.stored_width(sc, s)
    return (3 * w * h + (2 * w + h if bias else 0)) * el


def _packed_bytes(sc: Scope, s: StoredExpert, tensors: Mapping[str, torch.Tensor] | None) -> int:
    """A packed element-wise merge: its tensors' bytes when at hand, else its declared ``nbytes``."""
    if tensors is not None and any(k.startswith(f"{s.tensor}.") for k in tensors):
        mine = (tensors[k] for k in tensors if k.startswith(f"{s.tensor}."))  # keys first: a
        return sum(t.numel() * t.element_size() for t in mine)  # lazy mapping reads only these
    if s.nbytes is not None:
        return s.nbytes
    fail(
        f"Stored expert {s.id} of scope '{sc.id}' is packed; pass its tensors or set nbytes "
        "to count its bytes."
    )


def _operator_bytes(plan, lp: LayerPlan, padded: bool, el: int) -> int:
    """One layer's replacement operators; padded, tilts at the layer's largest rank and partial copies at
    their largest width."""
    h = plan.model.hidden_size
    bias = plan.model.expert_bias
    found = [op for _, op in lp.operators()]
    rank = max((op.rank for op in found if isinstance(op, TiltOp)), default=0)
    pwidth = max((op.width for op in found if not isinstance(op, (ConstantOp, TiltOp))), default=0)
    ops = 0
    for op in found:
        if isinstance(op, ConstantOp):
            ops += h * el
        elif isinstance(op, TiltOp):
            ops += (2 * h * (rank if padded else op.rank) + h) * el
        else:
            w = pwidth if padded else op.width
            ops += (3 * w * h + h + (2 * w if bias else 0)) * el
    return ops
