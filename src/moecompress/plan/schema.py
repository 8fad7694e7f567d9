"""The plan's vocabulary: the pydantic models a `CompressionPlan` is made of (stored experts, scopes,
replacement operators, per-layer slot maps, non-expert precisions, the byte report), the file names and
the schema version. Leaf of the package: it imports no sibling module."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from ..errors import MoECompressError
from ..quant.spec import QuantSpec

SCHEMA_VERSION = 1
PLAN_FILE = "plan.json"
TENSORS_FILE = "plan_tensors.safetensors"

GateSemantics = Literal["renorm", "keep", "aggregate", "replace"]
Construction = Literal["copy", "weighted_merge", "elementwise_merge", "dense_group"]
PlanTensors = dict[str, torch.Tensor]


class Strict(BaseModel):
    """Base of every plan model: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


def fail(msg: str):
    """Refuse with one sentence (MoECompressError is not a ValueError, so pydantic lets it through unchanged)."""
    raise MoECompressError(msg)


def floating_dtype(v: str) -> str:
    # getattr(torch, v) must be a floating dtype: "load" named torch.load and failed later as a traceback
    if not isinstance(getattr(torch, v, None), torch.dtype) or not getattr(torch, v).is_floating_point:
        raise ValueError(f"'{v}' is not a floating torch dtype such as bfloat16 or float32")
    return v


# ----------------------------------------------------------------------------- stored experts
class StoredExpert(Strict):
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


class Scope(Strict):
    """A pool of stored experts used by one layer, or shared by several (cross-layer consolidation)."""

    id: str
    layers: list[int]
    stored: list[StoredExpert]


# ----------------------------------------------------------------------------- operators
class ConstantOp(Strict):
    """The slot outputs a constant vector c (e.g. the expert's mean output): y = g * c."""

    op: Literal["constant"] = "constant"
    tensor: str  # p.value [H]


class TiltOp(Strict):
    """Low-rank affine map of the token: y = g * (b + U (V^T x)), U, V [H, r]."""

    op: Literal["tilt"] = "tilt"
    rank: int
    tensor: str  # p.U, p.V [H, r]; p.bias [H]


class PartialOp(Strict):
    """A subset of `width` neurons of an original expert plus an output bias."""

    op: Literal["partial"] = "partial"
    source: tuple[int, int]
    width: int
    tensor: str  # p.gate/p.up [w, H], p.down [H, w], p.bias [H]


Operator = Annotated[ConstantOp | TiltOp | PartialOp, Field(discriminator="op")]
SlotTarget = int | Literal["drop"] | Operator


class LayerPlan(Strict):
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
class ByteReport(Strict):
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


# ----------------------------------------------------------------------------- non-expert precisions
QUANT_TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def quant_tensor_prefix(name: str) -> str:
    """Where a quantized non-expert weight's integer tensors live, in plan tensors and in a `compact` checkpoint:
    compressed-tensors' pack-quantized names, ``<module>.weight_packed`` / ``.weight_scale`` / ``.weight_shape``
    (+ ``.weight_zero_point``) for checkpoint tensor ``<module>.weight``; returns ``<module>``."""
    return name.removesuffix(".weight")


class TensorQuant(Strict):
    """The integer precision of one non-expert checkpoint tensor (issue 30): its class, its [out, in] shape and
    on-disk dtype in the original (for byte accounting and validation without the model), and the spec."""

    kind: Literal["attention", "shared", "dense_mlp", "embeddings", "lm_head", "router"]
    shape: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]  # a 2-D weight only
    dtype: str  # the original tensor's on-disk dtype
    quant: QuantSpec

    @field_validator("dtype")
    @classmethod
    def _floating(cls, v: str) -> str:
        return floating_dtype(v)

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
