"""Issue 32 benchmark: our GPTQ defaults checked one knob at a time on both bf16 fixtures.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_gptq_defaults.py run   # -> benchmarks/results/gptq_defaults.json
    python benchmarks/bench_gptq_defaults.py report                         # BENCHMARKS.md section

Pure GPTQ of the routed experts at 2, 3 and 4 bits, group 128, from one calibration per fixture, through
`moecompress.compare.run_compare` (every arm exported, loaded back and evaluated on the same held-out
windows). At each width the default (act order on, damp 0.01, uniform Hessian) is paired against one
variant per knob: act order off, damp 0.1, damp 0.001, and the gate²-weighted Hessian. Block size is not a
knob here: GPTQ's lazy blocks change the order of floating-point sums, not the algorithm (docs/quantization.md).
Each comparison is a paired bootstrap over held-out windows of KL to the original, Holm over one fixture's
comparisons; the report's sentences are computed from those verdicts.
"""

from __future__ import annotations

import platform
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

RESULTS = ROOT / "benchmarks" / "results" / "gptq_defaults.json"
SECTION = "## GPTQ defaults (issue 32)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
CALIBRATION = dict(data="fixture-calib:64", seq_len=256, seed=0)
WINDOW = 256
MAX_TOKENS = 32768
BITS = (2, 3, 4)
DEFAULT = "default"
# variant name -> the parameters it changes from the default (act order on, damp 0.01, uniform Hessian)
VARIANTS = {
    "actorder-off": {"actorder": False},
    "damp-0.1": {"damp": 0.1},
    "damp-0.001": {"damp": 0.001},
    "gate2": {"weighting": "gate2"},
}


def arms() -> list[dict]:
    out = []
    for bits in BITS:
        for variant, change in {DEFAULT: {}, **VARIANTS}.items():
            out.append(
                dict(
                    name=f"w{bits}-{variant}",
                    bits=bits,
                    variant=variant,
                    params={"quant": f"w{bits}g128", "algo": "gptq", **change},
                )
            )
    return out


def run_fixture(fixture: str, out: Path) -> dict:
    from moecompress.compare import run_compare
    from moecompress.eval.stats import apply_holm, paired_bootstrap
    from moecompress.recipe import parse_recipe

    spec = arms()
    recipe = parse_recipe(
        dict(
            model=f"fixture:{fixture}",
            calibration=CALIBRATION,
            eval=dict(
                ppl="fixture-heldout",
                window=WINDOW,
                max_tokens=MAX_TOKENS,
                tasks=[],
                latency=False,
                quant_baselines=[],
            ),
            arms=[dict(name=a["name"], method="quant", params=a["params"]) for a in spec],
        ),
        where="bench_gptq_defaults",
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
    stream = next(k for k in res["arms"][0]["metrics"] if k.startswith("ppl:"))
    rows = {}
    for a in res["arms"]:
        m = a["metrics"][stream]
        rows[a["name"]] = dict(
            name=a["name"],
            bytes=a["bytes"].get("model"),
            kl=m["aggregate"].get("kl"),
            ppl=m["aggregate"].get("ppl"),
            window_ids=m["items"]["ids"],
            window_kl=m["items"]["kl"],
        )
    comps = []
    for a in spec:
        if a["variant"] == DEFAULT:
            continue
        base, var = rows[f"w{a['bits']}-{DEFAULT}"], rows[a["name"]]
        c = paired_bootstrap(
            var["window_ids"],
            var["window_kl"],
            base["window_ids"],
            base["window_kl"],
            metric="kl",
            higher_is_better=False,
            B=4000,
            seed=0,
        ).to_dict()
        c.pop("per_task", None)
        comps.append(
            dict(
                c,
                a=a["name"],
                b=base["name"],
                bits=a["bits"],
                variant=a["variant"],
                ratio=var["kl"] / base["kl"],
            )
        )
    apply_holm(comps, 0.05)
    for r in rows.values():
        r.pop("window_ids"), r.pop("window_kl")
    return dict(fixture=fixture, seconds=round(seconds, 1), arms=list(rows.values()), comparisons=comps)


def run(fixtures, out: Path) -> None:
    import torch

    results = dict(
        machine=dict(platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads()),
        calibration=CALIBRATION,
        window=WINDOW,
        max_tokens=MAX_TOKENS,
        variants=VARIANTS,
        fixtures=kept_fixtures(RESULTS.name, {f: run_fixture(f, out) for f in fixtures}, FIXTURES),
    )
    save_results(RESULTS.name, results)


def _g(x, nd=3):
    return "—" if x is None else f"{x:.{nd}g}"


def verdict_lines(fx: dict) -> list[str]:
    """Per knob: at how many widths the variant is detectably better / worse than the default (Holm)."""
    out = []
    for variant in VARIANTS:
        cs = [c for c in fx["comparisons"] if c["variant"] == variant]
        better = [f"{c['bits']} bits" for c in cs if c["verdict"] == "A better"]
        worse = [f"{c['bits']} bits" for c in cs if c["verdict"] == "B better"]
        tied = [f"{c['bits']} bits" for c in cs if c["verdict"] not in ("A better", "B better")]
        parts = [
            f"detectably lower KL than the default at {', '.join(better)}" if better else None,
            f"detectably higher at {', '.join(worse)}" if worse else None,
            f"not detectably different at {', '.join(tied)}" if tied else None,
        ]
        out.append(f"- `{variant}`: " + "; ".join(p for p in parts if p) + ".")
    return out


def markdown(results: dict) -> str:
    cal = results["calibration"]
    lines = [
        SECTION,
        "",
        "Regenerate: `python -m benchmarks gptq-defaults` (results: `benchmarks/results/gptq_defaults.json`).",
        "",
        f"Pure GPTQ of the routed experts, group 128, symmetric, from one calibration per fixture ({cal['data']}, "
        f"sequences of {cal['seq_len']} tokens, seed {cal['seed']}); KL to the original on the first "
        f"{results['max_tokens']} tokens of `fixture-heldout` in windows of {results['window']}. The default "
        "(act order on, damp 0.01, uniform Hessian over each expert's routed tokens, block 128) is paired "
        "against one changed knob at a time (paired bootstrap over windows, Δ = KL(variant) − KL(default), "
        "Holm over one fixture's comparisons). The choices and llm-compressor's defaults beside them: "
        'docs/quantization.md, "Defaults". '
        f"Machine: {results['machine']['platform']}, torch {results['machine']['torch']}.",
        "",
    ]
    for fx in results["fixtures"]:
        kl = {r["name"]: r["kl"] for r in fx["arms"]}
        lines += [
            f"### {fx['fixture']} (run {fx['seconds'] / 60:.1f} min)",
            "",
            "| bits | " + " | ".join(["default", *VARIANTS]) + " |",
            "| --- | " + " | ".join("---" for _ in range(len(VARIANTS) + 1)) + " |",
        ]
        for b in BITS:
            lines.append(
                f"| {b} | " + " | ".join(_g(kl.get(f"w{b}-{v}")) for v in [DEFAULT, *VARIANTS]) + " |"
            )
        lines += [
            "",
            "| variant | vs | KL ratio | Δ KL | interval | Holm p | verdict |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in fx["comparisons"]:
            lines.append(
                f"| {c['a']} | {c['b']} | {c['ratio']:.3f} | {_g(c['delta'])} | "
                f"[{_g(c['ci_low'])}, {_g(c['ci_high'])}] | {_g(c.get('p_adjusted'))} | {c['verdict']} |"
            )
        lines += [""] + verdict_lines(fx) + [""]
    return "\n".join(lines)


def report() -> None:
    write_section(SECTION, markdown(load_results(RESULTS.name)))


if __name__ == "__main__":
    fixture_main(__doc__, FIXTURES, run, report, ROOT / "build" / "bench_gptq_defaults")
