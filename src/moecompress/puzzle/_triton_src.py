"""Triton source of the PuzzleMoE decode-GEMM. Imported only by triton_kernel.py (imports triton eagerly).

The kernel function is left undecorated; triton_kernel.py wraps it with ``triton.jit`` (CUDA) or with
Triton's interpreter (CPU tests), so one source serves both.
"""

import triton.language as tl


def packed_pair_gemm_kernel(
    xi_ptr,
    xj_ptr,
    w_ptr,
    yi_ptr,
    yj_ptr,
    M_i,
    M_j,
    N,
    K,
    stride_xim,
    stride_xik,
    stride_xjm,
    stride_xjk,
    stride_wn,
    stride_wk,
    stride_yim,
    stride_yin,
    stride_yjm,
    stride_yjn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Y_i[m, n] = Σ_k X_i[m, k] Ŵ_i[n, k] and Y_j likewise, decoding each packed word once.

    Grid: (cdiv(N, BLOCK_N), cdiv(max(M_i, M_j), BLOCK_M), SPLIT_K). Program (n, m, s) owns an output
    tile of both experts and the K-blocks s, s + SPLIT_K, ...; with SPLIT_K > 1 it atomically adds its
    float32 partial sums (outputs zero-initialised by the caller). DOT_FP32 upcasts the dot operands
    (exactly: bf16 ⊂ fp32); only Triton's CPU interpreter needs it, as its dot mishandles bf16.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    mi_mask = offs_m < M_i
    mj_mask = offs_m < M_j
    acc_i = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_j = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + rk
        k_mask = offs_k < K
        # One read of the packed tile, laid out [BLOCK_K, BLOCK_N] (W is [N, K] like nn.Linear).
        p = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        p = p.to(tl.int32) & 0xFFFF
        # Decode in registers: magnitude = (word & 0xFFF) + (112 << 7); bit 15/14 masks, bit 13/12 signs.
        mag = (p & 0x0FFF) + 0x3800
        wi = tl.where(((p >> 15) & 1) != 0, mag | (((p >> 13) & 1) << 15), 0)
        wj = tl.where(((p >> 14) & 1) != 0, mag | (((p >> 12) & 1) << 15), 0)
        wi = wi.to(tl.int16).to(tl.bfloat16, bitcast=True)
        wj = wj.to(tl.int16).to(tl.bfloat16, bitcast=True)
        xi = tl.load(
            xi_ptr + offs_m[:, None] * stride_xim + offs_k[None, :] * stride_xik,
            mask=mi_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        xj = tl.load(
            xj_ptr + offs_m[:, None] * stride_xjm + offs_k[None, :] * stride_xjk,
            mask=mj_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            xi, wi = xi.to(tl.float32), wi.to(tl.float32)
            xj, wj = xj.to(tl.float32), wj.to(tl.float32)
        acc_i += tl.dot(xi, wi)
        acc_j += tl.dot(xj, wj)
    yi_ptrs = yi_ptr + offs_m[:, None] * stride_yim + offs_n[None, :] * stride_yin
    yj_ptrs = yj_ptr + offs_m[:, None] * stride_yjm + offs_n[None, :] * stride_yjn
    yi_mask = mi_mask[:, None] & n_mask[None, :]
    yj_mask = mj_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(yi_ptrs, acc_i.to(yi_ptr.dtype.element_ty), mask=yi_mask)
        tl.store(yj_ptrs, acc_j.to(yj_ptr.dtype.element_ty), mask=yj_mask)
    else:
        tl.atomic_add(yi_ptrs, acc_i, mask=yi_mask)
        tl.atomic_add(yj_ptrs, acc_j, mask=yj_mask)
