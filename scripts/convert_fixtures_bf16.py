#!/usr/bin/env python3
"""Store the shipped fixture models in bfloat16, the way real MoE checkpoints are stored.

The fixtures are trained in float32 (scripts/train_fixtures.py). Real checkpoints (Qwen3-MoE,
OLMoE, Mixtral, DeepSeek, ...) ship bf16, and byte accounting that silently assumes 4 bytes
per parameter only shows up on bf16 weights, so the shipped copies are bf16: each fixture is
loaded, every floating tensor is rounded to bf16 (round-to-nearest-even, ``Tensor.to``), and
``save_pretrained`` writes ``model.safetensors`` and ``config.json`` (``"dtype": "bfloat16"``)
exactly as it does for any bf16 model. Tokenizer files are left as they are. No retraining.

Running it again on bf16 fixtures changes nothing (the cast is exact).

Usage::

    OMP_WAIT_POLICY=PASSIVE python scripts/convert_fixtures_bf16.py            # both fixtures
    python scripts/convert_fixtures_bf16.py --model olmoe-tiny
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "src/moecompress/fixtures"
NAMES = ("qwen3-moe-tiny", "olmoe-tiny")
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors")


def save_bf16(model, out_dir: Path) -> None:
    """`save_pretrained` of `model` cast to bfloat16 (weights, config and generation config) into `out_dir`."""
    model = model.to(torch.bfloat16)
    model.config.output_router_logits = False
    model.save_pretrained(str(out_dir), safe_serialization=True)


def convert(fixture: Path) -> tuple[int, int]:
    """Rewrite `fixture`'s weights in bf16 in place; returns (bytes before, bytes after) of model.safetensors."""
    from transformers import AutoModelForCausalLM

    before = (fixture / "model.safetensors").stat().st_size
    model = AutoModelForCausalLM.from_pretrained(str(fixture), dtype=torch.float32).eval()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory(dir=fixture.parent) as tmp:
        save_bf16(model, Path(tmp))
        back = AutoModelForCausalLM.from_pretrained(tmp, dtype="auto")
        sd = back.state_dict()
        bad = [k for k, v in ref.items() if sd[k].dtype != torch.bfloat16 or not torch.equal(sd[k], v.to(torch.bfloat16))]
        if bad:
            raise SystemExit(f"{fixture.name}: reloaded bf16 tensors differ from the cast ({bad[:3]})")
        for name in WEIGHT_FILES:
            if (Path(tmp) / name).is_file():
                shutil.copyfile(Path(tmp) / name, fixture / name)
    return before, (fixture / "model.safetensors").stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=FIXTURES)
    ap.add_argument("--model", choices=[*NAMES, "all"], default="all")
    args = ap.parse_args()
    for name in NAMES if args.model == "all" else [args.model]:
        before, after = convert(args.fixtures / name)
        print(f"{name}: model.safetensors {before:,} -> {after:,} bytes (bfloat16)")


if __name__ == "__main__":
    sys.exit(main())
