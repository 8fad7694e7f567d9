"""Fixture results for the method issues, through `moecompress compare` (one calibration, same items).

Suites (each on both trained fixtures, 25 % and 50 % routed-expert reduction):

* ``pruning`` (issue 10): the fixed-mask operator grid — criteria mone, reap, frequency × every operator
  cell (constant, reroute keep/renorm, drop, tilt-32, partial, remap) — plus DO-ACP; every cell paired
  against the constant operator on the same mask, Holm-corrected; compression wall time per arm
  (calibration excluded).
* ``consolidation`` (issue 6): ConMoE scope 1/2/4 (adaptive), the selection ablations and the
  fusion diagnostics at scope 2, M-SMoE and HC-SMoE.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_methods.py pruning --out build/bench_pruning
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_methods.py consolidation --out build/bench_consolidation
    python benchmarks/bench_methods.py pruning --write   # update BENCHMARKS.md from the committed results

Each run writes a full compare report (report.md, PNGs, results.json) per fixture under OUT (scratch) and
commits-ready copies of the results to benchmarks/results/SUITE/<fixture>.json, which `--write` reads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

FIXTURES = ("qwen3-moe-tiny", "olmoe-tiny")
SECTIONS = {
    "pruning": "## Expert pruning: fixed-mask operator grid (issue 10)",
    "consolidation": "## Consolidation and merging (issue 6)",
}


def pruning_arms():
    from moecompress.cli.grid import grid_arms
    from moecompress.recipe import ArmSpec

    arms, pairs = grid_arms(
        ["mone", "reap", "frequency"],
        ["reroute-keep", "reroute-renorm", "drop", "tilt", "partial", "remap"],
        [0.25, 0.5],
        rank=32,
    )
    for ratio in (0.25, 0.5):
        arms.append(
            ArmSpec(
                name=f"do-acp-{round(100 * ratio)}-reroute-keep",
                method="prune",
                params=dict(criterion="do-acp", ratio=ratio, operator="reroute", gate="keep"),
            )
        )
    return arms, pairs


def consolidation_arms():
    from moecompress.recipe import ArmSpec

    arms = []
    for ratio in (0.25, 0.5):
        r = round(100 * ratio)
        for scope in (1, 2, 4):
            arms.append(
                ArmSpec(
                    name=f"conmoe-s{scope}-{r}", method="conmoe", params=dict(ratio=ratio, scope_size=scope)
                )
            )
        for variant in (
            "conmoe-fixed-k",
            "conmoe-usage",
            "conmoe-reap",
            "conmoe-distance",
            "conmoe-average",
            "conmoe-arcee",
        ):
            arms.append(
                ArmSpec(name=f"{variant}-s2-{r}", method=variant, params=dict(ratio=ratio, scope_size=2))
            )
        arms.append(ArmSpec(name=f"msmoe-{r}", method="m-smoe", params=dict(ratio=ratio)))
        arms.append(ArmSpec(name=f"hcsmoe-{r}", method="hc-smoe", params=dict(ratio=ratio)))
        arms.append(
            ArmSpec(
                name=f"reap-keep-{r}",
                method="prune",
                params=dict(criterion="reap", ratio=ratio, operator="reroute", gate="keep"),
            )
        )
    return arms, None


def run(suite: str, out: Path, fixtures=FIXTURES) -> None:
    from _bench_md import machine, save_results

    from moecompress.compare import run_compare
    from moecompress.recipe import CalibrationSpec, EvalSpec, Recipe

    arms, pairs = pruning_arms() if suite == "pruning" else consolidation_arms()
    for fixture in fixtures:
        recipe = Recipe(
            model=f"fixture:{fixture}",
            calibration=CalibrationSpec(data="fixture-calib:64", seq_len=256),
            eval=EvalSpec(
                ppl="fixture-heldout",
                window=256,
                max_tokens=8192,
                tasks=["fixture_mc"],
                limit=200,
                latency=False,
                quant_baselines=[],
            ),
            arms=arms,
        )
        t0 = time.perf_counter()
        results = run_compare(
            recipe, out / fixture, overwrite=True, progress=False, keep_checkpoints=False, pairs=pairs
        )
        # the committed copy: compare's results.json (per-window and per-item values included) + the run's facts
        full = json.loads((out / fixture / "results.json").read_text())
        for arm in full["arms"]:
            arm.pop("path", None)  # a scratch path on the machine that ran it
        full["bench"] = dict(
            seconds=time.perf_counter() - t0,
            machine=machine(),
            date=time.strftime("%Y-%m-%d"),
            eval=recipe.eval.model_dump(),
            dtype=results["model"].get("dtype"),
        )
        save_results(f"{suite}/{fixture}.json", full)


def _row(arm: dict, verdicts: dict) -> list[str]:
    ppl = next(v for k, v in arm["metrics"].items() if k.startswith("ppl:"))["aggregate"]
    # the first multiple-choice task evaluated (fixture_cloze in today's recipes, fixture_mc in older results)
    mc_task = next((e for e in arm["metrics"].values() if e.get("output_type") == "multiple_choice"), {})
    mc = mc_task.get("aggregate", {}).get("acc")
    mb = arm["bytes"].get("model", 0) / 2**20
    v = verdicts.get(arm["name"], "")
    return [
        arm["name"],
        f"{mb:.2f}",
        f"{ppl['kl']:.4f}",
        f"{ppl['ppl']:.2f}",
        f"{mc:.3f}" if mc is not None else "-",
        f"{arm.get('compress_seconds', 0):.2f}" if arm["kind"] != "original" else "-",
        v,
    ]


def table(results: dict) -> str:
    verdicts = {}
    for c in results.get("comparisons", []):
        if c["task"].startswith("ppl:"):
            who = {"A better": f"{c['a']} better", "B better": f"{c['b']} better"}.get(
                c["verdict"], c["verdict"]
            )
            verdicts[c["a"]] = f"vs {c['b']}: {who} (ΔNLL {c['delta']:+.4f}, Holm p {c['p_adjusted']:.3g})"
    head = ["arm", "MiB", "KL", "ppl", "mc acc", "compress s", "paired KL/NLL verdict (Holm)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    arms = sorted(
        results["arms"],
        key=lambda a: next(v for k, v in a["metrics"].items() if k.startswith("ppl:"))["aggregate"]["kl"],
    )
    lines += ["| " + " | ".join(_row(a, verdicts)) + " |" for a in arms]
    return "\n".join(lines)


def byte_agreement(results: dict) -> str:
    """How far the exported weights and whole directories lie from the plan's logical bytes (computed)."""
    w, d = [], []
    for a in results["arms"]:
        b = a.get("bytes", {})
        if a.get("kind") == "original" or not b.get("model"):
            continue
        if b.get("weights"):
            w.append(abs(b["weights"] / b["model"] - 1))
        if b.get("disk"):
            d.append(abs(b["disk"] / b["model"] - 1))
    if not w:
        return "Sizes are the plan's logical bytes."
    out = f"Sizes are the plan's logical bytes; the exported safetensors (weights) lie within {100 * max(w):.2f} % of them"
    if d:
        out += (
            f", the whole checkpoint directory (tokenizer and configs included) within {100 * max(d):.2f} %"
        )
    return out + "."


def write(suite: str, out: Path | None = None, bench_md: Path = Path("BENCHMARKS.md")) -> None:
    from _bench_md import load_results, results_path

    title = SECTIONS[suite]
    parts = [title, ""]
    head = None
    for fixture in FIXTURES:
        if not results_path(f"{suite}/{fixture}.json").is_file():
            parts += [
                f"### {fixture}",
                "",
                f"not run: `python -m benchmarks {suite} run` writes "
                f"`benchmarks/results/{suite}/{fixture}.json`.",
                "",
            ]
            continue
        results = load_results(f"{suite}/{fixture}.json")
        b = results.get("bench", {})
        if head is None and b:
            ev, cal = b["eval"], results.get("calibration") or {}
            mc = next(
                (
                    len(next(iter(a["metrics"]["fixture_mc"]["items"].values())))
                    for a in results["arms"]
                    if "fixture_mc" in a["metrics"]
                ),
                None,
            )
            head = (
                f"Command: `python -m benchmarks {suite}` (= `OMP_WAIT_POLICY=PASSIVE python "
                f"benchmarks/bench_methods.py {suite} --out build/bench_{suite}`, then `--write`); results "
                f"`benchmarks/results/{suite}/<fixture>.json` (compare's results: per-window and per-item values, "
                f"paired comparisons). Machine: {b['machine']}, shared; {b.get('dtype') or 'float32'} compute; "
                f"{b['date']}. Calibration {cal.get('source')} ({cal.get('tokens'):,} tokens, sequences of "
                f"{cal.get('seq_len')}); evaluation on the same {ev['ppl']} windows ({ev['max_tokens']:,} tokens, "
                f"window {ev['window']})"
                + (f" and {mc} fixture_mc items" if mc else "")
                + " for every arm. "
                + byte_agreement(results)
                + " KL = mean KL(original ‖ arm) per token."
            )
        wall = b.get("seconds", 0)
        parts += [f"### {fixture} (suite wall time {wall / 60:.1f} min)", "", table(results), ""]
    if head:
        parts.insert(2, head)
        parts.insert(3, "")
    from _bench_md import write_section

    write_section(title, "\n".join(parts), bench_md)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("suite", choices=sorted(SECTIONS))
    parser.add_argument(
        "--out", type=Path, default=None, help="scratch directory for the run (default build/bench_SUITE)"
    )
    parser.add_argument("--write", action="store_true", help="only render BENCHMARKS.md from an earlier run")
    parser.add_argument("--fixtures", default=",".join(FIXTURES), help="comma-separated fixtures to run")
    args = parser.parse_args()
    if not args.write:
        run(args.suite, args.out or Path(f"build/bench_{args.suite}"), tuple(args.fixtures.split(",")))
    write(args.suite, args.out)


if __name__ == "__main__":
    main()
