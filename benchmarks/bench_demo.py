#!/usr/bin/env python3
"""The Demo section of BENCHMARKS.md: `moecompress demo` timed end to end (issue 5).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_demo.py run      # -> benchmarks/results/demo.json
    python benchmarks/bench_demo.py report                           # the "## Demo (issue 5)" section

`run` starts the README's run command (`moecompress demo --out build/demo`) in a child process and
measures its wall time, user CPU time and peak RSS (the child's ru_maxrss), and the load average around
it; then commits-ready copies the demo's results.json (per-window and per-item values, paired
comparisons) with those measurements into benchmarks/results/demo.json. `report` reads only that file.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_md import ROOT, load_results, machine, save_results, write_block, write_section

SECTION = "## Demo (issue 5)"
RESULTS = "demo.json"
OUT = ROOT / "build" / "demo"
TARGET_MINUTES = 6  # the demo's wall-time target on the idle 2-core machine (issue 35; it was 15 in issue 5)


def run(out: Path = OUT) -> dict:
    cmd = [sys.executable, "-m", "moecompress.cli", "demo", "--out", str(out)]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), check=False)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"moecompress demo exited with {proc.returncode}")
    results = json.loads((out / "results.json").read_text())
    for arm in results["arms"]:
        arm.pop("path", None)  # scratch paths of the machine that ran it
    recipe = ROOT / "src" / "moecompress" / "recipes" / "demo.yaml"
    results["bench"] = dict(
        command="moecompress demo --out build/demo",
        recipe=str(recipe.relative_to(ROOT)),
        wall_s=round(wall, 1),
        user_cpu_s=round(usage.ru_utime, 1),
        peak_rss_bytes=usage.ru_maxrss * 1024,
        load_before=load_before,
        load_after=os.getloadavg(),
        machine=machine(),
        date=time.strftime("%Y-%m-%d"),
        eval=_eval_settings(recipe),
    )
    save_results(RESULTS, results)
    return results


def _eval_settings(recipe: Path) -> dict:
    from moecompress.recipe import load_recipe

    r = load_recipe(recipe)
    return dict(r.eval.model_dump(), calibration=r.calibration.model_dump())


def markdown(results: dict) -> str:
    from bench_methods import byte_agreement, table

    b, ev = results["bench"], results["bench"]["eval"]
    cal = results.get("calibration") or {}
    arms = results["arms"]
    kinds = {k: sum(a["kind"] == k for a in arms) for k in ("compressed", "materialized", "quant_baseline")}
    distilled = [a for a in arms if a.get("distilled")]
    loads = sorted([*b["load_before"], *b["load_after"]])
    minutes, seconds = divmod(round(b["wall_s"]), 60)
    lines = [
        SECTION,
        "",
        f"Command: `python -m benchmarks demo` (= `{b['command']}`, the README's run command, timed in a child "
        f"process; recipe `{b['recipe']}`); results `benchmarks/results/{RESULTS}`. Machine: {b['machine']}, "
        f"shared (load average {loads[0]:.1f}–{loads[-1]:.1f} around the run), no GPU; {b['date']}.",
        "",
        f"**Wall time: {minutes} min {seconds} s** ({b['user_cpu_s']:.0f} s user CPU; peak RSS "
        f"{b['peak_rss_bytes'] / 2**30:.2f} GiB) for one calibration ({cal.get('source')}, "
        f"{cal.get('tokens'):,} tokens), {kinds['compressed'] + kinds['materialized']} compressed arms"
        + (f" (incl. {len(distilled)} distilled dense student(s))" if distilled else "")
        + f" + {kinds['quant_baseline']} quantization reference arm(s) + the original, each exported, "
        f"reloaded and evaluated on the same {ev['max_tokens']:,} held-out tokens (window {ev['window']})"
        + "".join(f", {ev['limit']} {t} items" for t in ev["tasks"])
        + (", plus latency" if ev.get("latency") else "")
        + f". Target: at most {TARGET_MINUTES} minutes "
        + ("✅" if b["wall_s"] <= 60 * TARGET_MINUTES else "❌")
        + ".",
        "",
    ]
    task_verdicts = {}
    for c in results.get("comparisons", []):
        if not c["task"].startswith("ppl:"):
            task_verdicts.setdefault(c["task"], []).append(c["verdict"] != "not detectably different")
    moves = "; ".join(
        f"{t}: {sum(v)} of {len(v)} arms detectably different from the original"
        for t, v in task_verdicts.items()
    )
    m = results["model"]
    lines += [
        f"Fixture: {m.get('name')} ({m.get('router_convention')}). Sorted by KL to the original. "
        + byte_agreement(results)
        + (f" Paired task intervals (Holm): {moves}." if moves else ""),
        "",
        table(results),
        "",
    ]
    return "\n".join(lines)


def ranking(results: dict) -> str:
    """The README's demo table: the arms as the demo ranks them, size, KL, perplexity, multiple-choice accuracy."""
    from bench_methods import table

    rows = [line.split("|")[1:-1] for line in table(results).splitlines()[2:]]
    return "\n".join(
        ["| arm | MiB | KL | ppl | mc acc |", "|---|---|---|---|---|"]
        + ["|" + "|".join(r[:5]) + "|" for r in rows]
    )


def report() -> str:
    results = load_results(RESULTS)
    text = markdown(results)
    write_section(SECTION, text)
    write_block("demo-ranking", ranking(results))
    print(text)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--out", type=Path, default=OUT, help="the demo's report directory (scratch)")
    args = ap.parse_args(argv)
    if args.command == "run":
        run(args.out)
    report()


if __name__ == "__main__":
    main(sys.argv[1:])
