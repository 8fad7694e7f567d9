#!/usr/bin/env python3
"""Runtime speed benchmark (issue 4): prefill and decode tokens/s, 50% plan vs the original, side by side.

    python benchmarks/bench_runtime_speed.py [--repeats 15] [--threads 1]

Model: the qwen3-moe-tiny fixture.
Arms, all float32 on CPU, timed in one process, arm order rotated every repeat, medians over the repeats:
  * original      — the HF model as loaded (transformers' default grouped_mm experts);
  * runtime-50%   — `apply_plan` with a renorm plan keeping every second expert of every layer;
  * hf-export-50% — the same plan exported with format="hf" and loaded by plain transformers (reference).
Prefill: batch 4 x 256 tokens, one forward without cache. Decode: batch 1, 16-token prompt, 64 greedy new
tokens with the KV cache (generation forced to its full length). Target: runtime-50% >= original.
Results: benchmarks/results/runtime_speed.json (this run) and runtime_speed_runs.jsonl (one line per run, so the
report shows the spread); `python benchmarks/bench_export_memory.py report` writes the section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_md import model_shape, results_path, save_results

ROOT = Path(__file__).resolve().parent.parent


def _model():
    from moecompress.models import load_model
    from moecompress.testing import fixture_dir

    fx = fixture_dir("qwen3-moe-tiny")
    return (lambda: load_model(str(fx), dtype="float32")), "qwen3-moe-tiny fixture"


def _prefill(model, ids) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=False)
    return time.perf_counter() - t0


def _decode(model, prompt, new_tokens) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return time.perf_counter() - t0


def run(repeats: int, threads: int) -> dict:
    from moecompress import apply_plan, export
    from moecompress.models import load_model
    from moecompress.plan import CompressionPlan, ModelInfo
    from moecompress.testing import fixture_dir

    torch.set_num_threads(threads)
    build, what = _model()
    original = build()
    info = ModelInfo.from_model(original)
    plan = CompressionPlan.prune(
        info,
        {li.layer: list(range(0, li.num_experts, 2)) for li in info.layers},
        gate="renorm",
        method="every-second-expert",
    )
    runtime = apply_plan(build(), plan)
    tmp = Path(tempfile.mkdtemp(prefix="bench_runtime_"))
    export(build(), plan, tmp / "hf", format="hf", quiet=True)
    hf = load_model(str(tmp / "hf"), dtype="float32")
    arms = {"original": original, "runtime-50%": runtime, "hf-export-50%": hf}
    gen = torch.Generator().manual_seed(0)
    vocab = original.config.vocab_size
    prefill_ids = torch.randint(2, vocab, (4, 256), generator=gen)
    prompt = torch.randint(2, vocab, (1, 16), generator=gen)
    new_tokens = 64
    for m in arms.values():  # warm-up
        _prefill(m, prefill_ids[:, :32])
        _decode(m, prompt, 4)
    times = {name: {"prefill": [], "decode": []} for name in arms}
    names = list(arms)
    for rep in range(repeats):  # rotate the order every repeat: no arm always runs first (or last)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            m = arms[name]
            times[name]["prefill"].append(_prefill(m, prefill_ids))
            times[name]["decode"].append(_decode(m, prompt, new_tokens))
    res = {
        "model": what,
        "dtype": str(next(original.parameters()).dtype).removeprefix("torch."),
        "checkpoint_dtype": model_shape(fixture_dir("qwen3-moe-tiny"))["dtype"],
        "threads": threads,
        "repeats": repeats,
        "prefill_tokens": prefill_ids.numel(),
        "decode_tokens": new_tokens,
        "plan": "renorm, every second expert kept (50% of routed experts)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "times_s": times,
        "tokens_per_s": {},
    }
    for name in arms:
        res["tokens_per_s"][name] = {
            "prefill": prefill_ids.numel() / statistics.median(times[name]["prefill"]),
            "decode": new_tokens / statistics.median(times[name]["decode"]),
        }
    o = res["tokens_per_s"]["original"]
    for name in ("runtime-50%", "hf-export-50%"):
        res[f"ratio_{name}"] = {k: res["tokens_per_s"][name][k] / o[k] for k in ("prefill", "decode")}
    save_results("runtime_speed.json", res)
    with open(
        results_path("runtime_speed_runs.jsonl"), "a"
    ) as f:  # every run, so the report can show the spread
        f.write(
            json.dumps(
                {
                    "date": res["date"],
                    "model": what,
                    "dtype": res["dtype"],
                    "repeats": repeats,
                    "ratio_runtime": res["ratio_runtime-50%"],
                    "ratio_hf": res["ratio_hf-export-50%"],
                }
            )
            + "\n"
        )
    print(json.dumps({k: v for k, v in res.items() if k != "times_s"}, indent=2))
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    run(args.repeats, args.threads)


if __name__ == "__main__":
    main(sys.argv[1:])
