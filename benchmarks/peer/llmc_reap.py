#!/usr/bin/env python3
"""llm-compressor's REAP expert pruning on a checkpoint and fixed token ids: which experts it keeps.

Runs INSIDE the peer virtualenv (build/peer-venv, see docs/peer_check.md); it imports nothing from
moecompress. `benchmarks/peer_llmcompressor_reap.py` calls it through a subprocess:

    build/peer-venv/bin/python benchmarks/peer/llmc_reap.py --model DIR --tokens tokens.safetensors \
        --sparsity 0.5 --out result.json [--batch-size 8] [--threads 1] \
        [--all-experts | --routed-only] [--propagate | --no-propagate]

The token file is a safetensors file holding `input_ids` and `attention_mask` ([n, seq_len] int64), the
exact sequences moecompress calibrated on. The model is loaded in float32 with plain transformers and
its fused experts are linearised to per-expert Linear modules with llm-compressor's `linearize_moe`
(the post-load path oneshot itself falls back to; the load-time path `load_quantizable_moe` needs
torchvision, see docs/peer_check.md), then `oneshot` runs `REAPPruningModifier(sparsity=...)` through the sequential pipeline on those
sequences in their stored order (no shuffling, no re-tokenisation).

The keep sets come from the modifier's own `report_path` JSON (retained expert ids per MoE block).
For diagnosis the script also records, per layer, the saliency vector and routed-token counts the
modifier decided on: `REAPSaliencyTracker.compute_retained_experts` and the modifier's `prune_moe_layer`
are wrapped to observe their inputs; neither result is altered.

Timing: `process_s` from interpreter start (imports included) to the keep sets; `run_s` from the
start of model loading to the end of `oneshot` (what `peer_llmcompressor_reap.py` compares with
moecompress's calibrate + select), after the same transformers modules were imported on both sides.
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()

import argparse
import json
import os
import re
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from _loader import calibration_data


def warm_imports(model: str) -> None:
    """Import the transformers modules the run needs before the clock starts (the same list as on our
    side, benchmarks/peer_llmcompressor_reap.py), so `run_s` times the work rather than lazy imports."""
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
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--all-experts",
        dest="all_experts",
        action="store_true",
        default=True,
        help="oneshot's default moe_calibrate_all_experts=True (every expert runs on every token)",
    )
    ap.add_argument(
        "--routed-only",
        dest="all_experts",
        action="store_false",
        help="moe_calibrate_all_experts=False, what the REAP modifier itself recommends",
    )
    ap.add_argument(
        "--mask",
        choices=("2d", "4d"),
        default="2d",
        help="2d: the dataset's 2-D attention mask, oneshot's own data path (default); 4d: a DataLoader "
        "whose batches carry the 4-D additive causal mask (see docs/peer_check.md)",
    )
    ap.add_argument(
        "--propagate",
        dest="propagate",
        action="store_true",
        default=True,
        help="oneshot's default propagate_error=True: layer i+1 sees the outputs of pruned layer i",
    )
    ap.add_argument(
        "--no-propagate",
        dest="propagate",
        action="store_false",
        help="propagate_error=False: every layer sees the outputs of the unpruned model",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import llmcompressor.modifiers.pruning.reap.base as reap_base
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.pruning.reap import REAPPruningModifier
    from llmcompressor.modifiers.pruning.reap.utils import REAPSaliencyTracker
    from transformers import AutoModelForCausalLM

    # --- observation only: remember the saliency each layer's decision used
    observed: dict[str, dict] = {}
    last: dict = {}
    orig_compute = REAPSaliencyTracker.compute_retained_experts
    orig_prune = reap_base.prune_moe_layer

    def compute(self, *a, **k):
        last.update(
            saliency=self.mean_saliency.tolist(),
            count=self.count.to("cpu", torch.float64).tolist(),
            sum=self.sum_saliency.to("cpu", torch.float64).tolist(),
        )
        return orig_compute(self, *a, **k)

    def prune(model, layer_name, retained, attrs):
        observed[layer_name] = dict(last, retained=list(retained))
        return orig_prune(model, layer_name, retained, attrs)

    REAPSaliencyTracker.compute_retained_experts = compute
    reap_base.prune_moe_layer = prune

    data, n, seq_len, n_tokens = calibration_data(args.tokens, args.mask, args.batch_size)

    warm_imports(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "retained.json"
        t_run = time.perf_counter()
        # llm-compressor's post-load path (`linearize_moe`, what oneshot itself falls back to): the
        # load-time path `load_quantizable_moe` walks every transformers module through
        # transformers.monkey_patching and imports torchvision, which has no CPU wheel on this machine
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        model.eval()
        linearize_moe(model)
        t_loaded = time.perf_counter()
        oneshot(
            model=model,
            dataset=data,
            recipe=REAPPruningModifier(sparsity=args.sparsity, report_path=str(report)),
            num_calibration_samples=n,
            max_seq_length=seq_len,
            batch_size=args.batch_size,
            shuffle_calibration_samples=False,
            moe_calibrate_all_experts=args.all_experts,
            propagate_error=args.propagate,
            pipeline="sequential",
        )
        t_done = time.perf_counter()
        retained = json.loads(report.read_text())

    def layer_index(name: str) -> int:
        m = re.search(r"layers\.(\d+)\.", name + ".")
        if m is None:
            raise SystemExit(f"cannot find a decoder-layer index in MoE block name {name!r}")
        return int(m.group(1))

    keep = {str(layer_index(k)): sorted(int(e) for e in v) for k, v in retained.items()}
    diag = {str(layer_index(k)): v for k, v in observed.items()}
    result = {
        "tool": "llm-compressor REAPPruningModifier",
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
        "sparsity": args.sparsity,
        "sequences": int(n),
        "seq_len": int(seq_len),
        "tokens": n_tokens,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "moe_calibrate_all_experts": args.all_experts,
        "propagate_error": args.propagate,
        "mask": args.mask,
        "pipeline": "sequential",
        "keep": dict(sorted(keep.items(), key=lambda kv: int(kv[0]))),
        "saliency": diag,
        "load_s": t_loaded - t_run,
        "oneshot_s": t_done - t_loaded,
        "run_s": t_done - t_run,
        "process_s": time.perf_counter() - T_PROCESS,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("keep", "run_s", "process_s", "versions")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
