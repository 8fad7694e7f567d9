#!/usr/bin/env python3
"""llm-compressor's GPTQModifier on the routed experts of a checkpoint, on fixed token ids; saves the checkpoint.

Runs INSIDE the peer virtualenv (build/peer-venv, see docs/peer_check.md); it imports nothing from
moecompress. `benchmarks/peer_llmcompressor_gptq.py` calls it through a subprocess:

    build/peer-venv/bin/python benchmarks/peer/llmc_gptq.py --model DIR --tokens tokens.safetensors \
        --bits 4 --group 32 --save DIR --out result.json [--batch-size 8] [--threads 1] \
        [--all-experts | --routed-only] [--propagate | --no-propagate] [--mask 2d|4d] [--actorder static|none]

The token file holds `input_ids` and `attention_mask` ([n, seq_len] int64), the exact sequences moecompress
calibrates on. The model is loaded with plain transformers in the checkpoint's dtype, its fused experts are
linearised with llm-compressor's `linearize_moe` (the post-load path oneshot itself falls back to; see
docs/peer_check.md for why not `load_quantizable_moe`), and `oneshot` runs one `GPTQModifier` whose only
config group targets the routed experts' projections,

    re:.*mlp\\.experts\\.\\d+\\.(gate_proj|up_proj|down_proj)$   W{bits}A16: int, symmetric, group `--group`

(attention, router, shared experts and lm_head stay as they are), through the sequential pipeline on those
sequences in stored order. `save_pretrained(save_compressed=True)` writes the compressed-tensors
`pack-quantized` checkpoint.

`--mask 4d` feeds a DataLoader whose batches carry the 4-D additive causal mask: llm-compressor 0.14.0.1's
traced graph otherwise calibrates with no attention mask at all (docs/peer_check.md, the REAP finding).

Timing: `run_s` from the start of model loading to the end of `save_pretrained` (checkpoint + token ids ->
quantized checkpoint on disk), after the same transformers modules were imported as on our side;
`process_s` from interpreter start.
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

EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"


from _loader import calibration_data


def warm_imports(model: str) -> None:
    """The same pre-clock imports as our side (transformers' lazy modules)."""
    import transformers.conversion_mapping
    import transformers.core_model_loading
    import transformers.masking_utils  # noqa: F401
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model))]  # imports the modeling module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="safetensors file with input_ids and attention_mask")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--save", required=True, help="directory for the compressed checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--damp", type=float, default=0.01, help="GPTQModifier dampening_frac (its default 0.01)")
    ap.add_argument(
        "--actorder",
        choices=("static", "none"),
        default="static",
        help="GPTQModifier actorder: its default 'static', or None",
    )
    ap.add_argument(
        "--all-experts",
        dest="all_experts",
        action="store_true",
        default=True,
        help="oneshot's default moe_calibrate_all_experts=True (every expert's Hessian sees every token)",
    )
    ap.add_argument(
        "--routed-only",
        dest="all_experts",
        action="store_false",
        help="moe_calibrate_all_experts=False: each expert's Hessian from its routed tokens only",
    )
    ap.add_argument("--mask", choices=("2d", "4d"), default="2d")
    ap.add_argument(
        "--propagate",
        dest="propagate",
        action="store_true",
        default=True,
        help="oneshot's default propagate_error=True: layer i+1 sees the outputs of quantized layer i",
    )
    ap.add_argument("--no-propagate", dest="propagate", action="store_false")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    data, n, seq_len, n_tokens = calibration_data(args.tokens, args.mask, args.batch_size)
    scheme = QuantizationScheme(
        targets=[EXPERT_TARGET],
        weights=QuantizationArgs(
            num_bits=args.bits, type="int", symmetric=True, strategy="group", group_size=args.group
        ),
    )
    recipe = GPTQModifier(
        config_groups={"group_0": scheme},
        ignore=["lm_head"],
        dampening_frac=args.damp,
        actorder=None if args.actorder == "none" else args.actorder,
    )

    warm_imports(args.model)
    t_run = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    model.eval()
    linearize_moe(model)
    t_loaded = time.perf_counter()
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        num_calibration_samples=n,
        max_seq_length=seq_len,
        batch_size=args.batch_size,
        shuffle_calibration_samples=False,
        moe_calibrate_all_experts=args.all_experts,
        propagate_error=args.propagate,
        pipeline="sequential",
    )
    t_oneshot = time.perf_counter()
    model.save_pretrained(args.save, save_compressed=True)
    t_done = time.perf_counter()

    weight_dtype = str(next(p for n_, p in model.named_parameters() if "embed" in n_).dtype).replace(
        "torch.", ""
    )
    result = {
        "tool": "llm-compressor GPTQModifier",
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
        "damp": args.damp,
        "actorder": args.actorder,
        "target": EXPERT_TARGET,
        "sequences": int(n),
        "seq_len": int(seq_len),
        "tokens": n_tokens,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "moe_calibrate_all_experts": args.all_experts,
        "propagate_error": args.propagate,
        "mask": args.mask,
        "pipeline": "sequential",
        "save": str(args.save),
        "load_s": t_loaded - t_run,
        "oneshot_s": t_oneshot - t_loaded,
        "save_s": t_done - t_oneshot,
        "run_s": t_done - t_run,
        "process_s": time.perf_counter() - T_PROCESS,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("bits", "run_s", "process_s", "dtype")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
