"""PuzzleMoE bit packing: masks and signs of a merged pair inside the bfloat16 word of W_merged (§3.3.2).

bfloat16 is  [sign:1 | exponent:8 | mantissa:7].  W_merged ≥ 0, so its sign bit is free, and expert
weights have exponents in a narrow band, so the exponent is shifted into 5 bits (e' = e − 112, values
2^-15 ≤ x < 2^17), freeing 3 more bits. One packed 16-bit word per element of the pair:

    bit  15    14    13    12    11 10 9 8 7    6 5 4 3 2 1 0
        [M_i] [M_j] [S_i] [S_j] [ e' = e−112 ] [  mantissa   ]

decoding:  magnitude bits = (word & 0x0FFF) + (112 << 7)          (= e << 7 | mantissa)
           Ŵ_i bits       = M_i ? magnitude bits | S_i << 15 : 0  (likewise Ŵ_j with M_j, S_j)

Zero: M_i ∨ M_j = 1 for every element a merge produces, so the mask pair (0, 0) is free. It codes
W_merged = 0 (both reconstructions are 0, which the decode rule above gives with no special case);
its low 12 bits are stored as 0 and the sign bits are kept. So zero stays exactly zero and every value
2^-15 ≤ x ≤ (2 − 2^-7)·2^16 round-trips exactly.

Values below 2^-15 (exponent < 112) — the clamp — follow ``underflow``:
    "nearest" (default): to whichever of 0 and 2^-15 is closer (x ≥ 2^-16 -> 2^-15); error ≤ 2^-16;
    "clamp":  to 2^-15, the smallest representable non-zero value (the paper's "round the exponent up
              to 112", read as a value clamp); zero still stays zero; error < 2^-15;
    "flush":  to 0; error < 2^-15.
Values ≥ 2^17 (exponent > 143), infinities, NaNs and negative W_merged are errors: nothing in a trained
expert is that large, and silently saturating would hide a bug.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from ..errors import MoECompressError

EXP_BIAS = 112  # exponents 112..143 are stored as 0..31
EXP_SHIFTED_MAX = 31
MIN_NORMAL = 2.0 ** (EXP_BIAS - 127)  # 2^-15, the smallest non-zero packable value
MAX_PACKABLE = (2.0 - 2.0**-7) * 2.0 ** (EXP_BIAS + EXP_SHIFTED_MAX - 127)  # 130560.0
MAG_MASK = 0x0FFF  # e' (5 bits) and mantissa (7 bits)
MAG_OFFSET = EXP_BIAS << 7  # 0x3800: adds 112 back to the exponent field
BIT_MI, BIT_MJ, BIT_SI, BIT_SJ = 15, 14, 13, 12

Underflow = Literal["nearest", "clamp", "flush"]
_MIN_NORMAL_BITS = EXP_BIAS << 7  # bf16 bit pattern of 2^-15 (0x3800)
_HALF_MIN_BITS = (EXP_BIAS - 1) << 7  # bf16 bit pattern of 2^-16
_WORD_DTYPES = (torch.int16, getattr(torch, "uint16", torch.int16))


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit patterns of a bfloat16 tensor as int32 in [0, 65535]."""
    if x.dtype != torch.bfloat16:
        raise MoECompressError(
            f"Expected a bfloat16 tensor, got {x.dtype}; cast it with .to(torch.bfloat16)."
        )
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def bits_to_int16(bits: torch.Tensor) -> torch.Tensor:
    """int32 values in [0, 65535] -> int16 tensor with the same 16-bit patterns (two's complement)."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)


def bits_to_bf16(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns in [0, 65535] -> bfloat16 tensor."""
    return bits_to_int16(bits).view(torch.bfloat16)


def _check_underflow(underflow: str) -> None:
    if underflow not in ("nearest", "clamp", "flush"):
        raise MoECompressError(f"Unknown underflow rule {underflow!r}; use 'nearest', 'clamp' or 'flush'.")


def _clamp_magnitude_bits(mag: torch.Tensor, underflow: str) -> torch.Tensor:
    """Apply the underflow rule to magnitude bit patterns (int32, sign bit already removed)."""
    small = (mag < _MIN_NORMAL_BITS) & (mag != 0)
    if underflow == "clamp":
        to_min = small
    elif underflow == "flush":
        to_min = torch.zeros_like(small)
    else:  # nearest: positive bf16 bit patterns order like their values
        to_min = small & (mag >= _HALF_MIN_BITS)
    out = torch.where(small, torch.zeros_like(mag), mag)
    return torch.where(to_min, torch.full_like(mag, _MIN_NORMAL_BITS), out)


def _check_range(mag: torch.Tensor, what: str) -> None:
    if bool((mag >= 0x7F80).any()):
        raise MoECompressError(f"{what} contains inf or NaN; fix the merge inputs before packing.")
    if bool((mag > (MAG_MASK + MAG_OFFSET)).any()):
        raise MoECompressError(
            f"{what} has magnitudes ≥ 2^17 that a 5-bit shifted exponent cannot hold; "
            "store this projection unpacked (or rescale it) instead."
        )


def clamp_exponent(w: torch.Tensor, underflow: Underflow = "nearest") -> torch.Tensor:
    """What packing does to a bfloat16 tensor's magnitudes (signs kept): the exponent clamp at 112.

    Returns bfloat16. Use it to measure the clamp's effect on a whole model (e.g. perplexity before/after).
    """
    _check_underflow(underflow)
    bits = bf16_bits(w)
    sign, mag = bits & 0x8000, bits & 0x7FFF
    _check_range(mag, "The tensor")
    return bits_to_bf16(sign | _clamp_magnitude_bits(mag, underflow))


@dataclass
class ClampReport:
    """How many weights the exponent clamp changes, and by how much (absolute values, float32)."""

    total: int = 0
    zeros: int = 0
    changed: int = 0  # non-zero values below 2^-15 (only these can change)
    to_zero: int = 0
    to_min: int = 0
    max_abs_change: float = 0.0
    sum_abs_change: float = 0.0
    sum_abs: float = 0.0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0

    @property
    def mean_abs_change(self) -> float:
        return self.sum_abs_change / self.total if self.total else 0.0

    @property
    def relative_l1_change(self) -> float:
        """Σ|Δw| / Σ|w|."""
        return self.sum_abs_change / self.sum_abs if self.sum_abs else 0.0

    def __add__(self, other: ClampReport) -> ClampReport:
        return ClampReport(
            self.total + other.total,
            self.zeros + other.zeros,
            self.changed + other.changed,
            self.to_zero + other.to_zero,
            self.to_min + other.to_min,
            max(self.max_abs_change, other.max_abs_change),
            self.sum_abs_change + other.sum_abs_change,
            self.sum_abs + other.sum_abs,
        )

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "changed_fraction": self.changed_fraction,
            "mean_abs_change": self.mean_abs_change,
            "relative_l1_change": self.relative_l1_change,
        }


def clamp_report(
    weights: torch.Tensor | Iterable[torch.Tensor], underflow: Underflow = "nearest"
) -> ClampReport:
    """Measure the clamp on one tensor or many (any float dtype; magnitudes are first rounded to bf16).

    The change is counted against the bf16-rounded values, i.e. it is what packing adds on top of bf16.
    """
    _check_underflow(underflow)
    tensors = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    report = ClampReport()
    for w in tensors:
        mag_bf16 = w.detach().to(torch.bfloat16).abs()
        before = bf16_bits(mag_bf16)
        _check_range(before, "The tensor")
        after = _clamp_magnitude_bits(before, underflow)
        b, a = mag_bf16.float(), bits_to_bf16(after).float()
        diff = (a - b).abs()
        changed = before != after
        report = report + ClampReport(
            total=w.numel(),
            zeros=int((before == 0).sum()),
            changed=int(changed.sum()),
            to_zero=int((changed & (after == 0)).sum()),
            to_min=int((changed & (after != 0)).sum()),
            max_abs_change=float(diff.max()) if diff.numel() else 0.0,
            sum_abs_change=float(diff.double().sum()),
            sum_abs=float(b.double().sum()),
        )
    return report


def pack_pair(
    w_merged: torch.Tensor,
    m_i: torch.Tensor,
    m_j: torch.Tensor,
    s_i: torch.Tensor,
    s_j: torch.Tensor,
    underflow: Underflow = "nearest",
) -> torch.Tensor:
    """Pack W_merged (≥ 0; rounded to bf16 if it is not) with M_i, M_j, S_i, S_j into int16 words.

    Layout and zero/underflow rules: module docstring. Elements with W_merged = 0 or M_i = M_j = 0 are
    stored as the zero code (masks 0, 0), so decode_pair(pack_pair(...)) equals the dense reconstruction
    (−1)^S ⊙ M ⊙ clamp(bf16(W_merged)) for every input.
    """
    _check_underflow(underflow)
    shape = w_merged.shape
    for name, t in (("m_i", m_i), ("m_j", m_j), ("s_i", s_i), ("s_j", s_j)):
        if t.shape != shape:
            raise MoECompressError(
                f"Mask/sign {name} has shape {tuple(t.shape)} but W_merged has {tuple(shape)}; "
                "they must match element for element."
            )
    wb = w_merged if w_merged.dtype == torch.bfloat16 else w_merged.to(torch.bfloat16)
    bits = bf16_bits(wb)
    neg = (bits & 0x8000) != 0
    if bool((neg & ((bits & 0x7FFF) != 0)).any()):
        raise MoECompressError(
            "W_merged has negative values; it must hold magnitudes (merge_pair produces them)."
        )
    mag = _clamp_magnitude_bits(bits & 0x7FFF, underflow)
    _check_range(mag, "W_merged")
    mi, mj = m_i.to(torch.int32) != 0, m_j.to(torch.int32) != 0
    zero = (mag == 0) | ~(mi | mj)
    low = torch.where(zero, torch.zeros_like(mag), mag - MAG_OFFSET)
    mi, mj = mi & ~zero, mj & ~zero
    word = (
        low
        | (mi.to(torch.int32) << BIT_MI)
        | (mj.to(torch.int32) << BIT_MJ)
        | ((s_i != 0).to(torch.int32) << BIT_SI)
        | ((s_j != 0).to(torch.int32) << BIT_SJ)
    )
    return bits_to_int16(word)


def _words(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype not in _WORD_DTYPES:
        raise MoECompressError(
            f"A packed PuzzleMoE tensor must be int16, got {packed.dtype}; was it written by pack_pair?"
        )
    return packed.view(torch.int16).to(torch.int32) & 0xFFFF


def unpack_pair(
    packed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int16 words -> (W_merged bf16 ≥ 0, M_i, M_j, S_i, S_j) with bool masks/signs (zero code -> W = 0)."""
    w = _words(packed)
    mi, mj = ((w >> BIT_MI) & 1).bool(), ((w >> BIT_MJ) & 1).bool()
    si, sj = ((w >> BIT_SI) & 1).bool(), ((w >> BIT_SJ) & 1).bool()
    mag = torch.where(mi | mj, (w & MAG_MASK) + MAG_OFFSET, torch.zeros_like(w))
    return bits_to_bf16(mag), mi, mj, si, sj


def decode_pair(
    packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 words -> (Ŵ_i, Ŵ_j) = (−1)^{S_e} ⊙ M_e ⊙ W_merged, built directly on the bit patterns."""
    w = _words(packed)
    mag = (w & MAG_MASK) + MAG_OFFSET
    zero = torch.zeros_like(w)
    w_i = torch.where(((w >> BIT_MI) & 1).bool(), mag | (((w >> BIT_SI) & 1) << 15), zero)
    w_j = torch.where(((w >> BIT_MJ) & 1).bool(), mag | (((w >> BIT_SJ) & 1) << 15), zero)
    w_i, w_j = bits_to_bf16(w_i), bits_to_bf16(w_j)
    if dtype != torch.bfloat16:
        w_i, w_j = w_i.to(dtype), w_j.to(dtype)
    return w_i, w_j
