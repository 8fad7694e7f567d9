#!/usr/bin/env python3
"""Calibration engine benchmark (issue 3).

    python benchmarks/bench_calibration.py speed     # (a) calibration time / plain forward time, side by side
    python benchmarks/bench_calibration.py build     # the wide random MoE (>= 4 GB on disk) under build/
    python benchmarks/bench_calibration.py memory    # (b) peak RSS while calibrating it / its size on disk
    python benchmarks/bench_calibration.py report    # writes "## Calibration (issue 3)" in BENCHMARKS.md

(a) On the qwen3-moe-tiny fixture, the same calibration tokens go through (1) a plain full-model forward of the loaded model and (2)
    `moecompress.calibrate` gathering the routing statistics (counts, tokens, routing_mass, pp, cp), which
    streams the checkpoint layer by layer and writes a stats store; also (3) the REAP/output statistics for
    reference. Runs alternate, repeats are timed separately, medians reported. Target (2)/(1) <= 1.3.
(b) A wide random Qwen3-MoE (hidden 1024, 24 layers, 64 experts of width 512, bf16, written as per-expert
    shards like save_pretrained) is calibrated in a child process; its peak resident set size (ru_maxrss) is
    divided by the checkpoint's bytes on disk. Target <= 0.35.
Everything runs single-threaded (the machine is shared). Results: benchmarks/results/calibration_speed.json and
calibration_memory.json (committed; `report` reads only these); scratch (the stats store) under build/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_md import load_results, machine, save_results, write_section

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench_calibration"
WIDE = ROOT / "build" / "wide_moe_4gb"
SECTION = "## Calibration (issue 3)"
TARGET_SPEED = 1.3  # calibration / plain forward (issue 3)
TARGET_MEMORY = 0.35  # peak RSS / checkpoint bytes on disk (issue 3)

WIDE_SHAPE = dict(
    vocab_size=4096,
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=1,
    dtype="bfloat16",
)


def _tokenizer_dir() -> Path:
    from moecompress.testing import fixture_dir

    fx = fixture_dir("qwen3-moe-tiny")
    return fx if (fx / "tokenizer.json").is_file() else ROOT / "build" / "fixture_tokenizer"


def _speed_model() -> tuple[Path, str]:
    """The trained qwen3-moe-tiny fixture (shipped with the package)."""
    from moecompress.testing import fixture_dir

    return fixture_dir("qwen3-moe-tiny"), "qwen3-moe-tiny fixture"


def speed(sequences: int, seq_len: int, batch_size: int, repeats: int) -> dict:
    from moecompress.calibrate import calibrate
    from moecompress.data import load_calibration, load_tokenizer
    from moecompress.models import load_model

    path, what = _speed_model()
    tok = load_tokenizer(str(path), str(_tokenizer_dir()))
    data = load_calibration(f"fixture-calib:{sequences}", tok, seq_len, seed=0)
    model = load_model(str(path), dtype="float32")
    batches = [
        (data.input_ids[s : s + batch_size], data.attention_mask[s : s + batch_size])
        for s in range(0, data.num_sequences, batch_size)
    ]

    def plain(decoder_only: bool = False) -> float:
        run = (
            model.model if decoder_only else model
        )  # decoder only: no final norm / lm_head, like calibration
        t0 = time.perf_counter()
        with torch.no_grad():
            for ids, mask in batches:
                run(input_ids=ids, attention_mask=mask, use_cache=False)
        return time.perf_counter() - t0

    def calib(stats) -> float:
        t0 = time.perf_counter()
        calibrate(
            str(path),
            data,
            out=OUT / "store",
            stats=stats,
            batch_size=batch_size,
            dtype="float32",
            overwrite=True,
            progress=False,
            device="cpu",
        )
        return time.perf_counter() - t0

    plain()
    calib(None)  # warm-up: imports, caches
    times = {"plain": [], "plain_decoder": [], "routing": [], "reap": []}
    for _ in range(repeats):
        times["plain"].append(plain())
        times["plain_decoder"].append(plain(decoder_only=True))
        times["routing"].append(calib(None))
        times["reap"].append(calib(["reap", "out_mean", "out_var"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "model": what,
        "path": str(path),
        "sequences": data.num_sequences,
        "seq_len": seq_len,
        "tokens": data.num_tokens,
        "batch_size": batch_size,
        "repeats": repeats,
        "threads": 1,
        "times_s": times,
        "median_s": med,
        "ratio_routing": med["routing"] / med["plain"],
        "ratio_reap": med["reap"] / med["plain"],
        "ratio_routing_vs_decoder": med["routing"] / med["plain_decoder"],
        "dtype": "float32",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    save_results("calibration_speed.json", res)
    print(json.dumps(res, indent=2))
    return res


def _copy_tokenizer(dest: Path) -> None:
    """The fixture's tokenizer (same vocabulary size) next to the wide checkpoint, so `moecompress compress
    W --calib SPEC` can tokenize its calibration text (without one, transformers builds an empty tokenizer)."""
    import shutil

    src = _tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file() and not (dest / name).is_file():
            shutil.copy2(src / name, dest / name)


def build_wide() -> Path:
    """Write the wide random MoE one decoder layer per shard, in save_pretrained's per-expert key format."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    from moecompress.models import skeleton

    if (WIDE / "model.safetensors.index.json").is_file():
        _copy_tokenizer(WIDE)  # a copy built before the tokenizer was part of it
        print(f"{WIDE} exists")
        return WIDE
    tmp = WIDE.with_name(WIDE.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model("qwen3_moe", **WIDE_SHAPE)
    config.save_pretrained(tmp)
    _copy_tokenizer(tmp)
    model = skeleton(config)
    native = model.state_dict()
    n = config.num_hidden_layers
    groups = [[k for k in native if k.startswith(f"model.layers.{i}.")] for i in range(n)]
    groups.append([k for k in native if not k.startswith("model.layers.")])
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for g, keys in enumerate(groups):
        sd = {}
        for k in keys:
            shape = native[k].shape
            if k.endswith("norm.weight"):
                sd[k] = torch.ones(shape, dtype=torch.bfloat16)
            else:  # small random weights keep activations finite through 24 layers
                sd[k] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        disk = revert_weight_conversion(model, sd)
        name = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in disk.items()}, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(disk, name))
        total += sum(v.numel() * v.element_size() for v in disk.values())
        print(f"shard {g + 1}/{len(groups)}: {len(disk)} tensors", flush=True)
        del sd, disk
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    tmp.rename(WIDE)
    return WIDE


_CHILD = """
import json, sys, time, resource, torch
torch.set_num_threads(1)
from moecompress.calibrate import calibrate
from moecompress.data import load_calibration, load_tokenizer
path, out, tokdir, seqs, seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
data = load_calibration(f"fixture-calib:{seqs}", load_tokenizer(path, tokdir), seq_len)
t0 = time.perf_counter()
store = calibrate(path, data, out=out, batch_size=4, overwrite=True, progress=False, device="cpu")
print(json.dumps({"seconds": time.perf_counter() - t0, "rss_after_imports_kb": base,
                  "tokens": store.token_count, "layers": len(store.layers)}))
"""


def memory(sequences: int, seq_len: int) -> dict:
    from moecompress.atomic import dir_bytes

    path = build_wide()
    disk = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(path),
            str(OUT / "wide_store"),
            str(_tokenizer_dir()),
            str(sequences),
            str(seq_len),
        ],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if proc.returncode != 0:
        sys.exit(proc.stderr[-4000:])
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    res = {
        "checkpoint": str(path),
        "disk_bytes": disk,
        "dir_bytes": dir_bytes(path),
        "peak_rss_bytes": peak,
        "ratio": peak / disk,
        "rss_after_imports_bytes": child["rss_after_imports_kb"] * 1024,
        "seconds": child["seconds"],
        "tokens": child["tokens"],
        "layers": child["layers"],
        "shape": {
            k: WIDE_SHAPE[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_experts",
                "moe_intermediate_size",
                "num_experts_per_tok",
                "dtype",
            )
        },
    }
    res.update(machine=machine(), date=time.strftime("%Y-%m-%d"))
    save_results("calibration_memory.json", res)
    print(json.dumps(res, indent=2))
    return res


def report() -> None:
    sp = load_results("calibration_speed.json")
    mem = load_results("calibration_memory.json")
    gb = 1024**3
    s = sp["median_s"]
    lines = [
        SECTION,
        "",
        f"Measured by `python -m benchmarks calibration` (`benchmarks/bench_calibration.py`); results "
        f"`benchmarks/results/calibration_speed.json`, `benchmarks/results/calibration_memory.json`. Machine: "
        f"{sp.get('machine', 'not recorded')}, shared, {sp['threads']} thread, no GPU; {sp.get('date', '')}.",
        "",
        f"**Summary: calibration costs {sp['ratio_routing_vs_decoder']:.2f}× a like-for-like forward** (the "
        f"decoder stack calibration runs: no final norm / lm_head); {sp['ratio_routing']:.2f}× a full-model "
        "forward that also runs the final norm and lm_head.",
        "",
        f"**(a) Calibration speed** — {sp['model']}; {sp['sequences']} × {sp['seq_len']} tokens of "
        f"`fixture-calib` ({sp['tokens']:,} tokens), batch {sp['batch_size']}, computed in {sp.get('dtype', 'float32')} (model and calibration alike); plain forward and "
        f"calibration alternate in one run, median of {sp['repeats']} repeats each.",
        "",
        "| run | median s | ÷ decoder-only forward (like for like) | ÷ full-model forward | target |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| plain decoder-only forward (no final norm / lm_head, as calibration) | {s['plain_decoder']:.2f} | "
        f"{1:.2f} | {s['plain_decoder'] / s['plain']:.2f} | |",
        f"| plain full-model forward (model already in memory) | {s['plain']:.2f} | "
        f"{s['plain'] / s['plain_decoder']:.2f} | {1:.2f} | |",
        f"| `calibrate` routing statistics (counts, tokens, routing_mass, pp, cp), streamed layer by layer, "
        f"store written | {s['routing']:.2f} | **{sp['ratio_routing_vs_decoder']:.2f}** | {sp['ratio_routing']:.2f} | "
        f"≤ {TARGET_SPEED} {'✅' if sp['ratio_routing_vs_decoder'] <= TARGET_SPEED else '❌'} |",
        f"| `calibrate` + REAP/EAN/output norms, mean and variance (expert outputs shared with the block) | "
        f"{s['reap']:.2f} | {s['reap'] / s['plain_decoder']:.2f} | {sp['ratio_reap']:.2f} | (reference) |",
        "",
        f"Spread over the {sp['repeats']} repeats (min–max s): "
        + "; ".join(f"{k} {min(v):.2f}–{max(v):.2f}" for k, v in sp["times_s"].items())
        + ".",
        "",
        "Where calibration's time goes beyond the decoder forward: docs/calibration.md (fixed costs per run, "
        "router re-evaluation per token).",
        "",
        f"**(b) Peak memory** — wide random Qwen3-MoE (hidden {mem['shape']['hidden_size']}, "
        f"{mem['shape']['num_hidden_layers']} layers, {mem['shape']['num_experts']} experts of width "
        f"{mem['shape']['moe_intermediate_size']}, top-{mem['shape']['num_experts_per_tok']}, "
        f"{mem['shape']['dtype']}, per-expert keys in {mem['layers']} MoE-layer shards), routing statistics on "
        f"{mem['tokens']:,} tokens in a child process.",
        "",
        "| quantity | value |",
        "| --- | ---: |",
        f"| checkpoint on disk | {mem['disk_bytes'] / gb:.2f} GiB |",
        f"| peak RSS of the calibration process (ru_maxrss) | {mem['peak_rss_bytes'] / gb:.2f} GiB |",
        f"| of which Python + torch + transformers after imports | {mem['rss_after_imports_bytes'] / gb:.2f} GiB |",
        f"| **peak RSS ÷ size on disk** | **{mem['ratio']:.3f}** (target ≤ {TARGET_MEMORY} "
        f"{'✅' if mem['ratio'] <= TARGET_MEMORY else '❌'}) |",
        f"| calibration wall time | {mem['seconds']:.0f} s |",
        "",
        f"The checkpoint is {mem['disk_bytes'] / 1e9:.2f} GB; peak memory is one decoder layer (read from its "
        "shard, per-expert tensors fused into the model's 3-D parameters) plus the activation cache and the "
        "interpreter; safetensors handles are closed after each fused tensor so mapped pages leave the "
        "resident set.",
        "",
    ]
    block = "\n".join(lines)
    write_section(SECTION, block)
    print(block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["speed", "build", "memory", "report", "all"])
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--wide-sequences", type=int, default=8)
    ap.add_argument("--wide-seq-len", type=int, default=128)
    a = ap.parse_args()
    if a.what in ("speed", "all"):
        speed(a.sequences, a.seq_len, a.batch_size, a.repeats)
    if a.what == "build":
        build_wide()
    if a.what in ("memory", "all"):
        memory(a.wide_sequences, a.wide_seq_len)
    if a.what in ("report", "all"):
        report()


if __name__ == "__main__":
    main()
