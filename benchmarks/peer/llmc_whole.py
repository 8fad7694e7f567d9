#!/usr/bin/env python3
"""llm-compressor whole-model GPTQ (every Linear but the router gates) on fixed token ids; saves the checkpoint.

Runs INSIDE the peer virtualenv (build/peer-venv, see docs/peer_check.md); it imports nothing from
moecompress. `benchmarks/peer_llmcompressor_whole.py` calls it through a subprocess:

    build/peer-venv/bin/python benchmarks/peer/llmc_whole.py --model DIR --tokens tokens.safetensors \
        --bits 4 --group 32 --scope linear|all [--embed rtn-pass|in-gptq] --save DIR --out result.json

The model is loaded with plain transformers in the checkpoint's dtype, its fused experts are linearised with
llm-compressor's `linearize_moe` (as in the GPTQ peer check), and `oneshot` runs ONE `GPTQModifier` with one
config group, W{bits}A16 int symmetric group `--group`, everything else as llm-compressor ships it
(`actorder="static"`, `dampening_frac=0.01`, the sequential pipeline, a 2-D mask, `moe_calibrate_all_experts=True`,
`propagate_error=True`):

* `--scope linear`: targets ["Linear"], ignore ["lm_head", "re:.*mlp\\.gate$"] -- llm-compressor's conventional
  whole-model recipe: attention q/k/v/o, every routed expert's gate/up/down (and shared experts, where a model has
  them); the routers (not nn.Linear in transformers 5 anyway) and lm_head stay bf16, the embeddings too;
* `--scope all`: targets ["Linear"], ignore ["re:.*mlp\\.gate$"] (lm_head GPTQ'd like every other Linear), then the
  embeddings: `--embed rtn-pass` (default) a second, data-free `oneshot` with a `QuantizationModifier` targeting
  ["Embedding"] at the same W{bits} group spec (round-to-nearest: GPTQModifier never calibrates an Embedding);
  `--embed in-gptq` puts "Embedding" among the GPTQModifier's targets instead -- in 0.14.0.1 that writes the
  embedding packed with scales that were never computed (uninitialised memory: zeros and NaNs), which this mode
  exists to record (`embedding_scales` in the result).

`save_pretrained(save_compressed=True)` writes the compressed-tensors checkpoint. The result JSON records the
versions, the recipe, which modules carry a quantization scheme (by kind), and, for a quantized embedding, how
many of its stored scales are zero or not finite.
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()

import argparse
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUTER_IGNORE = r"re:.*mlp\.gate$"

from _loader import calibration_data


def module_kind(name: str, module) -> str:
    """attention | routed_experts | shared_experts | lm_head | embeddings | other (for the record only)."""
    if name == "lm_head":
        return "lm_head"
    if type(module).__name__ == "Embedding" or name.endswith("embed_tokens"):
        return "embeddings"
    if ".self_attn." in name:
        return "attention"
    if ".shared_expert" in name:
        return "shared_experts"
    if ".experts." in name:
        return "routed_experts"
    return "other"


def quantized_modules(model) -> dict:
    """{kind: {modules, bits}} of the modules that carry a weight quantization scheme, and the Linear/Embedding
    modules that do not."""
    done, left = {}, {}
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        w = getattr(scheme, "weights", None) if scheme is not None else None
        kind = module_kind(name, m)
        if w is not None:
            d = done.setdefault(kind, {"modules": 0, "bits": set()})
            d["modules"] += 1
            d["bits"].add(int(w.num_bits))
        elif type(m).__name__ in ("Linear", "Embedding") or "Router" in type(m).__name__:
            left.setdefault(kind if kind != "other" else type(m).__name__, []).append(name)
    return (
        {k: {"modules": v["modules"], "bits": sorted(v["bits"])} for k, v in done.items()},
        {k: {"modules": len(v), "example": v[0]} for k, v in left.items()},
    )


def embedding_scales(save: Path) -> dict | None:
    """Zero / non-finite entries among the stored embedding scales (None when the embedding is not quantized)."""
    import torch
    from safetensors import safe_open

    for shard in sorted(save.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                if k.endswith("embed_tokens.weight_scale"):
                    s = f.get_tensor(k).float()
                    return {
                        "tensor": k,
                        "numel": s.numel(),
                        "zero": int((s == 0).sum()),
                        "non_finite": int((~torch.isfinite(s)).sum()),
                    }
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="safetensors file with input_ids and attention_mask")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--scope", choices=("linear", "all"), default="linear")
    ap.add_argument(
        "--embed",
        choices=("rtn-pass", "in-gptq"),
        default="rtn-pass",
        help="--scope all: how the embeddings are quantized (see the module docstring)",
    )
    ap.add_argument("--save", required=True, help="directory for the compressed checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    data, n, seq_len, n_tokens = calibration_data(
        args.tokens, "2d", args.batch_size
    )  # as shipped: a 2-D mask

    def weights() -> QuantizationArgs:
        return QuantizationArgs(
            num_bits=args.bits, type="int", symmetric=True, strategy="group", group_size=args.group
        )

    targets = ["Linear"] + (["Embedding"] if args.scope == "all" and args.embed == "in-gptq" else [])
    ignore = [ROUTER_IGNORE] + (["lm_head"] if args.scope == "linear" else [])
    gptq = GPTQModifier(
        config_groups={"group_0": QuantizationScheme(targets=targets, weights=weights())}, ignore=ignore
    )  # actorder "static", dampening_frac 0.01: its defaults
    embed_pass = args.scope == "all" and args.embed == "rtn-pass"

    t_run = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    model.eval()
    linearize_moe(model)
    t_loaded = time.perf_counter()
    oneshot(
        model=model,
        dataset=data,
        recipe=gptq,
        num_calibration_samples=n,
        max_seq_length=seq_len,
        batch_size=args.batch_size,
        shuffle_calibration_samples=False,
        pipeline="sequential",
    )
    if embed_pass:  # data-free round-to-nearest of the embeddings, the same W{b} group spec
        oneshot(
            model=model,
            recipe=QuantizationModifier(
                config_groups={"group_embed": QuantizationScheme(targets=["Embedding"], weights=weights())}
            ),
        )
    t_oneshot = time.perf_counter()
    done, left = quantized_modules(model)
    model.save_pretrained(args.save, save_compressed=True)
    t_done = time.perf_counter()

    weight_dtype = str(next(p for n_, p in model.named_parameters() if "norm" in n_).dtype).replace(
        "torch.", ""
    )
    result = {
        "tool": "llm-compressor GPTQModifier (whole model)",
        "versions": {
            p: version(p)
            for p in (
                "llmcompressor",
                "compressed-tensors",
                "torch",
                "transformers",
                "datasets",
                "accelerate",
            )
        },
        "python": sys.version.split()[0],
        "model": str(args.model),
        "dtype": weight_dtype,
        "bits": args.bits,
        "group": args.group,
        "symmetric": True,
        "scope": args.scope,
        "embed": args.embed if args.scope == "all" else None,
        "recipe": {
            "gptq": {
                "targets": targets,
                "ignore": ignore,
                "actorder": "static (default)",
                "dampening_frac": "0.01 (default)",
            },
            "embedding_rtn_pass": embed_pass,
        },
        "quantized": done,
        "not_quantized": left,
        "embedding_scales": embedding_scales(Path(args.save)),
        "sequences": int(n),
        "seq_len": int(seq_len),
        "tokens": n_tokens,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "mask": "2d",
        "moe_calibrate_all_experts": True,
        "propagate_error": True,
        "pipeline": "sequential",
        "save": str(args.save),
        "load_s": t_loaded - t_run,
        "oneshot_s": t_oneshot - t_loaded,
        "save_s": t_done - t_oneshot,
        "run_s": t_done - t_run,
        "process_s": time.perf_counter() - T_PROCESS,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("bits", "scope", "run_s", "quantized")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
