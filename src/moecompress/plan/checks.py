"""Validation of a `CompressionPlan`: its own consistency and feasibility (`check`, run by the pydantic
validator), that it fits a model (`check_model`) and that its tensors are all there (`check_tensors`).
Every refusal is one sentence (`MoECompressError`). Functions take the plan as their first argument."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..quant.spec import QuantSpec
from .model_info import MoELayerInfo
from .schema import (
    SCHEMA_VERSION,
    ConstantOp,
    LayerPlan,
    PartialOp,
    Scope,
    StoredExpert,
    TiltOp,
    fail,
    quant_tensor_prefix,
)


# ----------------------------------------------------------------------------- consistency (check)
def check(plan) -> None:
    """Raise MoECompressError (one sentence) if the plan is inconsistent or infeasible."""
    if plan.schema_version != SCHEMA_VERSION:
        fail(
            f"Plan schema version {plan.schema_version} is not supported (this moecompress reads version "
            f"{SCHEMA_VERSION}); regenerate the plan with this version."
        )
    info = {x.layer: x for x in plan.model.layers}
    _check_layer_entries(plan, info)
    scopes = _check_scopes(plan, info)
    owner = _scope_owners(plan)
    used: dict[str, set[int]] = {sc.id: set() for sc in plan.scopes}
    for lp in sorted(plan.layers, key=lambda x: x.layer):
        _check_layer(plan, lp, info, scopes, owner, used)
    for sc in plan.scopes:
        unused = sorted(set(range(len(sc.stored))) - used[sc.id])
        if unused:
            fail(
                f"Stored expert {unused[0]} of scope '{sc.id}' is never used by any slot; remove it "
                "(it would only cost bytes)."
            )
    _check_tensor_quant(plan)


def _check_layer_entries(plan, info: dict[int, MoELayerInfo]) -> None:
    """Exactly one entry per MoE layer of the model."""
    seen = [lp.layer for lp in plan.layers]
    if len(set(seen)) != len(seen):
        dup = sorted({x for x in seen if seen.count(x) > 1})
        fail(f"The plan lists MoE layer {dup[0]} twice; give each layer exactly one entry.")
    if set(seen) != set(info):
        missing, extra = sorted(set(info) - set(seen)), sorted(set(seen) - set(info))
        if extra:
            fail(
                f"The plan has an entry for layer {extra[0]}, which is not a MoE layer of the model "
                f"(MoE layers: {sorted(info)}); remove it."
            )
        fail(
            f"The plan has no entry for MoE layer {missing[0]}; every MoE layer needs one "
            "(use the identity mapping for layers left untouched)."
        )


def _check_scopes(plan, info: dict[int, MoELayerInfo]) -> dict[str, Scope]:
    """Unique scope ids, each covering layers and holding stored experts 0..K-1; returns id -> scope."""
    scopes = {}
    for sc in plan.scopes:
        if sc.id in scopes:
            fail(f"Scope id '{sc.id}' is used twice; scope ids must be unique.")
        scopes[sc.id] = sc
        if not sc.layers:
            fail(f"Scope '{sc.id}' covers no layers; list the layers that use it.")
        if [s.id for s in sc.stored] != list(range(len(sc.stored))):
            fail(f"Stored experts of scope '{sc.id}' must have ids 0..{len(sc.stored) - 1} in order.")
        for s in sc.stored:
            check_stored(sc, s, info)
    return scopes


def _scope_owners(plan) -> dict[int, str]:
    """layer -> the one scope that lists it."""
    owner: dict[int, str] = {}
    for sc in plan.scopes:
        for i in sc.layers:
            if i in owner:
                fail(
                    f"Layer {i} belongs to scopes '{owner[i]}' and '{sc.id}'; a layer uses exactly one scope."
                )
            owner[i] = sc.id
    return owner


def _check_layer(
    plan,
    lp: LayerPlan,
    info: dict[int, MoELayerInfo],
    scopes: dict[str, Scope],
    owner: dict[int, str],
    used: dict[str, set[int]],
) -> None:
    """One layer's entry: its scope, one target per original slot, operators and routing; marks `used`."""
    li = info[lp.layer]
    if lp.scope not in scopes:
        fail(f"Layer {lp.layer} refers to scope '{lp.scope}', which the plan does not define.")
    if owner.get(lp.layer) != lp.scope:
        fail(
            f"Layer {lp.layer} uses scope '{lp.scope}' but that scope does not list layer {lp.layer}; "
            "add the layer to the scope's layers."
        )
    if len(lp.slots) != li.num_experts:
        fail(
            f"Layer {lp.layer} maps {len(lp.slots)} slots but the model has {li.num_experts} experts there; "
            'map every original slot (to a stored id, an operator or "drop").'
        )
    for e, target in enumerate(lp.slots):
        if isinstance(target, bool):
            fail(f'Slot {e} of layer {lp.layer} is a boolean; use a stored id, an operator or "drop".')
        if isinstance(target, int):
            _check_slot_target(lp, e, target, scopes[lp.scope])
            used[lp.scope].add(target)
        elif not isinstance(target, str):
            check_operator(plan.model.hidden_size, lp.layer, e, target, info)
    check_routing(lp, li)


def _check_slot_target(lp: LayerPlan, e: int, target: int, sc: Scope) -> None:
    """Slot `e` maps to a stored expert of its scope (its own member, when that expert is packed)."""
    k_stored = len(sc.stored)
    if not 0 <= target < k_stored:
        fail(
            f"Slot {e} of layer {lp.layer} maps to stored expert {target}, but scope "
            f"'{lp.scope}' stores only ids 0..{k_stored - 1}."
        )
    packed = sc.stored[target]
    if packed.packing is not None and (lp.layer, e) not in [tuple(x) for x in packed.sources]:
        fail(
            f"Slot {e} of layer {lp.layer} maps to the packed stored expert {target} of scope "
            f"'{lp.scope}', which holds only its sources {[tuple(x) for x in packed.sources]}; "
            "a slot can only compute its own member of a packed merge."
        )


def _check_tensor_quant(plan) -> None:
    """Non-expert precisions name '.weight' tensors and no more bytes than the model holds."""
    for name, _tq in plan.tensor_quant.items():
        if not name.endswith(".weight"):
            fail(
                f"The plan quantizes '{name}', which is not a '.weight' tensor; only 2-D weights of "
                "linear layers and embeddings take an integer precision."
            )
    if sum(tq.original_bytes() for tq in plan.tensor_quant.values()) > plan.model.other_bytes:
        fail("The plan quantizes more non-expert bytes than the model holds; it was made for another model.")


def check_stored(sc: Scope, s: StoredExpert, info: dict[int, MoELayerInfo]) -> None:
    """One stored expert: its sources exist in its scope's layers, and its construction is complete."""
    where = f"stored expert {s.id} of scope '{sc.id}'"
    if not s.sources:
        fail(f"The {where} has no sources; list the (layer, expert) pairs it was built from.")
    for layer, e in s.sources:
        if layer not in info or not 0 <= e < info[layer].num_experts:
            fail(f"The {where} names source ({layer}, {e}), which is not an expert of the model.")
        if layer not in sc.layers:
            fail(
                f"The {where} takes expert {e} of layer {layer}, outside the scope's layers {sc.layers}; "
                "add that layer to the scope."
            )
    _check_construction(where, s)
    if s.quant is not None:
        if s.packing is not None:
            fail(
                f"The {where} is packed as '{s.packing}', which carries its own precision; drop its 'quant'."
            )
        if s.tensor is None:
            fail(f"The {where} is quantized, so its integer tensors must be supplied (set 'tensor').")
    if s.packing is not None:
        _check_packing(where, s)


def _check_construction(where: str, s: StoredExpert) -> None:
    if s.construction == "copy":
        if len(s.sources) != 1 or s.weights is not None:
            fail(f"The {where} is a copy, so it needs exactly one source and no weights.")
    elif s.construction in ("weighted_merge", "dense_group"):
        # with supplied tensors the weights are provenance only (e.g. one per group of sources)
        if s.tensor is None and s.weights is not None and len(s.weights) != len(s.sources):
            fail(
                f"The {where} has {len(s.weights)} weights for {len(s.sources)} sources; give one per source."
            )
        if s.construction == "weighted_merge" and s.weights is None and s.tensor is None:
            fail(f"The {where} is a weighted merge without weights or tensors; give merge weights.")
    elif s.tensor is None:
        fail(f"The {where} is an element-wise merge, so the method must supply its tensors (set 'tensor').")


def _check_packing(where: str, s: StoredExpert) -> None:
    if s.construction != "elementwise_merge":
        fail(
            f"The {where} declares packing '{s.packing}' but is a {s.construction}; only element-wise "
            "merges are packed."
        )
    from ..puzzle.codes import parse_packing

    spec = parse_packing(s.packing)
    if len(s.sources) != spec.members or len(set(s.sources)) != spec.members:
        fail(
            f"The {where} is packed as '{s.packing}' ({spec.members} members) but lists "
            f"{len(s.sources)} sources; give one distinct source per member."
        )


def check_operator(h: int, layer: int, e: int, op, info: dict[int, MoELayerInfo]) -> None:
    """A replacement operator of slot `e` fits the model (hidden size `h`)."""
    if isinstance(op, TiltOp) and not 1 <= op.rank <= h:
        fail(f"The tilt operator of slot {e} in layer {layer} has rank {op.rank}; use 1..{h}.")
    if isinstance(op, PartialOp):
        sl, se = op.source
        if sl not in info or not 0 <= se < info[sl].num_experts:
            fail(
                f"The partial copy of slot {e} in layer {layer} names source ({sl}, {se}), "
                "which is not an expert of the model."
            )
        if not 1 <= op.width <= info[sl].intermediate_size:
            fail(
                f"The partial copy of slot {e} in layer {layer} keeps {op.width} neurons; "
                f"use 1..{info[sl].intermediate_size}."
            )


def check_routing(lp: LayerPlan, li: MoELayerInfo) -> None:
    """The router can still select top-k experts (within its groups, for group-limited routing)."""
    routable = lp.routable()
    n = sum(routable)
    if n < li.top_k:
        fail(
            f"Layer {lp.layer} leaves {n} routable experts but the router selects top-{li.top_k}; "
            f"keep at least {li.top_k} slots or use gate 'replace'."
        )
    if li.n_group > 1 and lp.gate in ("renorm", "keep"):
        size = li.num_experts // li.n_group
        counts = sorted(sum(routable[g * size : (g + 1) * size]) for g in range(li.n_group))
        # a group with no routable expert scores -inf and is never chosen while enough live groups remain,
        # so the worst case is the topk_group live groups holding the fewest experts
        live = [c for c in counts if c >= (2 if li.group_score == "top2_sum" else 1)]
        worst = sum(live[: li.topk_group])
        if worst < li.top_k:
            fail(
                f"Layer {lp.layer} makes group-limited routing infeasible: the {li.topk_group} router groups "
                f"with fewest experts left hold {worst} < top-{li.top_k}; keep more experts in the groups "
                f"of {size}."
            )
        if li.group_score == "top2_sum" and 1 in counts:
            fail(
                f"Layer {lp.layer} leaves a group with a single expert, but this router scores groups by the "
                "sum of their top two experts; keep zero or at least two experts in every group."
            )


# ----------------------------------------------------------------------------- the model (check_model)
def check_model(plan, adapter) -> None:
    """Refuse a plan made for a different model (one sentence)."""
    m = plan.model
    if adapter.model_type != m.model_type or adapter.moe_layers != [x.layer for x in m.layers]:
        fail(
            f"This plan was made for a {m.model_type} model with MoE layers {[x.layer for x in m.layers]}, "
            f"but the model is {adapter.model_type} with MoE layers {adapter.moe_layers}; use a plan made "
            "for this model."
        )
    for x in m.layers:
        if (
            adapter.num_experts(x.layer) != x.num_experts
            or adapter.intermediate_size(x.layer) != x.intermediate_size
        ):
            fail(
                f"Layer {x.layer} of the model has {adapter.num_experts(x.layer)} experts of width "
                f"{adapter.intermediate_size(x.layer)}, the plan expects {x.num_experts} of width "
                f"{x.intermediate_size}; use a plan made for this model."
            )
    if plan.tensor_quant:
        from ..models.tensor_classes import tensor_classes, tensor_shapes

        classes, shapes = tensor_classes(adapter), tensor_shapes(adapter)
        for name, tq in plan.tensor_quant.items():
            if classes.get(name) != tq.kind or shapes.get(name) != tuple(tq.shape):
                found = (
                    f"a {classes[name]} tensor of shape {shapes[name]}"
                    if name in classes
                    else "not a tensor of it"
                )
                fail(
                    f"The plan quantizes '{name}' as a {tq.kind} weight of shape {tuple(tq.shape)}, but in "
                    f"the model it is {found}; use a plan made for this model."
                )


# ----------------------------------------------------------------------------- tensors (check_tensors)
def check_tensors(plan, tensors: Mapping[str, torch.Tensor] | None) -> None:
    """Every tensor the plan references is present with the right shape (one sentence if not)."""
    tensors = tensors or {}
    h = plan.model.hidden_size
    for sc in plan.scopes:
        for s in sc.stored:
            if s.tensor is not None:
                _check_stored_tensors(plan, sc, s, tensors)
    for name, tq in plan.tensor_quant.items():
        prefix, _, part = quant_tensor_prefix(name).rpartition(".")
        need_quant(tensors, prefix, tq.quant, {part: tuple(tq.shape)}, what=f"quantized {tq.kind} weight")
    for lp in plan.layers:
        for _e, op in lp.operators():
            if isinstance(op, ConstantOp):
                need(tensors, op.tensor, {"value": (h,)})
            elif isinstance(op, TiltOp):
                need(tensors, op.tensor, {"U": (h, op.rank), "V": (h, op.rank), "bias": (h,)})
            else:
                need(
                    tensors,
                    op.tensor,
                    {"gate": (op.width, h), "up": (op.width, h), "down": (h, op.width), "bias": (h,)},
                )


def _check_stored_tensors(plan, sc: Scope, s: StoredExpert, tensors: Mapping[str, torch.Tensor]) -> None:
    """The tensors of one stored expert that supplies them (`s.tensor` is set)."""
    if s.quant is not None:
        need_quant(tensors, s.tensor, s.quant, plan.expert_shapes(sc, s))
        return
    if s.packing is not None:
        from ..puzzle.codes import check_packed_tensors

        check_packed_tensors(plan, sc, s, tensors)
        return
    if s.construction == "elementwise_merge" and f"{s.tensor}.gate" not in tensors:
        from ..decoders import has_decoder

        if not any(k.startswith(s.tensor + ".") for k in tensors):
            fail(
                f"The plan tensors lack '{s.tensor}.*' for stored expert {s.id} of scope '{sc.id}'; "
                "pass the tensors the method produced (plan_tensors.safetensors)."
            )
        if not has_decoder(s.construction):
            fail(
                f"Stored expert {s.id} of scope '{sc.id}' is packed but no decoder is registered "
                "for element-wise merges; import the PuzzleMoE method module first."
            )
        return
    need(tensors, s.tensor, plan.expert_shapes(sc, s))


def need(tensors, prefix: str, shapes: dict[str, tuple]) -> None:
    """``prefix.part`` is present with shape ``shapes[part]`` for every part."""
    for part, shape in shapes.items():
        key = f"{prefix}.{part}"
        if key not in tensors:
            fail(
                f"The plan tensors lack '{key}'; pass the tensors the method produced "
                "(plan_tensors.safetensors beside plan.json)."
            )
        if tuple(tensors[key].shape) != shape:
            fail(
                f"Plan tensor '{key}' has shape {tuple(tensors[key].shape)}, expected {shape}; "
                "the tensors do not belong to this plan."
            )


def need_quant(
    tensors, prefix: str, spec: QuantSpec, shapes: dict[str, tuple], what: str = "stored expert"
) -> None:
    """The pack-quantized tensors of every part are present, of the right shape and well formed."""
    for part, shape in shapes.items():
        key = f"{prefix}.{part}" if prefix else part
        for suffix in ("weight_packed", "weight_scale", "weight_shape") + (
            () if spec.symmetric else ("weight_zero_point",)
        ):
            if f"{key}.{suffix}" not in tensors:
                fail(
                    f"The plan tensors lack '{key}.{suffix}' of a {spec.name()} {what}; pass the "
                    "tensors the quantization produced (plan_tensors.safetensors beside plan.json)."
                )
        if tuple(int(x) for x in tensors[f"{key}.weight_shape"].reshape(-1).tolist()) != shape:
            fail(
                f"Plan tensor '{key}' is quantized with shape {tuple(tensors[f'{key}.weight_shape'].tolist())}, "
                f"expected {shape}; the tensors do not belong to this plan."
            )
        from ..quant.tensor import check_packed

        check_packed(
            {s: tensors[f"{key}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")},
            spec,
            f"Plan tensor '{key}'",
        )
