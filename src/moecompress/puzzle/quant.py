"""Quantization on top of PuzzleMoE (App. 7.8.1): W_merged group-quantized, stored with masks and signs.

Levels. W_merged ≥ 0, so a signed symmetric grid would waste its negative half. We keep the paper's
zero-point-free ("symmetric") scheme but use unsigned levels: per group g of ``group_size`` consecutive
input channels of one output row,

    s_g = max_{x ∈ g} W_merged[x] / (2^b − 1)     (rounded UP to bfloat16, so no value needs clipping)
    q   = round(W_merged / s_g) ∈ {0, …, 2^b − 1},  |q·s_g − W_merged| ≤ s_g / 2.

Codes. One (b + 4)-bit code per element of the pair:

    bit   b+3   b+2   b+1   b      b−1 … 0
         [M_i] [M_j] [S_i] [S_j]  [   q   ]

b = 4: one code per byte; b = 3: 7-bit codes, eight codes packed into seven bytes (little-endian bit
stream over the row-major flattened matrix, padded to a multiple of eight codes). Scales: bfloat16,
[out, ceil(in / group_size)].

Bits per original weight (a pair holds two original weights per element):
    paper formula     (2 sign + log2 3 mask + b + 16/group) / 2   -> 3.35 at b = 3, 3.85 at b = 4
                      (log2 3 ≈ 1.58: (M_i, M_j) ∈ {(1,1), (1,0), (0,1)}; reachable with base-3 mask
                      coding, not implemented);
    this layout       (b + 4 + 16/group) / 2                       -> 3.5625 at b = 3, 4.0625 at b = 4;
    packed bf16 pair  16 / 2 = 8 (exactly half of bf16).
"""

from __future__ import annotations

import math

import torch

from ..errors import MoECompressError

SUPPORTED_BITS = (2, 3, 4)


def _check_bits(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise MoECompressError(f"PuzzleMoE quantization supports {SUPPORTED_BITS} bits, got {bits}.")
    if group_size < 1:
        raise MoECompressError(f"The quantization group size must be positive, got {group_size}.")


def _round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16 ≥ s (s ≥ 0, finite)."""
    sb = s.to(torch.bfloat16)
    bumped = (sb.view(torch.int16) + 1).view(torch.bfloat16)  # next bf16 up for positive finite values
    return torch.where(sb.float() < s, bumped, sb)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, n_groups, group_size] zero-padded along the input dim."""
    out_f, in_f = w.shape
    n_groups = math.ceil(in_f / group_size)
    pad = n_groups * group_size - in_f
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_f, n_groups, group_size)


def quantize_magnitudes(
    w_merged: torch.Tensor, bits: int, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """W_merged [out, in] (≥ 0) -> (q uint8 [out, in], scales bf16 [out, ceil(in / group_size)])."""
    _check_bits(bits, group_size)
    if w_merged.dim() != 2:
        raise MoECompressError(f"W_merged must be 2-D [out, in], got shape {tuple(w_merged.shape)}.")
    w = w_merged.float()
    if bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
        raise MoECompressError(
            "W_merged must be finite and non-negative to be quantized; merge_pair produces that."
        )
    levels = 2**bits - 1
    g = _grouped(w, group_size)
    scales = _round_up_bf16(g.amax(dim=-1) / levels)
    s = scales.float()[..., None]
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(g))
    q = q.clamp(0, levels).to(torch.uint8).reshape(w.shape[0], -1)[:, : w.shape[1]]
    return q.contiguous(), scales


def dequantize_magnitudes(
    q: torch.Tensor, scales: torch.Tensor, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [out, in] and scales [out, n_groups] -> q·s [out, in] (computed in float32, then cast)."""
    in_f = q.shape[1]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :in_f]
    return (q.float() * s).to(dtype)


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack integer codes < 2^width (width ≤ 8) into a little-endian bit stream: 8 codes -> `width` bytes."""
    if not 1 <= width <= 8:
        raise MoECompressError(f"Code width must be 1..8 bits, got {width}.")
    flat = codes.reshape(-1).to(torch.int64)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if width == 8:
        return flat.to(torch.uint8)
    chunks = flat.reshape(-1, 8)
    shifts = torch.arange(8, dtype=torch.int64, device=flat.device) * width
    word = (chunks << shifts).sum(dim=1)  # ≤ 56 bits: fits int64
    byte_shifts = torch.arange(width, dtype=torch.int64, device=flat.device) * 8
    return ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_codes(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of pack_codes: the first `count` codes as int64."""
    raw = data.reshape(-1).to(torch.int64)
    if width == 8:
        return raw[:count]
    chunks = raw.reshape(-1, width)
    byte_shifts = torch.arange(width, dtype=torch.int64, device=raw.device) * 8
    word = (chunks << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, dtype=torch.int64, device=raw.device) * width
    return ((word[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)[:count]


def quantize_pair(
    w_merged: torch.Tensor,
    m_i: torch.Tensor,
    m_j: torch.Tensor,
    s_i: torch.Tensor,
    s_j: torch.Tensor,
    bits: int = 3,
    group_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize W_merged and pack it with the masks and signs -> (code bytes uint8, scales bf16)."""
    q, scales = quantize_magnitudes(w_merged, bits, group_size)
    code = (
        q.to(torch.int64)
        | (m_i.bool().to(torch.int64) << (bits + 3))
        | (m_j.bool().to(torch.int64) << (bits + 2))
        | (s_i.bool().to(torch.int64) << (bits + 1))
        | (s_j.bool().to(torch.int64) << bits)
    )
    return pack_codes(code, bits + 4), scales


def unpack_quantized_pair(
    data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], bits: int, group_size: int = 128
):
    """-> (W_merged float32 = q·s, M_i, M_j, S_i, S_j) from quantize_pair's output."""
    code = unpack_codes(data, bits + 4, shape[0] * shape[1]).reshape(shape)
    q = (code & ((1 << bits) - 1)).to(torch.uint8)
    w = dequantize_magnitudes(q, scales, group_size)
    bit = lambda k: ((code >> k) & 1).bool()
    return w, bit(bits + 3), bit(bits + 2), bit(bits + 1), bit(bits)


def decode_quantized_pair(
    data: torch.Tensor,
    scales: torch.Tensor,
    shape: tuple[int, int],
    bits: int,
    group_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
):
    """-> (Ŵ_i, Ŵ_j) = (−1)^{S_e} ⊙ M_e ⊙ (q·s), computed in float32 and cast to dtype."""
    from .merge import reconstruct_pair

    w, mi, mj, si, sj = unpack_quantized_pair(data, scales, shape, bits, group_size)
    w_i, w_j = reconstruct_pair(w, mi, mj, si, sj)
    return w_i.to(dtype), w_j.to(dtype)


# ------------------------------------------------------------------------------------ bits accounting


def paper_bits_per_weight(
    quant_bits: int = 3,
    group_size: int = 128,
    scale_bits: int = 16,
    members: int = 2,
    mask_bits: float | None = None,
) -> float:
    """PuzzleMoE App. 7.8.1: (G sign + log2(2^G − 1) mask + b + scale_bits/group) / G.

    At G = 2, b = 3, group 128, 16-bit scales: (2 + 1.58 + 3 + 0.125) / 2 ≈ 3.35. ``mask_bits`` overrides
    the information-theoretic log2(2^G − 1) (pass 1.58 to reproduce the paper's rounding).
    """
    mask = math.log2(2**members - 1) if mask_bits is None else mask_bits
    return (members + mask + quant_bits + scale_bits / group_size) / members


def layout_bits_per_weight(
    quant_bits: int | None = None, group_size: int = 128, scale_bits: int = 16, members: int = 2
) -> float:
    """What the layouts implemented here cost per original weight (ignoring < 8 codes of padding).

    members = 2: bf16 packed pair (quant_bits None) -> 8.0; quantized -> (b + 4 + scale_bits/group) / 2.
    members > 2 (explicit masks, bf16 W_merged): (16 + 2G) / G.
    """
    if members == 2:
        if quant_bits is None:
            return 8.0
        return (quant_bits + 4 + scale_bits / group_size) / 2
    if quant_bits is not None:
        raise MoECompressError("Quantized storage is implemented for pairs only; use members=2.")
    return (16 + 2 * members) / members
