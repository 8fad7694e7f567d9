"""Packed pair projections and a packed expert pair as nn.Modules (torch reference; Triton on CUDA).

``packed_pair_linear`` computes x_i @ Ŵ_iᵀ (+ b_i) and x_j @ Ŵ_jᵀ (+ b_j) from one packed tensor; the
tokens routed to i and to j differ (either may be None or empty). ``PackedPairExperts`` runs both
experts of a merged pair: f_e(x) = Ŵ_down,e · act(Ŵ_gate,e x + b, Ŵ_up,e x + b) + b_down,e.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MoECompressError
from ..models import ExpertActivation, ExpertWeights
from .merge import ExpertPairMerge, PairMerge
from .packing import Underflow, decode_pair, pack_pair
from .quant import decode_quantized_pair, quantize_pair

Backend = Literal["auto", "torch", "triton"]


def _use_triton(backend: Backend, x: torch.Tensor | None) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    from .triton_kernel import cuda_kernel_available

    return x is not None and x.is_cuda and cuda_kernel_available()


def _linear(x: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    if x is None:
        return None
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def packed_pair_linear(
    x_i: torch.Tensor | None,
    x_j: torch.Tensor | None,
    packed: torch.Tensor,
    bias_i: torch.Tensor | None = None,
    bias_j: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(x_i @ Ŵ_iᵀ + b_i, x_j @ Ŵ_jᵀ + b_j) for packed int16 words [out, in]; x_* are [..., in].

    The torch reference decodes Ŵ in the inputs' dtype (bf16 values are exact in float32) and calls
    F.linear; on CUDA with Triton installed the fused decode-GEMM reads the packed tensor once.
    """
    ref = x_i if x_i is not None else x_j
    if ref is None:
        return None, None
    for x in (x_i, x_j):
        if x is not None and x.shape[-1] != packed.shape[-1]:
            raise MoECompressError(
                f"Input has {x.shape[-1]} features but the packed weight expects "
                f"{packed.shape[-1]}; check which projection you are calling."
            )
    if _use_triton(backend, ref):
        from .triton_kernel import packed_pair_linear_triton

        return packed_pair_linear_triton(x_i, x_j, packed, bias_i, bias_j)
    dtype = ref.dtype if ref.is_floating_point() else torch.float32
    w_i, w_j = decode_pair(packed, dtype=dtype)
    return _linear(x_i, w_i, bias_i), _linear(x_j, w_j, bias_j)


class PackedPairLinear(nn.Module):
    """One projection of a merged pair, bf16-packed: 2 bytes per element for both experts."""

    def __init__(self, packed: torch.Tensor):
        super().__init__()
        if packed.dtype != torch.int16 or packed.dim() != 2:
            raise MoECompressError("PackedPairLinear needs a 2-D int16 tensor from pack_pair.")
        self.register_buffer("packed", packed.contiguous())

    @classmethod
    def from_merge(cls, merge: PairMerge, underflow: Underflow = "nearest") -> PackedPairLinear:
        return cls(pack_pair(merge.w_merged, merge.m_i, merge.m_j, merge.s_i, merge.s_j, underflow=underflow))

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1]

    def decode(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_pair(self.packed, dtype)

    def forward(self, x_i, x_j, bias_i=None, bias_j=None, backend: Backend = "auto"):
        return packed_pair_linear(x_i, x_j, self.packed, bias_i, bias_j, backend=backend)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def meta(self) -> dict:
        return {"format": "bf16_packed", "shape": [self.out_features, self.in_features]}


class QuantPairLinear(nn.Module):
    """One projection of a merged pair with W_merged group-quantized (see quant.py for the layout)."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        shape: tuple[int, int],
        bits: int,
        group_size: int = 128,
    ):
        super().__init__()
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.shape = (int(shape[0]), int(shape[1]))
        self.bits, self.group_size = int(bits), int(group_size)

    @classmethod
    def from_merge(cls, merge: PairMerge, bits: int = 3, group_size: int = 128) -> QuantPairLinear:
        codes, scales = quantize_pair(
            merge.w_merged, merge.m_i, merge.m_j, merge.s_i, merge.s_j, bits, group_size
        )
        return cls(codes, scales, tuple(merge.shape), bits, group_size)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def decode(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_quantized_pair(self.codes, self.scales, self.shape, self.bits, self.group_size, dtype)

    def forward(self, x_i, x_j, bias_i=None, bias_j=None, backend: Backend = "auto"):
        # Decode-then-matmul on every device: there is no fused kernel for the quantized codes yet.
        ref = x_i if x_i is not None else x_j
        if ref is None:
            return None, None
        w_i, w_j = self.decode(ref.dtype)
        return _linear(x_i, w_i, bias_i), _linear(x_j, w_j, bias_j)

    def nbytes(self) -> int:
        return (
            self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()
        )

    def meta(self) -> dict:
        return {
            "format": f"q{self.bits}_g{self.group_size}",
            "shape": list(self.shape),
            "bits": self.bits,
            "group_size": self.group_size,
        }


PairLinear = PackedPairLinear | QuantPairLinear


def pair_linear_from_meta(meta: dict, tensors: dict[str, torch.Tensor]) -> PairLinear:
    """Rebuild a projection from ``meta()`` and its state_dict tensors (for loaders)."""
    if meta["format"] == "bf16_packed":
        return PackedPairLinear(tensors["packed"])
    return QuantPairLinear(
        tensors["codes"], tensors["scales"], tuple(meta["shape"]), meta["bits"], meta["group_size"]
    )


class PackedPairExperts(nn.Module):
    """Both experts of a merged pair: gate and up as one [2I, H] pair projection, down [H, I].

    forward(x_i, x_j) -> (f_i(x_i), f_j(x_j)) with x_i, x_j [N_i, H], [N_j, H] (tokens routed to each;
    either may be None). Biases, when the family has them, are kept per expert (not merged).
    """

    def __init__(
        self,
        gate_up: PairLinear,
        down: PairLinear,
        act: ExpertActivation | None = None,
        bias_i: ExpertWeights | None = None,
        bias_j: ExpertWeights | None = None,
    ):
        super().__init__()
        if gate_up.out_features != 2 * down.in_features or gate_up.in_features != down.out_features:
            raise MoECompressError(
                f"Packed gate_up {gate_up.out_features}x{gate_up.in_features} and down "
                f"{down.out_features}x{down.in_features} do not form an expert ([2I, H] and [H, I])."
            )
        self.gate_up, self.down = gate_up, down
        self.act = act or ExpertActivation()
        for tag, b in (("i", bias_i), ("j", bias_j)):
            gu = None
            if b is not None and (b.gate is not None or b.up is not None):
                i_size = down.in_features
                ref = b.gate if b.gate is not None else b.up
                zeros = torch.zeros(i_size, dtype=ref.dtype, device=ref.device)
                gu = torch.cat([b.gate if b.gate is not None else zeros, b.up if b.up is not None else zeros])
            self.register_buffer(f"gate_up_bias_{tag}", gu)
            self.register_buffer(f"down_bias_{tag}", None if b is None else b.down)

    @classmethod
    def from_merge(
        cls,
        merge: ExpertPairMerge,
        act: ExpertActivation | None = None,
        quant_bits: int | None = None,
        group_size: int = 128,
        underflow: Underflow = "nearest",
    ) -> PackedPairExperts:
        """Pack (quant_bits None) or quantize (3/4 bits) both projections of a merged expert pair."""
        if quant_bits is None:
            gu, dn = (PackedPairLinear.from_merge(m, underflow) for m in (merge.gate_up, merge.down))
        else:
            gu, dn = (
                QuantPairLinear.from_merge(m, quant_bits, group_size) for m in (merge.gate_up, merge.down)
            )
        return cls(gu, dn, act, merge.bias_i, merge.bias_j)

    @property
    def intermediate_size(self) -> int:
        return self.down.in_features

    def forward(self, x_i: torch.Tensor | None, x_j: torch.Tensor | None, backend: Backend = "auto"):
        i_size = self.intermediate_size
        h_i, h_j = self.gate_up(x_i, x_j, self.gate_up_bias_i, self.gate_up_bias_j, backend=backend)
        a_i = None if h_i is None else self.act(h_i[..., :i_size], h_i[..., i_size:])
        a_j = None if h_j is None else self.act(h_j[..., :i_size], h_j[..., i_size:])
        return self.down(a_i, a_j, self.down_bias_i, self.down_bias_j, backend=backend)

    def decode(self, dtype: torch.dtype = torch.bfloat16) -> tuple[ExpertWeights, ExpertWeights]:
        """Dense Ŵ of both experts (gate [I, H], up [I, H], down [H, I]) — for materializing/evaluation."""
        i_size = self.intermediate_size
        gu = self.gate_up.decode(dtype)
        dn = self.down.decode(dtype)
        out = []
        for k, tag in enumerate(("i", "j")):
            gub, db = getattr(self, f"gate_up_bias_{tag}"), getattr(self, f"down_bias_{tag}")
            out.append(
                ExpertWeights(
                    gate=gu[k][:i_size],
                    up=gu[k][i_size:],
                    down=dn[k],
                    gate_bias=None if gub is None else gub[:i_size],
                    up_bias=None if gub is None else gub[i_size:],
                    down_bias=db,
                )
            )
        return out[0], out[1]

    def nbytes(self) -> int:
        """Bytes of the packed weights (biases excluded: they are per expert and tiny)."""
        return self.gate_up.nbytes() + self.down.nbytes()

    def meta(self) -> dict:
        return {"gate_up": self.gate_up.meta(), "down": self.down.meta(), "act": dataclasses.asdict(self.act)}

    @classmethod
    def from_state(cls, meta: dict, state: dict[str, torch.Tensor]) -> PackedPairExperts:
        """Rebuild from ``meta()`` and ``state_dict()`` (keys as written by state_dict)."""
        sub = lambda p: {k[len(p) + 1 :]: v for k, v in state.items() if k.startswith(p + ".")}
        gu = pair_linear_from_meta(meta["gate_up"], sub("gate_up"))
        dn = pair_linear_from_meta(meta["down"], sub("down"))
        biases = {}
        i_size = dn.in_features
        for tag in ("i", "j"):
            gub, db = state.get(f"gate_up_bias_{tag}"), state.get(f"down_bias_{tag}")
            biases[tag] = (
                None
                if gub is None and db is None
                else ExpertWeights(
                    gate=None if gub is None else gub[:i_size],
                    up=None if gub is None else gub[i_size:],
                    down=db,
                )
            )
        return cls(gu, dn, ExpertActivation(**meta.get("act", {})), biases["i"], biases["j"])
