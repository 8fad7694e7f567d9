"""The quantization grid, identical to compressed-tensors / llm-compressor's integer grid.

For b bits the codes are the integers q in [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1] (CT's
``calculate_range``). Per output row and group of ``group_size`` input columns (or per row when
``group_size`` is None), with mn = min(0, min w), mx = max(0, max w) over the group (zero is always
representable; llm-compressor's default ``memoryless_minmax`` observer):

    symmetric:   scale = max(|mn|, |mx|) / ((qmax - qmin) / 2),  zero = 0
                 4-bit: codes [-8, 7],  scale = absmax / 7.5
                 2-bit: codes [-2, 1],  scale = absmax / 1.5   (grid {-2, -1, 0, 1}·absmax/1.5)
    asymmetric:  scale = (mx - mn) / (qmax - qmin),  zero = clamp(round(qmin - mn / scale), qmin, qmax)  (int8)
    a zero scale is replaced by the scale dtype's eps (CT's guard against division by zero)

    quantize:    q = clamp(round(w / scale + zero), qmin, qmax)      (round half to even, torch.round)
    dequantize:  w_hat = (q - zero) · scale

``qparams`` calls CT's own ``calculate_qparams`` on the group min/max taken in the weight's own dtype,
exactly as llm-compressor's observer does, and then stores the scale in bf16 (llm-compressor stores
``weight_scale`` in the weight dtype, bf16 for every model here; a float32 weight gets its scale rounded
to bf16 so the stored checkpoint is the same format). Codes are always chosen against that stored bf16
scale, so ``dequantize`` reproduces exactly what a loader of the checkpoint computes.

``quantize`` divides in float32. That equals CT's ``quantize`` on a float32 weight (GPTQ's working
precision in llm-compressor); on a bf16 weight CT divides in bf16 and can, on rare near-ties, round to the
neighbouring code. ``dequantize`` is the float32 product (exact: a <= 9-bit integer times a bf16 scale)
rounded once to ``dtype``, which equals CT's bf16 ``dequantize`` bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .spec import QuantSpec


def qparams(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor | None]:
    """scale [..., out, G] (bf16) and zero [..., out, G] (int8, None when symmetric) of w [..., out, in]."""
    from compressed_tensors.quantization.utils import calculate_qparams

    in_features = w.shape[-1]
    groups = spec.num_groups(in_features)
    width = spec.group_width(in_features)
    # a ragged last group is padded with zeros, which change neither min(0, min w) nor max(0, max w)
    padded = torch.nn.functional.pad(w, (0, groups * width - in_features))
    wg = padded.unflatten(-1, (groups, width))  # [..., out, G, group]
    mn = wg.amin(dim=-1)
    mx = wg.amax(dim=-1)
    scale, zero = calculate_qparams(mn, mx, spec.quantization_args())
    scale = scale.reshape(mn.shape).to(torch.bfloat16)
    if spec.symmetric:
        return scale, None
    return scale, zero.reshape(mn.shape).to(torch.int8)


def expand_groups(t: Tensor, in_features: int, spec: QuantSpec) -> Tensor:
    """[..., out, G] -> [..., out, in]: each group's parameter repeated over its columns."""
    return t.repeat_interleave(spec.group_width(in_features), dim=-1)[..., :in_features]


def quantize_values(x: Tensor, scale: Tensor, zero: Tensor | None, spec: QuantSpec) -> Tensor:
    """Element-wise q = clamp(round(x / scale + zero), qmin, qmax) in float32, for same-shaped x/scale/zero."""
    t = x.float() / scale.float()
    if zero is not None:
        t = t + zero.float()
    return t.clamp_(spec.qmin, spec.qmax).round_().to(torch.int8)


def dequantize_values(codes: Tensor, scale: Tensor, zero: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Element-wise w_hat = (q - zero) · scale, float32 product rounded once to dtype."""
    q = codes.float()
    if zero is not None:
        q = q - zero.float()
    return (q * scale.float()).to(dtype)


def quantize(w: Tensor, scale: Tensor, zero: Tensor | None, spec: QuantSpec) -> Tensor:
    """Codes int8 [..., out, in] of w [..., out, in] on the grid (scale, zero) [..., out, G]."""
    n = w.shape[-1]
    z = None if zero is None else expand_groups(zero, n, spec)
    return quantize_values(w, expand_groups(scale, n, spec), z, spec)


def dequantize(
    codes: Tensor, scale: Tensor, zero: Tensor | None, spec: QuantSpec, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """w_hat [..., out, in] = (codes - zero) · scale, with group parameters [..., out, G]."""
    n = codes.shape[-1]
    z = None if zero is None else expand_groups(zero, n, spec)
    return dequantize_values(codes, expand_groups(scale, n, spec), z, dtype)
