"""Integer precisions for the non-expert weights of a plan (issue 30, items 1-3): which class gets which spec,
and the quantization itself.

A quantization setting (`QuantConfig`) maps tensor classes (`models.tensor_classes`) to specs: explicitly
(``classes: {attention: w8g128, embeddings: w8c}``, a recipe's ``quant: {experts: w4g128, attention: ...}``) or
through ``scope: all`` — the experts' spec for every linear class (attention, shared, dense_mlp), ``w8c`` for
the embeddings and an untied lm_head, the router untouched — with explicit classes overriding it. Every 2-D
``.weight`` of a chosen class is quantized by GPTQ (`quant.gptq`, Frantar et al. 2023) on its input Hessian from
one more streaming calibration pass over the data the statistics record (`calibrate.linear_hessian`), or by
round-to-nearest (`quant.rtn`; always for the embeddings, whose input is a one-hot token), and recorded in
``plan.tensor_quant``; its compressed-tensors pack-quantized tensors go into the plan tensors under
``<module>.weight_packed`` etc. (`plan.quant_tensor_prefix`).

Weights are read one decoder layer's worth at a time: from the checkpoint (`CheckpointReader.read_tensors`,
on-disk dtype) on the streamed view, from the module otherwise.
"""

from __future__ import annotations

import re

import torch

from ..errors import MoECompressError
from ..models.tensor_classes import QUANTIZABLE, quantizable, tensor_classes, tensor_shapes
from ..plan import CompressionPlan, PlanTensors, TensorQuant, quant_tensor_prefix
from ..quant import gptq, rtn
from ..quant.spec import QuantSpec

# classes `scope: all` gives the experts' spec; the embeddings and an untied lm_head get EDGE_SPEC
LINEAR_CLASSES = ("attention", "shared", "dense_mlp")
EDGE_SPEC = "w8c"
# the router keeps 8 bits at least: see docs/quantization.md, "Non-expert tensors" (a measurement on olmoe-tiny)
ROUTER_MIN_BITS = 8


def resolve_class_specs(
    adapter,
    classes: dict[str, str] | None,
    scope: str | None,
    expert_spec: str | None,
    gptq: dict | None = None,
) -> dict[str, QuantSpec]:
    """class -> spec for this model, from explicit `classes` over `scope`'s defaults: GPTQ with the options
    `gptq` (``{actorder, damp}``) when given, else round-to-nearest; the embeddings are always round-to-nearest
    (an embedding's input is a one-hot token: it has no Hessian to weigh its columns with).

    One sentence (`MoECompressError`) for a class the model has no quantizable tensor of (e.g. ``dense_mlp`` in a
    model without dense layers, ``lm_head`` tied to the embeddings), an unknown class, or a spec a class cannot
    take (the router below `ROUTER_MIN_BITS`)."""
    present = present_classes(adapter)
    chosen: dict[str, str] = {}
    if scope == "all":
        for cls in LINEAR_CLASSES:
            if cls in present and expert_spec is not None:
                chosen[cls] = expert_spec
        for cls in ("embeddings", "lm_head"):
            if cls in present:
                chosen[cls] = EDGE_SPEC
    for cls, text in (classes or {}).items():
        if cls not in QUANTIZABLE:
            raise MoECompressError(
                f"'{cls}' is not a tensor class that takes a precision; use "
                f"{', '.join(QUANTIZABLE)} (and 'experts' for the routed experts)."
            )
        if cls not in present:
            if cls == "lm_head" and "embeddings" in present and _tied(adapter):
                raise MoECompressError(
                    "This model's lm_head is tied to its embeddings (one tensor); give its "
                    "precision under 'embeddings' instead of 'lm_head'."
                )
            raise MoECompressError(
                f"This {adapter.model_type} model has no {cls} weights to quantize (its classes: "
                f"{', '.join(sorted(present))}); remove '{cls}' from the quantization setting."
            )
        chosen[cls] = text
    specs = {
        cls: QuantSpec.parse(text, algo="rtn")
        if gptq is None or cls == "embeddings"
        else QuantSpec.parse(text, algo="gptq", **gptq)
        for cls, text in chosen.items()
    }
    router = specs.get("router")
    if router is not None and router.bits < ROUTER_MIN_BITS:
        raise MoECompressError(
            f"The router cannot take {router.name()}: router weights keep at least "
            f"{ROUTER_MIN_BITS} bits (docs/quantization.md, 'Non-expert tensors'); use w8c or "
            "leave the router out."
        )
    return specs


def _tied(adapter) -> bool:
    model = adapter.model
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return emb is not None and head is not None and head.weight is emb.weight


def present_classes(adapter) -> set[str]:
    """The classes of which the model has at least one quantizable tensor."""
    shapes = tensor_shapes(adapter)
    return {cls for name, cls in tensor_classes(adapter).items() if quantizable(name, shapes[name], cls)}


def on_disk_dtypes(info) -> dict[str, tuple[str, int]] | None:
    """name -> (on-disk dtype, bytes) of the checkpoint `info` (a `ModelInfo`) was described from, else None."""
    from ..disk import checkpoint_dir, stored_tensors

    found = checkpoint_dir(info.source)
    return stored_tensors(found) if found is not None and info.disk_dtypes is not None else None


def _layer_of(name: str, prefix: str) -> int:
    m = re.match(re.escape(prefix) + r"\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _read(adapter, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors, one call per decoder layer (the caller's loop): from the checkpoint on the streamed view."""
    reader = getattr(adapter, "reader", None)
    if reader is not None and hasattr(reader, "read_tensors"):
        return reader.read_tensors(names)
    return {n: adapter.model.get_parameter(n).detach() for n in names}


def quantize_tensors(
    plan: CompressionPlan, tensors: PlanTensors | None, adapter, specs: dict[str, QuantSpec], hessians=None
) -> tuple[CompressionPlan, PlanTensors]:
    """(plan, tensors) with every quantizable tensor `specs` names — by class, or by tensor name (auto's
    per-tensor choices; a name wins over its class) — quantized and recorded in ``plan.tensor_quant``; the rest
    untouched. Bytes follow at once (`plan.logical_bytes`).

    A GPTQ spec needs `hessians(names)`: an iterator of (decoder layer or None, {name: H}) in layer order, None
    (lm_head) last (`calibrate.linear_hessian.linear_hessian_pass`). A weight without a Hessian there (no real
    token reached it) falls back to round-to-nearest, and its entry says ``algo: rtn``."""
    # a store on disk (`SpilledTensors`, the streamed view) takes the codes in place: copying it would read it all
    out = tensors if tensors is not None and not isinstance(tensors, dict) else dict(tensors or {})
    if not specs:
        return plan, out
    classes, shapes = tensor_classes(adapter), tensor_shapes(adapter)
    spec_of = {n: specs.get(n, specs.get(cls)) for n, cls in classes.items()}
    names = [n for n, cls in classes.items() if spec_of[n] is not None and quantizable(n, shapes[n], cls)]
    prefix = _layers_prefix(adapter)
    disk = on_disk_dtypes(plan.model)
    entries = dict(plan.tensor_quant)
    by_layer: dict[int, list[str]] = {}
    for n in names:
        by_layer.setdefault(_layer_of(n, prefix), []).append(n)
    want = [n for n in names if spec_of[n].algo == "gptq"]
    if want and hessians is None:
        raise MoECompressError(
            "GPTQ of non-expert weights needs calibration Hessians; pass --calib (a stats directory "
            "or a data spec) or use --quant-algo rtn."
        )
    passes = iter(hessians(want)) if want else iter(())
    held: tuple[int | None, dict] = (-2, {})
    for layer in sorted(by_layer, key=lambda i: (i < 0, i)):  # decoder layers in order, then the rest
        key = None if layer < 0 else layer
        if any(n in want for n in by_layer[layer]):
            while held[0] != key:
                held = next(passes)
        for name, w in _read(adapter, by_layer[layer]).items():
            cls, spec = classes[name], spec_of[name]
            h = held[1].get(name) if held[0] == key else None
            q, spec = _quantize_weight(w, spec, h)
            base = quant_tensor_prefix(name)
            out.update({f"{base}.{k}": v for k, v in q.packed().items()})
            dtype = (
                disk[name][0] if disk is not None and name in disk else str(w.dtype).removeprefix("torch.")
            )
            entries[name] = TensorQuant(kind=cls, shape=tuple(w.shape), dtype=dtype, quant=spec)
        held = (held[0], {}) if held[0] == key else held  # this layer's Hessians are done with
    for _ in passes:  # let the pass finish (it frees its last layer and its activation cache)
        pass
    plan = plan.model_copy(update={"tensor_quant": dict(sorted(entries.items()))})
    plan = CompressionPlan.model_validate(
        plan.model_dump()
    )  # validated as a whole, as a loaded plan would be
    plan.check_tensors(out)
    return plan, out


def _quantize_weight(w: torch.Tensor, spec: QuantSpec, h):
    """(codes, the spec they follow) of weight `w`: GPTQ on Hessian `h` when the spec asks for it and a token
    reached the weight, else round-to-nearest (the spec then says ``algo: rtn``)."""
    if spec.algo == "gptq" and h is not None and bool(h.diagonal().gt(0).any()):
        return gptq(w.float(), h, spec), spec
    spec = spec.as_rtn()
    return rtn(w.float(), spec), spec


def hessian_source(adapter, stats):
    """`quantize_tensors`' ``hessians`` for a plan built on the streamed view of a checkpoint with statistics
    `stats` (a store or streamed statistics, whose ``meta["data"]`` names the calibration data), else None."""
    reader = getattr(adapter, "reader", None)
    data = (getattr(stats, "meta", None) or {}).get("data") if stats is not None else None
    if reader is None or data is None:
        return None
    from ..calibrate.linear_hessian import linear_hessian_pass

    return lambda names: linear_hessian_pass(str(reader.path), data, names)


def _layers_prefix(adapter) -> str:
    for name, mod in adapter.model.named_modules():
        if mod is adapter.decoder_layers:
            return name
    return "model.layers"
