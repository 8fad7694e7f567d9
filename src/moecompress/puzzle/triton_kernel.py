"""Fused PuzzleMoE decode-GEMM in Triton: both experts' outputs from one read of the packed weights.

Triton is imported lazily: importing this module never needs Triton or CUDA. On CUDA the kernel is
compiled with ``triton.jit``; on CPU tensors it runs in Triton's interpreter (slow, for tests only).

Design (see docs/puzzlemoe.md): each program owns a [BLOCK_M, BLOCK_N] output tile of *both* experts.
Per K-step it loads one [BLOCK_K, BLOCK_N] tile of int16 words, decodes Ŵ_i and Ŵ_j in registers with
integer ops (mask, add the exponent offset, OR the sign, select on the mask bit, bitcast to bf16), and
issues two tensor-core dots against the X_i and X_j tiles. Decode-time GEMMs (M ≤ 64) are memory bound,
so reading 2 bytes per element for two experts instead of 4 is the whole point; SPLIT_K spreads the K
loop over more programs when N / BLOCK_N alone would leave most SMs idle.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..errors import MoECompressError


def triton_available() -> bool:
    """True when the triton package is importable (says nothing about a GPU)."""
    return importlib.util.find_spec("triton") is not None


def cuda_kernel_available() -> bool:
    """True when the compiled kernel can run: Triton installed and a CUDA device present."""
    return triton_available() and torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def _kernel():
    if not triton_available():
        raise MoECompressError(
            "The PuzzleMoE Triton kernel needs the triton package; install it or use backend='torch'."
        )
    import triton

    from . import _triton_src

    # Under TRITON_INTERPRET=1 (set before triton is first imported) triton.jit returns the CPU interpreter.
    return triton.jit(_triton_src.packed_pair_gemm_kernel)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    if not triton_available():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _block_m(m: int) -> int:
    # tl.dot needs ≥ 16 rows; decode batches are small, so keep the M tile as small as allowed.
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _split_k(n_tiles: int, k_blocks: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split = 1
    # Aim for at least one program per SM; each split costs an fp32 atomic add of the output tile.
    while n_tiles * split < sms and split * 2 <= k_blocks and split < 16:
        split *= 2
    return split


def _as_2d(x: torch.Tensor | None, k: int, like: torch.Tensor) -> torch.Tensor:
    if x is None:
        return torch.empty(0, k, dtype=like.dtype, device=like.device)
    return x.reshape(-1, k)


def packed_pair_linear_triton(
    x_i: torch.Tensor | None,
    x_j: torch.Tensor | None,
    packed: torch.Tensor,
    bias_i: torch.Tensor | None = None,
    bias_j: torch.Tensor | None = None,
    *,
    block_n: int = 64,
    block_k: int = 128,
    block_m: int | None = None,
    split_k: int | None = None,
):
    """(x_i @ Ŵ_iᵀ + b_i, x_j @ Ŵ_jᵀ + b_j) with the fused kernel; x_* [..., K], packed int16 [N, K].

    Inputs are computed in bf16 (tensor-core dots, float32 accumulation); outputs take the inputs' dtype.
    CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1 set before importing triton).
    """
    ref = x_i if x_i is not None else x_j
    if ref is None:
        return None, None
    if packed.dtype != torch.int16 or packed.dim() != 2:
        raise MoECompressError("The packed PuzzleMoE weight must be a 2-D int16 tensor from pack_pair.")
    n, k = packed.shape
    interpret = not ref.is_cuda
    if interpret and not interpreter_active():
        raise MoECompressError(
            "The Triton PuzzleMoE kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            "triton is imported, for CPU testing); use backend='torch' on CPU."
        )
    out_dtype = ref.dtype
    xi = _as_2d(x_i, k, ref).to(torch.bfloat16).contiguous()
    xj = _as_2d(x_j, k, ref).to(torch.bfloat16).contiguous()
    m_i, m_j = xi.shape[0], xj.shape[0]
    bm = block_m or _block_m(max(m_i, m_j, 1))
    n_tiles = triton_cdiv(n, block_n) * triton_cdiv(max(m_i, m_j, 1), bm)
    split = split_k or _split_k(n_tiles, triton_cdiv(k, block_k), ref.device)
    # Split-K partial sums are atomically added in float32; otherwise store straight in the output dtype.
    acc_dtype = (
        out_dtype
        if split == 1 and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
        else torch.float32
    )
    alloc = torch.zeros if split > 1 else torch.empty
    yi = alloc(m_i, n, dtype=acc_dtype, device=ref.device)
    yj = alloc(m_j, n, dtype=acc_dtype, device=ref.device)
    grid = (triton_cdiv(n, block_n), triton_cdiv(max(m_i, m_j, 1), bm), split)
    kwargs = {} if interpret else {"num_warps": 4, "num_stages": 3}
    _kernel()[grid](
        xi,
        xj,
        packed,
        yi,
        yj,
        m_i,
        m_j,
        n,
        k,
        xi.stride(0),
        xi.stride(1),
        xj.stride(0),
        xj.stride(1),
        packed.stride(0),
        packed.stride(1),
        yi.stride(0),
        yi.stride(1),
        yj.stride(0),
        yj.stride(1),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        DOT_FP32=interpret,
        **kwargs,
    )
    outs = []
    for x, y, b in ((x_i, yi, bias_i), (x_j, yj, bias_j)):
        if x is None:
            outs.append(None)
            continue
        y = y.to(out_dtype)
        if b is not None:
            y = y + b.to(out_dtype)
        outs.append(y.reshape(*x.shape[:-1], n))
    return outs[0], outs[1]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
