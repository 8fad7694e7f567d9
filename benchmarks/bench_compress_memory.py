#!/usr/bin/env python3
"""Streaming `compress` benchmark (issue 19): peak memory of every method family, calibration included.

    python benchmarks/bench_compress_memory.py run [--families prune,tilt,...] [--model DIR]
    python benchmarks/bench_compress_memory.py dryrun     # every family's `compress --dry-run --json` estimate
    python benchmarks/bench_compress_memory.py report     # writes the BENCHMARKS.md section from the JSON

Every family runs `moecompress compress W --calib fixture-calib:N --seq-len T ...` in its own child process
(so calibration is part of the measured run) on the wide random Qwen3-MoE that
`benchmarks/bench_calibration.py build` writes (bf16, 24 layers x 64 experts, 4.98 GB). The child's peak
resident set (``ru_maxrss`` of the waited-for child) is divided by the checkpoint's bytes on disk; the
target is <= 0.35. Results: benchmarks/results/compress_memory.json; outputs go to build/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
WIDE = ROOT / "build" / "wide_moe_4gb"
OUT = ROOT / "build" / "bench_compress_memory"
RESULTS = ROOT / "benchmarks" / "results" / "compress_memory.json"
SECTION = "## Streaming compress: peak memory (issue 19)"
TARGET = 0.35

# family -> extra CLI arguments after `compress W --calib ... --out ...`
FAMILIES = {
    "prune": ["--method", "prune", "--criterion", "reap", "--ratio", "0.5", "--gate", "renorm"],
    "prune + tilt": [
        "--method",
        "prune",
        "--criterion",
        "mone",
        "--ratio",
        "0.5",
        "--operator",
        "tilt",
        "--rank",
        "32",
    ],
    "ConMoE scope 4": ["--method", "conmoe", "--ratio", "0.5", "--param", "scope_size=4"],
    "M-SMoE": ["--method", "m-smoe", "--ratio", "0.5", "--param", "router=merge"],
    "HC-SMoE": ["--method", "hc-smoe", "--ratio", "0.5"],
    "PuzzleMoE": ["--method", "puzzlemoe", "--ratio", "0.5"],
    "dense": ["--method", "dense", "--criterion", "frequency", "--param", "grouping=wc", "--param", "K=8"],
    # uniform sensitivities, no measured KL: auto's KL probes are full-model forwards (streamed, one layer
    # resident, but dozens of passes over 5 GB on this 2-core box); its plan building is what is measured here
    "auto": [
        "--method",
        "auto",
        "--budget",
        "0.5",
        "--budget-scope",
        "routed",
        "--param",
        "search=full",
        "--param",
        "sensitivity=uniform",
        "--param",
        "measure=false",
    ],
    # auto without the candidates whose statistics are [E, H, H] per layer (tilt and partial fits, GPTQ Hessians)
    "auto (no H×H statistics)": [
        "--method",
        "auto",
        "--budget",
        "0.5",
        "--budget-scope",
        "routed",
        "--param",
        "search=full",
        "--param",
        "sensitivity=uniform",
        "--param",
        "measure=false",
        "--param",
        "candidates=[reroute,drop,constant,remap,pair]",
        "--param",
        "quant_algo=rtn",
    ],
    # pure GPTQ, its Hessians streamed from the data spec (nothing per-expert H×H stored: issue 32 item 4)
    "GPTQ w4g128": ["--method", "quant", "--quant", "w4g128"],
    # and every linear of the model (issue 30): one more streamed pass for the attention / lm_head Hessians
    "GPTQ w4g128 all weights": ["--method", "quant", "--quant", "w4g128", "--quant-scope", "all"],
}

# threads per family (default 1): `auto`'s tilt fits and GPTQ of every expert at every width take minutes per layer
THREADS = {"auto": 2}

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from moecompress.cli import app
from moecompress.cli.entry import run
try:  # the CLI's own entry: a refused input is its one sentence on stderr, not a traceback
    run(app, sys.argv[1:])
    rc = 0
except SystemExit as exc:
    rc = exc.code or 0
print("BENCH " + json.dumps({"seconds": time.perf_counter() - t0, "rc": rc}))
"""


def run_family(name: str, args: list[str], model: Path, calib: str, seq_len: int) -> dict:
    out = OUT / name.replace(" ", "_").replace("+", "p")
    cmd = [
        sys.executable,
        "-c",
        _CHILD,
        "compress",
        str(model),
        "--calib",
        calib,
        "--seq-len",
        str(seq_len),
        "--out",
        str(out),
        "--overwrite",
        *args,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(THREADS.get(name, 1)),
        OMP_WAIT_POLICY="PASSIVE",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT / "src"),
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    # this parent waits for exactly one child, so RUSAGE_CHILDREN's maximum is that child's ru_maxrss
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    line = next((ln for ln in stdout.splitlines() if ln.startswith("BENCH ")), None)
    res = {
        "family": name,
        "args": args,
        "wall_s": round(wall, 1),
        "rc": proc.returncode,
        "peak_rss_bytes": peak,
        "output_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")) if out.is_dir() else 0,
    }
    if line:
        res["rc"] = json.loads(line[6:])["rc"]
    if res["rc"] != 0:
        res["error"] = (stderr or stdout)[-600:]
    return res


def run(families: list[str], model: Path, calib: str, seq_len: int) -> dict:
    disk = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    from _bench_md import machine, model_shape

    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if data.get("disk_bytes") != disk:
        data = {}
    data.update(
        {
            "model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model),
            "disk_bytes": disk,
            "calib": calib,
            "seq_len": seq_len,
            "shape": model_shape(model),
            "target": TARGET,
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d"),
        }
    )
    rows = data.setdefault("families", {})
    for name in families:
        src = _src_rev()  # per family: src/ may be committed between families of one long run
        # a fresh interpreter per family: RUSAGE_CHILDREN keeps the max over every child ever waited for, so each
        # family is measured by a dedicated parent process
        proc = subprocess.run(
            [sys.executable, __file__, "_one", name, str(model), calib, str(seq_len)],
            capture_output=True,
            text=True,
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ONE ")), None)
        res = (
            json.loads(line[4:])
            if line
            else {"family": name, "rc": proc.returncode, "error": proc.stderr[-600:]}
        )
        if res.get("peak_rss_bytes"):
            res["ratio"] = round(res["peak_rss_bytes"] / disk, 4)
        res.update(src=src, date=time.strftime("%Y-%m-%d %H:%M"))
        # every run of the same source tree is kept (peak RSS varies run to run); a changed src/ starts over
        prev = [r for r in _runs(rows.get(name)) if r.get("src") == src]
        rows[name] = {"family": name, "args": FAMILIES[name], "runs": prev + [res]}
        print(json.dumps(res), flush=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    return data


def dryrun(model: Path, calib: str, seq_len: int, repeats: int = 3) -> dict:
    """Every family's `compress --dry-run --json` estimate, kept beside the measured runs (seconds each).
    Each is taken `repeats` times: its time comes from one timed layer read, which a cold page cache or a
    busy disk stretches tenfold, so the report quotes medians."""
    import statistics

    data = json.loads(RESULTS.read_text())
    estimates = data.setdefault("estimates", {})
    src = _src_rev()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT / "src"),
    )
    for name, args in FAMILIES.items():
        cmd = [
            sys.executable,
            "-m",
            "moecompress.cli",
            "compress",
            str(model),
            "--calib",
            calib,
            "--seq-len",
            str(seq_len),
            "--out",
            str(OUT / "dry-run"),
            *args,
            "--dry-run",
            "--json",
        ]
        runs = []
        for _ in range(repeats):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{name}: the dry-run failed: {proc.stderr[-600:]}")
            runs.append(json.loads(proc.stdout))
        estimates[name] = dict(
            runs[0],
            peak_memory_bytes=statistics.median(r["peak_memory_bytes"] for r in runs),
            time_s=statistics.median(r["time_s"] for r in runs),
            runs=runs,
            src=src,
            date=time.strftime("%Y-%m-%d %H:%M"),
        )
        print(name, estimates[name]["peak_memory_bytes"], estimates[name]["time_s"], flush=True)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    return data


def _src_rev() -> str:
    """The package source measured: git's tree id of src/ at HEAD, marked dirty when src/ has local changes."""
    tree = subprocess.run(
        ["git", "rev-parse", "HEAD:src"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return (tree[:12] or "unknown") + ("-dirty" if dirty else "")


def _runs(row: dict | None) -> list[dict]:
    """A family's runs (results written before runs were kept hold one run inline)."""
    if not row:
        return []
    return row["runs"] if "runs" in row else [row]


def _summary(row: dict) -> dict:
    """One table row from a family's runs: the highest peak (the target is about the peak), median wall time."""
    import statistics

    runs = _runs(row)
    ok = [r for r in runs if r.get("rc") == 0 and r.get("peak_rss_bytes")]
    if not ok:
        return dict(runs[-1], n=len(runs), n_ok=0)
    worst = max(ok, key=lambda r: r["peak_rss_bytes"])
    return dict(
        worst,
        n=len(runs),
        n_ok=len(ok),
        wall_s=statistics.median(r["wall_s"] for r in ok),
        low_ratio=min(r["ratio"] for r in ok),
    )


def one(name: str, model: Path, calib: str, seq_len: int) -> None:
    res = run_family(name, FAMILIES[name], model, calib, seq_len)
    print("ONE " + json.dumps(res), flush=True)


def report() -> None:
    from _bench_md import write_section

    d = json.loads(RESULTS.read_text())
    gb = 1e9
    sh = d["shape"]
    lines = [
        SECTION,
        "",
        "Measured by `python -m benchmarks compress-memory` (`benchmarks/bench_compress_memory.py`); results "
        f"`benchmarks/results/{RESULTS.name}`. Machine: {d.get('machine', 'not recorded')}, shared with other "
        f"jobs, one thread unless said below, no GPU; {d.get('date', 'date not recorded')}. Each family is one `moecompress "
        f"compress` child process that calibrates (`--calib {d['calib']} --seq-len {d['seq_len']}`), builds "
        "the plan through the streamed checkpoint view and exports; peak RSS is the child's `ru_maxrss`.",
        "",
        f"Model: `{d['model']}`, random Qwen3-MoE, hidden {sh['hidden_size']}, {sh['num_hidden_layers']} layers "
        f"× {sh['num_experts']} experts of width {sh['moe_intermediate_size']}, top-{sh['num_experts_per_tok']}, "
        f"{sh['dtype']}, **{d['disk_bytes'] / gb:.2f} GB** on disk.",
        "",
        f"| family | arguments | peak RSS (highest run) | ÷ checkpoint | lowest run ÷ checkpoint | runs | "
        f"wall (median) | target ≤ {d['target']} |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    summaries = {}
    tags = [_summary(row).get("src") for row in d["families"].values()]
    main_src = max(set(tags), key=tags.count) if tags else None
    for name in FAMILIES:
        row = d["families"].get(name)
        if row is None:
            lines.append(f"| {name} | `{' '.join(FAMILIES[name])}` | not run | | | | | |")
            continue
        r = summaries[name] = _summary(row)
        if r.get("src") != main_src:  # measured on another src/ tree than the rest of the table
            name = f"{name} (src/ `{r.get('src') or 'not recorded'}`, {r.get('date') or 'an earlier run'})"
        if not r["n_ok"]:
            rc = r.get("rc")
            err = [
                ln for ln in (r.get("error") or "").splitlines() if "Error" in ln or ln.startswith("error:")
            ][-1:] or [f"killed by signal {-rc}" if isinstance(rc, int) and rc < 0 else f"exit code {rc}"]
            killed = isinstance(rc, int) and rc < 0 and r.get("peak_rss_bytes")
            peak = f" at {r['peak_rss_bytes'] / gb:.2f} GB" if killed else ""
            ratio = f"≥ {r['peak_rss_bytes'] / d['disk_bytes']:.3f}" if killed else ""
            lines.append(
                f"| {name} | `{' '.join(row.get('args') or FAMILIES[name])}` | failed: "
                f"{err[0].strip()[:260]}{peak} | {ratio} | | {r['n']} | {r.get('wall_s', '')} s | ❌ |"
            )
            continue
        ok = "✅" if r["ratio"] <= d["target"] else "❌"
        lines.append(
            f"| {name} | `{' '.join(row.get('args') or r['args'])}` | {r['peak_rss_bytes'] / gb:.2f} GB | "
            f"**{r['ratio']:.3f}** | {r['low_ratio']:.3f} | {r['n_ok']} | {r['wall_s']:.0f} s | {ok} |"
        )
    rows = [r for r in summaries.values() if r["n_ok"]]
    if main_src:
        lines += [
            "",
            f"Source measured (git tree of `src/`): `{main_src}` unless a row names another. A family's runs "
            "are kept while `src/` is unchanged; its row shows the highest peak of those runs.",
        ]
    if rows:
        ok = [r for r in rows if r["ratio"] <= d["target"]]
        worst = max(rows, key=lambda r: r["ratio"])
        unfinished = [(n, r) for n, r in summaries.items() if not r["n_ok"]]
        trees = {r.get("src") for r in summaries.values()}
        text = (
            f"{len(ok)} of {len(summaries)} variants run meet the target; the highest that finished is "
            f"{worst['family']} at {worst['ratio']:.3f} × the checkpoint"
        )
        if unfinished:
            text += "; did not finish: " + ", ".join(
                n
                + (
                    f" (peak ≥ {r['peak_rss_bytes'] / d['disk_bytes']:.3f} × when it stopped)"
                    if r.get("peak_rss_bytes")
                    else ""
                )
                for n, r in unfinished
            )
        if len(trees) > 1:
            text += f". The rows come from {len(trees)} src/ trees (a row measured on another names it)"
        lines += ["", text + "."]
    e, h = sh.get("num_experts"), sh.get("hidden_size")
    if e and h and "prune + tilt" in summaries:
        removed = e // 2  # the family's ratio 0.5
        per_layer = 2 * removed * h * h * 4  # input and cross moments, [S, H, H] float32 each
        lines += [
            "",
            f"`prune + tilt` calibrates twice: first everything its selection reads, then the input and cross "
            f"moments of the {removed} experts per layer it removes (two [S, H, H] float32 sums: "
            f"{per_layer / gb:.2f} GB per layer, {per_layer / d['disk_bytes']:.3f} × the checkpoint).",
        ]
    auto = summaries.get("auto")
    if auto:
        lines += [
            "",
            "`auto` with its default candidates and bits reads [E, H, H] and [E, I, I] statistics of every expert "
            '(gate²-weighted tilt and partial fits, GPTQ Hessians, their cross-fit halves). `compress` streams them (docs/calibration.md, "Streamed statistics"): each layer\'s '
            "are gathered while `auto` works on that layer, a few experts at a time, and never stored. "
            f"`auto` runs with {THREADS['auto']} threads here, the other families with one.",
        ]
    for name in ("auto", "auto (no H×H statistics)"):
        r = summaries.get(name)
        if r and not r["n_ok"] and isinstance(r.get("rc"), int) and r["rc"] < 0:
            lines += [
                "",
                f"`{name}` was stopped by hand after {r.get('wall_s', '?')} s, while it was still building "
                "its layer problems (its peak when stopped is in the table, a lower bound of the whole run's).",
            ]
    lines += _estimate_lines(d, summaries)
    width = {"bfloat16": 2, "float16": 2, "float32": 4}.get(sh["dtype"])
    if width:  # what the pre-issue-19 `compress` held in weights alone: the whole model upcast to float32
        lines += [
            "",
            f"Before issue 19, `compress` loaded the whole model in float32: its weights alone are "
            f"{4 / width * d['disk_bytes'] / gb:.2f} GB ({4 / width:.2f} × this checkpoint) before any "
            "calibration activations.",
        ]
    lines += [
        "",
        "`auto` runs with `sensitivity=uniform, measure=false` here: its KL probes are full-model forwards, "
        "which stream one layer at a time too but take many passes over the checkpoint.",
        "",
    ]
    write_section(SECTION, "\n".join(lines))
    print("\n".join(lines))


def _estimate_lines(d: dict, summaries: dict) -> list[str]:
    """`compress --dry-run`'s estimates beside the measured peaks and wall times."""
    est = d.get("estimates") or {}
    if not est:
        return []
    gb = 1e9
    srcs = sorted({e["src"] for e in est.values()})
    lines = [
        "",
        "### `compress --dry-run` against the measured runs",
        "",
        f"`python benchmarks/bench_compress_memory.py dryrun` (src/ `{', '.join(srcs)}`): each family's "
        "estimate before any work, the median of "
        f"{max(len(e.get('runs', [e])) for e in est.values())} dry-runs. The time counts the checkpoint reads "
        "only, not a method's own arithmetic.",
        "",
        "| family | estimated peak | ÷ measured peak | estimated time | measured wall |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in FAMILIES:
        e, r = est.get(name), summaries.get(name)
        if e is None:
            continue
        measured = r.get("peak_rss_bytes") if r else None
        done = bool(r and r["n_ok"])
        ratio = (
            f"{e['peak_memory_bytes'] / measured:.2f}"
            if measured and done
            else (f"≤ {e['peak_memory_bytes'] / measured:.2f} (run stopped)" if measured else "not run")
        )
        wall = f"{r['wall_s']:.0f} s" if done else "—"
        lines.append(
            f"| {name} | {e['peak_memory_bytes'] / gb:.2f} GB | {ratio} | {e['time_s']:.0f} s | {wall} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "dryrun", "report", "_one"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--model", default=str(WIDE))
    ap.add_argument("--calib", default="fixture-calib:8")
    ap.add_argument("--seq-len", type=int, default=128)
    a = ap.parse_args()
    if a.what == "_one":
        name, model, calib, seq_len = a.rest
        one(name, Path(model), calib, int(seq_len))
    elif a.what == "run":
        run([f for f in a.families.split(",") if f], Path(a.model), a.calib, a.seq_len)
    elif a.what == "dryrun":
        dryrun(Path(a.model), a.calib, a.seq_len)
    else:
        report()


if __name__ == "__main__":
    main()
