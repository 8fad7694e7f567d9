#!/usr/bin/env python3
"""Export memory benchmark (issue 4): peak RSS while exporting a 50% plan of a >= 4 GB checkpoint.

    python benchmarks/bench_export_memory.py build            # the wide random MoE under build/ (once)
    python benchmarks/bench_export_memory.py run [--formats compact hf]
    python benchmarks/bench_export_memory.py report           # "## Plan runtime and export (issue 4)" in BENCHMARKS.md

The checkpoint is the calibration benchmark's wide random Qwen3-MoE (build/wide_moe_4gb: hidden 1024,
24 layers, 64 experts of width 512, bf16, per-expert keys in 25 shards like save_pretrained writes;
4.8 GB on disk), built once and shared. Each export runs in a child process: the plan (renorm, every
second expert of every layer) is made from the config alone (meta skeleton), then `moecompress.export`
streams the shards layer by layer into build/bench_export_memory/<format>. The child's peak resident set
size (ru_maxrss, imports included) is divided by the checkpoint's safetensors bytes. Target <= 0.35.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_md import load_results, results_path, save_results, write_section

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench_export_memory"  # the exported checkpoints (scratch)
TARGET_MEMORY = 0.35  # peak RSS / checkpoint size (issue 4)
WIDE = ROOT / "build" / "wide_moe_4gb"
SECTION = "## Plan runtime and export (issue 4)"


def build() -> Path:
    """Reuse (or build, with the calibration benchmark's own recipe) the shared wide checkpoint."""
    if (WIDE / "model.safetensors.index.json").is_file():
        return WIDE
    tmp = WIDE.with_name(WIDE.name + ".tmp")
    if tmp.exists():  # the calibration benchmark is writing it right now: wait for it
        for _ in range(360):
            if (WIDE / "model.safetensors.index.json").is_file():
                return WIDE
            time.sleep(10)
        sys.exit(f"{tmp} has been half-built for an hour; remove it and rerun.")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_calibration import build_wide

    return build_wide()


_CHILD = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from moecompress import export
from moecompress.models import load_config, skeleton
from moecompress.plan import CompressionPlan, ModelInfo
path, out, fmt = sys.argv[1], sys.argv[2], sys.argv[3]
info = ModelInfo.from_model(skeleton(load_config(path)), source=path)
plan = CompressionPlan.prune(info, {li.layer: list(range(0, li.num_experts, 2)) for li in info.layers},
                             gate="renorm", method="every-second-expert")
imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
res = export(path, plan, out, format=fmt, overwrite=True, quiet=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # this process's own peak, imports included
print(json.dumps({"seconds": time.perf_counter() - t0, "rss_start_kb": base, "rss_after_imports_kb": imports,
                  "peak_rss_kb": peak,
                  "result": res.model_dump(), "logical_bytes": plan.logical_bytes().total}))
"""


def run(formats: list[str]) -> dict:
    path = build()
    disk = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    results = {}
    for fmt in formats:
        out = OUT / fmt
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), str(out), fmt],
            capture_output=True,
            text=True,
            check=False,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        if proc.returncode != 0:
            sys.exit(proc.stderr[-4000:])
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        peak = child["peak_rss_kb"] * 1024
        r = child["result"]
        results[fmt] = {
            "peak_rss_bytes": peak,
            "ratio": peak / disk,
            "seconds": child["seconds"],
            "rss_after_imports_bytes": child["rss_after_imports_kb"] * 1024,
            "output_weight_bytes": r["weight_bytes"],
            "output_dir_bytes": r["bytes_on_disk"],
            "logical_bytes": child["logical_bytes"],
            "shards": len(r["shards"]),
        }
        print(fmt, json.dumps(results[fmt]), flush=True)
    res = {
        "checkpoint": str(path.relative_to(ROOT)),
        "disk_bytes": disk,
        "shape": _shape(path),
        "plan": "renorm, every second expert of every layer (50%)",
        "threads": 1,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared)",
        "date": time.strftime("%Y-%m-%d"),
        "formats": results,
    }
    mem_file = results_path("export_memory.json")
    prev = json.loads(mem_file.read_text()) if mem_file.is_file() else {}
    prev_formats = prev.get("formats", {})
    prev_formats.update(results)
    res["formats"] = prev_formats
    save_results("export_memory.json", res)
    return res


def _shape(path: Path) -> str:
    """The checkpoint's architecture, read from its config (never typed by hand)."""
    from _bench_md import model_shape

    c = model_shape(path)
    return (
        f"{c['model_type']}, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_experts']} "
        f"experts x width {c['moe_intermediate_size']}, top-{c['num_experts_per_tok']}, {c['dtype']}"
    )


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _verdict(ratios: list[float]) -> str:
    """What the spread of runtime/original ratios over the runs supports (computed, never typed)."""
    lo, hi = min(ratios), max(ratios)
    if lo <= 1.0 <= hi:
        return f"parity within this machine's run-to-run spread ({lo:.2f}x–{hi:.2f}x)"
    return f"{'faster' if lo > 1.0 else 'slower'} in every run ({lo:.2f}x–{hi:.2f}x)"


def report() -> str:
    """Write this issue's section of BENCHMARKS.md from benchmarks/results/runtime_speed.json,
    runtime_speed_runs.jsonl and export_memory.json (committed; nothing is recomputed)."""
    lines = [SECTION, ""]
    s = load_results("runtime_speed.json")
    lines += [
        "### Runtime speed: 50% plan vs the original, side by side",
        "",
        "Command: `python -m benchmarks runtime run` (= `OMP_WAIT_POLICY=PASSIVE python "
        f"benchmarks/bench_runtime_speed.py --repeats {s['repeats']} --threads {s['threads']}`); results "
        "`benchmarks/results/runtime_speed.json`, every run's ratios in `benchmarks/results/runtime_speed_runs.jsonl`.  ",
        f"Machine: {s['machine']}, {s['threads']} thread; date {s['date']}.  ",
        f"Model: {s['model']} (stored {s.get('checkpoint_dtype') or 'dtype not recorded'}), run in "
        f"{s.get('dtype', 'float32')}. Plan: {s['plan']}. Prefill: {s['prefill_tokens']} tokens in "
        f"one forward; decode: {s['decode_tokens']} greedy tokens with KV cache, batch 1. Medians of "
        f"{s['repeats']} repeats, arm order rotated every repeat.",
        "",
        "| arm | prefill tok/s | decode tok/s | prefill vs original | decode vs original |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    o = s["tokens_per_s"]["original"]
    for name, t in s["tokens_per_s"].items():
        lines.append(
            f"| {name} | {t['prefill']:.0f} | {t['decode']:.1f} | {t['prefill'] / o['prefill']:.2f}x | "
            f"{t['decode'] / o['decode']:.2f}x |"
        )
    runs_file = results_path("runtime_speed_runs.jsonl")
    runs = (
        [json.loads(x) for x in runs_file.read_text().splitlines() if x.strip()]
        if runs_file.is_file()
        else []
    )
    # only runs on the model (and compute dtype) this table shows
    runs = [
        r
        for r in runs
        if r.get("model") == s["model"] and r.get("dtype", "float32") == s.get("dtype", "float32")
    ]
    t = s.get("times_s", {})
    if "original" in t and "runtime-50%" in t:
        import statistics

        def per_repeat(kind):  # original time / runtime time within each repeat (the two ran back to back)
            return sorted(a / b for a, b in zip(t["original"][kind], t["runtime-50%"][kind]))

        def quartiles(v):
            q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
            return q[0], q[2]

        parts = []
        for kind in ("prefill", "decode"):
            v = per_repeat(kind)
            q1, q3 = quartiles(v)
            what = "parity" if q1 <= 1.0 <= q3 else ("faster" if q1 > 1.0 else "slower")
            parts.append(f"{kind} {min(v):.2f}x–{max(v):.2f}x (quartiles {q1:.2f}x–{q3:.2f}x: {what})")
        lines += ["", "Within this run, runtime-50% vs original per repeat: " + "; ".join(parts) + "."]
    if runs:
        fmt = lambda r: f"{r['prefill']:.2f}x / {r['decode']:.2f}x"
        lines += [
            "",
            f"{'All ' + str(len(runs)) + ' runs' if len(runs) > 1 else 'The one run'} on this model "
            "(runtime-50% vs original, prefill / decode): "
            + "; ".join(fmt(r["ratio_runtime"]) for r in runs)
            + ". The hf-export arm, which does "
            "the same expert compute: " + "; ".join(fmt(r["ratio_hf"]) for r in runs) + ".",
        ]
        mean = {k: sum(r["ratio_runtime"][k] for r in runs) / len(runs) for k in ("prefill", "decode")}
        if len(runs) > 1:
            lines += [
                "",
                f"Mean over the runs: {mean['prefill']:.2f}x prefill, {mean['decode']:.2f}x decode; prefill "
                f"{_verdict([r['ratio_runtime']['prefill'] for r in runs])}, decode "
                f"{_verdict([r['ratio_runtime']['decode'] for r in runs])}.",
            ]
        lines += [
            "",
            "Why a pruned plan runs the same expert FLOPs per token at a fixed top-k: docs/plan.md.",
        ]
    lines += [
        "",
        "Target: the runtime with half the experts is not slower than the original (ratios at least "
        f"{1:.2f}x within the noise of a shared machine).",
        "",
    ]
    m = load_results("export_memory.json")
    lines += [
        "### Export memory: peak RSS / checkpoint size",
        "",
        "Command: `python -m benchmarks runtime run` (= `OMP_WAIT_POLICY=PASSIVE python "
        "benchmarks/bench_export_memory.py run --formats compact hf`, one child process per format; its own "
        "ru_maxrss); results `benchmarks/results/export_memory.json`.  ",
        f"Machine: {m['machine']}, {m['threads']} thread; date {m['date']}.  ",
        f"Checkpoint: `{m['checkpoint']}` ({m['shape']}), {_gb(m['disk_bytes'])} of safetensors. "
        f"Plan: {m['plan']}.",
        "",
        "| format | peak RSS | peak RSS / checkpoint | RSS after imports | output weights | output directory "
        "| plan logical size | weights vs plan | directory vs plan | shards | wall time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for fmt, r in m["formats"].items():
        dir_b, logical = r.get("output_dir_bytes"), r["logical_bytes"]
        pct = lambda n, logical=logical: f"{100 * (n / logical - 1):+.2f} %" if n else "—"
        lines.append(
            f"| {fmt} | {_gb(r['peak_rss_bytes'])} | **{r['ratio']:.3f}** | "
            f"{_gb(r['rss_after_imports_bytes'])} | {_gb(r['output_weight_bytes'])} | "
            f"{_gb(dir_b) if dir_b else '—'} | {_gb(logical)} | {pct(r['output_weight_bytes'])} | "
            f"{pct(dir_b)} | {r['shards']} | {r['seconds']:.0f} s |"
        )
    fm = m["formats"]
    if fm:
        worst = max(fm.values(), key=lambda r: r["ratio"])
        lines += [
            "",
            f"Peak RSS ÷ checkpoint: at most {worst['ratio']:.3f} over {len(fm)} format(s), target "
            f"<= {TARGET_MEMORY} {'met' if worst['ratio'] <= TARGET_MEMORY else 'NOT met'}.",
        ]
        w = [abs(r["output_weight_bytes"] / r["logical_bytes"] - 1) for r in fm.values()]
        dirs = [
            abs(r["output_dir_bytes"] / r["logical_bytes"] - 1)
            for r in fm.values()
            if r.get("output_dir_bytes")
        ]
        bytes_line = (
            f"Bytes on disk against the plan's logical size: the output weights are within "
            f"{100 * max(w):.2f} % of it"
        )
        if dirs:
            bytes_line += (
                f"; the whole output directory (weights plus config, plan, index and recipe) is within "
                f"{100 * max(dirs):.2f} %"
            )
        lines += ["", bytes_line + "."]
    lines += ["", f"Target: peak RSS / checkpoint size <= {TARGET_MEMORY}.", ""]
    text = "\n".join(lines).rstrip() + "\n"
    write_section(SECTION, text)
    print(text)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "run", "report"])
    ap.add_argument("--formats", nargs="+", default=["compact"], choices=["compact", "hf"])
    args = ap.parse_args(argv)
    if args.command == "build":
        print(build())
    elif args.command == "run":
        run(args.formats)
    else:
        report()


if __name__ == "__main__":
    main(sys.argv[1:])
