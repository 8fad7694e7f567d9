"""`CompressionPlan`: the fields, the queries the runtime and exporters ask, and thin methods that delegate
to the sibling modules (`checks`, `accounting`, `serialize`, `builders`). The top of the package: no sibling
imports it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from ..errors import MoECompressError
from . import accounting as _accounting
from . import builders, checks, serialize
from .model_info import ModelInfo
from .schema import (
    SCHEMA_VERSION,
    ByteReport,
    GateSemantics,
    LayerPlan,
    PlanTensors,
    Scope,
    StoredExpert,
    Strict,
    TensorQuant,
)


class CompressionPlan(Strict):
    """Per MoE layer (or scope): stored experts, the slot map and the gate semantics. See the package doc."""

    schema_version: int = SCHEMA_VERSION
    model: ModelInfo
    scopes: list[Scope]
    layers: list[LayerPlan]
    method: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    # a precision for non-expert tensors (issue 30): checkpoint tensor name -> TensorQuant; absent = as stored.
    # Empty by default, and then left out of plan.json, so plans without it serialize as before
    tensor_quant: dict[str, TensorQuant] = Field(default_factory=dict)

    # ------------------------------------------------------------------ validation (checks.py)
    @model_validator(mode="after")
    def _validate(self) -> CompressionPlan:
        # MoECompressError is not a ValueError, so pydantic lets it through unchanged: one sentence.
        self.check()
        return self

    def check(self) -> None:
        """Raise MoECompressError (one sentence) if the plan is inconsistent or infeasible."""
        checks.check(self)

    def check_model(self, adapter) -> None:
        """Refuse a plan made for a different model (one sentence)."""
        checks.check_model(self, adapter)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Every tensor the plan references is present with the right shape (one sentence if not)."""
        checks.check_tensors(self, tensors)

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
        return _accounting.logical_bytes(self, tensors, accounting)

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

    # ------------------------------------------------------------------ serialisation (serialize.py)
    def to_json(self) -> str:
        """Deterministic JSON: sorted keys, no None fields; same plan -> same bytes."""
        return serialize.to_json(self)

    @classmethod
    def from_json(cls, text: str, where: str = "the plan") -> CompressionPlan:
        return serialize.from_json(cls, text, where)

    def save(self, directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
        """Write plan.json (+ plan_tensors.safetensors when tensors are given) into `directory`."""
        return serialize.save(self, directory, tensors)

    @classmethod
    def load(cls, path: str | os.PathLike) -> tuple[CompressionPlan, PlanTensors]:
        """Read a plan (a plan.json file or a directory holding one) and its tensors if present."""
        return serialize.load(cls, path)

    # ------------------------------------------------------------------ builders (builders.py)
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
        return builders.prune(cls, model, keep, gate, method, params, source)

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
        return builders.remap(cls, model, assignment, gate, method, params, source)
