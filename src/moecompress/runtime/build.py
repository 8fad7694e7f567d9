"""Building runtime modules from a plan: stored-expert weights, scopes, operators, blocks; `apply_plan`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..errors import MoECompressError
from ..models import ExpertWeights, MoEAdapter, MoELayer
from ..models.storage import FusedLayout
from ..plan import CompressionPlan, LayerPlan, Scope, StoredExpert
from .block import CompressedMoEBlock
from .decoders import get_decoder
from .experts import StoredExperts
from .operators import SlotOperators
from .packed import PackedScopeExperts, module_for
from .quantized import QuantizedStoredExperts, StoredExpertSlot, packed_shapes, slot_tensor_names

SourceFn = Callable[[int, int], ExpertWeights]  # (layer, expert) -> weights (documented orientation)


def runtime_layout(layer: MoELayer) -> FusedLayout:
    """The fused layout the runtime holds `layer`'s stored experts in (its storage's, `ExpertStorage.fused_layout`)."""
    return layer.storage.fused_layout


def _tensor_weights(tensors: Mapping[str, torch.Tensor], prefix: str) -> ExpertWeights:
    get = lambda name: tensors.get(f"{prefix}.{name}")
    return ExpertWeights(
        get("gate"), get("up"), get("down"), get("gate_bias"), get("up_bias"), get("down_bias")
    )


def stored_weights(
    plan: CompressionPlan,
    sc: Scope,
    s: StoredExpert,
    source: SourceFn,
    tensors: Mapping[str, torch.Tensor] | None,
) -> ExpertWeights:
    """The dense weights of stored expert `s` (documented orientation, float dtype of its source).

    copy: theta = theta_src; weighted_merge without tensors: theta = sum_i w_i theta_i (M-SMoE style
    parameter average); dense_group without tensors: neurons concatenated with down columns scaled
    by w_i, so f(x) = sum_i w_i f_i(x); otherwise the method's tensors (decoded if packed).
    """
    tensors = tensors or {}
    if s.quant is not None:
        return quantized_slot(plan, sc, s, tensors).weights(torch.bfloat16)
    if s.construction == "copy":
        return source(*s.sources[0])
    if s.packing is not None:
        raise MoECompressError(
            f"Stored expert {s.id} of scope '{sc.id}' is packed ({s.packing}) and holds one "
            "reconstruction per source; decode its members with "
            "moecompress.runtime.packed.packed_member_weights."
        )
    if s.tensor is not None and f"{s.tensor}.gate" in tensors:
        w = _tensor_weights(tensors, s.tensor)
    elif s.construction == "elementwise_merge":
        w = get_decoder("elementwise_merge")(tensors, s.tensor, s)
    elif s.construction == "weighted_merge":
        srcs = [source(*src) for src in s.sources]
        acc = None
        for wi, src in zip(s.weights, srcs):
            term = src.map(lambda t, wi=wi: t.float() * wi)
            acc = (
                term
                if acc is None
                else ExpertWeights(**{k: v + getattr(term, k) for k, v in acc.tensors().items()})
            )
        w = acc.map(lambda t: t.to(srcs[0].gate.dtype))
    else:  # dense_group: concatenate neurons
        srcs = [source(*src) for src in s.sources]
        ws = s.weights or [1.0] * len(srcs)
        dt = srcs[0].gate.dtype
        w = ExpertWeights(
            torch.cat([x.gate for x in srcs]),
            torch.cat([x.up for x in srcs]),
            torch.cat([(x.down.float() * wi).to(dt) for x, wi in zip(srcs, ws)], dim=1),
            None if srcs[0].gate_bias is None else torch.cat([x.gate_bias for x in srcs]),
            None if srcs[0].up_bias is None else torch.cat([x.up_bias for x in srcs]),
            None
            if srcs[0].down_bias is None
            else sum((x.down_bias.float() * wi) for x, wi in zip(srcs, ws)).to(dt),
        )
    return w


def quantized_slot(plan: CompressionPlan, sc: Scope, s: StoredExpert, tensors) -> StoredExpertSlot:
    """The runtime slot of quantized stored expert `s` from the plan tensors under its prefix."""
    names = slot_tensor_names(s.quant, plan.model.expert_bias)
    return StoredExpertSlot.from_tensors(s.quant, {n: tensors[f"{s.tensor}.{n}"] for n in names})


def empty_slot(plan: CompressionPlan, sc: Scope, s: StoredExpert, dtype) -> StoredExpertSlot:
    """A meta-device slot with the shapes and dtypes stored expert `s` is saved with (filled by a loader)."""
    shapes = plan.expert_shapes(sc, s)
    if s.quant is None:
        tensors = {p: torch.empty(shape, dtype=dtype, device="meta") for p, shape in shapes.items()}
    else:
        tensors = {
            f"{p}.{k}": torch.empty(shape_, dtype=dt, device="meta")
            for p, shape in shapes.items()
            for k, (shape_, dt) in packed_shapes(s.quant, *shape).items()
        }
    if plan.model.expert_bias:
        tensors.update({f"{p}_bias": torch.empty(shapes[p][0], dtype=dtype, device="meta") for p in shapes})
    return StoredExpertSlot.from_tensors(s.quant, tensors)


def _complete_bias(w: ExpertWeights, layout: FusedLayout) -> ExpertWeights:
    if layout != "gpt_oss" or w.gate_bias is not None and w.up_bias is not None and w.down_bias is not None:
        return w
    z = lambda n, ref: torch.zeros(n, dtype=ref.dtype, device=ref.device)
    return ExpertWeights(
        w.gate,
        w.up,
        w.down,
        w.gate_bias if w.gate_bias is not None else z(w.gate.shape[0], w.gate),
        w.up_bias if w.up_bias is not None else z(w.up.shape[0], w.up),
        w.down_bias if w.down_bias is not None else z(w.down.shape[0], w.down),
    )


def build_scope(
    plan: CompressionPlan,
    sc: Scope,
    layer: MoELayer,
    source: SourceFn,
    tensors,
    config=None,
    dtype=None,
    device=None,
) -> StoredExperts:
    """The scope's stored experts in one fused tensor set (layout and activation of `layer`'s family).

    A scope with packed (PuzzleMoE) stored experts becomes a `PackedScopeExperts`: its dense experts
    fused as usual, each packed expert kept packed (decoded on the fly in every forward). A scope with
    quantized stored experts keeps their integer codes (`QuantizedStoredExperts`).
    """
    ref = layer.storage.read(0).gate
    dtype = dtype or ref.dtype
    device = device if device is not None else ref.device
    weights = [
        None
        if s.packing is not None or s.quant is not None
        else _complete_bias(stored_weights(plan, sc, s, source, tensors), runtime_layout(layer))
        for s in sc.stored
    ]
    return scope_from_weights(plan, sc, layer, weights, tensors, dtype, device, config)


def scope_from_weights(
    plan: CompressionPlan,
    sc: Scope,
    layer: MoELayer,
    weights: list[ExpertWeights | None],
    tensors,
    dtype,
    device="cpu",
    config=None,
):
    """The runtime module of scope `sc` from its dense stored experts' weights (None for packed or quantized
    experts, which come from the plan `tensors`)."""
    layout = runtime_layout(layer)
    tensors = tensors or {}
    dense, slots, merged = [], [], {}
    for s, w in zip(sc.stored, weights):
        if s.packing is not None:
            merged[s.id] = module_for(plan, sc, s, tensors, layer.act, device=device)
        elif s.quant is not None:
            slots.append(quantized_slot(plan, sc, s, tensors).to(device))
        else:
            dense.append(w.map(lambda t: t.to(device=device, dtype=dtype)))
            slots.append(StoredExpertSlot.from_tensors(None, dense[-1].tensors()))
    if any(slot.spec is not None for slot in slots):
        fused = QuantizedStoredExperts(
            slots, plan.model.hidden_size, plan.scope_width(sc), layout, layer.act, dtype, config=config
        )
    else:
        fused = (
            StoredExperts.from_weights(
                dense, layout, layer.act, width=plan.scope_width(sc), dtype=dtype, config=config
            )
            if dense
            else None
        )
    if not merged:
        return fused
    return PackedScopeExperts(
        fused,
        merged,
        [s.id for s in sc.stored if s.packing is None],
        {s.id: [tuple(x) for x in s.sources] for s in sc.stored if s.packing is not None},
        dtype,
    )


def empty_scope(plan: CompressionPlan, sc: Scope, layer: MoELayer, dtype, config=None):
    """A meta-device shell with the scope's shapes (filled later by a loader)."""
    dense_ids = [s.id for s in sc.stored if s.packing is None]
    if any(s.quant is not None for s in sc.stored):
        slots = [empty_slot(plan, sc, s, dtype) for s in sc.stored if s.packing is None]
        dense = QuantizedStoredExperts(
            slots,
            plan.model.hidden_size,
            plan.scope_width(sc),
            runtime_layout(layer),
            layer.act,
            dtype,
            config=config,
        )
    else:
        dense = (
            StoredExperts(
                len(dense_ids),
                plan.model.hidden_size,
                plan.scope_width(sc),
                runtime_layout(layer),
                layer.act,
                dtype=dtype,
                device="meta",
                config=config,
            )
            if dense_ids
            else None
        )
    if len(dense_ids) == len(sc.stored):
        return dense
    merged = {s.id: module_for(plan, sc, s, None, layer.act) for s in sc.stored if s.packing is not None}
    return PackedScopeExperts(
        dense,
        merged,
        dense_ids,
        {s.id: [tuple(x) for x in s.sources] for s in sc.stored if s.packing is not None},
        dtype,
    )


def scope_dtype(stored) -> torch.dtype:
    """Compute dtype of a scope module (`StoredExperts` or `PackedScopeExperts`)."""
    return (
        stored.dtype
        if isinstance(stored, (PackedScopeExperts, QuantizedStoredExperts))
        else stored.gate_up_proj.dtype
    )


def build_ops(
    plan: CompressionPlan, lp: LayerPlan, layer: MoELayer, tensors, dtype, device, fill: bool = True
) -> SlotOperators | None:
    if not lp.operators():
        return None
    ops = SlotOperators(
        lp, plan.model.hidden_size, layer.act, plan.model.expert_bias, dtype=dtype, device=device
    )
    return ops.fill(tensors) if fill else ops


def apply_plan(model, plan: CompressionPlan, tensors: Mapping[str, torch.Tensor] | None = None):
    """Install a `CompressedMoEBlock` for every MoE layer of `model` (in place) and return the model.

    The result is an ordinary PreTrainedModel: `generate`, lm-eval's HFLM and the exporters accept it.
    Original experts are released scope by scope, so peak memory is the model plus one scope.
    """
    if any(isinstance(m, CompressedMoEBlock) for m in model.modules()):
        raise MoECompressError(
            "This model already runs a compression plan; apply plans to the original model "
            "(reload it) instead of stacking them."
        )
    adapter = MoEAdapter(model)
    plan.check_model(adapter)
    plan.check_tensors(tensors)
    source = lambda l, e: adapter.layer(l).storage.read(e)
    with torch.no_grad():
        for sc in sorted(plan.scopes, key=lambda s: max(s.layers)):
            first = adapter.layer(sc.layers[0])
            stored = build_scope(plan, sc, first, source, tensors, config=model.config)
            for i in sc.layers:
                layer = adapter.layer(i)
                lp = plan.layer(i)
                dev = layer.router.weight.device
                ops = build_ops(plan, lp, layer, tensors, scope_dtype(stored), dev)
                adapter.set_block(i, CompressedMoEBlock(layer, lp, stored, ops, adapter.returns_tuple))
            for i in sc.layers:  # drop our last references to the original experts
                adapter.layers.pop(i)
    if plan.tensor_quant:
        from .tensor_quant import apply_tensor_quant

        apply_tensor_quant(model, plan, tensors)
    model._moecompress_plan = plan
    return model
