"""Quantized stored experts in the runtime: integer codes stay packed in memory, dequantized per forward.

A scope with any stored expert whose plan entry carries a precision (``quant``) runs as a
`QuantizedStoredExperts`. Stored expert k lives in ``experts[k]``:

* quantized — buffers ``{part}_weight_packed`` (int32 words), ``{part}_weight_scale``,
  ``{part}_weight_shape`` (+ ``{part}_weight_zero_point``) for part in gate/up/down, the
  compressed-tensors ``pack-quantized`` tensors of W [out, in];
* dense — buffers ``gate [w, H]``, ``up [w, H]``, ``down [H, w]`` in the compute dtype;

plus ``{part}_bias`` for biased families. Every forward dequantizes W = s·(q − z) of each stored expert
into the fused layout of `StoredExperts` (zero-padded to the scope width) and runs the same grouped or
eager kernel, so a quantized plan computes exactly what its dequantized weights compute, while the
resident bytes are the packed integers and scales. A big scope is dequantized a range of experts at a time
(`expert_ranges`), so a forward never holds more than `DEQUANT_BYTES` of dense weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..models import ExpertActivation, ExpertWeights
from ..models.storage import FusedLayout
from ..quant import QuantizedTensor
from ..quant.spec import QuantSpec
from .experts import StoredExperts, native_tensors

PARTS = ("gate", "up", "down")
# the most dequantized bytes a forward holds at once; below it a scope runs as one range, exactly the
# fused kernel of `StoredExperts` (over it, each range's experts are multiplied separately: the same
# products, each pair's output summed over its top-k in the same order)
DEQUANT_BYTES = 64 << 20
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


class StoredExpertSlot(nn.Module):
    """One stored expert of a quantized scope: its packed integer tensors (or dense weights) and biases.

    ``weight_rounding``: the dtype code·scale is rounded through before the compute dtype; bf16 is what a
    compressed-tensors loader computes, float32 keeps the products exact (llama.cpp's, `export.gguf_arith`)."""

    weight_rounding = torch.bfloat16

    def __init__(self, spec: QuantSpec | None):
        super().__init__()
        self.spec = spec

    @classmethod
    def from_tensors(cls, spec: QuantSpec | None, tensors: dict[str, torch.Tensor]) -> StoredExpertSlot:
        """`tensors`: ``{part}.weight_packed``-style keys (quantized) or ``gate``/``up``/``down`` (dense), biases."""
        mod = cls(spec)
        for key, t in tensors.items():
            mod.register_buffer(key.replace(".", "_"), t)
        return mod

    def weights(self, dtype: torch.dtype) -> ExpertWeights:
        """The expert's dense weights in `dtype` (dequantized when quantized)."""
        if self.spec is None:
            parts = {p: getattr(self, p).to(dtype) for p in PARTS}
        else:
            parts = {p: self._quantized(p).dequantize(self.weight_rounding).to(dtype) for p in PARTS}
        bias = {
            f"{p}_bias": getattr(self, f"{p}_bias").to(dtype) if hasattr(self, f"{p}_bias") else None
            for p in PARTS
        }
        return ExpertWeights(**parts, **bias)

    def _quantized(self, part: str) -> QuantizedTensor:
        found = {s: getattr(self, f"{part}_{s}") for s in _QUANT_SUFFIXES if hasattr(self, f"{part}_{s}")}
        return QuantizedTensor.from_packed(found, self.spec)


def packed_shapes(spec: QuantSpec, out: int, inp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each pack-quantized tensor of an [out, in] weight (quant/spec.py's byte formula)."""
    groups = spec.num_groups(inp)
    shapes = {
        "weight_packed": ((out, math.ceil(inp * spec.bits / 32)), torch.int32),
        "weight_scale": ((out, groups), torch.bfloat16),
        "weight_shape": ((2,), torch.int64),
    }
    if not spec.symmetric:
        shapes["weight_zero_point"] = ((math.ceil(out * spec.bits / 32), groups), torch.int32)
    return shapes


def slot_tensor_names(spec: QuantSpec | None, bias: bool) -> list[str]:
    """The tensor keys (relative to the stored expert's prefix) a slot of this precision holds."""
    if spec is None:
        names = list(PARTS)
    else:
        sfx = _QUANT_SUFFIXES if not spec.symmetric else _QUANT_SUFFIXES[:3]
        names = [f"{p}.{s}" for p in PARTS for s in sfx]
    return names + ([f"{p}_bias" for p in PARTS] if bias else [])


class _Dense(Sequence):
    """The slots' dense weights in `dtype`, computed when indexed (`StoredExpertSlot.weights`)."""

    def __init__(self, slots, dtype: torch.dtype):
        self.slots, self.dtype = slots, dtype

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, e: int) -> ExpertWeights:
        return self.slots[e].weights(self.dtype)


class QuantizedStoredExperts(StoredExperts):
    """K stored experts, some or all integer-quantized; ``forward(x, index, weight)`` as `StoredExperts`."""

    def __init__(
        self,
        slots: list[StoredExpertSlot],
        hidden_size: int,
        width: int,
        layout: FusedLayout,
        act: ExpertActivation,
        dtype: torch.dtype,
        config=None,
    ):
        nn.Module.__init__(self)
        self.num_experts, self.hidden_size, self.width, self.layout, self.act = (
            len(slots),
            hidden_size,
            width,
            layout,
            act,
        )
        self.is_transposed = self.has_bias = layout == "gpt_oss"
        self._config = config
        self.dtype = dtype
        self.experts = nn.ModuleList(slots)

    def fused(self) -> dict[str, torch.Tensor]:
        return self.fused_range(0, self.num_experts)

    def fused_range(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        # each slot is dequantized as it is copied in: a list of every slot's dense weights held the layer twice
        return native_tensors(_Dense(self.experts[lo:hi], self.dtype), self.layout, self.width, self.dtype)

    def expert_ranges(self) -> list[tuple[int, int]]:
        """Consecutive stored ids whose dequantized fused tensors stay within `DEQUANT_BYTES` (at least one
        expert each): a forward dequantizes one range at a time, so a layer of big experts is never held
        dense whole (the wide benchmark model's float32 layer is 400 MB)."""
        per = 3 * self.width * self.hidden_size * self.dtype.itemsize
        size = max(1, DEQUANT_BYTES // per)
        return [(lo, min(lo + size, self.num_experts)) for lo in range(0, self.num_experts, size)]

    def extra_repr(self) -> str:
        specs = sorted({"dense" if s.spec is None else s.spec.name() for s in self.experts})
        return super().extra_repr() + f", precision={'/'.join(specs)}"

    def resident_bytes(self) -> int:
        """Bytes this module holds in memory (packed codes, scales, dense experts, biases)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())
