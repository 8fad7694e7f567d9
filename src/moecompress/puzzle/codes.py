"""Packing codes of PuzzleMoE stored experts: parse a code, name it, and the tensors (shape, dtype) it holds.

Pure data about the plan's ``packing`` field (no model, no runtime), so the plan schema can validate
a packed stored expert without importing the runtime. The code grammar and tensor layout are
documented in runtime/packed.py and docs/puzzlemoe.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import MoECompressError

_PACKING = re.compile(r"^(pair|group(\d+))-(bf16|q(\d+)-g(\d+))$")


@dataclass(frozen=True)
class Packing:
    """A parsed packing code: pair (bf16 words or quantized codes) or an explicit group of G members."""

    members: int
    bits: int | None = None  # quantized W_merged (pairs only); None = bf16
    group_size: int = 128  # quantization group (input channels per scale)
    explicit: bool = False  # group layout (masks/signs stored explicitly), G >= 3

    @property
    def kind(self) -> str:
        return "group" if self.explicit else "pair"

    def code(self) -> str:
        head = f"group{self.members}" if self.explicit else "pair"
        return f"{head}-bf16" if self.bits is None else f"{head}-q{self.bits}-g{self.group_size}"


def parse_packing(code: str) -> Packing:
    m = _PACKING.match(code or "")
    if m is None:
        raise MoECompressError(
            f"Unknown packing '{code}'; use pair-bf16, pair-q3-g128, pair-q4-g128 or group3-bf16 "
            "/ group4-bf16."
        )
    if m.group(1) == "pair":
        spec = Packing(
            2,
            None if m.group(3) == "bf16" else int(m.group(4)),
            128 if m.group(3) == "bf16" else int(m.group(5)),
        )
        if spec.bits is not None and spec.bits not in (3, 4):
            raise MoECompressError(f"Packing '{code}' quantizes to {spec.bits} bits; use 3 or 4.")
        if spec.group_size < 1:
            raise MoECompressError(f"Packing '{code}' has an empty quantization group; use e.g. g128.")
        return spec
    g = int(m.group(2))
    if g < 3 or m.group(3) != "bf16":
        raise MoECompressError(
            f"Packing '{code}' is not supported; explicit groups need 3 or more members and bf16 "
            "(pairs use pair-bf16 / pair-q3-g128)."
        )
    return Packing(g, None, 128, explicit=True)


def packing_code(members: int, quant_bits: int | None = None, group_size: int = 128) -> str:
    """The packing code for a merge of `members` experts (quantization applies to pairs only)."""
    if members == 2:
        return Packing(2, quant_bits, group_size).code()
    if quant_bits is not None:
        raise MoECompressError(
            "Quantization on top applies to packed pairs only; use ratio 0.5 or 0.25 with "
            "quant_bits, or quant_bits null for groups of 3 or 4."
        )
    return Packing(members, None, 128, explicit=True).code()


def member_suffixes(spec: Packing) -> list[str]:
    return ["i", "j"] if spec.kind == "pair" else [str(m) for m in range(spec.members)]


def expected_tensors(
    spec: Packing, width: int, hidden: int, bias: bool, bias_dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Relative key -> (shape, dtype) of every tensor a packed stored expert of this shape holds."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    projections = {"gate_up": (2 * width, hidden), "down": (hidden, width)}
    for name, (o, i) in projections.items():
        n = o * i
        if spec.kind == "pair" and spec.bits is None:
            out[f"{name}.packed"] = ((o, i), torch.int16)
        elif spec.kind == "pair":
            out[f"{name}.codes"] = ((((n + 7) // 8) * (spec.bits + 4),), torch.uint8)
            out[f"{name}.scales"] = ((o, -(-i // spec.group_size)), torch.bfloat16)
        else:
            nbits = (spec.members * n + 7) // 8
            out[f"{name}.w_merged"] = ((o, i), torch.bfloat16)
            out[f"{name}.masks"] = ((nbits,), torch.uint8)
            out[f"{name}.signs"] = ((nbits,), torch.uint8)
    if bias:
        for tag in member_suffixes(spec):
            out[f"gate_up_bias_{tag}"] = ((2 * width,), bias_dtype)
            out[f"down_bias_{tag}"] = ((hidden,), bias_dtype)
    return out


def expected_for(plan, sc, s):
    spec = parse_packing(s.packing)
    return spec, expected_tensors(
        spec,
        plan.stored_width(sc, s),
        plan.model.hidden_size,
        plan.model.expert_bias,
        getattr(torch, plan.model.dtype),
    )


def check_packed_tensors(plan, sc, s, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor of packed stored expert `s` is present with the right shape and dtype (one sentence if not)."""
    _, expected = expected_for(plan, sc, s)
    for rel, (shape, dtype) in expected.items():
        key = f"{s.tensor}.{rel}"
        t = tensors.get(key)
        if t is None:
            raise MoECompressError(
                f"The plan tensors lack '{key}' of packed stored expert {s.id} in scope '{sc.id}'; "
                "pass the tensors the method produced (plan_tensors.safetensors)."
            )
        if tuple(t.shape) != shape or (
            t.dtype != dtype and not rel.startswith(("gate_up_bias", "down_bias"))
        ):
            raise MoECompressError(
                f"Plan tensor '{key}' is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}; "
                "the tensors do not belong to this plan."
            )


def packed_nbytes(plan, sc, s) -> int:
    """Bytes of a packed stored expert's tensors, from its shapes alone."""
    _, expected = expected_for(plan, sc, s)
    return sum(
        torch.empty((), dtype=dt).element_size() * int(torch.Size(shape).numel())
        for shape, dt in expected.values()
    )
