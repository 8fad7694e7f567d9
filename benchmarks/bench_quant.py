"""Issue 13 benchmark: quantization as a representation — pure RTN / GPTQ at 2, 3, 4 and 8 bits, and
REAP, PuzzleMoE, ConMoE and `auto` at 25 % and 50 % expert reduction, each alone and + GPTQ-4 / GPTQ-3,
on both bf16 fixtures, through `moecompress.compare.run_compare` (one calibration, every arm exported,
loaded back and evaluated on the same held-out windows).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_quant.py run      # -> benchmarks/results/quant.json
    python benchmarks/bench_quant.py report                           # BENCHMARKS.md section + plot

Group 128 along the input dimension (the fixtures' 192/96-wide inputs leave a shorter last group, which
the compact format holds). PuzzleMoE + b bits quantizes its packed pairs' merged weights with its own
q<b> codes (the paper's scheme) and GPTQ-quantizes the experts it leaves unpaired. Every structure + bits arm is paired (KL per held-out window, bootstrap, Holm)
against the best pure-GPTQ arm that takes no more bytes; the report's sentences are computed from those
comparisons.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "quant.json"
PLOT = ROOT / "benchmarks" / "results" / "quant_quality_vs_bytes.png"
SECTION = "## Quantization: structure × bits (issue 13)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
GROUP = 128
CALIBRATION = dict(data="fixture-calib:64", seq_len=256, seed=0)
WINDOW = 256
STRUCTURES = {
    "reap": lambda r: ("prune", {"criterion": "reap", "ratio": r, "gate": "renorm"}),
    "puzzlemoe": lambda r: ("puzzlemoe", {"ratio": r}),
    "conmoe": lambda r: ("conmoe", {"ratio": r}),
    "auto": lambda r: ("auto", {"budget": round(1 - r, 4), "budget_scope": "routed", "search": "full"}),
}


def arms() -> list[dict]:
    """Every arm: name, method, params, quant (None or a quant setting), family."""
    out = []
    for bits in (2, 3, 4, 8):
        for algo in ("rtn", "gptq"):
            out.append(
                dict(
                    name=f"{algo}-w{bits}",
                    method="quant",
                    family=f"pure {algo.upper()}",
                    params={"quant": f"w{bits}g{GROUP}", "algo": algo},
                    quant=None,
                )
            )
    for bits in (2, 3, 4):  # does the gate²-weighted Hessian help GPTQ?
        out.append(
            dict(
                name=f"gptq-g2-w{bits}",
                method="quant",
                family="pure GPTQ (gate² Hessian)",
                params={"quant": f"w{bits}g{GROUP}", "algo": "gptq", "weighting": "gate2"},
                quant=None,
            )
        )
    for level in (25, 50):
        for key, make in STRUCTURES.items():
            method, params = make(level / 100)
            out.append(
                dict(name=f"{key}-{level}", method=method, params=params, quant=None, family="structure")
            )
            for bits in (4, 3):
                # PuzzleMoE's packed pairs carry their own precision: W_merged at q3/q4 (the paper's scheme);
                # the quantization stage then takes the experts left unpaired
                p = dict(params, quant_bits=bits) if key == "puzzlemoe" else params
                out.append(
                    dict(
                        name=f"{key}-{level}+gptq-w{bits}",
                        method=method,
                        params=p,
                        quant={"quant": f"w{bits}g{GROUP}", "algo": "gptq"},
                        family="structure + bits",
                    )
                )
    return out


def run_fixture(fixture: str, out: Path, max_tokens: int, reuse: bool = False) -> dict:
    """Run the fixture's compare (or, with `reuse`, read the report an earlier run left under `out`)."""
    from moecompress.compare import run_compare
    from moecompress.recipe import parse_recipe

    spec = arms()
    done = out / fixture / "results.json"
    if reuse and done.is_file():
        wall = out / fixture / "wall.json"
        seconds = json.loads(wall.read_text())["seconds"] if wall.is_file() else None
        return summarize(fixture, json.loads(done.read_text()), spec, seconds)
    recipe = parse_recipe(
        dict(
            model=f"fixture:{fixture}",
            calibration=CALIBRATION,
            eval=dict(
                ppl="fixture-heldout",
                window=WINDOW,
                max_tokens=max_tokens,
                tasks=[],
                latency=False,
                quant_baselines=[],
            ),
            arms=[{k: a[k] for k in ("name", "method", "params", "quant") if a[k] is not None} for a in spec],
        ),
        where="bench_quant",
    )
    t0 = time.perf_counter()
    res = run_compare(
        recipe,
        out / fixture,
        overwrite=True,
        progress=False,
        keep_checkpoints=False,
        pairs=[(a["name"], "original") for a in spec],
    )
    seconds = time.perf_counter() - t0
    (out / fixture / "wall.json").write_text(json.dumps({"seconds": seconds}))
    return summarize(fixture, res, spec, seconds)


def summarize(fixture: str, res: dict, spec: list[dict], seconds: float | None) -> dict:
    """Per-arm rows and the structure + bits vs pure-GPTQ comparisons of one fixture's compare results."""
    from moecompress.eval.stats import apply_holm, paired_bootstrap

    stream = next(k for k in res["arms"][0]["metrics"] if k.startswith("ppl:"))
    family = {a["name"]: a["family"] for a in spec}
    rows = []
    for a in res["arms"]:
        m = a["metrics"][stream]
        rows.append(
            dict(
                name=a["name"],
                family=family.get(a["name"], "original"),
                bytes=a["bytes"].get("model"),
                weights=a["bytes"].get("weights"),
                bits_per_weight=a.get("bits_per_weight"),
                precision=a.get("precision"),
                kl=m["aggregate"].get("kl"),
                ppl=m["aggregate"].get("ppl"),
                compress_seconds=a.get("compress_seconds"),
                window_ids=m["items"]["ids"],
                window_kl=m["items"]["kl"],
            )
        )
    by = {r["name"]: r for r in rows}
    gptq = [r for r in rows if r["family"] == "pure GPTQ"]
    comps = []
    for r in rows:
        if r["family"] != "structure + bits":
            continue
        fits = [g for g in gptq if g["bytes"] <= r["bytes"]]
        if not fits:
            continue
        best = min(fits, key=lambda g: g["kl"])
        c = paired_bootstrap(
            r["window_ids"],
            r["window_kl"],
            best["window_ids"],
            best["window_kl"],
            metric="kl",
            higher_is_better=False,
            B=4000,
            seed=0,
        ).to_dict()
        c.pop("per_task", None)
        comps.append(dict(c, a=r["name"], b=best["name"]))
    apply_holm(comps, 0.05)
    return dict(
        fixture=fixture,
        seconds=None if seconds is None else round(seconds, 1),
        calibration_seconds=(res.get("calibration") or {}).get("seconds"),
        arms=rows,
        comparisons=comps,
        original_bytes=by["original"]["bytes"],
    )


def run(fixtures, max_tokens: int, out: Path, reuse: bool = False) -> None:
    import torch
    from _bench_md import kept_fixtures, save_results

    results = dict(
        machine=dict(platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads()),
        group=GROUP,
        max_tokens=max_tokens,
        calibration=CALIBRATION,
        window=WINDOW,
        fixtures=kept_fixtures(
            RESULTS.name, {f: run_fixture(f, out, max_tokens, reuse) for f in fixtures}, FIXTURES
        ),
    )
    save_results(RESULTS.name, results)


# ----------------------------------------------------------------------------- report
def _g(x, nd=3):
    return "—" if x is None else f"{x:.{nd}g}"


def verdicts(fx: dict) -> list[str]:
    """Sentences computed from the paired comparisons: where structure + bits beats bits alone, and not."""
    better = [c for c in fx["comparisons"] if c["verdict"] == "A better"]
    worse = [c for c in fx["comparisons"] if c["verdict"] == "B better"]
    tied = [c for c in fx["comparisons"] if c["verdict"] not in ("A better", "B better")]
    out = []
    for label, group in (
        ("detectably lower KL than", better),
        ("detectably higher KL than", worse),
        ("not detectably different from", tied),
    ):
        if group:
            pairs = ", ".join(f"`{c['a']}` vs `{c['b']}`" for c in group)
            out.append(
                f"{len(group)} of {len(fx['comparisons'])} structure + bits arms have {label} the best pure "
                f"GPTQ arm at equal or fewer bytes: {pairs}."
            )
    return out


def gate2_lines(fx: dict) -> list[str]:
    """Gate²-weighted against uniform GPTQ Hessians at each width: paired bootstrap over the held-out windows,
    Holm over the widths, the verdict per width (computed, never typed)."""
    from moecompress.eval.stats import apply_holm, paired_bootstrap

    by = {r["name"]: r for r in fx["arms"]}
    comps = []
    for b in (2, 3, 4):
        u, w = by.get(f"gptq-w{b}"), by.get(f"gptq-g2-w{b}")
        if u is None or w is None:
            continue
        c = paired_bootstrap(
            w["window_ids"],
            w["window_kl"],
            u["window_ids"],
            u["window_kl"],
            metric="kl",
            higher_is_better=False,
            B=4000,
            seed=0,
        ).to_dict()
        comps.append(dict(c, bits=b, uniform=u["kl"], gate2=w["kl"]))
    apply_holm(comps, 0.05)
    words = {"A better": "gate² lower", "B better": "gate² higher"}
    return [
        "Gate²-weighted against uniform GPTQ Hessians (paired bootstrap over held-out windows, Δ = KL(gate²) − "
        "KL(uniform), Holm over the widths): "
        + "; ".join(
            f"{c['bits']} bits {_g(c['uniform'])} → {_g(c['gate2'])}, Δ {_g(c['delta'])} "
            f"[{_g(c['ci_low'])}, {_g(c['ci_high'])}], {words.get(c['verdict'], 'not detectably different')}"
            for c in comps
        )
        + "."
    ]


def markdown(results: dict) -> str:
    lines = [
        SECTION,
        "",
        "Regenerate: `OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_quant.py run && python "
        "benchmarks/bench_quant.py report` (results: `benchmarks/results/quant.json`, plot: "
        "`benchmarks/results/quant_quality_vs_bytes.png`).",
        "",
        f"Routed experts quantized group-wise (group {results['group']}, symmetric, the grid of "
        f"docs/quantization.md); GPTQ from per-expert calibration Hessians ({results['calibration']['data']}, "
        f"sequences of {results['calibration']['seq_len']} tokens). KL to the original and perplexity on "
        f"held-out text ({results['max_tokens']} tokens, windows of {results['window']}); "
        "bytes are the plan's bytes (what the exported checkpoint stores for the model); bits/weight are stored "
        "routed-expert bits per original routed weight; compression time excludes the shared calibration. "
        f"Machine: {results['machine']['platform']}, torch {results['machine']['torch']}.",
        "",
    ]
    for fx in results["fixtures"]:
        took = f" (run {fx['seconds'] / 60:.1f} min)" if fx["seconds"] else ""
        lines += [f"### {fx['fixture']}{took}", ""]
        lines.append(
            "| arm | family | precision | bits/weight | model bytes vs original | KL | ppl | compress s |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in sorted(fx["arms"], key=lambda r: -(r["bytes"] or 0)):
            rel = r["bytes"] / fx["original_bytes"] if r["bytes"] else None
            lines.append(
                f"| {r['name']} | {r['family']} | {r['precision'] or '—'} | {_g(r['bits_per_weight'])} | "
                f"{_g(rel)} | {_g(r['kl'])} | {_g(r['ppl'], 4)} | {_g(r['compress_seconds'])} |"
            )
        lines += [
            "",
            "Structure + bits against the best pure-GPTQ arm at equal or fewer bytes (paired bootstrap over "
            "held-out windows, Δ = KL(arm) − KL(GPTQ), Holm over the comparisons of this fixture):",
            "",
            "| arm | vs | Δ KL | interval | Holm p |",
            "| --- | --- | --- | --- | --- |",
        ]
        for c in fx["comparisons"]:
            lines.append(
                f"| {c['a']} | {c['b']} | {_g(c['delta'])} | [{_g(c['ci_low'])}, {_g(c['ci_high'])}] | "
                f"{_g(c.get('p_adjusted'))} |"
            )
        lines += [""] + verdicts(fx) + [""]
        lines += gate2_lines(fx) + [""]
    lines.append(
        "Uniform bits on top of a fixed structural ratio is measured here; choosing structure and bits "
        "together per expert under one byte budget is `auto` over structure × bits (its own section)."
    )
    lines.append("")
    lines.append(f"![quality vs bytes](benchmarks/results/{PLOT.name})")
    return "\n".join(lines) + "\n"


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "pure RTN": "tab:gray",
        "pure GPTQ": "tab:blue",
        "pure GPTQ (gate² Hessian)": "tab:cyan",
        "structure": "tab:red",
        "structure + bits": "tab:green",
    }
    fig, axes = plt.subplots(
        1, len(results["fixtures"]), figsize=(6.5 * len(results["fixtures"]), 5), squeeze=False
    )
    for ax, fx in zip(axes[0], results["fixtures"]):
        for fam, color in colors.items():
            pts = [r for r in fx["arms"] if r["family"] == fam and r["kl"] and r["kl"] > 0]
            ax.scatter(
                [r["bytes"] / fx["original_bytes"] for r in pts],
                [r["kl"] for r in pts],
                c=color,
                label=fam,
                s=22,
            )
            for r in pts:
                ax.annotate(
                    r["name"],
                    (r["bytes"] / fx["original_bytes"], r["kl"]),
                    fontsize=6,
                    xytext=(2, 2),
                    textcoords="offset points",
                )
        ax.set_yscale("log")
        ax.set_xlabel("model bytes / original")
        ax.set_ylabel("KL to the original (log)")
        ax.set_title(fx["fixture"])
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["run", "report"])
    p.add_argument("--fixtures", nargs="*", default=list(FIXTURES))
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench_quant")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="summarize a fixture's finished compare under --out instead of recomputing it",
    )
    a = p.parse_args()
    if a.command == "run":
        run(a.fixtures, a.max_tokens, a.out, a.reuse)
        return
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _bench_md import write_section

    results = json.loads(RESULTS.read_text())
    plot(results)
    write_section(SECTION, markdown(results))


if __name__ == "__main__":
    main()
