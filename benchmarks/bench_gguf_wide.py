"""Issue 31 (speed and memory in llama.cpp): a 50 % pruned + 4-bit GGUF against the bf16 original, at real size.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_gguf_wide.py run   # -> benchmarks/results/gguf_wide.json
    python benchmarks/bench_gguf_wide.py report                         # BENCHMARKS.md section

The fixtures' GGUFs (BENCHMARKS.md, "GGUF inside llama.cpp") are 3-13 MB: there a decode step's fixed costs and the
interpreter's 41 MiB outweigh the weights, so their speed and memory ratios say little about a real checkpoint.
This runs the same two kinds of file on the 4.98 GB wide model (`python benchmarks/bench_calibration.py build`:
random Qwen3-MoE, hidden 1024, 24 layers x 64 experts of width 512, top-2, bf16), where reading the weights
dominates as it does for a real model:

* original: the identity plan written `--format gguf` (BF16 weights, F32 norms);
* reap50-w4-all: `moecompress compress --recipe` with REAP at 50 % (renorm gates; calibration `fixture-calib:8`
  of 128 tokens), the kept experts and attention at w4g32 (Q4_0), embeddings and lm_head at w8g32 (Q8_0),
  round-to-nearest, written `--format gguf` by the streamed compress.

llama.cpp (llama-cpp-python 0.3.36's bindings over the llama.cpp it vendors, set up as docs/export.md, "Checked
inside llama.cpp", says) runs each file in a fresh process of its own (benchmarks/llamacpp/child.py): a prompt of
128 token ids of `fixture-heldout` in one batch, then 128 greedy tokens, 2 threads; arms alternate, medians over
the repeats. Weights are random, so the tokens mean nothing; only time and memory are read.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._bench_md import load_results, machine, model_shape, save_results, write_section  # noqa: E402
from benchmarks.bench_gguf_llamacpp import (  # noqa: E402
    DECODE_TARGET,
    RSS_TARGET,
    build_plan,
    child,
    heldout_windows,
    speed_runs,
)

RESULTS = "gguf_wide.json"
SECTION = "## GGUF at scale in llama.cpp: speed and memory (issue 31)"
MODEL = ROOT / "build" / "wide_moe_4gb"
OUT = ROOT / "build" / "bench_gguf_wide"
ARMS = ("original", "reap50-w4-all")
REPEATS = 5
SETTINGS = ("on", "off")  # llama.cpp's extra CPU buffer types: its default, then off
RECIPE = {
    "method": "prune",
    "params": {"criterion": "reap", "ratio": 0.5, "gate": "renorm"},
    "quant": {
        "experts": "w4g32",
        "attention": "w4g32",
        "embeddings": "w8g32",
        "lm_head": "w8g32",
        "algo": "rtn",
    },
}
CALIB = ["--calib", "fixture-calib:8", "--seq-len", "128"]


def _write_original(model: Path, out: Path) -> float:
    from moecompress.api import export

    t0 = time.perf_counter()
    plan, tensors = build_plan(str(model), "original", None)  # the identity plan, as "GGUF inside llama.cpp"
    export(str(model), plan, out, format="gguf", tensors=tensors, overwrite=True, quiet=True)
    return time.perf_counter() - t0


def _write_pruned(model: Path, out: Path) -> float:
    import yaml

    recipe = OUT / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    cmd = [sys.executable, "-m", "moecompress", "compress", str(model), "--recipe", str(recipe), *CALIB]
    cmd += ["--format", "gguf", "--out", str(out), "--overwrite"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - t0


def run(model: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    seconds = {
        "original": _write_original(model, OUT / "original" / "gguf"),
        "reap50-w4-all": _write_pruned(model, OUT / "reap50-w4-all" / "gguf"),
    }
    files = {a: OUT / a / "gguf" / "model.gguf" for a in ARMS}
    _, info = child("info", "-", "-", "-")
    ids = heldout_windows(str(model))
    # llama.cpp's default (extra CPU buffer types on: repacked Q4_0/Q8_0 weights) is what a user runs; off is the
    # setting "GGUF inside llama.cpp" measures with, because on AMX CPUs the default crashed there
    speed = {b: speed_runs(OUT, ids, arms=ARMS, repeats=REPEATS, extra_bufts=b) for b in SETTINGS}
    save_results(
        RESULTS,
        dict(
            machine=machine(),
            llama_cpp=json.loads(info),
            model=str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model),
            shape=model_shape(model),
            checkpoint_bytes=sum(p.stat().st_size for p in model.glob("*.safetensors")),
            recipe=RECIPE,
            calib=" ".join(CALIB),
            write_seconds={a: round(s, 1) for a, s in seconds.items()},
            file_bytes={a: f.stat().st_size for a, f in files.items()},
            targets=dict(decode=DECODE_TARGET, rss=RSS_TARGET),
            speed=speed,
            date=time.strftime("%Y-%m-%d %H:%M"),
        ),
    )


def markdown(d: dict) -> str:
    t, s = d["targets"], d["shape"]
    sp = d["speed"][SETTINGS[0]]
    lines = [
        SECTION,
        "",
        "Regenerate: `python -m benchmarks gguf-wide` (results: `benchmarks/results/gguf_wide.json`; needs the wide model "
        'from `python benchmarks/bench_calibration.py build` and llama.cpp built as in docs/export.md, "Checked inside '
        f'llama.cpp"). {d["date"]}, {d["machine"]}; llama.cpp `{d["llama_cpp"]["system_info"]}`.',
        "",
        f"Model `{d['model']}`: random {s['model_type']}, hidden {s['hidden_size']}, {s['num_hidden_layers']} layers × "
        f"{s['num_experts']} experts, top-{s['num_experts_per_tok']}, {s['dtype']}, {d['checkpoint_bytes'] / 1e9:.2f} GB "
        "on disk. original: the identity plan as GGUF (BF16). reap50-w4-all: `moecompress compress --recipe` "
        f"`{json.dumps(d['recipe'])}` `{d['calib']} --format gguf` (Q4_0 experts and attention, Q8_0 embeddings and "
        "lm_head, F32 norms and routers). Weights are random: the generated tokens mean nothing, only time and memory "
        f"are read. llama.cpp with {sp['threads']} threads, OpenMP waiting {sp['omp_wait_policy']}; a prompt of "
        f"{sp['prompt_tokens']} token ids in one batch, then {sp['decode_tokens']} greedy tokens; every run a fresh "
        f"process, arms alternating, medians of {sp['repeats']}; tokens/s from llama.cpp's own timers; peak RSS is the "
        "process's VmHWM (llama.cpp maps the file: the pages it reads count). Each arm ran with llama.cpp's extra CPU "
        "buffer types on (its default: Q4_0/Q8_0 weights repacked into an interleaved copy for its AVX-512 kernels) "
        'and off (the setting of "GGUF inside llama.cpp", where the default crashed on an AMX CPU; this CPU has no AMX).',
        "",
        "| extra buffer types | arm | GGUF file | prompt tok/s | decode tok/s | peak RSS | ratio decode | ratio peak RSS |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    verdicts = []
    for b in SETTINGS:
        m = d["speed"][b]["medians"]
        base = m["original"]
        for arm, r in m.items():
            lines.append(
                f"| {b} | {arm} | {d['file_bytes'][arm] / 1e9:.2f} GB | {r['prompt_tok_s']:.1f} | "
                f"{r['decode_tok_s']:.1f} | {r['peak_rss'] / 2**30:.2f} GiB | "
                f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}× | {r['peak_rss'] / base['peak_rss']:.2f}× |"
            )
        dec = m["reap50-w4-all"]["decode_tok_s"] / base["decode_tok_s"]
        rss = m["reap50-w4-all"]["peak_rss"] / base["peak_rss"]
        verdicts.append(
            f"- extra buffer types {b}{' (llama.cpp default)' if b == 'on' else ''}: reap50-w4-all against original, "
            f"decode {dec:.2f}× (target ≥ {t['decode']:g}×: {'met' if dec >= t['decode'] else 'missed'}), peak RSS "
            f"{rss:.2f}× (target ≤ {t['rss']:g}×: {'met' if rss <= t['rss'] else 'missed'}); 1-minute load average as "
            f"runs started: median {d['speed'][b]['loadavg']['median']:.1f}."
        )
    return "\n".join([*lines, "", *verdicts]) + "\n"


def report() -> None:
    write_section(SECTION, markdown(load_results(RESULTS)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--model", default=str(MODEL))
    a = ap.parse_args()
    if a.what == "run":
        run(Path(a.model))
    report()
