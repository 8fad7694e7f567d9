#!/usr/bin/env python3
"""GPTQ at scale, side by side (issue 32 item 3): moecompress vs llm-compressor on the wide model.

    python benchmarks/bench_gptq_scale.py run [--model DIR]   # both sides at once, one thread each, then the JSON
    python benchmarks/bench_gptq_scale.py run-auto [--model DIR] [--search full|fast]  # our pure GPTQ and `auto
                                                              # --budget 25%` (its full or fast search) at once
    python benchmarks/bench_gptq_scale.py chunks [--model DIR]    # our GPTQ at streamed chunks 4, 8, 16, 32
    python benchmarks/bench_gptq_scale.py report              # writes "## GPTQ at scale: ..."

The default model is `benchmarks/bench_calibration.py build` (random Qwen3-MoE, 24 layers, 4.98 GB, bf16,
per-expert keys), its results `gptq_scale.json`; another model's (`--model build/wide4`, a 4-layer copy with the
same widths: `WIDE_SHAPE` with num_hidden_layers=4) go to `gptq_scale_<dir>.json`, and the report shows each.
On an idle machine both sides finish the 4-layer copy in minutes; on a shared one they took ~4x longer. Both sides
quantize the routed experts to 4 bits, symmetric, group 128, from the same calibration token ids
(`fixture-calib:<n>` at `--seq-len`, tokenized once by `moecompress.data.load_calibration` and written to
`build/bench_gptq_scale/tokens.safetensors`; our CLI tokenizes the same spec the same way):

- OURS: `moecompress compress MODEL --calib fixture-calib:<n> --seq-len L --method quant --quant w4g128`, the
  defaults otherwise (Hessians streamed from the data spec, a chunk of experts at a time; act order);
- THEIRS: `benchmarks/peer/llmc_gptq.py` in the peer virtualenv (`build/peer-venv`, docs/peer_check.md),
  `oneshot` with a `GPTQModifier` on the experts' projections as shipped (2-D mask, every expert calibrated
  on every token, quantized activations propagated, static act order), W4A16 group 128.

The two run at the same time, one thread each, on a 2-core machine that other jobs may share: the ratio of
their wall times is measured side by side (both see the same load), not on an idle machine. Each process's
peak RSS is its own `ru_maxrss` (`os.wait4`). Wall is the whole process: interpreter start, model load,
calibration, quantization, writing the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_md import load_results, machine, model_shape, results_path, save_results, write_section  # noqa: E402

WIDE = ROOT / "build" / "wide_moe_4gb"
OUT = ROOT / "build" / "bench_gptq_scale"
PEER_PY = ROOT / "build" / "peer-venv" / "bin" / "python"
PEER_SCRIPT = ROOT / "benchmarks" / "peer" / "llmc_gptq.py"
RESULTS = "gptq_scale.json"
RESULTS_AUTO = "gptq_scale_auto.json"  # `run-auto`: our pure GPTQ beside our `auto --budget 25%`
# `run-auto --search fast`: the same with `search=fast`, one file per model (the 24-layer one's, then wide4's)
RESULTS_AUTO_FAST = ("gptq_scale_auto_fast.json", "gptq_scale_auto_fast_wide4.json")
AUTO_BUDGET = "25%"
TARGET_AUTO = 2.0  # auto's wall ÷ our pure GPTQ's (issue 32)
RESULTS_CHUNKS = (
    "gptq_scale_chunks.json"  # `chunks`: quant's streamed chunk (MethodEntry.streamed_chunk) swept
)
CHUNKS = (4, 8, 16, 32)
_CHUNK_CHILD = """
import dataclasses, sys
from moecompress.cli import app
from moecompress.cli.entry import run
from moecompress.methods.registry import METHODS, _load_builtin_methods
_load_builtin_methods()
METHODS["quant"] = dataclasses.replace(METHODS["quant"], streamed_chunk=int(sys.argv[1]))
try:
    run(app, sys.argv[2:])
except SystemExit as exc:
    sys.exit(exc.code or 0)
"""
SECTION = "## GPTQ at scale: moecompress vs llm-compressor (issue 32)"
TARGET_WALL, TARGET_RSS = 0.5, 0.35  # ours ÷ theirs; our peak RSS ÷ checkpoint bytes (issue 32)


def _tokens(model: Path, sequences: int, seq_len: int) -> Path:
    from safetensors.torch import save_file

    from moecompress.data import load_calibration, load_tokenizer

    data = load_calibration(f"fixture-calib:{sequences}", load_tokenizer(str(model)), seq_len, seed=0)
    path = OUT / "tokens.safetensors"
    save_file(
        {"input_ids": data.input_ids.contiguous(), "attention_mask": data.attention_mask.contiguous()},
        str(path),
    )
    return path


def _commands(model: Path, tokens: Path, sequences: int, seq_len: int, search: str) -> dict[str, list[str]]:
    base = [
        sys.executable,
        "-m",
        "moecompress",
        "compress",
        str(model),
        "--calib",
        f"fixture-calib:{sequences}",
    ]
    base += ["--seq-len", str(seq_len)]
    ours = [*base, "--method", "quant", "--quant", "w4g128", "--out", str(OUT / "ours"), "--overwrite"]
    theirs = [str(PEER_PY), str(PEER_SCRIPT), "--model", str(model), "--tokens", str(tokens), "--bits", "4"]
    theirs += ["--group", "128", "--save", str(OUT / "theirs"), "--out", str(OUT / "theirs.json")]
    theirs += ["--threads", "1", "--actorder", "static"]
    auto = [*base, "--method", "auto", "--budget", AUTO_BUDGET, "--out", str(OUT / "auto"), "--overwrite"]
    auto += ["--param", f"search={search}"]
    return {"moecompress": ours, "llm-compressor": theirs, "moecompress auto": auto}


def run(model: Path, sequences: int, seq_len: int, with_auto: bool = False, search: str = "fast") -> dict:
    """Two sides at once: ours and llm-compressor's GPTQ, or (`with_auto`) our pure GPTQ and our `auto`."""
    if not with_auto and not PEER_PY.is_file():
        sys.exit(f"No peer virtualenv at {PEER_PY}; create it as docs/peer_check.md describes.")
    OUT.mkdir(parents=True, exist_ok=True)
    tokens = _tokens(model, sequences, seq_len)
    names = ("moecompress", "moecompress auto") if with_auto else ("moecompress", "llm-compressor")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
    procs, logs, t0 = {}, {}, {}
    for side, cmd in _commands(model, tokens, sequences, seq_len, search).items():
        if side not in names:
            continue
        logs[side] = (OUT / f"{side}.log").open("w")
        t0[side] = time.perf_counter()
        procs[side] = subprocess.Popen(cmd, stdout=logs[side], stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    sides = {}
    by_pid = {p.pid: side for side, p in procs.items()}
    while by_pid:  # whichever finishes first: its own rusage, its own wall
        pid, status, usage = os.wait4(-1, 0)
        side = by_pid.pop(pid, None)
        if side is None:
            continue
        logs[side].close()
        sides[side] = {
            "wall_s": round(time.perf_counter() - t0[side], 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "rc": os.waitstatus_to_exitcode(status),
            "command": [str(c) for c in procs[side].args],
        }
        if sides[side]["rc"] != 0:
            sides[side]["error"] = (OUT / f"{side}.log").read_text()[-800:]
    disk = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    res = {
        "model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model),
        "disk_bytes": disk,
        "shape": model_shape(model),
        "calib": f"fixture-calib:{sequences}",
        "seq_len": seq_len,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "sides": sides,
    }
    save_results(_auto_results(model, search) if with_auto else _results_name(model), res)
    print(json.dumps(res, indent=1))
    return res


def _auto_results(model: Path, search: str) -> str:
    """`run-auto`'s results: the full search's (one file), or the fast search's of the 24-layer or another model."""
    if search == "full":
        return RESULTS_AUTO
    return (
        RESULTS_AUTO_FAST[0]
        if model.resolve() == WIDE.resolve()
        else f"gptq_scale_auto_fast_{model.name}.json"
    )


def _results_name(model: Path) -> str:
    """The 24-layer wide model's side by side is `RESULTS`; another model's is named after its directory."""
    return RESULTS if model.resolve() == WIDE.resolve() else f"gptq_scale_{model.name}.json"


def _model_lines(name: str) -> list[str]:
    """One model's side by side: its table and the ratios against the targets."""
    d = load_results(name)
    ours, theirs = d["sides"]["moecompress"], d["sides"]["llm-compressor"]
    gb, sh = 1e9, d["shape"]
    rows = [
        f"| {side} | `{' '.join(Path(c).name if '/' in c else c for c in s['command'][1:])}` | "
        f"{s['wall_s']:.0f} | {s['cpu_s']:.0f} | {s['peak_rss_bytes'] / gb:.2f} | "
        f"{s['peak_rss_bytes'] / d['disk_bytes']:.3f} | {s['rc']} |"
        for side, s in d["sides"].items()
    ]
    ok = ours["rc"] == 0 and theirs["rc"] == 0
    wall = ours["wall_s"] / theirs["wall_s"] if ok else None
    rss = ours["peak_rss_bytes"] / d["disk_bytes"]
    return [
        f"### `{Path(d['model']).name}`",
        "",
        f"Results `benchmarks/results/{name}`; {d['date']}. Model: `{d['model']}`, random Qwen3-MoE, hidden "
        f"{sh['hidden_size']}, {sh['num_hidden_layers']} layers × {sh['num_experts']} experts of width "
        f"{sh['moe_intermediate_size']}, top-{sh['num_experts_per_tok']}, {sh['dtype']}, "
        f"{d['disk_bytes'] / gb:.2f} GB on disk. Calibration `{d['calib']}` in {d['seq_len']}-token sequences.",
        "",
        "| side | command | wall s | CPU s | peak RSS GB | ÷ checkpoint | exit |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"- ours ÷ llm-compressor, wall: {f'{wall:.3f}' if wall is not None else 'not measured (a side failed)'} "
        f"(target ≤ {TARGET_WALL}: {'met' if wall is not None and wall <= TARGET_WALL else 'not met'}).",
        f"- our peak RSS ÷ checkpoint: {rss:.3f} (target ≤ {TARGET_RSS}, set on the 24-layer 4.98 GB model: "
        f"{'met' if rss <= TARGET_RSS else 'not met'}).",
        "",
    ]


def report() -> None:
    d = load_results(RESULTS)
    names = [RESULTS] + sorted(
        p.name
        for p in results_path(RESULTS).parent.glob("gptq_scale_*.json")
        if p.name not in (RESULTS, RESULTS_AUTO, *RESULTS_AUTO_FAST, RESULTS_CHUNKS)
    )
    lines = [
        SECTION,
        "",
        "Measured by `python -m benchmarks gptq-scale` (`benchmarks/bench_gptq_scale.py run [--model DIR]`). "
        f"Machine: {d['machine']}, no GPU. Both sides ran at the same time, one thread each, so they saw the same "
        "load; wall is the whole process, peak RSS its own `ru_maxrss`. Routed experts to W4 group 128 on both "
        "sides from the same token ids.",
        "",
        *(line for name in names for line in _model_lines(name)),
        *_auto_lines(RESULTS_AUTO),
        *(
            line
            for name in RESULTS_AUTO_FAST
            for line in ([""] if results_path(name).is_file() else []) + _auto_lines(name)
        ),
        *_chunk_lines(),
    ]
    write_section(SECTION, "\n".join(lines).rstrip("\n") + "\n")


def chunks(model: Path, sequences: int, seq_len: int) -> dict:
    """Our pure GPTQ at each streamed chunk of `CHUNKS`, one after the other, one thread: wall and peak RSS."""
    OUT.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
    base = _commands(model, OUT / "tokens.safetensors", sequences, seq_len)["moecompress"][3:]
    runs = {}
    for c in CHUNKS:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", _CHUNK_CHILD, str(c), *base], env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        runs[str(c)] = {
            "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            "rc": os.waitstatus_to_exitcode(status),
        }
    res = {"model": str(model), "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}
    save_results(RESULTS_CHUNKS, res)
    print(json.dumps(res, indent=1))
    return res


def _chunk_lines() -> list[str]:
    """The `chunks` sub-section, when its results exist."""
    if not results_path(RESULTS_CHUNKS).is_file():
        return []
    d = load_results(RESULTS_CHUNKS)
    rows = [
        f"| {c} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_bytes'] / 1e9:.2f} | {r['rc']} |"
        for c, r in d["runs"].items()
    ]
    return [
        "",
        "### Streamed chunk of our GPTQ",
        "",
        f"`python benchmarks/bench_gptq_scale.py chunks` ({d['date']}, model `{Path(d['model']).name}`): our pure "
        "GPTQ with `quant`'s streamed chunk (experts whose Hessians one extra pass gathers) set to each value, one "
        "run after another, one thread.",
        "",
        "| chunk | wall s | CPU s | peak RSS GB | exit |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]


def _auto_lines(name: str) -> list[str]:
    """A `run-auto` sub-section (results `name`): our `auto` beside our pure GPTQ, when its results exist."""
    if not results_path(name).is_file():
        return []
    d = load_results(name)
    fast = name in RESULTS_AUTO_FAST
    gptq, auto = d["sides"]["moecompress"], d["sides"]["moecompress auto"]
    ok = gptq["rc"] == 0 and auto["rc"] == 0
    wall = auto["wall_s"] / gptq["wall_s"] if ok else None
    cpu = auto["cpu_s"] / gptq["cpu_s"] if ok else None
    rows = [
        f"| {side} | {s['wall_s']:.0f} | {s['cpu_s']:.0f} | {s['peak_rss_bytes'] / 1e9:.2f} | {s['rc']} |"
        for side, s in d["sides"].items()
    ]
    verdict = "not measured (a side failed)" if wall is None else f"{wall:.2f}"
    met = "met" if wall is not None and wall <= TARGET_AUTO else "not met"
    return [
        f"### `auto --budget {AUTO_BUDGET} --param search={'fast' if fast else 'full'}` beside our pure GPTQ",
        "",
        f"`python benchmarks/bench_gptq_scale.py run-auto --search {'fast' if fast else 'full'}` ({d['date']}, "
        f"model `{d['model']}`, calibration `{d['calib']}` in {d['seq_len']}-token sequences): the two `compress` "
        "runs at the same time, one thread each; `auto` "
        + (
            "with its fast search, the default (RTN-priced widths scaled by a few experts' GPTQ per layer, reroute "
            "and drop, one global sensitivity)."
            if fast
            else "with its full search, the default when this was measured (every candidate, measured "
            "sensitivities; the command then had no `--param search`)."
        ),
        "",
        "| side | wall s | CPU s | peak RSS GB | exit |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"- auto ÷ pure GPTQ, wall: {verdict} (target ≤ {TARGET_AUTO}: {met}); CPU: "
        f"{'—' if cpu is None else f'{cpu:.2f}'}. Once the shorter run ends the longer has a core to itself, so "
        "the CPU ratio is the one to read.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "run-auto", "chunks", "report"])
    ap.add_argument("--model", default=str(WIDE))
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--search", choices=["full", "fast"], default="fast", help="run-auto: auto's search")
    a = ap.parse_args()
    if a.what in ("run", "run-auto"):
        run(Path(a.model), a.sequences, a.seq_len, with_auto=a.what == "run-auto", search=a.search)
    elif a.what == "chunks":
        chunks(Path(a.model), a.sequences, a.seq_len)
    else:
        report()


if __name__ == "__main__":
    main()
