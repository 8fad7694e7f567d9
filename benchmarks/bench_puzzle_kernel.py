"""Benchmark the PuzzleMoE decode-GEMM (Triton) against decode-then-cuBLAS and two plain bf16 matmuls.

For each MoE shape (hidden H, expert width I) and projection (gate_up [2I, H], down [H, I]) and decode
batch size M (tokens routed to each of the two experts), it times:
  kernel          packed_pair_linear_triton: one read of the int16 words, both experts' outputs;
  decode+cuBLAS   decode_pair (torch, materializes Ŵ_i and Ŵ_j in bf16) then two F.linear;
  2x bf16         two F.linear with dense bf16 Ŵ_i, Ŵ_j (what an unmerged model pays);
and writes a markdown table (median µs over triton.testing.do_bench runs; effective GB/s of the
kernel counts the packed weight bytes only).

    python benchmarks/bench_puzzle_kernel.py --out benchmarks/results/puzzle_kernel.md

Needs an NVIDIA GPU and triton; without them it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

DEFAULT_SHAPES = "2048:768,2048:1408,4096:1792,4096:14336,2880:2880"
DEFAULT_BATCHES = "1,2,4,8,16,32,64"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help="comma-separated H:I pairs (default: Qwen3-30B-A3B, Qwen1.5/DeepSeek-MoE, fine-grained "
        "Mixtral/8, Mixtral-8x7B, GPT-OSS)",
    )
    p.add_argument("--batches", default=DEFAULT_BATCHES, help="decode batch sizes (tokens per expert)")
    p.add_argument("--out", default="benchmarks/results/puzzle_kernel.md", help="markdown table to write")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    return p.parse_args(argv)


def _fail(msg: str) -> None:
    print(f"bench_puzzle_kernel: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        _fail(
            "no CUDA device is available, so the Triton decode-GEMM cannot be measured here; run this on a "
            "machine with an NVIDIA GPU (the torch reference path is tested on CPU by tests/test_puzzle.py)."
        )
    from moecompress.puzzle import (
        decode_pair,
        merge_pair,
        pack_pair,
        packed_pair_linear_triton,
        triton_available,
    )

    if not triton_available():
        _fail("the triton package is not installed; `pip install triton` matching your CUDA torch.")
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench

    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",") if s]
    batches = [int(b) for b in args.batches.split(",") if b]
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for h, i in shapes:
        for proj, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            w_i = torch.randn(n, k, generator=gen) * 0.02
            w_j = torch.randn(n, k, generator=gen) * 0.02
            m = merge_pair(w_i, w_j)
            packed = pack_pair(m.w_merged, m.m_i, m.m_j, m.s_i, m.s_j).to(dev)
            d_i, d_j = (t.contiguous() for t in decode_pair(packed, torch.bfloat16))
            for mb in batches:
                x_i = torch.randn(mb, k, device=dev, dtype=torch.bfloat16)
                x_j = torch.randn(mb, k, device=dev, dtype=torch.bfloat16)
                y_i, y_j = packed_pair_linear_triton(x_i, x_j, packed)
                err = max(
                    float((y_i.float() - x_i.float() @ d_i.float().T).abs().max()),
                    float((y_j.float() - x_j.float() @ d_j.float().T).abs().max()),
                )

                def kernel(x_i=x_i, x_j=x_j, packed=packed):
                    packed_pair_linear_triton(x_i, x_j, packed)

                def decode_cublas(x_i=x_i, x_j=x_j, packed=packed):
                    a, b = decode_pair(packed, torch.bfloat16)
                    F.linear(x_i, a)
                    F.linear(x_j, b)

                def dense(x_i=x_i, x_j=x_j, d_i=d_i, d_j=d_j):
                    F.linear(x_i, d_i)
                    F.linear(x_j, d_j)

                t = {
                    name: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median") * 1e3
                    for name, fn in (("kernel", kernel), ("decode", decode_cublas), ("dense", dense))
                }
                gbs = packed.numel() * 2 / (t["kernel"] * 1e-6) / 1e9
                rows.append(
                    (
                        f"H={h} I={i}",
                        proj,
                        f"{n}x{k}",
                        mb,
                        t["kernel"],
                        t["decode"],
                        t["dense"],
                        t["dense"] / t["kernel"],
                        t["decode"] / t["kernel"],
                        gbs,
                        err,
                    )
                )
                print(
                    f"{h}:{i} {proj:7s} M={mb:3d} kernel {t['kernel']:8.1f} us  decode+cuBLAS "
                    f"{t['decode']:8.1f} us  2x bf16 {t['dense']:8.1f} us  max|err| {err:.2e}",
                    flush=True,
                )

    lines = [
        "# PuzzleMoE decode-GEMM benchmark",
        "",
        (
            f"Device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; triton {triton.__version__}; "
            f"python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M')}."
        ),
        "Times are medians (µs) of triton.testing.do_bench; M tokens go to each of the two experts.",
        "Speedups are relative to the kernel (> 1: the kernel is faster). GB/s counts the packed weights only.",
        "",
        (
            "| model shape | proj | N x K | M | kernel µs | decode+cuBLAS µs | 2x bf16 µs | vs 2x bf16 | "
            "vs decode+cuBLAS | kernel GB/s | max abs err |"
        ),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.1f} | "
            f"{r[7]:.2f}x | {r[8]:.2f}x | {r[9]:.0f} | {r[10]:.1e} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
