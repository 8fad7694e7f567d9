#!/usr/bin/env python3
"""Peer arm of issue 30 (item 6): llm-compressor's whole-model GPTQ, whole-file bytes and KL per held-out window.

    python benchmarks/peer_llmcompressor_whole.py run    # both fixtures, bits 8 4 3 2, scopes linear + all
    python benchmarks/peer_llmcompressor_whole.py show   # prints the arms from the committed JSON (no section)

`run` (in the project's interpreter), per fixture:
1. tokenises `fixture-calib:64` at 256 with `moecompress.data.load_calibration` (seed 0: the GPTQ peer check's
   tokens) into `build/peer_whole/<fixture>/tokens.safetensors`;
2. runs `benchmarks/peer/llmc_whole.py` in the peer virtualenv (build/peer-venv, docs/peer_check.md) once per arm:
   `oneshot` + `GPTQModifier`, W{b}A16 int symmetric group 32 (128 does not divide the fixtures' widths), its
   shipped defaults otherwise (act order static, damp 0.01, sequential pipeline, 2-D mask, all-experts
   calibration, error propagation), on every Linear but the router gates:
   - `w{b}-linear`: lm_head ignored (llm-compressor's conventional recipe), embeddings untouched;
   - `w{b}-all`: lm_head GPTQ'd too, and the embeddings round-to-nearest at the same spec in a second, data-free
     `oneshot` (`QuantizationModifier`): GPTQModifier never calibrates an Embedding;
   plus one probe, 4 bits with "Embedding" among the GPTQModifier's own targets, whose stored embedding scales
   are recorded (never evaluated);
3. counts each checkpoint's whole-file weight bytes from the dtypes and shapes of the tensors in its safetensors
   files (`moecompress.disk.stored_tensors`: packed codes, scales, shapes, every bf16 tensor; config and
   tokenizer files excluded), and the original bf16 checkpoint's the same way;
4. evaluates each arm against the original on the held-out windows of the GPTQ peer check and of
   `bench_whole_model.py` (`fixture-heldout`, the first 65,536 tokens, windows of 512, batch 8) with
   `moecompress.eval.metrics.evaluate_stream`, both models in the checkpoint's dtype (dtype "auto", as
   `moecompress.evaluate` loads them); llm-compressor's checkpoint is loaded by transformers + compressed-tensors,
   dequantized on load (`CompressedTensorsConfig(run_compressed=False)`; the compressed path cannot build an
   nn.Embedding whose weight is packed).

Schema of `benchmarks/results/peer_gptq_whole.json` (committed), read by `_peer.load_peer_whole(fixture)`:

    {"schema": "peer_gptq_whole/1",
     "eval": {"data": "fixture-heldout", "max_tokens": 65536, "window": 512, "stride": null, "batch_size": 8,
              "dtype": "auto", "reference": "the original fixture checkpoint"},
     "calibration": {"spec": "fixture-calib:64", "seq_len": 256, "seed": 0},
     "fixtures": [{"fixture": NAME, "describe": calibration text, "original_bytes": int,
                   "eval": {"fingerprint", "stride" (as evaluate_stream applies it), "window_ids": [...],
                            "window_tokens": [...], "original_ppl"},
                   "arms": [{"name": "w4-linear", "bits": 4, "group": 32, "scope": "linear" | "all",
                             "whole_bytes": int, "original_bytes": int, "file_ratio": float,
                             "bytes_by_kind": {"packed", "scale", "shape", "other"},
                             "kl": token-weighted mean, "ppl": float,
                             "kl_windows": [KL(original || arm) of each window, in window_ids order],
                             "quantized": {kind: {modules, bits}}, "not_quantized": {kind: {modules, example}},
                             "run_s": float, "versions": {...}}, ...],
                   "probes": {"embedding_in_gptq": {"bits", "embedding_scales": {tensor, numel, zero,
                                                                                 non_finite}}}}, ...]}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "peer_whole"
RESULTS = ROOT / "benchmarks" / "results" / "peer_gptq_whole.json"
PEER_PY = ROOT / "build" / "peer-venv" / "bin" / "python"
PEER_SCRIPT = ROOT / "benchmarks" / "peer" / "llmc_whole.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer import child, load_peer_whole, versions

FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
BITS = (8, 4, 3, 2)
SCOPES = ("linear", "all")
GROUP = 32
CALIB, SEQ_LEN, SEED = "fixture-calib:64", 256, 0
EVAL = {
    "data": "fixture-heldout",
    "max_tokens": 65536,
    "window": 512,
    "stride": None,
    "batch_size": 8,
    "dtype": "auto",
    "reference": "the original fixture checkpoint",
}
PROBE_BITS = 4


def bytes_by_kind(directory: Path) -> dict[str, int]:
    """Tensor bytes of a checkpoint's safetensors files by kind: packed codes, scales, shapes, the rest."""
    from moecompress.disk import stored_tensors

    out = {"packed": 0, "scale": 0, "shape": 0, "other": 0}
    for name, (_, n) in stored_tensors(directory).items():
        kind = next((k for k in ("packed", "scale", "shape") if name.endswith(f".weight_{k}")), "other")
        out[kind] += n
    return out


def peer_run(
    fx: Path, tokens: Path, bits: int, scope: str, save: Path, out: Path, embed: str = "rtn-pass"
) -> dict:
    if not PEER_PY.is_file():
        sys.exit(f"No peer virtualenv at {PEER_PY}; create it as docs/peer_check.md describes.")
    shutil.rmtree(save, ignore_errors=True)
    child(
        [
            str(PEER_PY),
            str(PEER_SCRIPT),
            "--model",
            str(fx),
            "--tokens",
            str(tokens),
            "--bits",
            str(bits),
            "--group",
            str(GROUP),
            "--scope",
            scope,
            "--embed",
            embed,
            "--save",
            str(save),
            "--out",
            str(out),
            "--batch-size",
            "8",
            "--threads",
            "1",
        ],
        out.with_suffix(".log"),
    )
    for f in fx.iterdir():  # the tokenizer beside the weights (llm-compressor saves the model only)
        if f.name.startswith(("tokenizer", "generation_config")) and not (save / f.name).exists():
            shutil.copyfile(f, save / f.name)
    return json.loads(out.read_text())


def evaluate(fx: Path, ckpts: dict[str, Path]) -> tuple[dict, dict]:
    """({arm: evaluate_stream entry}, the original's own entry) on the held-out windows, dtype auto."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from moecompress.data import load_tokenizer
    from moecompress.eval.metrics import evaluate_stream
    from moecompress.models import load_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    tok = load_tokenizer(str(fx))
    ref = load_model(str(fx), dtype=EVAL["dtype"])
    kw = {k: EVAL[k] for k in ("window", "stride", "max_tokens", "batch_size")} | {"progress": False}
    base = evaluate_stream(ref, EVAL["data"], tok, **kw)
    out = {}
    for key, path in ckpts.items():
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            dtype=EVAL["dtype"],
            use_safetensors=True,
            quantization_config=CompressedTensorsConfig(run_compressed=False),
        ).eval()
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            sys.exit(f"{path}: non-finite dequantized weights in {bad[:3]}")
        out[key] = evaluate_stream(model, EVAL["data"], tok, reference=ref, **kw)
        print(
            f"    eval {key}: kl {out[key]['aggregate']['kl']:.4g} ppl {out[key]['aggregate']['ppl']:.4g}",
            flush=True,
        )
    return out, base


def run(args) -> None:
    from safetensors.torch import save_file

    from moecompress.data import load_calibration, load_tokenizer
    from moecompress.disk import stored_tensors
    from moecompress.testing import fixture_dir

    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    kept = {f["fixture"]: f for f in old.get("fixtures", []) if f["fixture"] not in args.fixtures}
    fixtures = dict(kept)
    for name in args.fixtures:
        fx = fixture_dir(name)
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        data = load_calibration(CALIB, load_tokenizer(str(fx)), SEQ_LEN, seed=SEED)
        tokens = out / "tokens.safetensors"
        save_file(
            {"input_ids": data.input_ids.contiguous(), "attention_mask": data.attention_mask.contiguous()},
            str(tokens),
        )
        print(f"[{name}] {data.describe()}", flush=True)
        original = sum(n for _, n in stored_tensors(fx).values())
        runs, ckpts = {}, {}
        for scope in args.scopes:
            for b in args.bits:
                key = f"w{b}-{scope}"
                runs[key] = peer_run(fx, tokens, b, scope, out / key, out / f"{key}.json")
                ckpts[key] = out / key
                print(f"  {key}: run {runs[key]['run_s']:.1f}s", flush=True)
        probe = peer_run(
            fx,
            tokens,
            PROBE_BITS,
            "all",
            out / "probe-embed-in-gptq",
            out / "probe-embed-in-gptq.json",
            embed="in-gptq",
        )
        print(f"  probe embedding in GPTQModifier targets: {probe['embedding_scales']}", flush=True)
        quality, base = evaluate(fx, ckpts)
        ids = base["items"]["ids"]
        arms = []
        for key, r in runs.items():
            q = quality[key]
            if q["items"]["ids"] != ids:
                sys.exit(f"{name}: {key} was evaluated on other windows")
            whole = sum(n for _, n in stored_tensors(ckpts[key]).values())
            arms.append(
                {
                    "name": key,
                    "bits": r["bits"],
                    "group": r["group"],
                    "scope": r["scope"],
                    "whole_bytes": whole,
                    "original_bytes": original,
                    "file_ratio": whole / original,
                    "bytes_by_kind": bytes_by_kind(ckpts[key]),
                    "kl": q["aggregate"]["kl"],
                    "ppl": q["aggregate"]["ppl"],
                    "kl_windows": list(q["items"]["kl"]),
                    "quantized": r["quantized"],
                    "not_quantized": r["not_quantized"],
                    "recipe": r["recipe"],
                    "run_s": r["run_s"],
                    "versions": r["versions"],
                    "calibration": {
                        k: r[k]
                        for k in (
                            "sequences",
                            "seq_len",
                            "tokens",
                            "mask",
                            "moe_calibrate_all_experts",
                            "propagate_error",
                            "pipeline",
                        )
                    },
                }
            )
        fixtures[name] = {
            "fixture": name,
            "describe": data.describe(),
            "dtype": runs[next(iter(runs))]["dtype"],
            "original_bytes": original,
            "eval": {
                "fingerprint": base["fingerprint"],
                "stride": base["stride"],
                "window_ids": ids,
                "window_tokens": list(base["items"]["n_tokens"]),
                "original_ppl": base["aggregate"]["ppl"],
            },
            "arms": arms,
            "probes": {
                "embedding_in_gptq": {
                    "bits": PROBE_BITS,
                    "group": GROUP,
                    "embedding_scales": probe["embedding_scales"],
                }
            },
        }
    summary = {
        "schema": "peer_gptq_whole/1",
        "eval": EVAL,
        "calibration": {"spec": CALIB, "seq_len": SEQ_LEN, "seed": SEED},
        "project_versions": versions(("moecompress", "torch", "transformers", "compressed-tensors")),
        "fixtures": [fixtures[n] for n in FIXTURES if n in fixtures],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {RESULTS}")


def show() -> None:
    """The arms of the committed JSON as a table on stdout."""
    for name in FIXTURES:
        arms = load_peer_whole(name)
        if not arms:
            continue
        print(f"{name}\n| arm | bits | whole bytes | original bytes | file ratio | mean KL | windows |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for a in arms:
            print(
                f"| {a['name']} | {a['bits']} | {a['whole_bytes']:,} | {a['original_bytes']:,} | "
                f"{a['whole_bytes'] / a['original_bytes']:.3f} | {a['kl']:.3e} | {len(a['kl_windows'])} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--fixtures", nargs="+", default=list(FIXTURES))
    r.add_argument("--bits", nargs="+", type=int, default=list(BITS))
    r.add_argument("--scopes", nargs="+", choices=SCOPES, default=list(SCOPES))
    sub.add_parser("show")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else show()


if __name__ == "__main__":
    main()
