"""Issue 14 benchmark: `auto` over structure × bits against pure quantization, structure-only `auto`, and
REAP / PuzzleMoE + quantization at equal or fewer bytes, and how well the estimator ranks quantized candidates.

Two parts per fixture (olmoe-tiny, qwen3-moe-tiny, bf16):

* ``compare`` — `moecompress.compare.run_compare` with one recipe (one calibration, every arm exported, loaded
  back and evaluated on the same held-out windows). Budgets 6.25, 9.4, 12.5, 18.75, 25 and 50 % of the original
  routed-expert bytes; per budget: `auto` (structure × bits), `auto` with bits=[16], pure GPTQ and pure RTN at
  the largest uniform bit width that fits (method `quant`), REAP + GPTQ at the largest bit width that keeps at
  least half of the experts within the budget, and PuzzleMoE's own 3/4-bit packed pairs (fixed points,
  compared at every budget they fit). `auto` is paired (KL per held-out window, bootstrap, Holm over all
  comparisons of the fixture) against every other arm that fits its budget.
* ``spearman`` — the estimator's ranking of quantized candidates (as bench_auto.py's spearman part): single-slot
  quantized keeps (a seeded sample of slots, every bit width) and whole-layer uniform-bit states, estimated
  (per-kind scaled) loss against KL measured on held-out windows.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_auto_bits.py run --fixtures olmoe-tiny   # one JSON per fixture
    python benchmarks/bench_auto_bits.py report      # merge -> benchmarks/results/auto_bits.json, BENCHMARKS.md, plot
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "auto_bits.json"
PLOT = ROOT / "benchmarks" / "results" / "auto_bits_frontier.png"
SECTION = "## auto over structure × bits (issue 14)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
BUDGETS = (0.0625, 0.094, 0.125, 0.1875, 0.25, 0.5)
GROUP = 128
TARGET_LOW_KL = 0.02
PAIR_FLOOR = 0.4375  # the smallest state bits=[16] auto reaches with pair candidates on both fixtures (7 of 16 experts)
ALL_CANDIDATES = ("reroute", "drop", "constant", "tilt", "partial", "remap", "pair")

sys.path.insert(0, str(ROOT / "benchmarks"))


def tag(p: float) -> str:
    return f"{100 * p:g}".replace(".", "_")


def geometry(path: str):
    """(experts per layer, top-k, routed-expert bytes, bytes of one bf16 expert, {bits: bytes of one quantized expert})."""
    from moecompress.methods.auto.quant import expert_quant_bytes, quant_spec
    from moecompress.models import MoEAdapter, load_model
    from moecompress.plan import ModelInfo

    adapter = MoEAdapter(load_model(path, dtype="float32"))
    info = ModelInfo.from_model(adapter)
    li = info.layers[0]
    w = adapter.experts(adapter.moe_layers[0])
    i_dim, h = w.gate.shape[1:]
    qb = {
        b: expert_quant_bytes(
            quant_spec(b, GROUP, "gptq"), i_dim, h, w.gate_bias is not None, info.element_size
        )
        for b in (8, 4, 3, 2)
    }
    return li.num_experts, li.top_k, info.expert_bytes, li.bytes_per_expert, qb


def arms_for(path: str) -> list[dict]:
    e_all, top_k, _, per, qb = geometry(path)
    out, pure = [], set()
    for p in BUDGETS:
        t = tag(p)
        out.append(
            dict(
                name=f"auto-{t}",
                method="auto",
                params={"budget": p, "budget_scope": "routed", "quant_group": GROUP, "search": "full"},
                family="auto",
                budget=p,
            )
        )
        # structure-only auto: below 7/16 of the routed bytes its walks end in "every slot paired" (a packed pair
        # is final, and a bf16 pair costs half of its two experts), so there it runs without pair candidates
        p16 = {"budget": p, "budget_scope": "routed", "bits": [16], "search": "full"}
        if p < PAIR_FLOOR:
            p16["candidates"] = [c for c in ALL_CANDIDATES if c != "pair"]
        out.append(dict(name=f"auto16-{t}", method="auto", params=p16, family="auto 16-bit", budget=p))
        fit = [b for b in (8, 4, 3, 2) if qb[b] <= p * per]
        if fit:
            pure.add(max(fit))
        # REAP + GPTQ: the largest width that keeps at least half of the experts (else 2 bits), as many experts
        # as fit the budget at that width
        widths = [b for b in (8, 4, 3, 2) if int(e_all * p * per // qb[b]) >= e_all // 2] or [2]
        b = max(widths)
        k = min(e_all - 1, int(e_all * p * per // qb[b]))
        if k >= top_k:
            out.append(
                dict(
                    name=f"reap{k}+gptq-w{b}-{t}",
                    method="prune",
                    family="REAP + GPTQ",
                    budget=p,
                    params={"criterion": "reap", "ratio": round((e_all - k) / e_all, 6), "gate": "renorm"},
                    quant={"quant": f"w{b}g{GROUP}", "algo": "gptq"},
                )
            )
    for b in sorted(pure, reverse=True):
        for algo in ("gptq", "rtn"):
            out.append(
                dict(
                    name=f"{algo}-w{b}",
                    method="quant",
                    family=f"pure {algo.upper()}",
                    params={"quant": f"w{b}g{GROUP}", "algo": algo},
                )
            )
    for b in (4, 3):
        out.append(
            dict(
                name=f"puzzlemoe-q{b}",
                method="puzzlemoe",
                family="PuzzleMoE (own q-bit pairs)",
                params={"ratio": 0.5, "quant_bits": b, "quant_group": GROUP},
            )
        )
    return out


def run_compare_part(fixture: str, out: Path, max_tokens: int) -> dict:
    from moecompress.compare import run_compare
    from moecompress.eval.stats import apply_holm, paired_bootstrap
    from moecompress.recipe import parse_recipe
    from moecompress.testing import fixture_dir

    path = str(fixture_dir(fixture))
    spec = arms_for(path)
    _, _, routed, _, _ = geometry(path)
    recipe = parse_recipe(
        dict(
            model=f"fixture:{fixture}",
            calibration=dict(data="fixture-calib:64", seq_len=256, seed=0),
            eval=dict(
                ppl="fixture-heldout",
                window=256,
                max_tokens=max_tokens,
                tasks=[],
                latency=False,
                quant_baselines=[],
            ),
            arms=[
                {k: a[k] for k in ("name", "method", "params", "quant") if a.get(k) is not None} for a in spec
            ],
        ),
        where="bench_auto_bits",
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
    meta = {a["name"]: a for a in spec}
    rows = []
    for a in res["arms"]:
        m = a["metrics"][stream]
        s = meta.get(a["name"], {})
        rows.append(
            dict(
                name=a["name"],
                family=s.get("family", "original"),
                budget=s.get("budget"),
                bytes=a["bytes"].get("model"),
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
    original = by["original"]["bytes"]
    other = original - routed
    for r in rows:
        r["routed_fraction"] = (r["bytes"] - other) / routed if r["bytes"] else None
    comps = []
    for p in BUDGETS:
        a = by[f"auto-{tag(p)}"]
        limit = other + int(p * routed)  # model bytes the budget allows
        for r in rows:
            if (
                r["name"] == a["name"]
                or r["family"] in ("original", "auto")
                or r["bytes"] is None
                or r["bytes"] > limit
            ):
                continue
            if r["family"] == "REAP + GPTQ" and r["budget"] != p:
                continue
            if r["family"] == "auto 16-bit" and r["budget"] != p:
                continue
            c = paired_bootstrap(
                a["window_ids"],
                a["window_kl"],
                r["window_ids"],
                r["window_kl"],
                metric="kl",
                higher_is_better=False,
                B=4000,
                seed=0,
            ).to_dict()
            c.pop("per_task", None)
            comps.append(dict(c, a=a["name"], b=r["name"], budget=p, b_family=r["family"]))
    apply_holm(comps, 0.05)
    return dict(
        fixture=fixture,
        seconds=round(seconds, 1),
        original_bytes=original,
        routed_bytes=routed,
        other_bytes=other,
        arms=rows,
        comparisons=comps,
        calibration_seconds=(res.get("calibration") or {}).get("seconds"),
    )


def run_spearman(
    fixture: str, out: Path, slots_per_layer: int = 4, windows: int = 8, seq_len: int = 256, seed: int = 0
) -> dict:
    """Estimated vs held-out KL of quantized keeps: single slots at every width, and whole-layer uniform states."""
    from bench_auto import _stream_ids, calibrated, spearman

    from moecompress.data import load_tokenizer
    from moecompress.data.stream import token_stream
    from moecompress.methods.auto.config import AutoConfig, needs_stats
    from moecompress.methods.auto.frontier import keep_point_of, uniform_state
    from moecompress.methods.auto.measure import logprobs
    from moecompress.methods.auto.sensitivity import measure_states
    from moecompress.methods.auto.setup import prepare
    from moecompress.methods.auto.solver import LayerPoint
    from moecompress.models import MoEAdapter, load_model
    from moecompress.testing import fixture_dir

    path = str(fixture_dir(fixture))
    store = calibrated(path, out / f"stats-{fixture}", needs_stats(AutoConfig(search="full")))
    stream = _stream_ids(token_stream("fixture-heldout", load_tokenizer(path)))
    n = len(stream) // seq_len
    step = max(1, n // windows)
    held = __import__("torch").stack(
        [stream[k * step * seq_len : (k * step + 1) * seq_len] for k in range(min(windows, n))]
    )
    adapter = MoEAdapter(load_model(path, dtype="float32"))
    t0 = time.perf_counter()
    setup = prepare(
        AutoConfig(budget=0.25, budget_scope="routed", quant_group=GROUP, search="full"),
        adapter,
        store,
        keep_tensors=True,
    )
    prepare_s = time.perf_counter() - t0
    info, problems = setup.info, setup.problems
    ref = logprobs(adapter.model, held)

    def measure(states):
        return measure_states(adapter, info, states, held, ref)

    rng = random.Random(seed)
    single, layer_rows = [], []
    for i, prob in problems.items():
        for e in sorted(rng.sample(range(prob.num_experts), min(slots_per_layer, prob.num_experts))):
            for c in prob.options[e][1:]:
                choice = list(keep_point_of(info.layer(i)).choice)
                choice[e] = c
                mode = f"reroute:{c.gate}" if c.kind == "reroute" else "replace"
                pt = LayerPoint(mode, choice, prob.bytes_of(choice), c.loss)
                single.append(
                    dict(
                        layer=i,
                        slot=e,
                        kind=c.label + (f"-{c.gate}" if c.gate else ""),
                        quant=c.kind == "quant",
                        error=c.error,
                        kind_kl=c.loss,
                        kl=measure({i: pt}),
                    )
                )
        for b in (8, 4, 3, 2):
            state = uniform_state(prob, b)
            pt = LayerPoint("replace", state, prob.bytes_of(state), sum(c.loss for c in state))
            layer_rows.append(
                dict(layer=i, bits=b, error=sum(c.error for c in state), kind_kl=pt.loss, kl=measure({i: pt}))
            )
    quant = [r for r in single if r["quant"]]
    within = []
    for i in problems:
        for e in {r["slot"] for r in quant if r["layer"] == i}:
            rs = [r for r in quant if r["layer"] == i and r["slot"] == e]
            within.append(spearman([r["error"] for r in rs], [r["kl"] for r in rs]))
    return dict(
        fixture=fixture,
        prepare_seconds=round(prepare_s, 1),
        heldout=f"fixture-heldout, {len(held)} windows x {seq_len} tokens",
        n_quant=len(quant),
        n_single=len(single),
        spearman_quant_single=spearman([r["kind_kl"] for r in quant], [r["kl"] for r in quant]),
        spearman_all_single=spearman([r["kind_kl"] for r in single], [r["kl"] for r in single]),
        spearman_quant_widths_within_slot=sum(within) / len(within) if within else None,
        spearman_uniform_layer_states=spearman(
            [r["kind_kl"] for r in layer_rows], [r["kl"] for r in layer_rows]
        ),
        quant_sensitivity={str(i): setup.kind_sens[i].get("quant") for i in problems},
        single=single,
        layer_states=layer_rows,
    )


def run(fixtures, max_tokens: int, out: Path) -> None:
    import torch

    for f in fixtures:
        t0 = time.perf_counter()
        res = dict(
            machine=dict(
                platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads()
            ),
            max_tokens=max_tokens,
            compare=run_compare_part(f, out, max_tokens),
            spearman=run_spearman(f, out),
        )
        record(res, round(time.perf_counter() - t0, 1))


def record(part: dict, seconds: float) -> dict:
    """Put one fixture's run into the committed results, keeping the other fixture's, atomically: `report`
    reads only that file, so a partial `run --fixtures X` never drops or mixes in anything else."""
    from _bench_md import kept_fixtures, save_results

    entry = dict(part["compare"], spearman=part["spearman"], total_seconds=seconds)
    results = dict(
        machine=part["machine"],
        group=GROUP,
        max_tokens=part["max_tokens"],
        budgets=list(BUDGETS),
        fixtures=kept_fixtures(RESULTS.name, {entry["fixture"]: entry}, FIXTURES),
    )
    save_results(RESULTS.name, results)
    return results


# ----------------------------------------------------------------------------- report
def _spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def pct(p: float) -> str:
    return f"{100 * p:g} %"


def _g(x, nd=3):
    return "—" if x is None else f"{x:.{nd}g}"


def targets(fx: dict) -> dict:
    """Per budget: auto's KL, the best pure GPTQ arm within the budget, the paired comparison; and the verdicts."""
    by = {r["name"]: r for r in fx["arms"]}
    rows = []
    for p in BUDGETS:
        a = by[f"auto-{tag(p)}"]
        cs = [c for c in fx["comparisons"] if c["budget"] == p and c["b_family"] == "pure GPTQ"]
        best = min(cs, key=lambda c: by[c["b"]]["kl"]) if cs else None
        rows.append(
            dict(
                budget=p,
                auto=a["name"],
                kl=a["kl"],
                gptq=None if best is None else best["b"],
                gptq_kl=None if best is None else by[best["b"]]["kl"],
                comparison=best,
            )
        )
    with_gptq = [r for r in rows if r["gptq"]]
    return dict(
        rows=rows,
        not_higher=[r for r in with_gptq if r["kl"] <= r["gptq_kl"]],
        detectably_lower=[r for r in with_gptq if r["comparison"]["verdict"] == "A better"],
        with_gptq=with_gptq,
        low=[r for r in rows if r["budget"] in (0.0625, 0.094)],
    )


def markdown(results: dict) -> str:
    lines = [
        SECTION,
        "",
        "Regenerate: `OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_auto_bits.py run && python "
        "benchmarks/bench_auto_bits.py report` (results: `benchmarks/results/auto_bits.json`, plot: "
        f"`benchmarks/results/{PLOT.name}`).",
        "",
        "Budgets are fractions of the original routed-expert bytes as stored (bf16 fixtures); `auto` chooses per "
        f"slot among every representation and, for stored experts, 16, 8, 4, 3 or 2 bits (GPTQ with gate²-weighted "
        f"Hessians, group {results['group']}, scales counted). Pure GPTQ / RTN: the largest uniform width whose "
        'bytes fit the budget ("none fits" otherwise). REAP + GPTQ: the largest width keeping at least half of '
        "the experts, as many experts as fit. PuzzleMoE: its own 3/4-bit packed pairs at ratio 0.5 (fixed "
        f"points). KL to the original on held-out text ({results['max_tokens']} tokens, windows of 256); paired "
        "bootstrap over windows (Δ = KL(auto) − KL(arm)), Holm over all comparisons of a fixture. "
        f"`auto` 16-bit below {100 * PAIR_FLOOR:g} % of the routed bytes runs without pair candidates (its walks "
        'end in "every slot paired" above that, a packed pair being final). '
        f"Machine: {results['machine']['platform']}, torch {results['machine']['torch']}.",
        "",
    ]
    for fx in results["fixtures"]:
        t = targets(fx)
        by = {r["name"]: r for r in fx["arms"]}
        lines += [
            f"### {fx['fixture']} (run {fx['total_seconds'] / 60:.1f} min)",
            "",
            "| budget | auto KL | routed bytes used | auto 16-bit KL | best pure GPTQ within budget | its KL | "
            "Δ KL (auto − GPTQ) | interval | Holm p | pure RTN KL | REAP + GPTQ | its KL |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in t["rows"]:
            p = r["budget"]
            a16 = by.get(f"auto16-{tag(p)}")
            c = r["comparison"]
            ci = f"[{_g(c['ci_low'])}, {_g(c['ci_high'])}]" if c else "—"
            rtn = by.get(r["gptq"].replace("gptq", "rtn")) if r["gptq"] else None
            reap = next((x for x in fx["arms"] if x["family"] == "REAP + GPTQ" and x["budget"] == p), None)
            lines.append(
                f"| {100 * p:g} % | {_g(r['kl'])} | {_g(by[r['auto']]['routed_fraction'])} | "
                f"{_g(a16['kl']) if a16 else '—'} | {r['gptq'] or 'none fits'} | {_g(r['gptq_kl'])} | "
                f"{_g(c['delta']) if c else '—'} | {ci} | "
                f"{_g(c.get('p_adjusted')) if c else '—'} | {_g(rtn['kl']) if rtn else '—'} | "
                f"{reap['name'] if reap else '—'} | {_g(reap['kl']) if reap else '—'} |"
            )
        lines += [
            "",
            "All paired comparisons of `auto` (every arm within its budget):",
            "",
            "| auto | vs | Δ KL | interval | Holm p | verdict |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for c in fx["comparisons"]:
            lines.append(
                f"| {c['a']} | {c['b']} | {_g(c['delta'])} | [{_g(c['ci_low'])}, {_g(c['ci_high'])}] | "
                f"{_g(c.get('p_adjusted'))} | {c['verdict']} |"
            )
        nb = len(BUDGETS)
        wg = t["with_gptq"]
        lines += ["", "**Targets.**", ""]
        worst = [r for r in wg if r["kl"] > r["gptq_kl"]]
        lines.append(
            f"- auto KL ≤ best pure GPTQ within the budget: met at {len(t['not_higher'])} of {len(wg)} budgets "
            f"where a uniform width fits ({nb - len(wg)} of {nb} budgets: none fits)"
            + (
                "."
                if not worst
                else "; missed at "
                + ", ".join(
                    f"{100 * r['budget']:g} % ({_g(r['kl'])} vs {_g(r['gptq_kl'])} of {r['gptq']}, "
                    f"+{_g(r['kl'] - r['gptq_kl'])})"
                    for r in worst
                )
                + "."
            )
        )
        det = t["detectably_lower"]
        lines.append(
            f"- detectably lower than the best pure GPTQ: at {len(det)} of {len(wg)} budgets where one fits "
            f"({', '.join(pct(r['budget']) for r in det) or 'none'}), i.e. {len(det)} of all {nb} budgets; "
            f"target half or more of the budgets: {'met' if 2 * len(det) >= nb else 'missed'} "
            f"({len(det)} vs {(nb + 1) // 2} needed)."
        )
        for r in t["low"]:
            ok = r["kl"] is not None and r["kl"] <= TARGET_LOW_KL
            lines.append(
                f"- KL ≤ {TARGET_LOW_KL} at {100 * r['budget']:g} %: {_g(r['kl'])}, "
                + (
                    "met" + f" ({_g(TARGET_LOW_KL - r['kl'])} below)"
                    if ok
                    else f"missed by {_g(r['kl'] - TARGET_LOW_KL)}"
                )
                + "."
            )
        worse = [c for c in fx["comparisons"] if c["verdict"] == "B better"]
        fits = {r["budget"] for r in wg}
        if worse:
            lines.append(
                "- where `auto` is detectably worse: "
                + "; ".join(f"`{c['a']}` vs `{c['b']}` (Δ KL +{_g(c['delta'])})" for c in worse)
                + f". {len(worse)} of {len(fx['comparisons'])} comparisons, {sum(c['budget'] not in fits for c in worse)} "
                "of them at budgets where no uniform width fits; the arms that beat it, by family: "
                + ", ".join(
                    f"{fam} {n}" for fam, n in sorted(Counter(by[c["b"]]["family"] for c in worse).items())
                )
                + " (docs/auto.md discusses why, with the run it describes)."
            )
        sp = fx["spearman"]
        within = []
        for key in sorted({(r["layer"], r["slot"]) for r in sp["single"] if r["quant"]}):
            rs = [r for r in sp["single"] if r["quant"] and (r["layer"], r["slot"]) == key]
            if len({r["kl"] for r in rs}) > 1 and len({r["error"] for r in rs}) > 1:
                within.append(_spearman([r["error"] for r in rs], [r["kl"] for r in rs]))
        sp["spearman_quant_widths_within_slot"] = sum(within) / len(within) if within else None
        sp["slots_within"] = len(within)
        lines += [
            "",
            f"Estimator ranking on held-out windows ({sp['heldout']}; estimated loss × per-kind sensitivity "
            f"vs measured KL): {sp['n_quant']} single-slot quantized keeps ρ = {_g(sp['spearman_quant_single'])}; "
            f"the 4 bit widths within one slot, mean ρ = {_g(sp['spearman_quant_widths_within_slot'])} over "
            f"{sp['slots_within']} slots (slots no held-out token reaches excluded); all "
            f"{sp['n_single']} single-slot candidates (structure and bits together) ρ = "
            f"{_g(sp['spearman_all_single'])}; whole-layer uniform-bit states ρ = "
            f"{_g(sp['spearman_uniform_layer_states'])}. Plan build time at 50 % (`auto-50`, export excluded): "
            f"{_g(by['auto-50']['compress_seconds'])} s (`auto16-50`: {_g(by['auto16-50']['compress_seconds'])} s).",
            "",
        ]
    lines.append(f"![quality vs bytes](benchmarks/results/{PLOT.name})")
    return "\n".join(lines) + "\n"


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.NullFormatter

    style = {
        "auto": ("tab:green", "o", "-"),
        "auto 16-bit": ("tab:red", "s", "-"),
        "pure GPTQ": ("tab:blue", "^", "--"),
        "pure RTN": ("tab:gray", "v", "--"),
        "REAP + GPTQ": ("tab:orange", "D", ":"),
        "PuzzleMoE (own q-bit pairs)": ("tab:purple", "P", ""),
    }
    fig, axes = plt.subplots(
        1, len(results["fixtures"]), figsize=(6.5 * len(results["fixtures"]), 5), squeeze=False
    )
    for ax, fx in zip(axes[0], results["fixtures"]):
        for fam, (color, marker, ls) in style.items():
            pts = sorted(
                [r for r in fx["arms"] if r["family"] == fam and r["kl"] and r["kl"] > 0],
                key=lambda r: r["routed_fraction"],
            )
            ax.plot(
                [100 * r["routed_fraction"] for r in pts],
                [r["kl"] for r in pts],
                color=color,
                marker=marker,
                linestyle=ls,
                label=fam,
                markersize=5,
            )
        for p in BUDGETS:
            ax.axvline(100 * p, color="k", alpha=0.12, linewidth=0.8)
        ax.axhline(TARGET_LOW_KL, color="tab:green", alpha=0.3, linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([100 * p for p in BUDGETS])
        ax.set_xticklabels([f"{100 * p:g}" for p in BUDGETS])
        ax.set_xlabel("routed-expert bytes, % of the original (bf16)")
        ax.set_ylabel("KL to the original, held-out (log)")
        ax.set_title(fx["fixture"])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["run", "report"])
    p.add_argument("--fixtures", nargs="*", default=list(FIXTURES))
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench_auto_bits")
    a = p.parse_args()
    if a.command == "run":
        run(a.fixtures, a.max_tokens, a.out)
        return
    from _bench_md import write_section

    if not RESULTS.is_file():
        sys.exit(
            f"{RESULTS.relative_to(ROOT)} is missing; run `python benchmarks/bench_auto_bits.py run` first."
        )
    results = json.loads(RESULTS.read_text())
    plot(results)
    write_section(SECTION, markdown(results))


if __name__ == "__main__":
    main()
