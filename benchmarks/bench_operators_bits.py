#!/usr/bin/env python3
"""Replacement operators under quantization: the routing-semantics paper's §6.5 study (issue 18).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_operators_bits.py run   # -> benchmarks/results/operators_bits.json
    python benchmarks/bench_operators_bits.py report                        # BENCHMARKS.md section

The recipe `src/moecompress/recipes/operators-bits.yaml` (data, runnable with `moecompress compare`) holds one
fixed MoNE mask per ratio (25 %, 50 %) and on it the constant, the rank-32 tilt and rerouting at the trained
(keep) and renormalised gate scale, each with the kept experts at 16 bits and GPTQ-quantized to 4 and 3 bits
(group 128). It runs on both bf16 fixtures through `moecompress.compare.run_compare` (one calibration, every
arm exported, loaded back and scored on the same held-out windows). For every operator, ratio and width the
gain over the constant is mean KL(constant) − KL(operator) per window (paired bootstrap); whether that gain
changes with bits is the paired difference of the per-window gains at b bits and at 16 bits; Holm over each
fixture's family of tests.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_md import ROOT, load_results, machine, rel, results_path, save_results, write_section  # noqa: E402

SECTION = "## Operators under quantization: §6.5 (issue 18)"
RESULTS = "operators_bits.json"
RECIPE = ROOT / "src" / "moecompress" / "recipes" / "operators-bits.yaml"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
OPERATORS = ("tilt32", "reroute-keep", "reroute-renorm")
BITS = (16, 4, 3)
RATIOS = (25, 50)
B = 4000


def _items(res: dict) -> dict[str, tuple[list, list]]:
    stream = next(k for k in res["arms"][0]["metrics"] if k.startswith("ppl:"))
    return {
        a["name"]: (a["metrics"][stream]["items"]["ids"], a["metrics"][stream]["items"]["kl"])
        for a in res["arms"]
    }


def summarize(res: dict) -> dict:
    """Gains over the constant and their change with bits, from one fixture's compare results."""
    from moecompress.eval.stats import align, apply_holm, paired_bootstrap

    items = _items(res)
    arms = {
        a["name"]: {
            "bytes": a["bytes"].get("model"),
            "kl": next(m["aggregate"]["kl"] for k, m in a["metrics"].items() if k.startswith("ppl:")),
        }
        for a in res["arms"]
    }

    def per_window_gain(op: str, r: int, b: int) -> tuple[list, list[float]]:
        ids, const, oper = align(*items[f"const-{r}-b{b}"], *items[f"{op}-{r}-b{b}"])
        return ids, (const - oper).tolist()

    gains, changes = [], []
    for r in RATIOS:
        for op in OPERATORS:
            base_ids, base = per_window_gain(op, r, 16)
            for b in BITS:
                ids, g = per_window_gain(op, r, b)
                c = paired_bootstrap(
                    ids, g, ids, [0.0] * len(g), metric="kl gain", higher_is_better=True, B=B, seed=0
                ).to_dict()
                gains.append(dict(c, operator=op, ratio=r, bits=b))
                if b != 16:
                    d = paired_bootstrap(
                        ids, g, base_ids, base, metric="kl gain change", higher_is_better=True, B=B, seed=0
                    ).to_dict()
                    changes.append(dict(d, operator=op, ratio=r, bits=b))
    for family in (gains, changes):
        for row in family:
            row.pop("per_task", None)
        apply_holm(family, 0.05)
    return {
        "arms": arms,
        "gains": gains,
        "changes": changes,
        "calibration_seconds": (res.get("calibration") or {}).get("seconds"),
    }


def run(args) -> None:
    from moecompress.compare import run_compare
    from moecompress.recipe import load_recipe

    # a run of some fixtures keeps the committed results of the others
    kept = load_results(RESULTS)["fixtures"] if results_path(RESULTS).is_file() else {}
    out = {"machine": machine(), "recipe": rel(RECIPE), "bootstrap": B, "fixtures": dict(kept)}
    for fx in args.fixtures:
        recipe = load_recipe(RECIPE, model=f"fixture:{fx}")
        t0 = time.perf_counter()
        res = run_compare(
            recipe, Path(args.out) / fx, overwrite=True, progress=False, keep_checkpoints=False, pairs=[]
        )
        out["fixtures"][fx] = dict(summarize(res), wall_s=round(time.perf_counter() - t0, 1))
        print(f"{fx}: {out['fixtures'][fx]['wall_s']} s")
    print(f"wrote {save_results(RESULTS, out)}")


def _g(x, nd: int = 3) -> str:
    return "—" if x is None else f"{x:.{nd}g}"


def _cell(row: dict) -> str:
    mark = {"A better": " ↑", "B better": " ↓"}.get(row["verdict"], "")
    return f"{_g(row['delta'])} [{_g(row['ci_low'])}, {_g(row['ci_high'])}]{mark}"


def report() -> None:
    res = load_results(RESULTS)
    lines = [
        SECTION,
        "",
        f"Measured by `python -m benchmarks operators-bits` (`benchmarks/bench_operators_bits.py`, recipe "
        f"`{res['recipe']}`); results `{rel(results_path(RESULTS))}` (per-window values of every comparison). "
        f"Machine: {res['machine']}, no GPU.",
        "",
        "One fixed MoNE mask per ratio; on it the constant (rank 0), the rank-32 tilt, and rerouting at the "
        "trained (keep) and renormalised gate scale, with the kept experts at 16 bits or GPTQ w4/w3 (group 128). "
        "A cell is the operator's gain over the constant at that width, mean KL(constant) − KL(operator) per "
        f"held-out window, with its 95 % paired-bootstrap interval ({res['bootstrap']} draws); ↑ / ↓ mark a gain "
        "detectably above / below zero after Holm over the fixture's gains. The change column pairs the "
        "per-window gain at b bits against the gain at 16 bits (Holm over the fixture's changes).",
        "",
    ]
    survive, fall, rise, settings = {}, {}, {}, {}
    for fx, r in res["fixtures"].items():
        lines += [
            f"### {fx} (run {_g(r['wall_s'] / 60, 2)} min)",
            "",
            "| operator | pruned | gain @16 | gain @4 | gain @3 | change 16→4 | change 16→3 |",
            "| --- | ---: | --- | --- | --- | --- | --- |",
        ]
        g = {(x["operator"], x["ratio"], x["bits"]): x for x in r["gains"]}
        c = {(x["operator"], x["ratio"], x["bits"]): x for x in r["changes"]}
        for ratio in RATIOS:
            for op in OPERATORS:
                lines.append(
                    f"| {op} | {ratio}% | "
                    + " | ".join(_cell(g[op, ratio, b]) for b in BITS)
                    + " | "
                    + " | ".join(_cell(c[op, ratio, b]) for b in BITS[1:])
                    + " |"
                )
                for b in BITS[1:]:
                    settings[op] = settings.get(op, 0) + 1
                    same_sign = (g[op, ratio, b]["delta"] > 0) == (g[op, ratio, 16]["delta"] > 0)
                    survive[op] = survive.get(op, 0) + (
                        same_sign and g[op, ratio, b]["verdict"] != "not detectably different"
                    )
                    fall[op] = fall.get(op, 0) + (c[op, ratio, b]["verdict"] == "B better")
                    rise[op] = rise.get(op, 0) + (c[op, ratio, b]["verdict"] == "A better")
        a = r["arms"]
        extra = [
            f"{op} {ratio}% @{b}: {100 * (a[f'{op}-{ratio}-b{b}']['bytes'] / a[f'const-{ratio}-b{b}']['bytes'] - 1):+.1f} %"
            for ratio in RATIOS
            for op in OPERATORS[:1]
            for b in BITS
        ]
        lines += [
            "",
            "Bytes on disk against the constant arm at the same width (the tilt's factors stay 16-bit): "
            + "; ".join(extra)
            + ".",
            "",
        ]
    lines += [
        "### Do the paper's directions hold?",
        "",
        "The paper: the tilt's gain over the constant survives 4- and 3-bit quantization, while rerouting's "
        "gain falls. Counted over fixtures × ratios × {4, 3} bits:",
        "",
    ]
    for op in OPERATORS:
        lines.append(
            f"- **{op}**: its gain keeps the sign it has at 16 bits and stays detectably non-zero in "
            f"{survive[op]} of {settings[op]} settings; it is detectably smaller than at 16 bits in "
            f"{fall[op]} and detectably larger in {rise[op]} (Holm)."
        )
    write_section(SECTION, "\n".join(lines) + "\n")
    print(f"wrote {SECTION} into BENCHMARKS.md")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["run", "report"])
    ap.add_argument("--fixtures", nargs="+", default=list(FIXTURES))
    ap.add_argument("--out", default=str(ROOT / "build" / "bench_operators_bits"))
    args = ap.parse_args(argv)
    run(args) if args.step == "run" else report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
