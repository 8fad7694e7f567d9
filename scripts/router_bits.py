"""How many bits may the router take? (issue 30, item 1; docs/quantization.md, "Non-expert tensors")

On each bf16 fixture, quantize ONLY the routers (round-to-nearest, every other weight untouched) at several
widths and measure KL(original || quantized) per token on held-out windows, beside the experts and the attention
quantized alone at w4g32 for scale, and the bytes each saves. Prints one JSON line per (fixture, arm).

    OMP_NUM_THREADS=1 python scripts/router_bits.py [--max-tokens 16384]
"""

from __future__ import annotations

import argparse
import json

import torch

from moecompress import apply_plan, load_model
from moecompress.eval.metrics import evaluate_stream
from moecompress.methods.quantize import QuantConfig, quantize_plan
from moecompress.methods.tensor_quant import quantize_tensors
from moecompress.models import MoEAdapter
from moecompress.plan import CompressionPlan
from moecompress.quant import QuantSpec
from moecompress.testing import fixture_dir

ARMS = [("router", "w8c"), ("router", "w8g32"), ("router", "w4g32"), ("router", "w3g32"), ("router", "w2g32"),
        ("attention", "w4g32"), ("experts", "w4g32")]


def arm_model(path, cls: str, spec: str):
    model = load_model(str(path), dtype="bfloat16")
    plan = CompressionPlan.identity(model)
    if cls == "experts":
        adapter = MoEAdapter(model)
        plan, tensors = quantize_plan(plan, {}, lambda l, e: adapter.layer(l).storage.read(e),
                                      QuantConfig(quant=spec, algo="rtn"))
    else:
        plan, tensors = quantize_tensors(plan, {}, MoEAdapter(model), {cls: QuantSpec.parse(spec, algo="rtn")})
    before = plan.model.expert_bytes + plan.model.other_bytes
    return apply_plan(model, plan, tensors), before - plan.logical_bytes(tensors).total, before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=16384)
    args = ap.parse_args()
    for name in ("olmoe-tiny", "qwen3-moe-tiny"):
        path = fixture_dir(name)
        ref = load_model(str(path), dtype="bfloat16")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        for cls, spec in ARMS:
            model, saved, total = arm_model(path, cls, spec)
            with torch.no_grad():
                res = evaluate_stream(model, "fixture-heldout", tok, reference=ref, window=512,
                                      max_tokens=args.max_tokens, progress=False)
            print(json.dumps({"fixture": name, "class": cls, "spec": spec, "kl": res["aggregate"]["kl"],
                              "tokens": res["n_tokens"], "bytes_saved": saved, "file_bytes": total}), flush=True)


if __name__ == "__main__":
    main()
