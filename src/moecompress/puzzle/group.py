"""Merged groups of G ≥ 2 experts with explicit masks and signs (PuzzleMoE App. 7.8.4; 66.7 % / 75 %).

The four free bits of a bfloat16 word hold only a pair's masks and signs, so groups of 3 or 4 store
W_merged in bfloat16 plus one mask bit and one sign bit per member and element, bit-packed
(little-endian, 8 per byte, `quant.pack_codes` with width 1):

    key           dtype   shape                         bits per group element
    w_merged      bf16    [out, in]                     16
    masks         uint8   [ceil(G·out·in / 8)]          G
    signs         uint8   [ceil(G·out·in / 8)]          G

= (16 + 2G) / G bits per original weight (7.33 at G = 3, 6.0 at G = 4). Member m reconstructs
Ŵ_m = (−1)^{S_m} ⊙ M_m ⊙ W_merged (merge.py, anchor rule). Decoding is decode-then-matmul (torch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MoECompressError
from ..models import ExpertActivation, ExpertWeights
from .merge import GroupMerge
from .quant import pack_codes, unpack_codes


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool tensor -> uint8 [ceil(n / 8)] (little-endian bit stream over the flattened tensor)."""
    return pack_codes(bits.reshape(-1).to(torch.int64), 1)


def unpack_bits(data: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    return unpack_codes(data, 1, n).reshape(shape).bool()


def packed_bits_len(n: int) -> int:
    return (n + 7) // 8


class GroupLinear(nn.Module):
    """One projection of a merged group: bf16 W_merged [out, in] + bit-packed masks/signs of G members."""

    def __init__(self, w_merged: torch.Tensor, masks: torch.Tensor, signs: torch.Tensor, members: int):
        super().__init__()
        if w_merged.dim() != 2:
            raise MoECompressError("GroupLinear needs a 2-D W_merged [out, in].")
        self.members = int(members)
        self.register_buffer("w_merged", w_merged.contiguous())
        self.register_buffer("masks", masks.contiguous())
        self.register_buffer("signs", signs.contiguous())

    @classmethod
    def from_merge(cls, merge: GroupMerge) -> GroupLinear:
        return cls(
            merge.w_merged.to(torch.bfloat16),
            pack_bits(merge.masks),
            pack_bits(merge.signs),
            merge.group_size,
        )

    @property
    def out_features(self) -> int:
        return self.w_merged.shape[0]

    @property
    def in_features(self) -> int:
        return self.w_merged.shape[1]

    def decode(self, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
        """[Ŵ_m for each member], Ŵ_m = (−1)^{S_m} ⊙ M_m ⊙ W_merged (exact in any float dtype ≥ bf16)."""
        shape = (self.members, *self.w_merged.shape)
        masks, signs = unpack_bits(self.masks, shape), unpack_bits(self.signs, shape)
        w = self.w_merged.to(dtype)
        zero = torch.zeros_like(w)
        return [torch.where(masks[m], torch.where(signs[m], -w, w), zero) for m in range(self.members)]

    def forward(self, xs: list[torch.Tensor | None], biases: list[torch.Tensor | None] | None = None):
        ref = next((x for x in xs if x is not None), None)
        if ref is None:
            return [None] * len(xs)
        ws = self.decode(ref.dtype)
        biases = biases or [None] * len(xs)
        return [
            None if x is None else F.linear(x, w, None if b is None else b.to(x.dtype))
            for x, w, b in zip(xs, ws, biases)
        ]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_merged, self.masks, self.signs))


class GroupMergedExperts(nn.Module):
    """All G experts of a merged group: forward([x_0, ..., x_{G-1}]) -> [f_0(x_0), ..., f_{G-1}(x_{G-1})]."""

    def __init__(
        self,
        gate_up: GroupLinear,
        down: GroupLinear,
        act: ExpertActivation | None = None,
        biases: list[ExpertWeights | None] | None = None,
    ):
        super().__init__()
        if gate_up.out_features != 2 * down.in_features or gate_up.in_features != down.out_features:
            raise MoECompressError("Group gate_up and down do not form an expert ([2I, H] and [H, I]).")
        if gate_up.members != down.members:
            raise MoECompressError("Group gate_up and down projections have different member counts.")
        self.gate_up, self.down = gate_up, down
        self.members = gate_up.members
        self.act = act or ExpertActivation()
        biases = biases or [None] * self.members
        for m, b in enumerate(biases):
            gu = None
            if b is not None and (b.gate is not None or b.up is not None):
                ref = b.gate if b.gate is not None else b.up
                zeros = torch.zeros(down.in_features, dtype=ref.dtype, device=ref.device)
                gu = torch.cat([b.gate if b.gate is not None else zeros, b.up if b.up is not None else zeros])
            self.register_buffer(f"gate_up_bias_{m}", gu)
            self.register_buffer(f"down_bias_{m}", None if b is None else b.down)

    @classmethod
    def from_merge(
        cls,
        merge: dict[str, GroupMerge],
        act: ExpertActivation | None = None,
        biases: list[ExpertWeights | None] | None = None,
    ) -> GroupMergedExperts:
        return cls(
            GroupLinear.from_merge(merge["gate_up"]), GroupLinear.from_merge(merge["down"]), act, biases
        )

    @property
    def intermediate_size(self) -> int:
        return self.down.in_features

    def _bias(self, kind: str) -> list[torch.Tensor | None]:
        return [getattr(self, f"{kind}_bias_{m}") for m in range(self.members)]

    def forward(self, xs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        i_size = self.intermediate_size
        hs = self.gate_up(xs, self._bias("gate_up"))
        acts = [None if h is None else self.act(h[..., :i_size], h[..., i_size:]) for h in hs]
        return self.down(acts, self._bias("down"))

    def decode(self, dtype: torch.dtype = torch.bfloat16) -> list[ExpertWeights]:
        i_size = self.intermediate_size
        gus, dns = self.gate_up.decode(dtype), self.down.decode(dtype)
        out = []
        for m in range(self.members):
            gub, db = getattr(self, f"gate_up_bias_{m}"), getattr(self, f"down_bias_{m}")
            out.append(
                ExpertWeights(
                    gate=gus[m][:i_size],
                    up=gus[m][i_size:],
                    down=dns[m],
                    gate_bias=None if gub is None else gub[:i_size],
                    up_bias=None if gub is None else gub[i_size:],
                    down_bias=db,
                )
            )
        return out

    def nbytes(self) -> int:
        """Bytes of the merged weights with masks and signs (biases excluded: per member and tiny)."""
        return self.gate_up.nbytes() + self.down.nbytes()
