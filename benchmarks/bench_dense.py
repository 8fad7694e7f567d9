#!/usr/bin/env python3
"""MoE → dense benchmark (issue 8): the pre-distillation sweep on both fixtures and a CPU distillation run.

    OMP_WAIT_POLICY=PASSIVE nohup python benchmarks/bench_dense.py sweep > build/bench_dense/sweep.log 2>&1 &
    OMP_WAIT_POLICY=PASSIVE nohup python benchmarks/bench_dense.py distill > build/bench_dense/distill.log 2>&1 &
    python benchmarks/bench_dense.py report      # writes the "MoE to dense (issue 8)" section of BENCHMARKS.md

sweep:   every criterion (7) × grouping (5) × scaling (uniform, proportional, gate; plus uniform+mass and
         proportional+mass for a router that does not renormalise) × K (k, 2k, 4k, up to E) on
         qwen3-moe-tiny and olmoe-tiny; held-out perplexity of each dense conversion before distillation
         (calibration fixture-calib:32 × 256 tokens, first 16,384 tokens of fixture-heldout).
distill: the best sweep configuration of one fixture exported as a dense checkpoint, then forward-KL
         distillation from the MoE teacher on fixture-calib for a few hundred steps on CPU; held-out
         perplexity and KL(teacher ‖ student) before and after, the validation curve PNG, bytes on disk and
         decode tokens/s of teacher and student.
Everything runs on one thread (the machine is shared); results (committed, what `report` reads) land in
benchmarks/results/dense/ and benchmarks/results/dense_distill_<fixture>.png; scratch in build/bench_dense/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench_dense"  # scratch: students, distillation runs
RES = ROOT / "benchmarks" / "results" / "dense"  # committed: what `report` reads
CALIB = "fixture-calib:32"
SPEED = dict(prompt_len=64, new_tokens=64, repeats=5)  # decode tokens/s settings (recorded in the results)
FIXTURES = ("qwen3-moe-tiny", "olmoe-tiny")
SECTION = "## MoE to dense (issue 8)"


def _fixture(name: str) -> Path:
    from moecompress.testing import fixture_dir

    path = fixture_dir(name)
    if not (path / "config.json").is_file():
        sys.exit(f"fixture {name} is missing at {path}; build it with scripts/train_fixtures.py first")
    return path


def run_sweep(names, heldout_tokens: int) -> None:
    from moecompress.distill.sweep import dense_sweep, write_sweep

    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.time()
        from moecompress.models import load_config

        cfg = load_config(str(_fixture(name)))
        scalings = ["uniform", "proportional", "gate"]
        if not getattr(cfg, "norm_topk_prob", True):  # a router that does not renormalise: also α·M̂
            scalings += ["uniform+mass", "proportional+mass"]
        res = dense_sweep(
            str(_fixture(name)),
            CALIB,
            "fixture-heldout",
            heldout_tokens=heldout_tokens,
            scalings=scalings,
            seq_len=256,
            window=256,
            progress=False,
        )
        res["calibration"] = dict(data=CALIB, seq_len=256)
        write_sweep(res, RES / f"sweep_{name}.md")
        best = min(res["rows"], key=lambda r: r["ppl"])
        print(
            f"{name}: {res['evaluations']} evaluations in {time.time() - t0:.0f} s; teacher {res['teacher_ppl']:.2f}, "
            f"best {best}",
            flush=True,
        )


def _best(name: str) -> dict:
    path = RES / f"sweep_{name}.json"
    if not path.is_file():
        return {"criterion": "do-acp", "grouping": "rr", "scaling": "uniform", "K": None}
    return min(json.loads(path.read_text())["rows"], key=lambda r: r["ppl"])


def run_distill(name: str, steps: int, heldout_tokens: int) -> None:
    from moecompress.distill import distill, export_dense
    from moecompress.eval.metrics import evaluate_stream
    from moecompress.methods.dense_fit import DenseConfig
    from moecompress.models import load_model

    OUT.mkdir(parents=True, exist_ok=True)
    src = _fixture(name)
    best = _best(name)
    scaling, _, extra = best["scaling"].partition("+")
    cfg = DenseConfig(
        criterion=best["criterion"],
        K=best["K"],
        grouping=best["grouping"],
        scaling=scaling,
        mass_scale=extra == "mass",
    )
    student_dir = OUT / f"student_{name}"
    summary = export_dense(
        str(src), student_dir, cfg, calib=CALIB, seq_len=256, overwrite=True, progress=False
    )
    from moecompress.data import load_tokenizer, token_stream

    tok = load_tokenizer(str(src))
    held = token_stream("fixture-heldout", tok).ids[:heldout_tokens]
    teacher = load_model(str(src), dtype="float32")

    def heldout(model) -> dict:
        agg = evaluate_stream(model, held, reference=teacher, window=256, progress=False)["aggregate"]
        return {"ppl": agg["ppl"], "kl": agg["kl"]}

    before = heldout(load_model(str(student_dir), dtype="float32"))
    seq, bs, lr, val_tokens = 256, 8, 5e-4, 4096
    run = OUT / f"distill_{name}"
    t0 = time.time()
    result = distill(
        str(src),
        str(student_dir),
        "fixture-calib",
        tokens=steps * seq * bs,
        out=run,
        eval_data="fixture-heldout",
        seq_len=seq,
        batch_size=bs,
        lr=lr,
        warmup=0.05,
        eval_every=max(steps // 10, 1),
        save_every=max(steps // 4, 1),
        val_tokens=val_tokens,
        overwrite=True,
        progress=False,
    )
    wall = time.time() - t0
    student = load_model(str(result.student_dir), dtype="float32")
    after = heldout(student)
    teacher_ppl = evaluate_stream(teacher, held, window=256, progress=False)["aggregate"]["ppl"]
    speed = measure_speed(src, result.student_dir)
    out = {
        "fixture": name,
        "config": cfg.model_dump(),
        "export": summary,
        "steps": result.metrics["steps"],
        "tokens": result.metrics["tokens"],
        "wall_s": round(wall, 1),
        "heldout_tokens": int(held.numel()),
        "teacher_ppl": teacher_ppl,
        "before": before,
        "after": after,
        "val": result.metrics,
        "curve": f"benchmarks/results/dense_distill_{name}.png",
        "speed": speed,
        "speed_settings": SPEED,
        "settings": dict(
            seq_len=seq,
            batch_size=bs,
            lr=lr,
            schedule="cosine",
            val_tokens=val_tokens,
            window=256,
            calibration=CALIB,
        ),
        "machine": f"{os.cpu_count()} CPU cores",
    }
    shutil.copy2(result.curve, ROOT / out["curve"])
    RES.mkdir(parents=True, exist_ok=True)
    (RES / f"distill_{name}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps(out, indent=2, default=str), flush=True)


def measure_speed(teacher_dir, student_dir) -> dict:
    """Bytes on disk / resident and greedy prefill + decode tokens/s (batch 1, 64-token prompt, 64 new tokens,
    median of 5), teacher and student measured back to back in one process."""
    from moecompress.eval.bench import benchmark
    from moecompress.models import load_model

    speed = {}
    for label, path in (("teacher", teacher_dir), ("student", student_dir)):
        b = benchmark(load_model(str(path), dtype="float32"), path, **SPEED)
        speed[label] = {
            "disk_bytes": b["bytes"].get("disk"),
            "resident_bytes": b["bytes"]["resident"],
            "decode_tok_s": b["latency"]["decode_tok_s"],
            "prefill_tok_s": b["latency"]["prefill_tok_s"],
        }
    return speed


def rerun_speed(names) -> None:
    for name in names:
        js = RES / f"distill_{name}.json"
        if js.is_file():
            d = json.loads(js.read_text())
            d["speed_settings"] = SPEED
            d["speed"] = measure_speed(_fixture(name), OUT / f"distill_{name}" / "student")
            js.write_text(json.dumps(d, indent=2, default=str) + "\n")
            print(name, d["speed"], flush=True)


def _mib(b) -> str:
    return f"{b / 2**20:.2f} MiB" if b else "–"


def report() -> None:
    parts = [
        SECTION,
        "",
        f"`python -m benchmarks dense` (`benchmarks/bench_dense.py`, one CPU thread, {os.cpu_count()}-core "
        "shared machine). Pre-distillation: each configuration converts every MoE layer (score → top-K → k "
        "groups → score-weighted merge → α-scaled block concatenation) and is scored by held-out perplexity in "
        "place (`dense-sweep`). Results: `benchmarks/results/dense/sweep_<fixture>.json` (raw rows; the tables "
        "are rendered from them) and `benchmarks/results/dense/distill_<fixture>.json`.",
        "",
    ]
    for name in FIXTURES:
        md = RES / f"sweep_{name}.md"
        if md.is_file():
            res = json.loads((RES / f"sweep_{name}.json").read_text())
            cal = res.get("calibration") or {}
            if cal:
                parts += [f"Calibration ({name}): `{cal['data']}`, sequences of {cal['seq_len']} tokens.", ""]
            rows, k = res["rows"], res["top_k"]
            by_row: dict = {}
            for r in rows:
                by_row.setdefault((r["criterion"], r["grouping"], r["scaling"]), []).append(r)
            pure = sum(1 for v in by_row.values() if min(v, key=lambda r: r["ppl"])["K"] == k)
            med = {}
            for r in rows:
                med.setdefault(r["scaling"], []).append(r["ppl"])
            med_txt = ", ".join(f"{sc} {sorted(v)[len(v) // 2]:.1f}" for sc, v in med.items())
            parts += [
                f"### Sweep: {name}",
                "",
                md.read_text().strip(),
                "",
                f"Pure pruning (K = k = {k}) is the best K in {pure} of {len(by_row)} rows; median perplexity "
                f"by scaling: {med_txt}.",
                "",
            ]
    for name in FIXTURES:
        js = RES / f"distill_{name}.json"
        if not js.is_file():
            continue
        d = json.loads(js.read_text())
        c = d["config"]
        st, sp_set = d["settings"], d["speed_settings"]  # written by run_distill (rerun it for older results)
        parts += [
            f"### Distillation: {name}",
            "",
            f"Student: `{c['criterion']}` / `{c['grouping']}` / `{c['scaling']}"
            f"{'+mass' if c.get('mass_scale') else ''}` / K={c['K'] or 'top-k'} "
            f"(best of the sweep), written as {d['export']['student_class']} (FFN width "
            f"{d['export']['intermediate_size']}). Forward KL, T=1, {d['steps']} steps × {st['batch_size']} × "
            f"{st['seq_len']} tokens ({d['tokens']:,} tokens of fixture-calib), lr {st['lr']} {st['schedule']}, "
            f"{d['wall_s']:.0f} s on one CPU thread. Held-out: first {d['heldout_tokens']:,} tokens of "
            f"fixture-heldout, windows of {st['window']}.",
            "",
            "| model | held-out ppl | KL(teacher ‖ model) | bytes on disk | decode tok/s |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        sp = d.get("speed", {})
        t, s = sp.get("teacher", {}), sp.get("student", {})
        parts.append(
            f"| MoE teacher | {d['teacher_ppl']:.2f} | 0 | {_mib(t.get('disk_bytes'))} | "
            f"{t.get('decode_tok_s', 0) or 0:.0f} |"
        )
        parts.append(
            f"| dense student, before KD | {d['before']['ppl']:.2f} | {d['before']['kl']:.4f} | "
            f"{_mib(d['export'].get('bytes'))} | – |"
        )
        parts.append(
            f"| dense student, after KD | {d['after']['ppl']:.2f} | {d['after']['kl']:.4f} | "
            f"{_mib(s.get('disk_bytes'))} | {s.get('decode_tok_s', 0) or 0:.0f} |"
        )
        png = ROOT / "benchmarks" / "results" / f"dense_distill_{name}.png"
        form = (
            "a dense model"
            if d["export"]["form"] == "dense"
            else "the same MoE class with one expert and top-1 (exactly dense; no dense sibling has OLMoE's "
            "attention/norm path), so it still runs the MoE block's code"
        )
        parts += [
            "",
            f"![validation curve](benchmarks/results/{png.name}) `benchmarks/results/{png.name}`: "
            "validation KD loss and KL(teacher ‖ student) per step, student perplexity against the teacher's "
            f"on the first {st['val_tokens']:,} held-out tokens.",
            "",
            f"The student is {form}. fixture-calib holds about {d['val']['train_blocks']:,} blocks of "
            f"{st['seq_len']} tokens, so the run passes over it "
            f"{d['tokens'] / (d['val']['train_blocks'] * st['seq_len']):.1f} times. "
            f"Decode tokens/s: greedy, batch 1, {sp_set['prompt_len']}-token prompt, "
            f"{sp_set['new_tokens']} new tokens, median of {sp_set['repeats']}, teacher and "
            "student back to back on the shared CPU: indicative only (docs/dense.md says why).",
            "",
        ]
    text = "\n".join(parts).rstrip() + "\n"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _bench_md import write_section

    bench = ROOT / "BENCHMARKS.md"
    write_section(SECTION, text, bench)
    print(f"updated {bench}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sweep", "distill", "speed", "report", "all"])
    ap.add_argument("--fixtures", default=",".join(FIXTURES))
    ap.add_argument("--distill-fixture", default="qwen3-moe-tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--heldout-tokens", type=int, default=16384)
    a = ap.parse_args()
    if a.what in ("sweep", "all"):
        run_sweep(a.fixtures.split(","), a.heldout_tokens)
    if a.what in ("distill", "all"):
        run_distill(a.distill_fixture, a.steps, a.heldout_tokens)
    if a.what == "speed":
        rerun_speed(a.fixtures.split(","))
    if a.what in ("report", "all"):
        report()


if __name__ == "__main__":
    main()
