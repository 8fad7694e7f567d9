"""Quantized non-expert weights in the runtime (issue 30): ``plan.tensor_quant`` dequantized into the modules.

Each quantized tensor's pack-quantized codes and scales (`plan.quant_tensor_prefix`) are dequantized once,
W = (q − z)·s rounded to the module's dtype (`quant.QuantizedTensor.dequantize`, what a compressed-tensors
loader reconstructs), and written into the module's own weight. So the model computes exactly what the quantized
checkpoint holds, but holds those weights at their dense size in memory; keeping them packed (as stored experts
are, `runtime.quantized`) is future work (docs/quantization.md, "Non-expert tensors").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..plan import QUANT_TENSOR_SUFFIXES, CompressionPlan, quant_tensor_prefix
from ..quant.tensor import QuantizedTensor


def packed_of(tensors: Mapping[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of checkpoint tensor `name` found in `tensors` (suffix -> tensor)."""
    base = quant_tensor_prefix(name)
    return {s: tensors[f"{base}.{s}"] for s in QUANT_TENSOR_SUFFIXES if f"{base}.{s}" in tensors}


def dequantized(
    plan: CompressionPlan, tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype
) -> torch.Tensor:
    """The dense weight `name` computes with: its codes dequantized to `dtype`."""
    spec = plan.tensor_quant[name].quant
    return QuantizedTensor.from_packed(packed_of(tensors, name), spec).dequantize(dtype)


def quantized_names(plan: CompressionPlan) -> dict[str, str]:
    """Packed tensor key -> the checkpoint tensor it belongs to, for every quantized non-expert weight."""
    return {
        f"{quant_tensor_prefix(name)}.{s}": name for name in plan.tensor_quant for s in QUANT_TENSOR_SUFFIXES
    }


def apply_tensor_quant(
    model: nn.Module, plan: CompressionPlan, tensors: Mapping[str, torch.Tensor] | None
) -> None:
    """Write every quantized non-expert weight of `plan`, dequantized, into `model` (in place; tied weights
    follow, being the same tensor)."""
    with torch.no_grad():
        for name in plan.tensor_quant:
            p = model.get_parameter(name)
            p.copy_(dequantized(plan, tensors or {}, name, p.dtype).to(p.device))
