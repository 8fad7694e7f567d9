"""QuantizedTensor: integer codes on the grid of grid.py plus their group parameters, and its packed form.

``packed()`` is compressed-tensors' ``pack-quantized`` layout, made by CT's own ``pack_to_int32`` (the
packer ``PackedQuantizationCompressor.compress`` uses): the codes of each row are offset by 2^(b-1) to
unsigned and packed densely, 32 codes into b int32 words along the input dimension, with no padding bits
except at the end of each row (this covers 3-bit too, CT packs any b in 1..8). Asymmetric zero points
are packed the same way along the output dimension (``packed_dim=0``), as CT's compressor does.

Leading batch dimensions (e.g. [E, out, in] for all experts of a projection) are carried through;
``packed()`` of a 3-D tensor stacks the per-matrix packs (CT's ``pack_to_int32`` does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import MoECompressError
from . import grid
from .spec import QuantSpec


@dataclass
class QuantizedTensor:
    """codes int8 [..., out, in]; scale bf16 [..., out, G]; zero int8 [..., out, G] or None (symmetric)."""

    codes: Tensor
    scale: Tensor
    zero: Tensor | None
    spec: QuantSpec

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """W_hat = (codes - zero) · scale (grid.dequantize)."""
        return grid.dequantize(self.codes, self.scale, self.zero, self.spec, dtype)

    def nbytes(self) -> int:
        """Bytes of ``packed()`` (= spec.tensor_bytes per matrix, times the batch size)."""
        out, n = self.codes.shape[-2:]
        return self.codes[..., 0, 0].numel() * self.spec.tensor_bytes(out, n)

    def packed(self) -> dict[str, Tensor]:
        """compressed-tensors pack-quantized tensors: weight_packed, weight_scale, weight_shape (+ weight_zero_point)."""
        from compressed_tensors.compressors import pack_to_int32

        out: dict[str, Tensor] = {
            "weight_packed": pack_to_int32(self.codes.contiguous(), self.spec.bits),
            "weight_scale": self.scale.to(torch.bfloat16).contiguous(),
            "weight_shape": _shape_tensor(self.codes),
        }
        if self.zero is not None:
            out["weight_zero_point"] = pack_to_int32(self.zero.contiguous(), self.spec.bits, packed_dim=0)
        return out

    @classmethod
    def from_packed(cls, tensors: dict[str, Tensor], spec: QuantSpec) -> QuantizedTensor:
        """Inverse of ``packed()`` (CT's ``unpack_from_int32``)."""
        from compressed_tensors.compressors import unpack_from_int32

        missing = {"weight_packed", "weight_scale", "weight_shape"} - set(tensors)
        if not spec.symmetric and "weight_zero_point" not in tensors:
            missing.add("weight_zero_point")
        if missing:
            raise MoECompressError(
                f"Packed quantized weight lacks {', '.join(sorted(missing))}: the checkpoint is incomplete "
                f"or was written with a different spec than {spec.name()}."
            )
        packed, scale = tensors["weight_packed"], tensors["weight_scale"]
        shape = check_packed(tensors, spec)
        batch = packed.shape[:-2]
        codes = unpack_from_int32(packed, spec.bits, torch.Size((*batch, *shape)))
        zero = None
        if not spec.symmetric:
            zero = unpack_from_int32(
                tensors["weight_zero_point"],
                spec.bits,
                torch.Size((*batch, shape[0], scale.shape[-1])),
                packed_dim=0,
            )
        return cls(codes=codes, scale=scale, zero=zero, spec=spec)


def check_packed(
    tensors: dict[str, Tensor], spec: QuantSpec, where: str = "A packed quantized weight"
) -> torch.Size:
    """The [out, in] that ``weight_shape`` declares, refused (one sentence) unless the packed words and scales,
    whose shapes the file header gives, hold exactly that matrix. A tampered ``weight_shape`` used to unpack
    into garbage or fail deep inside a forward."""
    packed, scale, shape_t = tensors["weight_packed"], tensors["weight_scale"], tensors["weight_shape"]
    values = shape_t.reshape(-1).tolist() if shape_t.numel() >= 2 else []
    shape = tuple(int(v) for v in values[:2])
    ok = len(shape) == 2 and shape_t.shape[-1:] == (2,) and min(shape) >= 1
    if ok:
        out, n = shape
        ok = tuple(packed.shape[-2:]) == (out, -(-n * spec.bits // 32)) and tuple(scale.shape[-2:]) == (
            out,
            spec.num_groups(n),
        )
    if not ok:
        raise MoECompressError(
            f"{where} declares weight_shape {shape or values} but its packed words are "
            f"{tuple(packed.shape)} and its scales {tuple(scale.shape)} at {spec.name()}: the "
            "checkpoint is corrupted or tampered with; re-export it."
        )
    return torch.Size(shape)


def _shape_tensor(codes: Tensor) -> Tensor:
    """weight_shape as CT stores it: int64 [2] per matrix ([..., 2] for a batch)."""
    shape = torch.tensor(list(codes.shape[-2:]), dtype=torch.int64)
    return shape.expand(*codes.shape[:-2], 2).clone() if codes.ndim > 2 else shape
