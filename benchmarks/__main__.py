"""`python -m benchmarks SECTION [run|report|all]`: regenerate one section of BENCHMARKS.md.

Every `## ` section of BENCHMARKS.md has one entry here: the generator's `run` steps (measure; write the
section's results under benchmarks/results/, committed) and its `report` step (render the section from
those results only, nothing recomputed). `all` (the default) runs both. `--list` prints the sections with
their results files; `--dry-run` prints the commands instead of running them. `slow-tests` is not a
section: it runs the tests marked `slow`, which the default test run excludes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = "python"  # replaced by sys.executable when run


@dataclass(frozen=True)
class Section:
    title: str | None  # the `## ` heading it owns in BENCHMARKS.md (None: not a section)
    results: tuple[str, ...]  # under benchmarks/results/
    run: tuple[tuple[str, ...], ...]
    report: tuple[tuple[str, ...], ...] = field(default_factory=tuple)


def _b(script: str, *args: str) -> tuple[str, ...]:
    return (PY, f"benchmarks/{script}", *args)


def _run_report(title: str, results: tuple[str, ...], script: str) -> Section:
    """A section whose generator measures with `SCRIPT run` and writes the section with `SCRIPT report`."""
    return Section(title, results, run=(_b(script, "run"),), report=(_b(script, "report"),))


SECTIONS: dict[str, Section] = {
    "calibration": Section(
        "## Calibration (issue 3)",
        ("calibration_speed.json", "calibration_memory.json"),
        run=(
            _b("bench_calibration.py", "speed", "--repeats", "7"),
            _b("bench_calibration.py", "build"),
            _b("bench_calibration.py", "memory"),
        ),
        report=(_b("bench_calibration.py", "report"),),
    ),
    "runtime": Section(
        "## Plan runtime and export (issue 4)",
        ("runtime_speed.json", "runtime_speed_runs.jsonl", "export_memory.json"),
        run=(
            _b("bench_runtime_speed.py", "--repeats", "15", "--threads", "1"),
            _b("bench_export_memory.py", "build"),
            _b("bench_export_memory.py", "run", "--formats", "compact", "hf"),
        ),
        report=(_b("bench_export_memory.py", "report"),),
    ),
    "peer": _run_report(
        "## Peer check: REAP vs llm-compressor (issue 10)", ("peer_reap.json",), "peer_llmcompressor_reap.py"
    ),
    "puzzle": Section(
        "## PuzzleMoE (issue 7)",
        ("puzzle/",),
        run=(_b("bench_puzzle.py", "--out", "build/bench_puzzle"),),
        report=(_b("bench_puzzle.py", "--report", "benchmarks/results/puzzle", "--write"),),
    ),
    "pruning": Section(
        "## Expert pruning: fixed-mask operator grid (issue 10)",
        ("pruning/",),
        run=(_b("bench_methods.py", "pruning", "--out", "build/bench_pruning"),),
        report=(_b("bench_methods.py", "pruning", "--write"),),
    ),
    "demo": _run_report("## Demo (issue 5)", ("demo.json",), "bench_demo.py"),
    "dense": Section(
        "## MoE to dense (issue 8)",
        ("dense/", "dense_distill_olmoe-tiny.png", "dense_distill_qwen3-moe-tiny.png"),
        run=(
            _b("bench_dense.py", "sweep"),
            _b("bench_dense.py", "distill", "--distill-fixture", "qwen3-moe-tiny"),
            _b("bench_dense.py", "distill", "--distill-fixture", "olmoe-tiny"),
        ),
        report=(_b("bench_dense.py", "report"),),
    ),
    "consolidation": Section(
        "## Consolidation and merging (issue 6)",
        ("consolidation/",),
        run=(_b("bench_methods.py", "consolidation", "--out", "build/bench_consolidation"),),
        report=(_b("bench_methods.py", "consolidation", "--write"),),
    ),
    "auto": Section(
        "## Budget-optimal auto (issue 9)",
        ("auto/",),
        run=(_b("bench_auto.py", "--out", "build/bench_auto"),),
        report=(_b("bench_auto.py", "--report", "benchmarks/results/auto", "--write"),),
    ),
    "quant": _run_report(
        "## Quantization: structure × bits (issue 13)",
        ("quant.json", "quant_quality_vs_bytes.png"),
        "bench_quant.py",
    ),
    "peer-gptq": _run_report(
        "## Peer check: GPTQ vs llm-compressor (issue 13)", ("peer_gptq.json",), "peer_llmcompressor_gptq.py"
    ),
    "gptq-defaults": _run_report(
        "## GPTQ defaults (issue 32)", ("gptq_defaults.json",), "bench_gptq_defaults.py"
    ),
    "calib-mode": _run_report(
        "## GPTQ calibration: one-pass vs sequential (issue 32)", ("calib_mode.json",), "bench_calib_mode.py"
    ),
    "auto-bits": _run_report(
        "## auto over structure × bits (issue 14)",
        ("auto_bits.json", "auto_bits_frontier.png"),
        "bench_auto_bits.py",
    ),
    "compress-memory": _run_report(
        "## Streaming compress: peak memory (issue 19)", ("compress_memory.json",), "bench_compress_memory.py"
    ),
    "drift": _run_report("## Calibration domain: mask drift (issue 18)", ("drift.json",), "bench_drift.py"),
    "operators-bits": _run_report(
        "## Operators under quantization: §6.5 (issue 18)",
        ("operators_bits.json",),
        "bench_operators_bits.py",
    ),
    "gguf-llamacpp": _run_report(
        "## GGUF inside llama.cpp (issue 31)", ("gguf_llamacpp.json",), "bench_gguf_llamacpp.py"
    ),
    "vllm-cpu": _run_report(
        "## vLLM CPU: pruned hf exports (issue 31)", ("vllm_cpu.json",), "bench_vllm_cpu.py"
    ),
    "whole-model": _run_report(
        "## Whole-file compression (issue 30)",
        ("whole_model.json", "whole_model_frontier.png"),
        "bench_whole_model.py",
    ),
    "gguf": _run_report(
        "## GGUF head to head with llama.cpp's quantizer (issue 31)",
        ("gguf_head2head.json", "gguf_head2head_frontier.png"),
        "bench_gguf_head2head.py",
    ),
    "gguf-wide": _run_report(
        "## GGUF at scale in llama.cpp: speed and memory (issue 31)",
        ("gguf_wide.json",),
        "bench_gguf_wide.py",
    ),
    "gptq-scale": _run_report(
        "## GPTQ at scale: moecompress vs llm-compressor (issue 32)",
        ("gptq_scale.json",),
        "bench_gptq_scale.py",
    ),
    "auto-search": _run_report(
        "## auto: fast vs full search (issue 32)", ("auto_search.json",), "bench_auto_search.py"
    ),
    "slow-tests": Section(None, (), run=((PY, "-m", "pytest", "-m", "slow"),)),
}


def commands(name: str, step: str) -> list[tuple[str, ...]]:
    """The argv lists `python -m benchmarks NAME STEP` runs, in order (`all` = run, then report)."""
    sec = SECTIONS[name]
    return list(sec.run if step in ("run", "all") else ()) + list(
        sec.report if step in ("report", "all") else ()
    )


def _describe() -> str:
    lines = []
    for name, sec in SECTIONS.items():
        where = ", ".join(f"benchmarks/results/{r}" for r in sec.results) or "—"
        lines.append(f"{name:14s} {sec.title or '(tests marked slow)'}\n{'':14s} results: {where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("section", nargs="?", choices=[*SECTIONS, "all"], help="which section ('all': every one)")
    ap.add_argument(
        "step",
        nargs="?",
        default="all",
        choices=["run", "report", "all"],
        help="run: measure and write results; report: rewrite the section from committed results",
    )
    ap.add_argument("--list", action="store_true", help="list the sections and their results files")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    if args.list or args.section is None:
        print(_describe())
        return 0
    names = [n for n in SECTIONS if n != "slow-tests"] if args.section == "all" else [args.section]
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    src = str(ROOT / "src")  # this checkout's package, ahead of any other install
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for name in names:
        for cmd in commands(name, args.step):
            argv_ = [sys.executable if c == PY else c for c in cmd]
            print(f"[{name}] {shlex.join(cmd)}", flush=True)
            if args.dry_run:
                continue
            rc = subprocess.run(argv_, cwd=ROOT, env=env, check=False).returncode
            if rc != 0:
                print(f"[{name}] failed with exit code {rc}: {shlex.join(cmd)}", file=sys.stderr)
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
