"""GPTQ (Frantar et al., 2023, Algorithm 1) on one weight W [..., out, in] with input Hessian H [..., in, in].

Minimises the layer-wise objective  ||W X - Q X||^2 = tr((W - Q) H (W - Q)^T),  H = X X^T  (``gptq_loss``),
quantizing one input column j at a time and spreading its error over the columns not yet quantized
(optimal brain surgeon update with U = upper Cholesky factor of H^-1):

    q_j = quant(w_j);   e = (w_j - q_j) / U_jj;   W[:, k] -= e · U_jk  for k > j

in lazy blocks of ``block_size`` columns (updates inside a block, one matmul for the rest; inside a block the same
again over sub-blocks of 16 columns). Follows
llm-compressor's ``quantize_weight`` (modifiers/gptq/gptq_quantize.py, 0.9 to 0.13 and main), which is the
reference for everything below:

- group parameters (grid.qparams) are computed once, from the original weight, before any update
  (llm-compressor's observer runs on the unmodified weight; it does not re-observe at each group start
  the way the original GPTQ repository's ``static_groups=False`` does);
- dead columns (H_jj == 0) get H_jj = 1 and W[:, j] = 0;
- dampening: H += damp · mean(diag H) · I, then U = chol(chol_inverse(chol(H)), upper);
  if a Cholesky fails the matrix falls back to round-to-nearest (U = I), with a warning;
- working precision float32 (llm-compressor's GPTQ_PRECISION); the quantized column q_j is the value a
  loader reconstructs, (code - zero)·scale rounded to bf16;
- ``actorder``: columns processed in order of descending diag(H) while each keeps its original group's
  parameters (llm-compressor's default "static" = "weight" ordering), so the stored format is unchanged
  and needs no g_idx.

Leading batch dimensions (all experts of one projection at once) run in one column loop.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import MoECompressError
from . import grid
from .spec import QuantSpec
from .tensor import QuantizedTensor

GPTQ_PRECISION = torch.float32
# columns updated one by one inside a lazy block; the rest of the block gets their error in one matmul (the same
# lazy-batch identity as the blocks themselves, one level down): the column-by-column rank-1 updates, memory-bound
# elementwise work, were half of `compress --method quant`'s time with 128-column blocks (issue 32)
_SUB_BLOCK = 16


def _upper_cholesky_of_inverse(H: Tensor) -> Tensor:
    """U with U^T U = H^-1 (H damped, SPD) per batch element; identity where a factorisation fails."""
    L, info = torch.linalg.cholesky_ex(H)
    Hinv = torch.cholesky_inverse(L)
    U, info2 = torch.linalg.cholesky_ex(Hinv, upper=True)
    failed = (info != 0) | (info2 != 0)
    if bool(failed.any()):
        warnings.warn(
            f"GPTQ: the damped Hessian of {int(failed.sum())} matrix(es) is not positive definite; "
            "those fall back to round-to-nearest (raise damp or add calibration tokens).",
            stacklevel=3,
        )
        eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device).expand_as(H)
        U = torch.where(failed[..., None, None], eye, U)
    return U


@dataclass(frozen=True)
class HessianFactor:
    """What GPTQ derives from a Hessian alone, shared by every weight quantized against it (gate and up, every
    bit width): the act-order permutation, the dead columns, and U = chol(H_damped^-1, upper), all permuted."""

    perm: Tensor | None
    dead: Tensor
    U: Tensor
    damp: float
    actorder: bool


def factor(H: Tensor, spec: QuantSpec) -> HessianFactor:
    """The `HessianFactor` of H [..., in, in] under `spec`'s damping and act order (its bits do not matter)."""
    H = H.to(GPTQ_PRECISION).clone()
    perm = None
    if spec.actorder:
        perm = torch.argsort(H.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True)  # [..., in]
        H = H.gather(-1, perm.unsqueeze(-2).expand_as(H)).gather(-2, perm.unsqueeze(-1).expand_as(H))
    diag = H.diagonal(dim1=-2, dim2=-1)  # a view: edits below change H
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)
    diag.add_(spec.damp * diag.mean(dim=-1, keepdim=True))
    return HessianFactor(perm, dead, _upper_cholesky_of_inverse(H), spec.damp, spec.actorder)


def gptq(w: Tensor, H: Tensor | None, spec: QuantSpec, hf: HessianFactor | None = None) -> QuantizedTensor:
    """GPTQ-quantize w [..., out, in] against H [..., in, in] (sum or mean of x x^T; the scale cancels), or
    against H's `factor` computed once for several weights or bit widths (then H may be None)."""
    want = (*w.shape[:-2], w.shape[-1], w.shape[-1])
    got = tuple(hf.U.shape) if hf is not None else (tuple(H.shape) if H is not None else None)
    if w.ndim < 2 or got != want:
        raise MoECompressError(
            f"GPTQ needs a Hessian of shape {want} for a weight of shape {tuple(w.shape)}, got {got}: pass the "
            "input Hessian of this projection."
        )
    if hf is None:
        hf = factor(H, spec)
    elif (hf.damp, hf.actorder) != (spec.damp, spec.actorder):
        raise RuntimeError(
            "GPTQ was given a Hessian factor made with another damping or column order; this is a "
            "bug, please report it."
        )
    n = w.shape[-1]
    scale, zero = grid.qparams(w, spec)  # from the original weight, as llm-compressor
    S = grid.expand_groups(scale, n, spec)  # [..., out, in] per-column scale
    Z = None if zero is None else grid.expand_groups(zero, n, spec)

    W = w.to(GPTQ_PRECISION).clone()
    perm, U = hf.perm, hf.U
    if perm is not None:
        cols = perm.unsqueeze(-2)
        W = W.gather(-1, cols.expand_as(W))
        S = S.gather(-1, cols.expand_as(S))
        Z = None if Z is None else Z.gather(-1, cols.expand_as(Z))
    W.masked_fill_(hf.dead.unsqueeze(-2), 0.0)

    codes = torch.empty(W.shape, dtype=torch.int8, device=W.device)
    for i1 in range(0, n, spec.block_size):
        i2 = min(i1 + spec.block_size, n)
        W1 = W[..., i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[..., i1:i2, i1:i2]
        for s1 in range(0, i2 - i1, _SUB_BLOCK):
            s2 = min(s1 + _SUB_BLOCK, i2 - i1)
            for i in range(s1, s2):
                j = i1 + i
                w_col = W1[..., i]  # [..., out]
                z_col = None if Z is None else Z[..., j]
                c = grid.quantize_values(w_col, S[..., j], z_col, spec)
                q = grid.dequantize_values(c, S[..., j], z_col, torch.bfloat16).to(GPTQ_PRECISION)
                codes[..., j] = c
                err = (w_col - q) / U1[..., i, i].unsqueeze(-1)  # [..., out]
                W1[..., i:s2] -= err.unsqueeze(-1) * U1[..., i, i:s2].unsqueeze(-2)
                Err1[..., i] = err
            if s2 < i2 - i1:  # the sub-block's error reaches the rest of the block in one matmul
                W1[..., s2:] -= Err1[..., s1:s2] @ U1[..., s1:s2, s2:]
        if i2 < n:
            W[..., i2:] -= Err1 @ U[..., i1:i2, i2:]

    if perm is not None:
        codes = codes.gather(-1, torch.argsort(perm, dim=-1).unsqueeze(-2).expand_as(codes))
    return QuantizedTensor(codes=codes, scale=scale, zero=zero, spec=spec)


def diagonal_loss(w: Tensor, q: Tensor, h_diag: Tensor) -> Tensor:
    """Σ_j H_jj Σ_i (W − Q)_ij² per matrix of a batch [..., out, in] (float64): `gptq_loss` without the cross
    terms of different input columns, which independent rounding errors average out (`auto`'s fast search prices
    round-to-nearest codes with it). Q dequantized in W's dtype, `h_diag` [..., in]; a bf16 weight's difference
    with grid values is exact in float32."""
    return ((w - q).square().sum(-2).double() * h_diag.double()).sum(-1)


def gptq_loss(w: Tensor, q: QuantizedTensor | Tensor, H: Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) summed over any batch, in float64; Q is a QuantizedTensor or a dense tensor.

    With H = sum of x x^T over tokens this is the summed squared output error of the projection, the
    quantity GPTQ minimises (undamped H, dead columns included).
    """
    Q = q.dequantize(torch.float64) if isinstance(q, QuantizedTensor) else q.to(torch.float64)
    D = w.to(torch.float64) - Q
    return float(((D @ H.to(torch.float64)) * D).sum())
