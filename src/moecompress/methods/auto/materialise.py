"""`auto`'s plan from the chosen layer states (docs/auto.md, "Output"): `plan_from_points` (one state per layer
-> CompressionPlan + tensors), `shed` / `restore` (a layer's candidates drop their tensors and codes once
scored; the chosen state's are computed again) and `plan_layer_by_layer` (the plan built one layer at a time)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ...calibrate.streamed import each_layer
from ...plan import CompressionPlan, LayerPlan, ModelInfo, Scope, StoredExpert
from .candidates import layer_problem
from .config import AutoConfig, hessians_only
from .frontier import STORED_KINDS, LayerProblem, keep_point_of
from .moments import LayerMoments
from .quant import HESSIANS, gptq_codes, quant_candidates
from .solver import Candidate, LayerPoint


def plan_from_points(
    info: ModelInfo,
    chosen: dict[int, LayerPoint],
    method: str = "auto",
    params: dict | None = None,
    source=None,
) -> tuple[CompressionPlan, dict[str, torch.Tensor]]:
    """The plan of one state per layer. Quantized keeps are written by `quantize_plan` from the codes the
    estimator computed; source(layer, expert) -> ExpertWeights (their biases) is needed only for them."""
    scopes, layers, tensors = [], [], {}
    specs, done = {}, {}
    for li in info.layers:
        pt = chosen[li.layer]
        sid = f"layer{li.layer}"
        stored, pos, kept = _stored_experts(li, pt, sid, tensors, specs, done)
        slots = []
        for e, c in enumerate(pt.choice):
            if c.kind in (*STORED_KINDS, "pair"):
                slots.append(pos[e])
            elif c.kind == "remap":
                slots.append(pos[c.param])
            elif c.kind in ("drop", "reroute"):
                slots.append("drop")
            else:
                slots.append(c.op)
                tensors.update(c.tensors)
        removed = len(kept) < li.num_experts
        gate = "renorm" if not removed else ("replace" if pt.mode == "replace" else pt.mode.split(":")[1])
        scopes.append(Scope(id=sid, layers=[li.layer], stored=stored))
        layers.append(LayerPlan(layer=li.layer, scope=sid, gate=gate, slots=slots))
    plan = CompressionPlan(model=info, scopes=scopes, layers=layers, method=method, params=params or {})
    if specs:
        from ..quantize import quantize_experts

        if source is None:
            raise RuntimeError(
                "plan_from_points: quantized keeps need the model's experts (source); this is a bug."
            )
        plan, tensors = quantize_experts(plan, tensors, source, specs, done=done)
    return plan, tensors


def _stored_experts(li, pt: LayerPoint, sid: str, tensors: dict, specs: dict, done: dict):
    """(stored experts, stored position per slot, kept slots) of one layer's state: kept copies and packed pairs
    in order of their smallest original expert; a pair's tensors go into `tensors`, a quantized keep's spec and
    codes into `specs` / `done`."""
    entries = sorted(
        {
            (e,) if c.kind in STORED_KINDS else tuple(sorted((e, c.param)))
            for e, c in enumerate(pt.choice)
            if c.kind in (*STORED_KINDS, "pair")
        }
    )
    kept = [e for e, c in enumerate(pt.choice) if c.kind in STORED_KINDS]
    pos = {}
    stored = []
    for j, entry in enumerate(entries):
        if len(entry) == 1:
            stored.append(StoredExpert(id=j, sources=[(li.layer, entry[0])]))
            c = pt.choice[entry[0]]
            if c.kind == "quant":
                specs[(sid, j)], done[(sid, j)] = c.op.spec, c.op.parts
        else:
            ref = pt.choice[entry[0]].op
            merge = ref.merge()
            prefix = f"layer{li.layer}.merge{entry[0]}"
            stored.append(merge.stored_expert(j, prefix))
            tensors.update(merge.tensors(prefix))
        for e in entry:
            pos[e] = j
    return stored, pos, kept


REBUILT_KINDS = frozenset({"constant", "tilt", "partial", "quant"})  # candidates whose tensors `shed` drops


def shed(prob: LayerProblem) -> None:
    """Drop what a layer's candidates hold beyond their (bytes, loss): operator tensors, quantized codes and
    packed-pair merges. The fronts and the allocation read only those numbers; a layer's candidates would
    otherwise keep about its own size in memory (codes at every bit width), every layer's together more
    than the checkpoint. `restore` rebuilds the tensors of the one state chosen per layer."""
    for slot in prob.options:
        for c in slot:
            if c.kind in REBUILT_KINDS:
                c.tensors = {}
                if c.kind == "quant":
                    c.op = None  # with keep_codes=False there were none to begin with
    for ref in prob.pairs:
        ref.drop_merge()  # rebuilt from the weights by `PairRef.merge()` when the plan needs it


def _was_shed(c: Candidate) -> bool:
    """Has `c` no payload any more (see `shed`)?"""
    return (c.kind == "quant" and c.op is None) or (c.kind in REBUILT_KINDS - {"quant"} and not c.tensors)


def restore(config: AutoConfig, adapter, stats, info: ModelInfo, layer: int, point: LayerPoint) -> LayerPoint:
    """`point` with the tensors and codes its candidates shed, computed again for this layer from the same
    statistics and weights: the same deterministic fits, and GPTQ codes for the slots kept quantized only."""
    todo = [e for e, c in enumerate(point.choice) if _was_shed(c)]
    if not todo:
        return point
    rebuilt: dict[tuple[int, str, int], Candidate] = {}
    ops = {point.choice[e].kind for e in todo} - {"quant"}
    if ops:  # operator fits: the layer's problem with only those kinds and no quantized keeps
        sub = config.model_copy(
            update={"candidates": [k for k in config.candidates if k in ops], "bits": [16]}
        )
        prob, _ = layer_problem(
            sub, adapter, stats, info, layer, config.accounting == "stored", slots=set(todo)
        )
        rebuilt |= {(e, c.kind, c.param): c for e in todo for c in prob.options[e]}
    quant = [e for e in todo if point.choice[e].kind == "quant"]
    if quant and config.proxy_pricing:  # priced by proxy: the codes only, the estimate stays
        width = {e: point.choice[e].param for e in quant}
        codes = gptq_codes(adapter, stats, layer, width, config.quant_group, config.quant_weighting)
        rebuilt |= {(e, "quant", width[e]): replace(point.choice[e], op=codes[e]) for e in quant}
    elif quant:
        m = LayerMoments(layer, None, None, None, sample=stats.get(layer, "auto_sample"))
        width = {e: point.choice[e].param for e in quant}
        got = quant_candidates(
            adapter,
            stats,
            m,
            sorted(set(width.values())),
            config.quant_group,
            config.quant_algo,
            config.quant_weighting,
            info.element_size,
            experts=width,
        )
        rebuilt |= {(e, "quant", c.param): c for e in quant for c in got[e]}
    choice = list(point.choice)
    for e in todo:
        c = point.choice[e]
        new = rebuilt.get((e, c.kind, c.param))
        if new is None or new.error != c.error:
            raise RuntimeError(
                f"auto: layer {layer} slot {e}'s {c.label} came out differently when rebuilt; "
                "this is a bug, please report it."
            )
        choice[e] = Candidate(
            c.kind, c.loss, c.param, c.bytes, op=new.op, gate=c.gate, tensors=new.tensors, raw=c.raw
        )
    return LayerPoint(point.mode, choice, point.bytes, point.loss)


def _codes_only(config: AutoConfig) -> bool:
    """Whether `restore` reads no statistic but GPTQ's Hessians: the fast search's codes, and no other candidate
    than those a plan states without tensors (reroute, drop)."""
    return config.proxy_pricing and hessians_only(config)


def plan_layer_by_layer(
    config: AutoConfig, adapter, stats, info: ModelInfo, chosen: dict[int, LayerPoint], on_layer=None
) -> tuple[CompressionPlan, object]:
    """`plan_from_points` of the chosen states, built one layer at a time: each layer's state is restored, its
    part of the plan made and its tensors put in the method's tensor store (on disk for a streamed view).
    on_layer(i, part, part_tensors), if given, runs while layer i's part is still in memory (and a streamed
    view still lends the layer): a plan whose other layers are kept whole, and that layer's tensors."""
    from ...checkpoint.view import plan_tensor_store

    keeps = {li.layer: keep_point_of(li) for li in info.layers}
    source = lambda l, e: adapter.layer(l).storage.read(e)
    tensors = plan_tensor_store(adapter)
    scopes, layers = [], []
    only = set(HESSIANS[config.quant_weighting]) if _codes_only(config) else None
    for i, layer_stats in each_layer(stats, [li.layer for li in info.layers], adapter, only):
        pt = restore(config, adapter, layer_stats, info, i, chosen[i])
        part, part_tensors = plan_from_points(info, {**keeps, i: pt}, source=source)
        if on_layer is not None:
            on_layer(i, part, part_tensors)
        scopes.append(part.scope(part.layer(i).scope))
        layers.append(part.layer(i))
        tensors.update(part_tensors)
        del pt, part_tensors
    return CompressionPlan(model=info, scopes=scopes, layers=layers, method="auto", params={}), tensors
