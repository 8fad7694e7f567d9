"""Quantization as a plan stage: give every stored expert of any plan an integer precision.

`quantize_plan(plan, tensors, source, config, stats)` takes the output of any method (or the identity
plan: the `quant` method, the pure-quantization reference) and replaces each stored expert's weights
by integer codes on the config's grid (docs/quantization.md), computed by round-to-nearest or by GPTQ;
`quantize_experts` does the same for a precision per stored expert (`auto`'s mixed precision).

GPTQ minimises ‖(W − Q) X‖² over the tokens the stored expert computes, i.e. the objective
tr((W − Q) H (W − Q)ᵀ) with H = Σ_t x_t x_tᵀ (Frantar et al. 2023, eq. 1–2). The tokens a stored
expert computes are those routed to the slots that map to it, so

    H_in(s)  = Σ_{(l, e) → s} hessian_in[l][e]      (gate and up projections: the block input)
    H_mid(s) = Σ_{(l, e) → s} hessian_mid[l][e]     (down projection: the intermediate activation)

H_in is exact for any stored expert (its input is the block input whatever expert computes it). H_mid
is exact for a copy that only its own slot uses; for a merged or shared prototype it is the sources'
intermediate activations standing in for the prototype's own (an approximation, stated in the docs).
With ``weighting="gate2"`` each token counts g_e(t)², the weighting the toolkit's other losses use.
A stored expert whose width differs from its sources' (dense groups) quantizes its down projection by
round-to-nearest. PuzzleMoE packed experts keep their own packed precision.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ..calibrate.streamed import LayerStats, each_layer
from ..errors import MoECompressError
from ..plan import CompressionPlan, PlanTensors, Scope
from ..quant import QuantizedTensor, gptq, rtn
from ..quant.gptq import GPTQ_PRECISION
from ..quant.spec import QuantSpec
from ..runtime.build import stored_weights
from .context import MethodContext
from .needs import register_method_stats
from .registry import register_method
from .tensor_quant import hessian_source, quantize_tensors

Weighting = Literal["uniform", "gate2"]
_HESSIANS = {"uniform": ("hessian_in", "hessian_mid"), "gate2": ("hessian_in_g2", "hessian_mid_g2")}


class QuantConfig(BaseModel):
    """Weight quantization of the stored experts: a spec such as ``w4g128`` and an algorithm."""

    model_config = ConfigDict(extra="forbid")

    quant: str | None = Field(
        "w4g128",
        description="bits, group size and symmetry: w{2,3,4,8}g{32,64,128} or w{b}c "
        "(per channel); an 'a' suffix makes it asymmetric; null leaves the routed experts as "
        "they are (only `classes` are quantized)",
    )
    algo: Literal["gptq", "rtn"] = Field(
        "gptq", description="GPTQ from calibration Hessians, or round-to-nearest"
    )
    weighting: Weighting = Field("uniform", description="GPTQ Hessian: every routed token, or gate²-weighted")
    actorder: bool = Field(
        True,
        description="GPTQ columns in order of descending Hessian diagonal, each keeping its "
        "group's parameters (llm-compressor's actorder='static', its default); ignored by rtn",
    )
    damp: float = Field(
        0.01,
        gt=0,
        description="GPTQ dampening: damp · mean(diag H) added to diag H "
        "(llm-compressor's dampening_frac, same default)",
    )
    # non-expert tensors (issue 30; methods/tensor_quant.py): None = untouched, and left out of plan.json's params
    classes: dict[str, str] | None = Field(
        None,
        description="a spec per non-expert tensor class (attention, "
        "shared, dense_mlp, embeddings, lm_head, router); GPTQ or RTN as algo says, "
        "the embeddings always RTN",
    )
    scope: Literal["experts", "all"] | None = Field(
        None,
        description="all: the experts' spec for attention, "
        "shared experts and dense MLPs too, w8c for embeddings and "
        "lm_head, the router untouched; `classes` override it",
    )

    @model_validator(mode="before")
    @classmethod
    def _class_keys(cls, data):
        """A recipe's ``{experts: w4g128, attention: w8g128, ...}``: class keys into `classes`, experts into quant."""
        from ..models.tensor_classes import QUANTIZABLE

        if isinstance(data, dict) and any(k in data for k in (*QUANTIZABLE, "experts")):
            data = dict(data)
            classes = dict(data.pop("classes", None) or {})
            classes.update({k: data.pop(k) for k in QUANTIZABLE if k in data})
            if "experts" in data:
                if "quant" in data:
                    raise ValueError("give the routed experts' spec once: 'experts' or 'quant', not both")
                data["quant"] = data.pop("experts")
            elif "quant" not in data:
                data["quant"] = None  # only the named classes are quantized
            data["classes"] = classes or None
        return data

    _spec: QuantSpec | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _parsed(self):
        """The routed experts' spec, parsed once with this setting's algorithm and GPTQ options (one sentence on a
        bad spec): `spec()` returns this object."""
        self._spec = (
            None
            if self.quant is None
            else QuantSpec.parse(
                self.quant, algo=self.algo, actorder=self.actorder and self.algo == "gptq", damp=self.damp
            )
        )
        return self

    @field_validator("classes")
    @classmethod
    def _class_specs(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        from ..models.tensor_classes import QUANTIZABLE

        for name, text in (v or {}).items():
            if name not in QUANTIZABLE:
                raise MoECompressError(
                    f"'{name}' is not a tensor class that takes a precision; use "
                    f"{', '.join(QUANTIZABLE)} (and 'experts' for the routed experts)."
                )
            QuantSpec.parse(text)
        return v

    def has_tensor_classes(self) -> bool:
        """Does this setting quantize any non-expert tensor?"""
        return bool(self.classes) or self.scope == "all"

    def class_specs(self, adapter) -> dict[str, QuantSpec]:
        """class -> spec of the non-expert tensors on this model (`tensor_quant.resolve_class_specs`)."""
        from .tensor_quant import resolve_class_specs

        if not self.has_tensor_classes():
            return {}
        gptq = dict(actorder=self.actorder, damp=self.damp) if self.algo == "gptq" else None
        return resolve_class_specs(adapter, self.classes, self.scope, self.quant, gptq)

    def spec(self) -> QuantSpec:
        if self.quant is None:
            raise MoECompressError(
                "This quantization setting leaves the routed experts as they are; give 'quant' "
                "(or 'experts') a spec such as w4g128 to quantize them."
            )
        return self._spec


def quant_stats(config: QuantConfig | None) -> list[str]:
    """Statistics quantization reads: the per-expert Hessians for GPTQ, nothing for round-to-nearest."""
    if config is None or config.algo == "rtn":
        return []
    if (
        config.quant is None
    ):  # GPTQ of non-expert classes only: their pass re-reads the data the store records
        return ["tokens"] if config.has_tensor_classes() else []
    return ["counts", "tokens", *_HESSIANS[config.weighting]]


def _slots_of(plan: CompressionPlan, sc: Scope) -> dict[int, list[tuple[int, int]]]:
    """Stored id -> the original (layer, slot) pairs that compute with it."""
    out: dict[int, list[tuple[int, int]]] = {s.id: [] for s in sc.stored}
    for lp in plan.layers:
        if lp.scope == sc.id:
            for e, t in enumerate(lp.slots):
                if isinstance(t, int):
                    out[t].append((lp.layer, e))
    return out


def _slot_hessian(stats, slots_of, rows: bool, name: str, s, size: int) -> torch.Tensor | None:
    """`_hessian` of stored expert `s`, from its slots (`_slots_of`)."""
    return _hessian(stats, name, slots_of[s.id], size, rows)


def _hessian(
    stats, name: str, slots: list[tuple[int, int]], size: int, rows: bool = False
) -> torch.Tensor | None:
    """Σ of the slots' Hessians (summed in float64, returned in GPTQ's float32 working precision; one slot's own
    statistic without a copy), or None (round-to-nearest) when their width does not match `size` or no
    calibration token reached the expert: GPTQ on a zero Hessian would treat every column as dead and zero the
    whole weight, losing an expert that held-out text may still route to."""
    hs = []
    for layer, e in slots:
        if rows:  # streamed: the pass holds a chunk of the layer's experts
            hs.append(stats.get_row(layer, name, e))
        else:
            per_layer = stats.get(layer, name)
            if per_layer.numel() == 0:  # a layer calibrated without Hessians (calibrate --hessian-layers)
                return None
            hs.append(per_layer[e])
        if hs[-1].shape != (size, size):
            return None
    if not hs:
        return None
    total = hs[0] if len(hs) == 1 else torch.stack([h.double() for h in hs]).sum(0)
    if not bool(total.diagonal().gt(0).any()):
        return None
    return total.to(GPTQ_PRECISION)


# float32 elements per batched GPTQ call, a weight's and its Hessian's: GPTQ's factorisation keeps about five
# working copies of the stacked Hessians, so this bounds one call to a few hundred MB (a whole layer's experts at
# once took 5 GB on the wide benchmark model, issue 32)
_BATCH_ELEMENTS = 1 << 24


def _quantize_batched(jobs):
    """(job index, QuantizedTensor) for every (prefix, part, weight, H, spec) job, round-to-nearest where H is
    None. GPTQ jobs on the same Hessian object with the same spec (gate and up of one expert) run as one weight
    with their rows stacked: GPTQ quantizes rows independently, so each keeps its own codes
    (tests/test_quant_plan.py), and the Hessian is factored once. Stacked weights of equal shape run batched, a
    bounded number per call, so the column loop runs once per batch instead of once per expert."""
    units: dict[tuple[int, QuantSpec], list[int]] = {}
    for i, (_, _, w, h, spec) in enumerate(jobs):
        if h is None:
            yield i, rtn(w.float(), spec)
        else:
            units.setdefault((id(h), spec), []).append(i)
    groups: dict[tuple, list[list[int]]] = {}
    for (_, spec), idx in units.items():
        rows = sum(jobs[i][2].shape[0] for i in idx)
        groups.setdefault((rows, jobs[idx[0]][2].shape[1], spec), []).append(idx)
    for (rows, cols, spec), members in groups.items():
        step = max(1, _BATCH_ELEMENTS // (rows * cols + cols * cols))
        for c in range(0, len(members), step):
            chunk = members[c : c + step]
            w = torch.stack([torch.cat([jobs[i][2] for i in idx]).float() for idx in chunk])
            q = gptq(w, torch.stack([jobs[idx[0]][3] for idx in chunk]), spec)
            del w
            for k, idx in enumerate(chunk):
                at = 0
                for i in idx:
                    n = jobs[i][2].shape[0]
                    yield (
                        i,
                        QuantizedTensor(
                            codes=q.codes[k, at : at + n],
                            scale=q.scale[k, at : at + n],
                            zero=None if q.zero is None else q.zero[k, at : at + n],
                            spec=spec,
                        ),
                    )
                    at += n


def quantize_plan(
    plan: CompressionPlan,
    tensors: PlanTensors | None,
    source,
    config: QuantConfig,
    stats=None,
    progress: bool = False,
) -> tuple[CompressionPlan, PlanTensors]:
    """(plan, tensors) with every stored expert not yet quantized (and not PuzzleMoE-packed) quantized at
    `config`'s spec, the setting recorded in ``plan.params["quant"]`` (`quantize_experts`)."""
    spec = config.spec()
    todo = [(sc.id, s.id) for sc in plan.scopes for s in sc.stored if s.packing is None and s.quant is None]
    plan, out = quantize_experts(
        plan, tensors, source, dict.fromkeys(todo, spec), stats, weighting=config.weighting, progress=progress
    )
    plan.params = {**plan.params, "quant": config.model_dump()}
    return plan, out


def quantize_experts(
    plan: CompressionPlan,
    tensors: PlanTensors | None,
    source,
    specs: Mapping[tuple[str, int], QuantSpec],
    stats=None,
    *,
    weighting: Weighting = "uniform",
    done: Mapping[tuple[str, int], Mapping[str, QuantizedTensor]] | None = None,
    chunk: int | None = None,
    progress: bool = False,
) -> tuple[CompressionPlan, PlanTensors]:
    """(plan, tensors) with the stored experts `specs` names — keyed (scope id, stored id) — quantized at their
    precision (mixed precision, as `auto` chooses it).

    source(layer, expert) -> ExpertWeights of the original model (as for `stored_weights`).
    weighting: which Hessians GPTQ reads (`QuantConfig.weighting`).
    done: codes already computed for some of them ({"gate"|"up"|"down": QuantizedTensor}, e.g. by `auto`'s
    estimator with the same Hessians), written as they are instead of running GPTQ again.
    chunk: streamed statistics (`LayerStats`) that gather square statistics `chunk` experts at a time: a
    scope's experts are quantized that many at a time, their Hessians read by row, so one layer's Hessians
    are never all in memory; None reads a layer's whole (a store).
    """
    from rich.progress import track

    done = done or {}
    h_in_name, h_mid_name = _require_hessians(specs, stats, weighting, done)
    plan = plan.model_copy(deep=True)
    # a store on disk (`SpilledTensors`, the streamed view) takes the codes in place: copying it would read it all
    out = tensors if tensors is not None and not isinstance(tensors, dict) else dict(tensors or {})
    by_scope: dict[str, list] = {}
    for sc in plan.scopes:
        for s in sc.stored:
            if s.packing is None and s.quant is None and (sc.id, s.id) in specs:
                by_scope.setdefault(sc.id, []).append((sc, s))
    # One scope (a layer, or a shared group) at a time, `chunk` stored experts at a time when streamed: gather
    # their weights and Hessians, then quantize same-shape matrices together, so GPTQ's column loop runs once per
    # batch instead of once per expert (most of its Python overhead; the batched result equals per-matrix
    # runs, tests/test_quant_core.py). Memory stays bounded by one group's weights and Hessians.
    for items in track(
        list(by_scope.values()),
        description="quantize experts",
        disable=not progress,
        transient=True,
    ):
        slots_of = _slots_of(plan, items[0][0])
        step = chunk or len(items)
        new: dict[str, torch.Tensor] = {}  # this scope's tensors, stored in one update
        for c in range(0, len(items), step):  # a streamed pass gathers `chunk` experts' Hessians at a time
            group = [(sc, s, specs[(sc.id, s.id)]) for sc, s in items[c : c + step]]
            hessian = partial(_slot_hessian, stats, slots_of, chunk is not None)
            new.update(_quantize_group(plan, group, source, out, hessian, (h_in_name, h_mid_name), done))
        out.update(new)
    plan.check_tensors(out)
    return plan, out


def _require_hessians(specs, stats, weighting: Weighting, done) -> tuple[str, str]:
    """The names of the Hessians GPTQ reads under `weighting`; refused in one sentence when a GPTQ spec has
    no statistics to read them from (and no codes `done` already)."""
    names = _HESSIANS[weighting]
    if any(s.algo == "gptq" for s in specs.values()):
        if stats is None and not set(specs) <= set(done):
            raise MoECompressError(
                "GPTQ needs calibration Hessians; pass --calib (a stats directory or a data spec) "
                "or use --quant-algo rtn."
            )
        if stats is not None:
            stats.require(*names, method="quant")
    return names


def _quantize_group(plan, group, source, out, hessian, names, done) -> dict[str, torch.Tensor]:
    """The packed tensors of `group`'s stored experts [(scope, stored, spec)], each recorded in the plan as
    quantized; codes `done` holds are written as they are, the rest quantized together (`_quantize_batched`).
    hessian(name, stored, size) -> the input Hessian of that width, or None (round-to-nearest)."""
    jobs: list[tuple[str, str, torch.Tensor, torch.Tensor | None, QuantSpec]] = []
    new: dict[str, torch.Tensor] = {}
    for sc, s, s_spec in group:
        w = stored_weights(plan, sc, s, source, out)
        ready = done.get((sc.id, s.id), {})  # codes `auto` already computed while estimating
        hin = hmid = None
        if s_spec.algo == "gptq" and len(ready) < 3:
            hin, hmid = hessian(names[0], s, w.gate.shape[1]), hessian(names[1], s, w.down.shape[1])
        prefix = s.tensor or f"q.{sc.id}.{s.id}"
        for key in [k for k in out if k.startswith(prefix + ".")]:
            del out[key]
        for part, h in (("gate", hin), ("up", hin), ("down", hmid)):
            if part in ready:
                new.update({f"{prefix}.{part}.{k}": v for k, v in ready[part].packed().items()})
            else:  # the stored dtype: GPTQ upcasts one bounded batch at a time
                jobs.append((prefix, part, getattr(w, part).detach(), h, s_spec))
            bias = getattr(w, f"{part}_bias")
            if bias is not None:
                new[f"{prefix}.{part}_bias"] = bias.detach().clone()
        s.tensor, s.quant = prefix, s_spec
    for idx, q in _quantize_batched(jobs):
        prefix, part = jobs[idx][:2]
        new.update({f"{prefix}.{part}.{k}": v for k, v in q.packed().items()})
    return new


def build_quant(config: QuantConfig, ctx: MethodContext):
    """The pure-quantization reference arm: the identity plan, every expert quantized (and the non-expert classes
    the setting names, `tensor_quant`).

    One layer at a time, in order (`each_layer`): from streamed statistics (`compress` from a data spec) each
    layer's Hessians exist only while its experts are quantized, so no per-expert H×H statistic is stored, as
    llm-compressor quantizes a layer while its Hessians are in memory. The codes equal those from a store."""
    plan, tensors = _quantize_experts(config, ctx)
    return quantize_tensors(
        plan, tensors, ctx.adapter, config.class_specs(ctx.adapter), hessian_source(ctx.adapter, ctx.stats)
    )


def _quantize_experts(config: QuantConfig, ctx: MethodContext):
    plan = CompressionPlan.identity(ctx.adapter, method="quant")
    source = lambda l, e: ctx.adapter.layer(l).storage.read(e)
    if config.quant is None:
        plan.params = {**plan.params, "quant": config.model_dump()}
        return plan, {}
    if ctx.stats is None or config.algo == "rtn":
        return quantize_plan(plan, {}, source, config, ctx.stats, ctx.progress)
    from rich.progress import track

    from ..checkpoint.view import plan_tensor_store

    # the streamed view keeps finished layers' codes on disk: all of them would be a third of a 4-bit checkpoint
    spec, tensors, layers = config.spec(), plan_tensor_store(ctx.adapter), ctx.adapter.moe_layers
    for i, stats in track(
        each_layer(ctx.stats, layers, ctx.adapter),
        total=len(layers),
        transient=True,
        description=f"quantize {spec.name()} (gptq)",
        disable=not ctx.progress,
    ):
        sc = plan.scope_of(i)
        specs = {(sc.id, s.id): spec for s in sc.stored}
        plan, tensors = quantize_experts(
            plan, tensors, source, specs, stats, weighting=config.weighting, chunk=stats.chunk
        )
        if (
            isinstance(stats, LayerStats) and stats.sequential
        ):  # later layers calibrate on these quantized ones
            done = plan.scope_of(i)  # quantize_plan returned a new plan: its scope holds the codes
            for s in done.stored:
                stats.replace_expert(s.sources[0][1], stored_weights(plan, done, s, source, tensors))
    plan.params = {**plan.params, "quant": config.model_dump()}
    return plan, tensors


# 16 experts' Hessians per extra pass, not 4: a few % faster on the wide benchmark model's 4-layer copy for ~0.27 GB
# more, and 32 was no faster for 0.7 GB (BENCHMARKS.md, "Streamed chunk of our GPTQ"; one run each)
HESSIAN_CHUNK = 16

register_method(
    "quant",
    QuantConfig,
    build_quant,
    quant_stats,
    family="quant",
    streamed_stats=True,
    streamed_chunk=HESSIAN_CHUNK,
)
# `calibrate --for-method gptq` / `gptq-g2`: the Hessians of each weighting (`quant` reads the default's)
register_method_stats("gptq", quant_stats(QuantConfig()))
register_method_stats("gptq-g2", quant_stats(QuantConfig(weighting="gate2")))
