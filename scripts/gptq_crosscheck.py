"""Cross-check moecompress.quant.gptq against llm-compressor's GPTQ source, bit for bit.

Usage:  python scripts/gptq_crosscheck.py PATH/TO/llmcompressor/modifiers/gptq/gptq_quantize.py [...]

Loads llm-compressor's ``quantize_weight`` straight from its source file (only compressed-tensors,
transformers and loguru are needed, not llm-compressor's pins) and runs it and ours on the same bf16
weight and correlated Hessian (with a dead column) for 2/3/4/8 bits, symmetric and asymmetric,
group and channel, with and without activation ordering. llm-compressor's weight observer is replaced
by one returning ``moecompress.quant.qparams`` (CT's ``calculate_qparams`` on the bf16 group min/max, as
its ``memoryless_minmax`` observer computes), so what is compared is the GPTQ loop itself. Prints the
number of differing dequantized weights per case; see docs/quantization.md for the recorded result.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from moecompress.quant import QuantSpec, gptq, qparams

SPECS = ("w4g128", "w4g32", "w3g64", "w2g32", "w8c", "w4g128a", "w3ca", "w2g64a")


class _Observer:
    def __init__(self, w: torch.Tensor, spec: QuantSpec):
        self.w, self.spec = w, spec

    def delete_statistics(self, **_):
        pass

    def get_qparams(self) -> dict:
        scale, zero = qparams(self.w, self.spec)
        if zero is None:
            zero = torch.zeros(scale.shape, dtype=torch.int8)
        return {"scale": scale, "zero_point": zero, "global_scale": None}


def _load(path: str):
    spec = importlib.util.spec_from_file_location("llmc_gptq_quantize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(paths: list[str]) -> int:
    cases = differing = 0
    for path in paths:
        reference = _load(path)
        for seed, (text, actorder) in enumerate((t, a) for t in SPECS for a in (False, True)):
            spec = QuantSpec.parse(text).model_copy(update={"actorder": actorder})
            g = torch.Generator().manual_seed(seed)
            n, out = 256, 96
            X = torch.randn(2048, n, generator=g) @ (torch.randn(n, n, generator=g) / 16 + torch.eye(n))
            X[:, 3] = 0  # a dead column
            H = X.T @ X
            w = (torch.randn(out, n, generator=g) * 0.02).to(torch.bfloat16)
            linear = torch.nn.Linear(n, out, bias=False)
            linear.weight.data = w.clone()
            linear.weight_observer = _Observer(w, spec)
            args = spec.quantization_args()
            if actorder:
                args = args.model_copy(update={"actorder": "weight"})
            _, ref = reference.quantize_weight(linear, args, H.clone(), blocksize=128, percdamp=0.01)
            ours = gptq(w, H, spec).dequantize(torch.bfloat16)
            diff = int((ours != ref["weight"]).sum())
            cases, differing = cases + 1, differing + (diff > 0)
            print(f"{path}: {text} actorder={actorder}: {diff} of {w.numel()} weights differ")
    print(f"{cases} cases, {differing} with any difference")
    return int(differing > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
