"""`CompressionPlan`: the one interchange format between methods, the runtime and the exporters.

A plan separates the two decisions every MoE compression method makes:

1. **what is stored** — per *scope* (one MoE layer, or several neighbouring layers sharing a
   pool), a list of stored experts, each with its sources ``[(layer, expert), ...]`` and how it
   was built: ``copy`` (one source, verbatim), ``weighted_merge`` (parameter average
   ``theta = sum_i w_i theta_i``, or merged tensors the method supplies), ``elementwise_merge``
   (PuzzleMoE; tensors supplied by the method) or ``dense_group`` (the sources' neurons
   concatenated, ``f(x) = sum_i w_i f_i(x)``);
2. **what each original router slot computes** — per MoE layer, every slot maps to a stored
   expert id (an int), a replacement operator (``constant`` mean output ``c``; ``tilt``
   ``y = b + U (V^T x)`` of rank r; ``partial`` copy: a subset of an expert's neurons plus an
   output bias) or ``"drop"``; and at what gate scale (``gate``):

   * ``renorm``  — dropped slots are deleted from the router before any normalisation (what a
     physically pruned standard checkpoint computes);
   * ``keep``    — dropped slots stay in every normalisation but are never selected (trained scale);
   * ``aggregate`` — the original router selects among all slots; the weights of selected slots
     that map to the same stored expert are summed and the expert runs once (ConMoE);
   * ``replace`` — the original top-k is unchanged; a slot computes its target times its gate
     (``drop`` is the zero operator).

Weights that are not copies of original experts (merged experts, operator parameters) travel
beside the plan as ``PlanTensors = dict[str, Tensor]`` (``plan_tensors.safetensors``), keyed by
the names the plan references, so ``plan.json`` stays small and byte-deterministic.
Tensor keys under a reference ``p``: stored expert ``p.gate [I,H]``, ``p.up [I,H]``,
``p.down [H,I]`` (+ ``p.gate_bias``, ``p.up_bias``, ``p.down_bias`` for biased families);
constant ``p.value [H]``; tilt ``p.U [H,r]``, ``p.V [H,r]``, ``p.bias [H]``; partial
``p.gate [w,H]``, ``p.up [w,H]``, ``p.down [H,w]``, ``p.bias [H]`` (+ ``p.gate_bias``/``p.up_bias``).

Every stored expert also has a precision (``quant``): ``None`` keeps the model's 16-bit (or float32)
weights; a `QuantSpec` stores gate/up/down as integer codes on a group-wise grid, under
``p.{gate,up,down}.weight_packed`` (int32 words), ``.weight_scale``, ``.weight_shape`` (+
``.weight_zero_point`` when asymmetric) -- compressed-tensors' ``pack-quantized`` names -- with any
biases left in the model's dtype (``p.gate_bias`` ...). Structure and bits compose in one plan and
one byte count (docs/quantization.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from .errors import MoECompressError
from .quant.spec import QuantSpec

SCHEMA_VERSION = 1
PLAN_FILE = "plan.json"
TENSORS_FILE = "plan_tensors.safetensors"

GateSemantics = Literal["renorm", "keep", "aggregate", "replace"]
Construction = Literal["copy", "weighted_merge", "elementwise_merge", "dense_group"]
PlanTensors = dict[str, torch.Tensor]

_EXPERT_PARTS = ("gate", "up", "down")
_EXPERT_BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- model description
def _floating_dtype(v: str) -> str:
    # getattr(torch, v) must be a floating dtype: "load" named torch.load and failed later as a traceback
    if not isinstance(getattr(torch, v, None), torch.dtype) or not getattr(torch, v).is_floating_point:
        raise ValueError(f"'{v}' is not a floating torch dtype such as bfloat16 or float32")
    return v


class MoELayerInfo(_Strict):
    """What the plan needs to know about one original MoE layer."""

    # a plan.json is input too: sizes are checked here, so a tampered file is one sentence, not a traceback later
    layer: int = Field(ge=0)
    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    bytes_per_expert: int = Field(ge=0)
    n_group: int = Field(1, ge=1)
    topk_group: int = Field(1, ge=1)
    group_score: Literal["max", "top2_sum"] = "max"
    keep_equals_renorm: bool = False  # the router renormalises (or scores elementwise): keep == renorm
    router: str = ""  # RouterSpec.describe(), for reports


class ModelInfo(_Strict):
    """The original model, as far as plans, byte accounting and validation need it.

    Bytes are counted at the checkpoint's on-disk dtypes (read from its safetensors headers), not at
    the dtype the model happens to be loaded in: a bf16 checkpoint computed in float32 still costs
    2 bytes per parameter. A model with no checkpoint directory (built in memory) is counted as held.
    """

    model_type: str
    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    dtype: str  # on-disk dtype of the routed experts, e.g. "bfloat16"
    disk_dtypes: list[str] | None = None  # every dtype the checkpoint stores (None: counted from memory)
    expert_bias: bool = False  # experts carry biases (GPT-OSS)
    layers: list[MoELayerInfo]
    expert_bytes: int = Field(ge=0)  # all routed experts of the original, as stored
    other_bytes: int = Field(
        ge=0
    )  # every other saved tensor: embeddings, attention, norms, routers, shared experts
    source: str | None = None

    @field_validator("dtype")
    @classmethod
    def _floating_dtype(cls, v: str) -> str:
        return _floating_dtype(v)

    def layer(self, i: int) -> MoELayerInfo:
        for info in self.layers:
            if info.layer == i:
                return info
        raise MoECompressError(
            f"Layer {i} is not a MoE layer of this {self.model_type} model; "
            f"MoE layers are {[x.layer for x in self.layers]}."
        )

    @property
    def element_size(self) -> int:
        """Bytes per element of a routed expert (and of anything stored in its place) on disk."""
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @classmethod
    def from_model(
        cls, model_or_adapter, source: str | None = None, checkpoint: str | os.PathLike | None = None
    ) -> ModelInfo:
        """Describe an original model. Bytes follow `checkpoint` (default: `source`, else the model's
        ``name_or_path``) when it is a directory of safetensors; otherwise the in-memory dtypes."""
        from .disk import checkpoint_dir, stored_tensors
        from .models import MoEAdapter

        adapter = (
            model_or_adapter if isinstance(model_or_adapter, MoEAdapter) else MoEAdapter(model_or_adapter)
        )
        model = adapter.model
        name = getattr(model, "name_or_path", None) or None
        found = checkpoint_dir(checkpoint) or checkpoint_dir(source) or checkpoint_dir(name)
        disk = stored_tensors(found) if found is not None else None
        expert_dtype = _disk_expert_dtype(disk) if disk else None

        def el(dtype: str) -> int:
            return torch.empty((), dtype=getattr(torch, dtype)).element_size()

        expert_params = set()
        layers = []
        dtype = None
        for i in adapter.moe_layers:
            layer = adapter.layer(i)
            params = list(layer.storage.module.parameters())
            expert_params.update(id(p) for p in params)
            dtype = dtype or params[0].dtype
            numel = sum(p.numel() for p in params)
            nbytes = (
                numel * el(expert_dtype)
                if expert_dtype
                else sum(p.numel() * p.element_size() for p in params)
            )
            spec = layer.spec
            layers.append(
                MoELayerInfo(
                    layer=i,
                    num_experts=spec.num_experts,
                    top_k=spec.top_k,
                    intermediate_size=layer.storage.intermediate_size,
                    bytes_per_expert=nbytes // spec.num_experts,
                    n_group=spec.n_group,
                    topk_group=spec.topk_group,
                    group_score=spec.group_score,
                    keep_equals_renorm=bool(
                        spec.norm_topk_prob or spec.topk_before_softmax or spec.scoring == "sigmoid"
                    ),
                    router=spec.describe(),
                )
            )
        rest = _disk_other_dtype(disk) if disk else None

        def nbytes_of(key: str, t: torch.Tensor) -> int:
            if disk is None:
                return t.numel() * t.element_size()
            stored = disk.get(key)  # non-expert tensors keep their names on disk
            return t.numel() * el(stored[0] if stored else rest)

        other = 0
        for key, p in model.named_parameters():  # deduplicated: tied embeddings count once, as on disk
            if id(p) not in expert_params:
                other += nbytes_of(key, p)
        for mod_name, mod in model.named_modules():
            for buf, b in mod.named_buffers(recurse=False):
                if b is not None and buf not in mod._non_persistent_buffers_set:
                    other += nbytes_of(f"{mod_name}.{buf}" if mod_name else buf, b)
        first = adapter.layer(adapter.moe_layers[0])
        return cls(
            model_type=adapter.model_type,
            hidden_size=adapter.hidden_size,
            num_hidden_layers=len(adapter.decoder_layers),
            dtype=expert_dtype or str(dtype).removeprefix("torch."),
            disk_dtypes=sorted({d for d, _ in disk.values()}) if disk else None,
            expert_bias=first.storage.has_bias,
            layers=layers,
            expert_bytes=sum(x.bytes_per_expert * x.num_experts for x in layers),
            other_bytes=other,
            source=source if source is not None else name,
        )


def _dominant(disk: Mapping[str, tuple[str, int]], keep) -> str | None:
    """The dtype holding the most bytes among the stored tensors whose name passes `keep`."""
    by: dict[str, int] = {}
    for name, (dtype, n) in disk.items():
        if keep(name) and dtype.startswith(("float", "bfloat")):
            by[dtype] = by.get(dtype, 0) + n
    return min(by, key=lambda d: (-by[d], d)) if by else None


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_expert" not in name


def _disk_expert_dtype(disk: Mapping[str, tuple[str, int]]) -> str | None:
    """On-disk dtype of the routed experts: the dtype of tensors under ``.experts.`` (families that name
    their experts otherwise: the checkpoint's dominant floating dtype)."""
    return _dominant(disk, _is_routed_expert) or _dominant(disk, lambda n: True)


def _disk_other_dtype(disk: Mapping[str, tuple[str, int]]) -> str:
    return _dominant(disk, lambda n: not _is_routed_expert(n)) or _disk_expert_dtype(disk) or "float32"


# ----------------------------------------------------------------------------- stored experts
class StoredExpert(_Strict):
    """One stored expert of a scope: where it comes from and how it was built."""

    id: int = Field(ge=0)
    sources: list[tuple[int, int]]  # (layer, expert) of the original model
    construction: Construction = "copy"
    weights: list[float] | None = (
        None  # weighted_merge / dense_group: one per source (used when tensor is None)
    )
    tensor: str | None = None  # PlanTensors prefix when the method supplies the weights
    intermediate_size: int | None = Field(None, ge=1)  # width when it differs from the source layer's
    nbytes: int | None = Field(
        None, ge=0
    )  # stored bytes of packed (elementwise_merge) tensors when not at hand
    # PuzzleMoE packed layout of the tensors under `tensor` ("pair-bf16", "pair-q3-g128", "group3-bf16", ...;
    # see moecompress.runtime.packed). A packed expert holds one reconstruction per source: a slot that maps
    # to it computes the member whose source is (its layer, its slot) -- sources' order is the member order.
    packing: str | None = None
    # integer weights (tensors under `tensor`: p.{gate,up,down}.weight_packed/...); None = the model's dtype
    quant: QuantSpec | None = None

    @field_serializer("quant")
    def _quant_in_full(self, quant: QuantSpec | None):
        # in full: the plan's exclude_none must not drop group_size=None (per channel) to its default
        return None if quant is None else quant.model_dump(mode="json")


class Scope(_Strict):
    """A pool of stored experts used by one layer, or shared by several (cross-layer consolidation)."""

    id: str
    layers: list[int]
    stored: list[StoredExpert]


# ----------------------------------------------------------------------------- operators
class ConstantOp(_Strict):
    """The slot outputs a constant vector c (e.g. the expert's mean output): y = g * c."""

    op: Literal["constant"] = "constant"
    tensor: str  # p.value [H]


class TiltOp(_Strict):
    """Low-rank affine map of the token: y = g * (b + U (V^T x)), U, V [H, r]."""

    op: Literal["tilt"] = "tilt"
    rank: int
    tensor: str  # p.U, p.V [H, r]; p.bias [H]


class PartialOp(_Strict):
    """A subset of `width` neurons of an original expert plus an output bias."""

    op: Literal["partial"] = "partial"
    source: tuple[int, int]
    width: int
    tensor: str  # p.gate/p.up [w, H], p.down [H, w], p.bias [H]


Operator = Annotated[ConstantOp | TiltOp | PartialOp, Field(discriminator="op")]
SlotTarget = int | Literal["drop"] | Operator


class LayerPlan(_Strict):
    """What every original router slot of one MoE layer computes, and at what gate scale."""

    layer: int
    scope: str
    gate: GateSemantics = "renorm"
    slots: list[SlotTarget]

    def stored_ids(self) -> list[int]:
        return [s for s in self.slots if isinstance(s, int)]

    def dropped(self) -> list[int]:
        return [e for e, s in enumerate(self.slots) if s == "drop"]

    def operators(self) -> list[tuple[int, Any]]:
        return [(e, s) for e, s in enumerate(self.slots) if not isinstance(s, (int, str))]

    def routable(self) -> list[bool]:
        """Slots the router may still select: all of them unless the gate deletes or masks drops."""
        if self.gate in ("renorm", "keep"):
            return [s != "drop" for s in self.slots]
        return [True] * len(self.slots)


# ----------------------------------------------------------------------------- byte report
class ByteReport(_Strict):
    """A plan's bytes at the checkpoint's on-disk dtypes (`CompressionPlan.logical_bytes`)."""

    stored_experts: int
    operators: int
    other: int
    total: int
    original: int
    original_routed: int = 0  # the original's routed experts, as stored

    @property
    def routed(self) -> int:
        """What replaces the routed experts: stored experts + replacement operators."""
        return self.stored_experts + self.operators

    @property
    def ratio(self) -> float:
        return self.total / self.original if self.original else float("nan")

    @property
    def routed_ratio(self) -> float:
        """Routed bytes kept, as a fraction of the original's routed-expert bytes (what `auto`'s budget counts)."""
        return self.routed / self.original_routed if self.original_routed else float("nan")


def _fail(msg: str):
    raise MoECompressError(msg)


# ----------------------------------------------------------------------------- non-expert precisions
QUANT_TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def quant_tensor_prefix(name: str) -> str:
    """Where a quantized non-expert weight's integer tensors live, in plan tensors and in a `compact` checkpoint:
    compressed-tensors' pack-quantized names, ``<module>.weight_packed`` / ``.weight_scale`` / ``.weight_shape``
    (+ ``.weight_zero_point``) for checkpoint tensor ``<module>.weight``; returns ``<module>``."""
    return name.removesuffix(".weight")


class TensorQuant(_Strict):
    """The integer precision of one non-expert checkpoint tensor (issue 30): its class, its [out, in] shape and
    on-disk dtype in the original (for byte accounting and validation without the model), and the spec."""

    kind: Literal["attention", "shared", "dense_mlp", "embeddings", "lm_head", "router"]
    shape: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]  # a 2-D weight only
    dtype: str  # the original tensor's on-disk dtype
    quant: QuantSpec

    @field_validator("dtype")
    @classmethod
    def _floating(cls, v: str) -> str:
        return _floating_dtype(v)

    @field_serializer("quant")
    def _quant_in_full(self, quant: QuantSpec):
        return quant.model_dump(
            mode="json"
        )  # as StoredExpert.quant: group_size=None must survive exclude_none

    def original_bytes(self) -> int:
        return (
            self.shape[0] * self.shape[1] * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        )

    def stored_bytes(self) -> int:
        return self.quant.tensor_bytes(*self.shape)


# ----------------------------------------------------------------------------- the plan
class CompressionPlan(_Strict):
    """Per MoE layer (or scope): stored experts, the slot map and the gate semantics. See module doc."""

    schema_version: int = SCHEMA_VERSION
    model: ModelInfo
    scopes: list[Scope]
    layers: list[LayerPlan]
    method: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    # a precision for non-expert tensors (issue 30): checkpoint tensor name -> TensorQuant; absent = as stored.
    # Empty by default, and then left out of plan.json, so plans without it serialize as before
    tensor_quant: dict[str, TensorQuant] = Field(default_factory=dict)

    # ------------------------------------------------------------------ validation
    @model_validator(mode="after")
    def _validate(self) -> CompressionPlan:
        # MoECompressError is not a ValueError, so pydantic lets it through unchanged: one sentence.
        self.check()
        return self

    def check(self) -> None:
        """Raise MoECompressError (one sentence) if the plan is inconsistent or infeasible."""
        if self.schema_version != SCHEMA_VERSION:
            _fail(
                f"Plan schema version {self.schema_version} is not supported (this moecompress reads version "
                f"{SCHEMA_VERSION}); regenerate the plan with this version."
            )
        info = {x.layer: x for x in self.model.layers}
        seen = [lp.layer for lp in self.layers]
        if len(set(seen)) != len(seen):
            dup = sorted({x for x in seen if seen.count(x) > 1})
            _fail(f"The plan lists MoE layer {dup[0]} twice; give each layer exactly one entry.")
        if set(seen) != set(info):
            missing, extra = sorted(set(info) - set(seen)), sorted(set(seen) - set(info))
            if extra:
                _fail(
                    f"The plan has an entry for layer {extra[0]}, which is not a MoE layer of the model "
                    f"(MoE layers: {sorted(info)}); remove it."
                )
            _fail(
                f"The plan has no entry for MoE layer {missing[0]}; every MoE layer needs one "
                "(use the identity mapping for layers left untouched)."
            )
        scopes = {}
        for sc in self.scopes:
            if sc.id in scopes:
                _fail(f"Scope id '{sc.id}' is used twice; scope ids must be unique.")
            scopes[sc.id] = sc
            if not sc.layers:
                _fail(f"Scope '{sc.id}' covers no layers; list the layers that use it.")
            if [s.id for s in sc.stored] != list(range(len(sc.stored))):
                _fail(f"Stored experts of scope '{sc.id}' must have ids 0..{len(sc.stored) - 1} in order.")
            for s in sc.stored:
                self._check_stored(sc, s, info)
        owner = {}
        for sc in self.scopes:
            for i in sc.layers:
                if i in owner:
                    _fail(
                        f"Layer {i} belongs to scopes '{owner[i]}' and '{sc.id}'; a layer uses exactly one scope."
                    )
                owner[i] = sc.id
        used: dict[str, set[int]] = {sc.id: set() for sc in self.scopes}
        for lp in sorted(self.layers, key=lambda x: x.layer):
            li = info[lp.layer]
            if lp.scope not in scopes:
                _fail(f"Layer {lp.layer} refers to scope '{lp.scope}', which the plan does not define.")
            if owner.get(lp.layer) != lp.scope:
                _fail(
                    f"Layer {lp.layer} uses scope '{lp.scope}' but that scope does not list layer {lp.layer}; "
                    "add the layer to the scope's layers."
                )
            if len(lp.slots) != li.num_experts:
                _fail(
                    f"Layer {lp.layer} maps {len(lp.slots)} slots but the model has {li.num_experts} experts there; "
                    'map every original slot (to a stored id, an operator or "drop").'
                )
            k_stored = len(scopes[lp.scope].stored)
            for e, target in enumerate(lp.slots):
                if isinstance(target, bool):
                    _fail(
                        f'Slot {e} of layer {lp.layer} is a boolean; use a stored id, an operator or "drop".'
                    )
                if isinstance(target, int):
                    if not 0 <= target < k_stored:
                        _fail(
                            f"Slot {e} of layer {lp.layer} maps to stored expert {target}, but scope "
                            f"'{lp.scope}' stores only ids 0..{k_stored - 1}."
                        )
                    packed = scopes[lp.scope].stored[target]
                    if packed.packing is not None and (lp.layer, e) not in [tuple(x) for x in packed.sources]:
                        _fail(
                            f"Slot {e} of layer {lp.layer} maps to the packed stored expert {target} of scope "
                            f"'{lp.scope}', which holds only its sources {[tuple(x) for x in packed.sources]}; "
                            "a slot can only compute its own member of a packed merge."
                        )
                    used[lp.scope].add(target)
                elif not isinstance(target, str):
                    self._check_operator(lp.layer, e, target, info)
            self._check_routing(lp, li)
        for sc in self.scopes:
            unused = sorted(set(range(len(sc.stored))) - used[sc.id])
            if unused:
                _fail(
                    f"Stored expert {unused[0]} of scope '{sc.id}' is never used by any slot; remove it "
                    "(it would only cost bytes)."
                )
        for name, _tq in self.tensor_quant.items():
            if not name.endswith(".weight"):
                _fail(
                    f"The plan quantizes '{name}', which is not a '.weight' tensor; only 2-D weights of "
                    "linear layers and embeddings take an integer precision."
                )
        if sum(tq.original_bytes() for tq in self.tensor_quant.values()) > self.model.other_bytes:
            _fail(
                "The plan quantizes more non-expert bytes than the model holds; it was made for another model."
            )

    def _check_stored(self, sc: Scope, s: StoredExpert, info: dict[int, MoELayerInfo]) -> None:
        where = f"stored expert {s.id} of scope '{sc.id}'"
        if not s.sources:
            _fail(f"The {where} has no sources; list the (layer, expert) pairs it was built from.")
        for layer, e in s.sources:
            if layer not in info or not 0 <= e < info[layer].num_experts:
                _fail(f"The {where} names source ({layer}, {e}), which is not an expert of the model.")
            if layer not in sc.layers:
                _fail(
                    f"The {where} takes expert {e} of layer {layer}, outside the scope's layers {sc.layers}; "
                    "add that layer to the scope."
                )
        if s.construction == "copy":
            if len(s.sources) != 1 or s.weights is not None:
                _fail(f"The {where} is a copy, so it needs exactly one source and no weights.")
        elif s.construction in ("weighted_merge", "dense_group"):
            # with supplied tensors the weights are provenance only (e.g. one per group of sources)
            if s.tensor is None and s.weights is not None and len(s.weights) != len(s.sources):
                _fail(
                    f"The {where} has {len(s.weights)} weights for {len(s.sources)} sources; give one per source."
                )
            if s.construction == "weighted_merge" and s.weights is None and s.tensor is None:
                _fail(f"The {where} is a weighted merge without weights or tensors; give merge weights.")
        elif s.tensor is None:
            _fail(
                f"The {where} is an element-wise merge, so the method must supply its tensors (set 'tensor')."
            )
        if s.quant is not None:
            if s.packing is not None:
                _fail(
                    f"The {where} is packed as '{s.packing}', which carries its own precision; drop its 'quant'."
                )
            if s.tensor is None:
                _fail(f"The {where} is quantized, so its integer tensors must be supplied (set 'tensor').")
        if s.packing is not None:
            if s.construction != "elementwise_merge":
                _fail(
                    f"The {where} declares packing '{s.packing}' but is a {s.construction}; only element-wise "
                    "merges are packed."
                )
            from .puzzle.codes import parse_packing

            spec = parse_packing(s.packing)
            if len(s.sources) != spec.members or len(set(s.sources)) != spec.members:
                _fail(
                    f"The {where} is packed as '{s.packing}' ({spec.members} members) but lists "
                    f"{len(s.sources)} sources; give one distinct source per member."
                )

    def _check_operator(self, layer: int, e: int, op, info: dict[int, MoELayerInfo]) -> None:
        h = self.model.hidden_size
        if isinstance(op, TiltOp) and not 1 <= op.rank <= h:
            _fail(f"The tilt operator of slot {e} in layer {layer} has rank {op.rank}; use 1..{h}.")
        if isinstance(op, PartialOp):
            sl, se = op.source
            if sl not in info or not 0 <= se < info[sl].num_experts:
                _fail(
                    f"The partial copy of slot {e} in layer {layer} names source ({sl}, {se}), "
                    "which is not an expert of the model."
                )
            if not 1 <= op.width <= info[sl].intermediate_size:
                _fail(
                    f"The partial copy of slot {e} in layer {layer} keeps {op.width} neurons; "
                    f"use 1..{info[sl].intermediate_size}."
                )

    def _check_routing(self, lp: LayerPlan, li: MoELayerInfo) -> None:
        routable = lp.routable()
        n = sum(routable)
        if n < li.top_k:
            _fail(
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
                _fail(
                    f"Layer {lp.layer} makes group-limited routing infeasible: the {li.topk_group} router groups "
                    f"with fewest experts left hold {worst} < top-{li.top_k}; keep more experts in the groups "
                    f"of {size}."
                )
            if li.group_score == "top2_sum" and 1 in counts:
                _fail(
                    f"Layer {lp.layer} leaves a group with a single expert, but this router scores groups by the "
                    "sum of their top two experts; keep zero or at least two experts in every group."
                )

    def check_model(self, adapter) -> None:
        """Refuse a plan made for a different model (one sentence)."""
        m = self.model
        if adapter.model_type != m.model_type or adapter.moe_layers != [x.layer for x in m.layers]:
            _fail(
                f"This plan was made for a {m.model_type} model with MoE layers {[x.layer for x in m.layers]}, "
                f"but the model is {adapter.model_type} with MoE layers {adapter.moe_layers}; use a plan made "
                "for this model."
            )
        for x in m.layers:
            if (
                adapter.num_experts(x.layer) != x.num_experts
                or adapter.intermediate_size(x.layer) != x.intermediate_size
            ):
                _fail(
                    f"Layer {x.layer} of the model has {adapter.num_experts(x.layer)} experts of width "
                    f"{adapter.intermediate_size(x.layer)}, the plan expects {x.num_experts} of width "
                    f"{x.intermediate_size}; use a plan made for this model."
                )
        if self.tensor_quant:
            from .models.tensor_classes import tensor_classes, tensor_shapes

            classes, shapes = tensor_classes(adapter), tensor_shapes(adapter)
            for name, tq in self.tensor_quant.items():
                if classes.get(name) != tq.kind or shapes.get(name) != tuple(tq.shape):
                    found = (
                        f"a {classes[name]} tensor of shape {shapes[name]}"
                        if name in classes
                        else "not a tensor of it"
                    )
                    _fail(
                        f"The plan quantizes '{name}' as a {tq.kind} weight of shape {tuple(tq.shape)}, but in "
                        f"the model it is {found}; use a plan made for this model."
                    )

    def check_tensors(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Every tensor the plan references is present with the right shape (one sentence if not)."""
        tensors = tensors or {}
        h = self.model.hidden_size
        for sc in self.scopes:
            for s in sc.stored:
                if s.tensor is None:
                    continue
                if s.quant is not None:
                    self._need_quant(tensors, s.tensor, s.quant, self.expert_shapes(sc, s))
                    continue
                if s.packing is not None:
                    from .puzzle.codes import check_packed_tensors

                    check_packed_tensors(self, sc, s, tensors)
                    continue
                if s.construction == "elementwise_merge" and f"{s.tensor}.gate" not in tensors:
                    from .decoders import has_decoder

                    if not any(k.startswith(s.tensor + ".") for k in tensors):
                        _fail(
                            f"The plan tensors lack '{s.tensor}.*' for stored expert {s.id} of scope '{sc.id}'; "
                            "pass the tensors the method produced (plan_tensors.safetensors)."
                        )
                    if not has_decoder(s.construction):
                        _fail(
                            f"Stored expert {s.id} of scope '{sc.id}' is packed but no decoder is registered "
                            "for element-wise merges; import the PuzzleMoE method module first."
                        )
                    continue
                self._need(tensors, s.tensor, self.expert_shapes(sc, s))
        for name, tq in self.tensor_quant.items():
            prefix, _, part = quant_tensor_prefix(name).rpartition(".")
            self._need_quant(
                tensors, prefix, tq.quant, {part: tuple(tq.shape)}, what=f"quantized {tq.kind} weight"
            )
        for lp in self.layers:
            for _e, op in lp.operators():
                if isinstance(op, ConstantOp):
                    self._need(tensors, op.tensor, {"value": (h,)})
                elif isinstance(op, TiltOp):
                    self._need(tensors, op.tensor, {"U": (h, op.rank), "V": (h, op.rank), "bias": (h,)})
                else:
                    self._need(
                        tensors,
                        op.tensor,
                        {"gate": (op.width, h), "up": (op.width, h), "down": (h, op.width), "bias": (h,)},
                    )

    @staticmethod
    def _need(tensors, prefix: str, shapes: dict[str, tuple]) -> None:
        for part, shape in shapes.items():
            key = f"{prefix}.{part}"
            if key not in tensors:
                _fail(
                    f"The plan tensors lack '{key}'; pass the tensors the method produced "
                    "(plan_tensors.safetensors beside plan.json)."
                )
            if tuple(tensors[key].shape) != shape:
                _fail(
                    f"Plan tensor '{key}' has shape {tuple(tensors[key].shape)}, expected {shape}; "
                    "the tensors do not belong to this plan."
                )

    @staticmethod
    def _need_quant(
        tensors, prefix: str, spec: QuantSpec, shapes: dict[str, tuple], what: str = "stored expert"
    ) -> None:
        for part, shape in shapes.items():
            key = f"{prefix}.{part}" if prefix else part
            for suffix in ("weight_packed", "weight_scale", "weight_shape") + (
                () if spec.symmetric else ("weight_zero_point",)
            ):
                if f"{key}.{suffix}" not in tensors:
                    _fail(
                        f"The plan tensors lack '{key}.{suffix}' of a {spec.name()} {what}; pass the "
                        "tensors the quantization produced (plan_tensors.safetensors beside plan.json)."
                    )
            if tuple(int(x) for x in tensors[f"{key}.weight_shape"].reshape(-1).tolist()) != shape:
                _fail(
                    f"Plan tensor '{key}' is quantized with shape {tuple(tensors[f'{key}.weight_shape'].tolist())}, "
                    f"expected {shape}; the tensors do not belong to this plan."
                )
            from .quant.tensor import check_packed

            check_packed(
                {s: tensors[f"{key}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")},
                spec,
                f"Plan tensor '{key}'",
            )

    # ------------------------------------------------------------------ queries
    def expert_shapes(self, sc: Scope, s: StoredExpert) -> dict[str, tuple[int, int]]:
        """[out, in] of the stored expert's gate, up and down projections."""
        w, h = self.stored_width(sc, s), self.model.hidden_size
        return {"gate": (w, h), "up": (w, h), "down": (h, w)}

    def quant_specs(self) -> set:
        """The precisions of the stored experts (None = the model's dtype)."""
        return {s.quant for sc in self.scopes for s in sc.stored}

    def layer(self, i: int) -> LayerPlan:
        for lp in self.layers:
            if lp.layer == i:
                return lp
        raise MoECompressError(f"The plan has no entry for layer {i}.")

    def scope(self, scope_id: str) -> Scope:
        for sc in self.scopes:
            if sc.id == scope_id:
                return sc
        raise MoECompressError(f"The plan has no scope '{scope_id}'.")

    def scope_of(self, i: int) -> Scope:
        return self.scope(self.layer(i).scope)

    def stored_width(self, sc: Scope, s: StoredExpert) -> int:
        if s.intermediate_size is not None:
            return s.intermediate_size
        widths = [self.model.layer(layer).intermediate_size for layer, _ in s.sources]
        return sum(widths) if s.construction == "dense_group" else widths[0]

    def scope_width(self, sc: Scope) -> int:
        """Width of the scope's fused tensor: the widest stored expert (narrower ones are zero-padded)."""
        return max(self.stored_width(sc, s) for s in sc.stored)

    def has_packed(self) -> bool:
        """Does any stored expert keep PuzzleMoE packed tensors?"""
        return any(s.packing is not None for sc in self.scopes for s in sc.stored)

    def logical_bytes(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        accounting: Literal["logical", "stored"] = "logical",
    ) -> ByteReport:
        """Bytes the compressed model needs: stored experts + operator parameters + everything else.

        The one byte count of a plan: the `auto` solver's budget, the exporter's report and the tests
        use it. Everything is counted at the checkpoint's on-disk dtypes (`ModelInfo`): copies cost the
        original expert's bytes; dense merged experts and operators are stored in the experts' dtype
        (counted from shapes); packed element-wise merges count their tensors (or their declared
        ``nbytes``). "Everything else" is the original's non-expert tensors, each one the plan quantizes
        (`tensor_quant`) at its pack-quantized bytes (`QuantSpec.tensor_bytes`) instead of its on-disk bytes: the
        total is the whole file's weights.

        ``accounting="stored"`` counts what the compact/packed checkpoint writes, padding included: the
        runtime holds a scope's dense stored experts at the scope's widest width, a layer's tilts at its
        largest rank and its partial copies at their largest width.
        """
        el = self.model.element_size
        h = self.model.hidden_size
        bias = self.model.expert_bias
        padded = accounting == "stored"
        stored = 0
        for sc in self.scopes:
            # a scope holding quantized experts stores every expert at its own width (QuantizedStoredExperts)
            pad = padded and all(s.quant is None for s in sc.stored)
            width = self.scope_width(sc) if pad else None
            for s in sc.stored:
                if s.quant is not None:
                    shapes = self.expert_shapes(sc, s)
                    stored += sum(s.quant.tensor_bytes(*shape) for shape in shapes.values())
                    stored += (2 * shapes["gate"][0] + h) * el if bias else 0
                elif (
                    pad
                    and s.packing is None
                    and not (
                        s.construction == "elementwise_merge"
                        and (tensors is None or f"{s.tensor}.gate" not in tensors)
                    )
                ):
                    stored += (3 * width * h + (2 * width + h if bias else 0)) * el
                elif s.construction == "copy":
                    stored += self.model.layer(s.sources[0][0]).bytes_per_expert
                elif s.construction == "elementwise_merge" and (
                    s.packing is not None or tensors is None or f"{s.tensor}.gate" not in tensors
                ):
                    if tensors is not None and any(k.startswith(f"{s.tensor}.") for k in tensors):
                        mine = (tensors[k] for k in tensors if k.startswith(f"{s.tensor}."))  # keys first: a
                        stored += sum(
                            t.numel() * t.element_size() for t in mine
                        )  # lazy mapping reads only these
                    elif s.nbytes is not None:
                        stored += s.nbytes
                    else:
                        _fail(
                            f"Stored expert {s.id} of scope '{sc.id}' is packed; pass its tensors or set nbytes "
                            "to count its bytes."
                        )
                else:
                    w = self.stored_width(sc, s)
                    stored += (3 * w * h + (2 * w + h if bias else 0)) * el
        ops = 0
        for lp in self.layers:
            found = [op for _, op in lp.operators()]
            rank = max((op.rank for op in found if isinstance(op, TiltOp)), default=0)
            pwidth = max((op.width for op in found if not isinstance(op, (ConstantOp, TiltOp))), default=0)
            for op in found:
                if isinstance(op, ConstantOp):
                    ops += h * el
                elif isinstance(op, TiltOp):
                    ops += (2 * h * (rank if padded else op.rank) + h) * el
                else:
                    w = pwidth if padded else op.width
                    ops += (3 * w * h + h + (2 * w if bias else 0)) * el
        other = self.model.other_bytes + sum(
            tq.stored_bytes() - tq.original_bytes() for tq in self.tensor_quant.values()
        )
        return ByteReport(
            stored_experts=stored,
            operators=ops,
            other=other,
            total=stored + ops + other,
            original=self.model.expert_bytes + self.model.other_bytes,
            original_routed=self.model.expert_bytes,
        )

    def summary(self) -> list[dict]:
        """One row per MoE layer, for reports."""
        rows = []
        for lp in sorted(self.layers, key=lambda x: x.layer):
            sc = self.scope(lp.scope)
            rows.append(
                dict(
                    layer=lp.layer,
                    scope=sc.id,
                    stored=len(sc.stored),
                    gate=lp.gate,
                    slots=len(lp.slots),
                    to_stored=len(lp.stored_ids()),
                    operators=len(lp.operators()),
                    dropped=len(lp.dropped()),
                )
            )
        return rows

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> str:
        """Deterministic JSON: sorted keys, no None fields; same plan -> same bytes."""
        data = self.model_dump(mode="json", exclude_none=True)
        if not data.get("tensor_quant"):
            data.pop("tensor_quant", None)  # plans without non-expert precisions serialize as before
        return json.dumps(data, sort_keys=True, indent=1, ensure_ascii=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "the plan") -> CompressionPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MoECompressError(
                f"{where} is not valid JSON (line {exc.lineno}); regenerate or fix it."
            ) from None
        if isinstance(data, dict) and data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            _fail(
                f"{where} has schema version {data.get('schema_version')}, but this moecompress reads version "
                f"{SCHEMA_VERSION}; regenerate the plan with this version."
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise MoECompressError(
                f"{where} is invalid at '{loc}': {err['msg']}; fix it (see docs/plan.md)."
            ) from None

    def save(self, directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
        """Write plan.json (+ plan_tensors.safetensors when tensors are given) into `directory`."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / PLAN_FILE).write_text(self.to_json())
        if tensors:
            from safetensors.torch import save_file

            save_file(
                {k: v.detach().contiguous().cpu() for k, v in sorted(tensors.items())},
                str(d / TENSORS_FILE),
                metadata={"format": "pt"},
            )
        return d / PLAN_FILE

    @classmethod
    def load(cls, path: str | os.PathLike) -> tuple[CompressionPlan, PlanTensors]:
        """Read a plan (a plan.json file or a directory holding one) and its tensors if present."""
        p = Path(path)
        file = p / PLAN_FILE if p.is_dir() else p
        if not file.is_file():
            _fail(f"No plan at {path}: pass a plan.json file or a directory that holds one.")
        plan = cls.from_json(file.read_text(), where=str(file))
        tensors: PlanTensors = {}
        tfile = file.parent / TENSORS_FILE
        if tfile.is_file():
            from safetensors.torch import load_file

            try:
                tensors = load_file(str(tfile))
            except Exception:  # safetensors raises its own error types for truncated/garbled files
                _fail(f"{tfile} is corrupted (not a readable safetensors file); regenerate the plan.")
        return plan, tensors

    # ------------------------------------------------------------------ builders
    @classmethod
    def identity(cls, model, method: str = "identity", source: str | None = None) -> CompressionPlan:
        """Every slot keeps its own expert (ratio 0)."""
        info = ModelInfo.from_model(model, source)
        return cls.prune(info, {x.layer: list(range(x.num_experts)) for x in info.layers}, method=method)

    @classmethod
    def prune(
        cls,
        model,
        keep: Mapping[int, Sequence[int]],
        gate: GateSemantics = "renorm",
        method: str = "prune",
        params: dict | None = None,
        source: str | None = None,
    ) -> CompressionPlan:
        """Keep the listed experts of each layer (copies); every other slot is dropped, at gate `gate`."""
        info = model if isinstance(model, ModelInfo) else ModelInfo.from_model(model, source)
        scopes, layers = [], []
        for li in info.layers:
            kept = sorted(set(int(e) for e in keep.get(li.layer, range(li.num_experts))))
            sid = f"layer{li.layer}"
            scopes.append(
                Scope(
                    id=sid,
                    layers=[li.layer],
                    stored=[StoredExpert(id=j, sources=[(li.layer, e)]) for j, e in enumerate(kept)],
                )
            )
            pos = {e: j for j, e in enumerate(kept)}
            layers.append(
                LayerPlan(
                    layer=li.layer,
                    scope=sid,
                    gate=gate,
                    slots=[pos.get(e, "drop") for e in range(li.num_experts)],
                )
            )
        return cls(model=info, scopes=scopes, layers=layers, method=method, params=params or {})

    @classmethod
    def remap(
        cls,
        model,
        assignment: Mapping[int, Sequence[int]],
        gate: GateSemantics = "aggregate",
        method: str = "remap",
        params: dict | None = None,
        source: str | None = None,
    ) -> CompressionPlan:
        """Per layer, slot e computes original expert assignment[e] (a retained prototype), stored once."""
        info = model if isinstance(model, ModelInfo) else ModelInfo.from_model(model, source)
        scopes, layers = [], []
        for li in info.layers:
            assign = [int(a) for a in assignment.get(li.layer, range(li.num_experts))]
            protos = sorted(set(assign))
            sid = f"layer{li.layer}"
            scopes.append(
                Scope(
                    id=sid,
                    layers=[li.layer],
                    stored=[StoredExpert(id=j, sources=[(li.layer, e)]) for j, e in enumerate(protos)],
                )
            )
            pos = {e: j for j, e in enumerate(protos)}
            layers.append(LayerPlan(layer=li.layer, scope=sid, gate=gate, slots=[pos[a] for a in assign]))
        return cls(model=info, scopes=scopes, layers=layers, method=method, params=params or {})
