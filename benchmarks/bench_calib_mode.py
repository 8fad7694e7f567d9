"""Issue 32 benchmark: one-pass against sequential calibration for pure GPTQ, on both bf16 fixtures.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_calib_mode.py run   # -> benchmarks/results/calib_mode.json
    python benchmarks/bench_calib_mode.py report                         # BENCHMARKS.md section

Each arm is `moecompress.compress(fixture, "quant", {"quant": "w<b>g128"}, calib=<data spec>, calib_mode=...)`:
GPTQ with the default knobs, its Hessians streamed per layer, either on the original model's activations
(`one-pass`) or on those of the already-quantized earlier layers (`sequential`, GPTQ's own pipeline and
llm-compressor's default). Both arms of a (fixture, width) are evaluated on the same held-out windows (KL to the
original); sequential is paired against one-pass (bootstrap over windows, Holm over one fixture's widths), and
each compress is timed whole (calibration included). The report's sentences come from those verdicts.
"""

from __future__ import annotations

import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._bench_md import (  # noqa: E402
    fixture_main,
    kept_fixtures,
    load_results,
    save_results,
    write_section,
)

RESULTS = ROOT / "benchmarks" / "results" / "calib_mode.json"
SECTION = "## GPTQ calibration: one-pass vs sequential (issue 32)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
CALIB, SEQ_LEN = "fixture-calib:64", 256
WINDOW, MAX_TOKENS = 256, 32768
BITS = (2, 3, 4)
MODES = ("one-pass", "sequential")


def run_fixture(fixture: str, out: Path) -> dict:
    import moecompress
    from moecompress.eval.stats import apply_holm, paired_bootstrap

    model = f"fixture:{fixture}"
    arms, comps = [], []
    for bits in BITS:
        by = {}
        for mode in MODES:
            dest = out / fixture / f"w{bits}-{mode}"
            shutil.rmtree(dest, ignore_errors=True)
            t0 = time.perf_counter()
            moecompress.compress(
                model,
                "quant",
                {"quant": f"w{bits}g128"},
                calib=CALIB,
                seq_len=SEQ_LEN,
                calib_mode=mode,
                out=dest,
                progress=False,
            )
            seconds = time.perf_counter() - t0
            res = moecompress.evaluate(
                str(dest), ppl="fixture-heldout", reference=model, window=WINDOW, max_tokens=MAX_TOKENS
            )
            m = res["arms"][0]["metrics"]["ppl:fixture-heldout"]
            by[mode] = dict(
                name=f"w{bits}-{mode}",
                bits=bits,
                mode=mode,
                kl=m["aggregate"]["kl"],
                ppl=m["aggregate"]["ppl"],
                compress_seconds=round(seconds, 1),
                ids=m["items"]["ids"],
                window_kl=m["items"]["kl"],
            )
        a, b = by["sequential"], by["one-pass"]
        c = paired_bootstrap(
            a["ids"],
            a["window_kl"],
            b["ids"],
            b["window_kl"],
            metric="kl",
            higher_is_better=False,
            B=4000,
            seed=0,
        ).to_dict()
        c.pop("per_task", None)
        comps.append(dict(c, bits=bits, ratio=a["kl"] / b["kl"]))
        arms += [{k: v for k, v in r.items() if k not in ("ids", "window_kl")} for r in by.values()]
    apply_holm(comps, 0.05)
    return dict(fixture=fixture, arms=arms, comparisons=comps)


def run(fixtures, out: Path) -> None:
    import torch

    results = dict(
        machine=dict(platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads()),
        calib=CALIB,
        seq_len=SEQ_LEN,
        window=WINDOW,
        max_tokens=MAX_TOKENS,
        fixtures=kept_fixtures(RESULTS.name, {f: run_fixture(f, out) for f in fixtures}, FIXTURES),
    )
    save_results(RESULTS.name, results)


def _g(x, nd=3):
    return "—" if x is None else f"{x:.{nd}g}"


def markdown(results: dict) -> str:
    lines = [
        SECTION,
        "",
        "Regenerate: `python -m benchmarks calib-mode` (results: `benchmarks/results/calib_mode.json`).",
        "",
        f"`compress --method quant --quant w<b>g128` (GPTQ, default knobs) from {results['calib']} (sequences of "
        f"{results['seq_len']} tokens), its Hessians streamed per layer: `one-pass` takes every layer's on the "
        "original model's activations, `sequential` on those of the already-quantized earlier layers. KL to the "
        f"original on the first {results['max_tokens']} tokens of `fixture-heldout` in windows of "
        f"{results['window']}; sequential paired against one-pass (bootstrap over windows, Δ = KL(sequential) − "
        "KL(one-pass), Holm over one fixture's widths); compress time is the whole call, calibration included. "
        f"Machine: {results['machine']['platform']}, torch {results['machine']['torch']}.",
        "",
    ]
    words = {"A better": "sequential lower", "B better": "sequential higher"}
    for fx in results["fixtures"]:
        arms = {r["name"]: r for r in fx["arms"]}
        lines += [
            f"### {fx['fixture']}",
            "",
            "| bits | KL one-pass | KL sequential | ratio | Δ KL | interval | Holm p | verdict | compress s "
            "(one-pass / sequential) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in fx["comparisons"]:
            a, b = arms[f"w{c['bits']}-one-pass"], arms[f"w{c['bits']}-sequential"]
            lines.append(
                f"| {c['bits']} | {_g(a['kl'])} | {_g(b['kl'])} | {c['ratio']:.3f} | {_g(c['delta'])} | "
                f"[{_g(c['ci_low'])}, {_g(c['ci_high'])}] | {_g(c.get('p_adjusted'))} | "
                f"{words.get(c['verdict'], 'not detectably different')} | "
                f"{a['compress_seconds']:.0f} / {b['compress_seconds']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def report() -> None:
    write_section(SECTION, markdown(load_results(RESULTS.name)))


if __name__ == "__main__":
    fixture_main(__doc__, FIXTURES, run, report, ROOT / "build" / "bench_calib_mode")
