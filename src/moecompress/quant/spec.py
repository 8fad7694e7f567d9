"""QuantSpec: one weight-quantization setting (bits, grouping, symmetry, algorithm), parsed from "w4g128".

Text form (``QuantSpec.parse`` / ``QuantSpec.name``): ``w<bits>g<group>`` or ``w<bits>c`` (one group per
output channel), with a trailing ``a`` for asymmetric: ``w4g128``, ``w3g64a``, ``w2g32``, ``w8c``. The
algorithm (``rtn``/``gptq``) and the GPTQ knobs are not part of the text; they are passed separately
(``--quant-algo``) because they change how codes are chosen, not what is stored.

Stored bytes of one [out, in] weight (``tensor_bytes``), exactly the tensors compressed-tensors'
``pack-quantized`` format writes (see docs/quantization.md):

    weight_packed      int32 [out, ceil(in·b/32)]             4·out·ceil(in·b/32)
    weight_scale       bf16  [out, G]                          2·out·G        (G = in/group, or 1)
    weight_zero_point  int32 [ceil(out·b/32), G]  (asym only)  4·ceil(out·b/32)·G
    weight_shape       int64 [2]                               16
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from ..errors import MoECompressError

ALLOWED_GROUPS = (32, 64, 128)
_SPEC_RE = re.compile(r"^w(?P<bits>\d+)(?:g(?P<group>\d+)|(?P<channel>c))(?P<asym>a?)$")
_SPEC_HELP = (
    "write w<bits>g<group> or w<bits>c with bits 2, 3, 4, 5 or 8, group 32, 64 or 128, "
    "and an optional trailing 'a' for asymmetric (for example w4g128, w3g64a or w8c)"
)
SHAPE_BYTES = 16  # weight_shape: int64 [2], stored next to every packed weight


class QuantSpec(BaseModel):
    """Integer weight quantization of a 2-D weight [out, in], grouped along the input dimension."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[2, 3, 4, 5, 8]
    group_size: int | None = 128  # along the input dim; None = one group per output channel
    symmetric: bool = True
    algo: Literal["rtn", "gptq"] = "gptq"
    damp: float = 0.01  # GPTQ dampening: damp · mean(diag H) is added to diag H
    block_size: int = 128  # GPTQ lazy-batch block (columns)
    # GPTQ column order by descending diag(H), llm-compressor's default "static" (docs/quantization.md,
    # "Defaults"): on unless asked off; round-to-nearest has no column order, so it is off there
    actorder: bool = True

    @model_validator(mode="before")
    @classmethod
    def _actorder_default(cls, data):
        if isinstance(data, dict) and "actorder" not in data:
            data = {**data, "actorder": data.get("algo", "gptq") == "gptq"}
        return data

    @field_validator("group_size")
    @classmethod
    def _group_allowed(cls, v: int | None) -> int | None:
        if v is not None and v not in ALLOWED_GROUPS:
            raise ValueError(f"group_size must be one of {ALLOWED_GROUPS} or None, got {v}")
        return v

    @field_validator("damp")
    @classmethod
    def _damp_positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"damp must be > 0, got {v}")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"block_size must be >= 1, got {v}")
        return v

    @classmethod
    def parse(cls, text: str, algo: str = "gptq", **gptq_options) -> QuantSpec:
        """Parse "w4g128" / "w8c" / "w3g64a"; a bad spec or algorithm is a one-sentence MoECompressError."""
        m = _SPEC_RE.match(text.strip().lower()) if isinstance(text, str) else None
        if m is None:
            raise MoECompressError(f"Quantization spec {text!r} is not valid: {_SPEC_HELP}.")
        bits = int(m["bits"])
        group = None if m["channel"] else int(m["group"])
        if bits not in (2, 3, 4, 5, 8) or (group is not None and group not in ALLOWED_GROUPS):
            raise MoECompressError(f"Quantization spec {text!r} is not valid: {_SPEC_HELP}.")
        if algo not in ("rtn", "gptq"):
            raise MoECompressError(f"Quantization algorithm {algo!r} is not known: use rtn or gptq.")
        return cls(bits=bits, group_size=group, symmetric=not m["asym"], algo=algo, **gptq_options)

    def as_rtn(self) -> QuantSpec:
        """This spec as round-to-nearest (no column order): what a weight without a Hessian gets."""
        return self if self.algo == "rtn" else self.model_copy(update={"algo": "rtn", "actorder": False})

    def name(self) -> str:
        """Inverse of ``parse`` (the algorithm is not part of the name)."""
        grouping = f"g{self.group_size}" if self.group_size is not None else "c"
        return f"w{self.bits}{grouping}{'' if self.symmetric else 'a'}"

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def num_groups(self, in_features: int) -> int:
        """G = ceil(in / group): a group that does not divide the input leaves a shorter last group, as
        compressed-tensors allows (its non-strict ``strategy_cdiv``; vLLM's kernels want it to divide)."""
        return 1 if self.group_size is None else math.ceil(in_features / self.group_size)

    def group_width(self, in_features: int) -> int:
        """Input columns per group (the last one may be shorter)."""
        return in_features if self.group_size is None else self.group_size

    def tensor_bytes(self, out_features: int, in_features: int) -> int:
        """Exact bytes of the pack-quantized tensors of one [out, in] weight (formula in the module docstring)."""
        groups = self.num_groups(in_features)
        packed = 4 * out_features * math.ceil(in_features * self.bits / 32)
        scale = 2 * out_features * groups
        zero = 0 if self.symmetric else 4 * math.ceil(out_features * self.bits / 32) * groups
        return packed + scale + zero + SHAPE_BYTES

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        """Stored bits per weight element, scales, zero points and the shape tensor included."""
        return 8.0 * self.tensor_bytes(out_features, in_features) / (out_features * in_features)

    def quantization_args(self):
        """The equivalent compressed-tensors ``QuantizationArgs`` (for quantization_config and CT calls)."""
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(
            num_bits=self.bits,
            type="int",
            symmetric=self.symmetric,
            strategy="group" if self.group_size is not None else "channel",
            group_size=self.group_size,
            actorder="static" if (self.algo == "gptq" and self.actorder) else None,
            observer="memoryless_minmax",
        )
