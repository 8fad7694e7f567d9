"""Issue 9 benchmark: `auto` (budget-optimal mixed representations) against single-method arms, and how
well its loss estimator ranks candidates against measured KL on held-out text.

Two parts per fixture (qwen3-moe-tiny, olmoe-tiny):

* ``spearman`` — calibrate on ``fixture-calib:64`` (the calibration fold), then measure on held-out text
  (``fixture-heldout``, a fold the statistics never saw) the KL to the original of (a) single-slot
  changes: every candidate of a seeded sample of slots in every layer, the rest of the model untouched;
  (b) whole-layer frontier states of every layer; (c) whole auto plans at several budgets. Reports the
  Spearman correlation of estimated vs measured KL with the probe sensitivity (default), the Gaussian
  noise sensitivity and none (uniform), and the gate²-weighted moments vs the mean-g² × unweighted
  approximation (drop/constant/tilt candidates).
* ``compare`` — `moecompress.compare.run_compare` with one recipe: auto at 50 % and 25 % of the routed-expert
  bytes and single-method arms at the same reduction (equal bytes, or more for operator arms) plus the
  operator arms byte-matched (suffix ``m``: the most experts kept within auto's budget, equal or fewer
  bytes), exported, reloaded and evaluated
  on the same held-out windows; KL per window paired-bootstrapped (auto minus arm, Holm over all pairs);
  the per-layer histogram of the representations auto chose.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_auto.py --fixture olmoe-tiny --out build/bench_auto
    python benchmarks/bench_auto.py --report benchmarks/results/auto --write  # BENCHMARKS.md from committed results
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

SECTION = "## Budget-optimal auto (issue 9)"
CALIB_SPEC = "fixture-calib:64"  # the calibration fold every part uses (`calibrated`)


def calibrated(path: str, out: Path, stats: list[str]):
    """A stats store on fixture-calib:64 holding `stats` (reused when an earlier run already holds them)."""
    from moecompress.calibrate import StatsStore, calibrate

    if (out / "stats.json").is_file():
        store = StatsStore.load(out)
        if store.has(*stats):
            return store
    return calibrate(
        path,
        CALIB_SPEC,
        seq_len=256,
        out=out,
        stats=stats,
        batch_size=8,
        dtype="float32",
        progress=False,
        overwrite=True,
    )


EXTRA_STATS = [
    "out_mean",
    "out_var",
    "moment_experts",
    "moment_count",
    "moment_in_mean",
    "moment_out_mean",
    "input_moment",
    "cross_moment",
]


def spearman(a, b) -> float:
    import numpy as np
    from scipy.stats import spearmanr

    if len(a) < 3:
        return float("nan")
    return float(spearmanr(np.asarray(a, dtype=float), np.asarray(b, dtype=float)).statistic)


def _stream_ids(stream) -> torch.Tensor:
    for name in ("ids", "input_ids", "tokens"):
        if hasattr(stream, name):
            return getattr(stream, name)
    raise AttributeError("TokenStream has no token tensor")


# ----------------------------------------------------------------------------- part A: estimator ranking
def run_spearman(
    fixture: str, out: Path, slots_per_layer: int = 6, windows: int = 8, seq_len: int = 256, seed: int = 0
) -> dict:
    from moecompress.data import load_tokenizer
    from moecompress.data.stream import token_stream
    from moecompress.methods.auto.config import AutoConfig, needs_stats
    from moecompress.methods.auto.estimate import affine_loss, constant_loss, drop_loss
    from moecompress.methods.auto.frontier import keep_point_of, remap_to
    from moecompress.methods.auto.measure import logprobs
    from moecompress.methods.auto.moments import approximate_moments
    from moecompress.methods.auto.sensitivity import measure_states
    from moecompress.methods.auto.setup import prepare
    from moecompress.methods.auto.solver import Candidate, LayerPoint, allocate
    from moecompress.models import MoEAdapter, load_model
    from moecompress.testing import fixture_dir

    path = fixture if Path(fixture).is_dir() else str(fixture_dir(fixture))
    tok = load_tokenizer(path)
    t0 = time.perf_counter()
    store = calibrated(
        path, out / f"stats-{Path(fixture).name}", needs_stats(AutoConfig(search="full")) + EXTRA_STATS
    )
    calib_s = time.perf_counter() - t0
    stream = _stream_ids(token_stream("fixture-heldout", tok))
    n = len(stream) // seq_len
    step = max(1, n // windows)
    held = torch.stack(
        [stream[k * step * seq_len : (k * step + 1) * seq_len] for k in range(min(windows, n))]
    )

    adapter = MoEAdapter(load_model(path, dtype="float32"))
    t0 = time.perf_counter()
    setup = prepare(
        AutoConfig(budget=0.5, budget_scope="routed", search="full"), adapter, store, keep_tensors=True
    )  # the default: per-(layer, kind) sensitivity
    prepare_s = time.perf_counter() - t0
    lay = prepare(
        AutoConfig(budget=0.5, budget_scope="routed", sensitivity="probe", search="full"),
        adapter,
        store,
        keep_tensors=True,
    )  # per-layer probe (+ noise)
    info, problems = setup.info, setup.problems
    held_ref = logprobs(adapter.model, held)

    def measure(states):
        return measure_states(adapter, info, states, held, held_ref)

    # (a) single-slot changes: every candidate of a sample of slots, the pair of each with its nearest partner
    rng = random.Random(seed)
    rows = []
    for i, prob in problems.items():
        m = setup.moments[i]
        approx = approximate_moments(store, i)
        kept_all = list(range(prob.num_experts))
        for e in sorted(rng.sample(kept_all, min(slots_per_layer, prob.num_experts))):
            cands = [c for c in prob.options[e] if c.kind != "keep"]
            r = remap_to(prob, e, kept_all)
            if r is not None:
                cands.append(r)
            for c in cands:
                choice = list(keep_point_of(info.layer(i)).choice)
                choice[e] = c
                mode = f"reroute:{c.gate}" if c.kind == "reroute" else "replace"
                pt = LayerPoint(mode, choice, prob.bytes_of(choice), c.loss)
                row = dict(
                    layer=i,
                    slot=e,
                    kind=c.label + (f"-{c.gate}" if c.gate else ""),
                    error=c.error,
                    kind_kl=c.loss,
                    kl=measure({i: pt}),
                )
                if c.kind in (
                    "drop",
                    "constant",
                    "tilt",
                ):  # in-sample, gate²-weighted vs mean-g² approximation
                    if c.kind == "drop":
                        row["insample"], row["approx"] = drop_loss(m, e), drop_loss(approx, e)
                    elif c.kind == "constant":
                        v = next(iter(c.tensors.values()))
                        row["insample"], row["approx"] = (
                            constant_loss(m, e, v),
                            constant_loss(approx, e, v),
                        )
                    else:
                        t = {k.rsplit(".", 1)[1]: v.double() for k, v in c.tensors.items()}
                        mat = t["U"] @ t["V"].T
                        row["insample"] = affine_loss(m, e, t["bias"], mat)
                        row["approx"] = affine_loss(approx, e, t["bias"], mat)
                rows.append(row)
            for pref in [p for p in prob.pairs if e in p.members][:1]:
                a, b = pref.members
                choice = list(keep_point_of(info.layer(i)).choice)
                choice[a] = Candidate("pair", pref.losses[0], b, pref.nbytes // 2, op=pref)
                choice[b] = Candidate("pair", pref.losses[1], a, pref.nbytes - pref.nbytes // 2, op=pref)
                pt = LayerPoint("replace", choice, prob.bytes_of(choice), sum(pref.losses))
                rows.append(
                    dict(
                        layer=i,
                        slot=e,
                        kind="pair",
                        error=sum(pref.losses),
                        kind_kl=sum(pref.losses) * pref.scale,
                        kl=measure({i: pt}),
                    )
                )
    # (b) whole-layer frontier states: about five per layer, spread over the bytes
    layer_rows = []
    for i, front in setup.fronts.items():
        lossy = [p for p in front if p.loss > 0]
        for k in sorted({round(x * (len(lossy) - 1) / 4) for x in range(5)}) if lossy else []:
            pt = lossy[k]
            layer_rows.append(
                dict(
                    layer=i,
                    bytes=pt.bytes,
                    error=sum(c.error for c in pt.choice),
                    kind_kl=pt.loss,
                    kl=measure({i: pt}),
                )
            )
    # (c) whole plans at several budgets, allocated with each sensitivity
    plan_rows = []
    for budget in (0.25, 0.35, 0.5, 0.65, 0.8):
        b = int(budget * info.expert_bytes)
        for name, su in (("kind", setup), ("probe", lay)):
            idx = allocate(su.fronts, su.sens, b)
            states = {i: su.fronts[i][k] for i, k in idx.items()}
            plan_rows.append(
                dict(
                    budget=budget,
                    sensitivity=name,
                    est_kl=sum(states[i].loss * su.sens[i] for i in states),
                    kl=measure(states),
                )
            )

    def rho(rows, key, scale=None):
        return spearman(
            [r[key] * (1.0 if scale is None else scale[r["layer"]]) for r in rows], [r["kl"] for r in rows]
        )

    within = [rho([r for r in rows if r["layer"] == i], "kind_kl") for i in problems]
    sub = [r for r in rows if "approx" in r]
    result = dict(
        fixture=fixture,
        calib_seconds=round(calib_s, 1),
        prepare_seconds=round(prepare_s, 1),
        heldout=f"fixture-heldout, {len(held)} windows x {seq_len} tokens",
        n_single=len(rows),
        sensitivity={
            str(i): dict(kind=setup.kind_sens[i], probe=lay.sens[i], noise=lay.noise_sens[i])
            for i in problems
        },
        spearman_single=dict(
            kind=rho(rows, "kind_kl"),
            probe=rho(rows, "error", lay.sens),
            noise=rho(rows, "error", lay.noise_sens),
            uniform=rho(rows, "error"),
            within_layer_mean=sum(within) / len(within),
        ),
        spearman_weighting=dict(
            n=len(sub),
            cross_fitted=rho(sub, "error", lay.sens),
            weighted=rho(sub, "insample", lay.sens),
            approx=rho(sub, "approx", lay.sens),
        ),
        spearman_layer_states=dict(
            n=len(layer_rows),
            kind=rho(layer_rows, "kind_kl"),
            probe=rho(layer_rows, "error", lay.sens),
            noise=rho(layer_rows, "error", lay.noise_sens),
            uniform=rho(layer_rows, "error"),
        ),
        plans=plan_rows,
        single=rows,
        layer_states=layer_rows,
    )
    kind_plans = [r for r in plan_rows if r["sensitivity"] == "kind"]
    result["spearman_plans"] = spearman([r["est_kl"] for r in kind_plans], [r["kl"] for r in kind_plans])
    return result


# ----------------------------------------------------------------------------- part B: arms
def matched_ratio(info, level: int, op_elems: int) -> float:
    """The smallest uniform reduction whose plan (K kept experts + (E − K) operators of `op_elems` values per
    layer) fits in `level` % of the routed bytes: a byte-matched single-method arm (equal or fewer bytes; when
    even K = top-k does not fit, K = top-k, the fewest bytes the method allows)."""
    li = info.layers[0]
    e, b = li.num_experts, li.bytes_per_expert
    op = op_elems * info.element_size
    budget = (level * e * b) // 100
    fits = [kk for kk in range(li.top_k, e + 1) if kk * b + (e - kk) * op <= budget]
    return (
        1 - (max(fits) if fits else li.top_k) / e
    )  # prune keeps at least top-k: then the fewest bytes it allows


def arms_for(level: int, with_puzzle: bool, info) -> list[dict]:
    """auto at `level` % of routed bytes; single-method arms removing (100 − level) % of the experts (equal bytes,
    or more for operator arms), and the operator arms again byte-matched (suffix 'm': equal or fewer bytes)."""
    ratio = 1 - level / 100
    h = info.hidden_size
    inter = info.layers[0].intermediate_size
    width = min((32 * 2 * h) // (3 * h), inter)
    arms = [
        dict(
            name=f"auto-{level}",
            method="auto",
            params=dict(budget=level / 100, budget_scope="routed", search="full"),
        ),
        dict(
            name=f"reap-keep-{level}", method="prune", params=dict(criterion="reap", ratio=ratio, gate="keep")
        ),
        dict(
            name=f"freq-renorm-{level}",
            method="prune",
            params=dict(criterion="frequency", ratio=ratio, gate="renorm"),
        ),
        dict(
            name=f"doacp-keep-{level}",
            method="prune",
            params=dict(criterion="do-acp", ratio=ratio, gate="keep"),
        ),
        dict(
            name=f"reap-remap-{level}",
            method="prune",
            params=dict(criterion="reap", ratio=ratio, operator="remap"),
        ),
        dict(name=f"conmoe-local-{level}", method="conmoe", params=dict(ratio=ratio, scope_size=1)),
        dict(name=f"m-smoe-{level}", method="m-smoe", params=dict(ratio=ratio)),
        dict(name=f"hc-smoe-{level}", method="hc-smoe", params=dict(ratio=ratio)),
    ]
    ops = [
        ("mone-const", dict(criterion="mone", operator="constant"), h),
        ("mone-tilt32", dict(criterion="mone", operator="tilt", rank=32), 2 * h * 32 + h),
        ("reap-partial32", dict(criterion="reap", operator="partial", rank=32), 3 * width * h + h),
    ]
    for name, params, elems in ops:
        arms.append(dict(name=f"{name}-{level}", method="prune", params=dict(params, ratio=ratio)))
        m = matched_ratio(info, level, elems)
        if abs(m - ratio) > 1e-9:
            arms.append(dict(name=f"{name}-{level}m", method="prune", params=dict(params, ratio=m)))
    if with_puzzle:
        # a packed pair stores one 16-bit word per weight for both experts: pairs·pair_bytes + rest·B fits the level
        li = info.layers[0]
        e, b = li.num_experts, li.bytes_per_expert
        pair = 2 * b * 2 // (2 * info.element_size)  # bytes of one packed pair
        fits = [n for n in range(e // 2 + 1) if (e - 2 * n) * b + n * pair <= level * e * b // 100]
        if (
            fits
        ):  # none when even pairing every expert stores more than the level (no arm then, not a 50 % one)
            arms.append(dict(name=f"puzzlemoe-{level}m", method="puzzlemoe", params=dict(ratio=fits[0] / e)))
    return arms


def run_compare_part(fixture: str, out: Path, max_tokens: int = 16384) -> dict:
    from moecompress.compare import run_compare
    from moecompress.eval.stats import apply_holm, paired_bootstrap
    from moecompress.methods.registry import METHODS, _load_builtin_methods
    from moecompress.models import load_model
    from moecompress.plan import ModelInfo
    from moecompress.recipe import parse_recipe
    from moecompress.testing import fixture_dir

    _load_builtin_methods()
    puzzle = "puzzlemoe" in METHODS
    path = fixture if Path(fixture).is_dir() else str(fixture_dir(fixture))
    info = ModelInfo.from_model(load_model(path, dtype="float32"))
    arms = arms_for(50, puzzle, info) + arms_for(25, puzzle, info)
    # one calibration for every arm, kept beside the results (reruns reuse it); every arm's plan is built
    # once before the long run so that a bad arm fails in seconds, not after an hour of evaluation
    from moecompress.models import MoEAdapter
    from moecompress.workflows.pipeline import build_plan, needs_for

    needs = sorted({n for a in arms for n in needs_for(a["method"], a["params"])})
    stats_dir = out / f"stats-compare-{Path(fixture).name}"
    store = calibrated(path, stats_dir, needs)
    for a in arms:
        if a["method"] != "auto":
            build_plan(MoEAdapter(load_model(path, dtype="float32")), a["method"], a["params"], store)
    recipe = parse_recipe(
        dict(
            model=fixture if Path(fixture).is_dir() else f"fixture:{fixture}",
            calibration=dict(data=str(stats_dir), seq_len=256, seed=0),
            eval=dict(
                ppl="fixture-heldout",
                window=256,
                max_tokens=max_tokens,
                tasks=[],
                latency=False,
                quant_baselines=[],
            ),
            arms=arms,
        ),
        where="bench_auto",
    )
    dest = out / f"compare-{Path(fixture).name}"
    t0 = time.perf_counter()
    res = run_compare(
        recipe, dest, overwrite=True, progress=False, pairs=[(a["name"], "original") for a in arms]
    )
    seconds = time.perf_counter() - t0
    by = {a["name"]: a for a in res["arms"]}
    stream = next(k for k in by["original"]["metrics"] if k.startswith("ppl:"))

    def kl_items(name):
        items = by[name]["metrics"][stream]["items"]
        return items["ids"], items["kl"]

    comps, table = [], []
    for level in (50, 25):
        auto = f"auto-{level}"
        ia, ka = kl_items(auto)
        for arm in [
            a["name"] for a in arms if a["name"].rstrip("m").endswith(f"-{level}") and a["name"] != auto
        ]:
            ib, kb = kl_items(arm)
            r = paired_bootstrap(
                ia, ka, ib, kb, metric="kl", higher_is_better=False, B=4000, seed=0
            ).to_dict()
            r.pop("per_task", None)
            comps.append(dict(r, a=auto, b=arm, level=level))
    apply_holm(comps, 0.05)
    for a in res["arms"]:
        agg = a["metrics"][stream]["aggregate"]
        ids, kls = kl_items(a["name"])
        table.append(
            dict(
                name=a["name"],
                method=a["method"],
                bytes=a["bytes"].get("model"),
                weights=a["bytes"].get("weights"),
                kl=agg.get("kl"),
                ppl=agg.get("ppl"),
                compress_seconds=a.get("compress_seconds"),
                window_ids=list(ids),
                window_kl=[float(x) for x in kls],
            )
        )  # what the bootstrap paired
    hist = {}
    for level in (50, 25):
        plan = json.loads((dest / "checkpoints" / f"auto-{level}" / "plan.json").read_text())
        hist[level] = plan["params"]["auto"]
    return dict(
        fixture=fixture,
        seconds=round(seconds, 1),
        arms=table,
        comparisons=comps,
        auto=hist,
        windows=len(kl_items("original")[0]),
        puzzle=puzzle,
    )


# ----------------------------------------------------------------------------- report
def _f(x, nd=4):
    return "—" if x is None else (f"{x:.{nd}g}" if isinstance(x, float) else str(x))


def markdown(results: dict) -> str:
    lines = [
        SECTION,
        "",
        "Measured by `python -m benchmarks auto` (`benchmarks/bench_auto.py`, fp32 compute); results "
        "`benchmarks/results/auto/results-<fixture>.json` (per-window KL included). Calibration "
        f"`{CALIB_SPEC}`; every KL is KL(original ‖ compressed) on `fixture-heldout` windows the statistics "
        "never saw. Budgets are fractions of the original routed-expert bytes, counted as the compact "
        "checkpoint stores them. How `auto` chooses, and why its estimate and the measurement can part: "
        "docs/auto.md.",
        "",
    ]
    comps = [(f, c) for f, r in results.items() for c in (r.get("compare") or {}).get("comparisons", [])]
    if comps:
        won = [(f, c) for f, c in comps if c["verdict"] == "A better"]
        worst = max(c.get("p_adjusted") or 1 for _, c in comps)
        levels = sorted({c["level"] for _, c in comps}, reverse=True)
        more = []  # bytes an arm that auto beat holds beyond auto
        for f, c in won:
            arms = {x["name"]: x for x in results[f]["compare"]["arms"]}
            more.append(arms[c["b"]]["bytes"] - arms[c["a"]]["bytes"])
        summary = (
            f"**Summary.** `auto` has lower KL to the original than the single-method arm in {len(won)} of "
            f"{len(comps)} paired comparisons ({len(results)} fixture(s), levels "
            f"{', '.join(f'{lv} %' for lv in levels)}; largest Holm-adjusted p = {worst:.3g})"
        )
        if more:
            summary += (
                f"; the arms it beat hold between {min(more) / 1e6:+.2f} MB and {max(more) / 1e6:+.2f} MB "
                "relative to auto"
            )
        widths = sorted(
            {
                int(b)
                for r in results.values()
                for h in (r.get("compare") or {}).get("auto", {}).values()
                for row in h["layers"]
                for b in row.get("bits", {"16": 1})
            },
            reverse=True,
        )
        if widths != [16]:  # say what differs between the arms: structure × bits against structure alone
            summary += (
                f". What differs: `auto` chose structure and bits (its plans store experts at "
                f"{', '.join(map(str, widths))} bits) while every single-method arm stores 16-bit experts, "
                "so this is structure × bits against structure alone; `auto` against quantization is the "
                'section "auto over structure × bits"'
            )
        rhos = [
            v
            for r in results.values()
            if r.get("spearman")
            for v in (
                r["spearman"]["spearman_single"]["kind"],
                r["spearman"]["spearman_layer_states"]["kind"],
                r["spearman"]["spearman_plans"],
            )
            if isinstance(v, (int, float))
        ]
        if rhos:
            summary += (
                f". Its estimator ranks single-slot candidates, whole-layer states and whole plans on "
                f"held-out text with Spearman ρ between {min(rhos):.2f} and {max(rhos):.2f} (tables below)"
            )
        lost = [(f, c) for f, c in comps if c["verdict"] != "A better"]
        if lost:

            def _arm_bytes(f, c):
                arms = {x["name"]: x for x in results[f]["compare"]["arms"]}
                return arms[c["b"]]["bytes"] - arms[c["a"]]["bytes"]

            summary += ". Not won: " + "; ".join(
                f"{c['b']} on {f} ({c['verdict'].replace('A better', 'auto better').replace('B better', 'arm better')}, "
                f"Δ KL {c['delta']:+.3g}, Holm p = {c.get('p_adjusted') or float('nan'):.3g}, arm bytes "
                f"{_arm_bytes(f, c) / 1e6:+.2f} MB vs auto)"
                for f, c in lost
            )
        lines += [summary + ".", ""]
    for f, r in results.items():
        c = r.get("compare") or {}
        names = {x["name"] for x in c.get("arms", [])}
        missing = [
            lv
            for lv in sorted({x["level"] for x in c.get("comparisons", [])}, reverse=True)
            if c.get("puzzle") and f"puzzlemoe-{lv}m" not in names
        ]
        if missing:
            lines += [
                f"{f}: no PuzzleMoE arm at {', '.join(f'{lv} %' for lv in missing)}: a packed pair stores two "
                "experts in the bytes of one, so even pairing every expert keeps more than that.",
                "",
            ]
    ratios = []  # estimated / measured held-out plan KL, per fixture and budget (default sensitivity)
    for f, r in results.items():
        for p in (r.get("spearman") or {}).get("plans", []):
            if p.get("sensitivity") == "kind" and p.get("kl"):
                ratios.append((f, p["budget"], p["est_kl"] / p["kl"], p["kl"]))
    if ratios:
        lo, hi = min(ratios, key=lambda t: t[2]), max(ratios, key=lambda t: t[2])
        lines += [
            f"Estimated ÷ measured held-out plan KL ranges from {lo[2]:.2f} ({lo[0]}, budget {lo[1]}, measured "
            f"KL {lo[3]:.3g}) to {hi[2]:.2f} ({hi[0]}, budget {hi[1]}, measured KL {hi[3]:.3g}); the "
            "per-budget rows are below.",
            "",
        ]
    for fixture, r in results.items():
        lines += [f"### {fixture}", ""]
        sp = r.get("spearman")
        if sp:
            s1, sw, sl = sp["spearman_single"], sp["spearman_weighting"], sp["spearman_layer_states"]
            lines += [
                f"**Estimator ranking** — Spearman ρ of estimated vs measured KL to the original on "
                f"{sp['heldout']} (held out from calibration):",
                "",
                "| what is ranked | n | per-(layer, kind) probe (default) | per-layer probe | per-layer noise "
                "| none |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
                f"| single-slot candidates, all layers and kinds | {sp['n_single']} | {_f(s1['kind'], 3)} | "
                f"{_f(s1['probe'], 3)} | {_f(s1['noise'], 3)} | {_f(s1['uniform'], 3)} |",
                f"| whole-layer frontier states | {sl['n']} | {_f(sl['kind'], 3)} | {_f(sl['probe'], 3)} | "
                f"{_f(sl['noise'], 3)} | {_f(sl['uniform'], 3)} |",
                "",
                f"Within a layer the mean ρ is {_f(s1['within_layer_mean'], 3)}. On the {sw['n']} "
                f"drop/constant/tilt candidates (per-layer probe scale): cross-fitted gate²-weighted losses "
                f"ρ = {_f(sw['cross_fitted'], 3)}, in-sample gate²-weighted {_f(sw['weighted'], 3)}, in-sample "
                f"mean-g² × unweighted approximation {_f(sw['approx'], 3)}. Whole auto plans at budgets "
                f"{min(p['budget'] for p in sp['plans'])}–{max(p['budget'] for p in sp['plans'])}: "
                f"ρ = {_f(sp['spearman_plans'], 3)}.",
                "",
                "| budget | est. KL (kind) | measured KL (kind) | est. KL (layer probe) | measured KL (layer "
                "probe) |",
                "| ---: | ---: | ---: | ---: | ---: |",
            ]
            by = {(p["budget"], p["sensitivity"]): p for p in sp["plans"]}
            for bud in sorted({p["budget"] for p in sp["plans"]}):
                k, q = by[(bud, "kind")], by[(bud, "probe")]
                lines.append(
                    f"| {bud} | {_f(k['est_kl'])} | {_f(k['kl'])} | {_f(q['est_kl'])} | {_f(q['kl'])} |"
                )
            lines.append("")
        cp = r.get("compare")
        if cp:
            n_boot = cp["comparisons"][0].get("B") if cp["comparisons"] else None
            lines += [
                f"**Against single-method arms** ({cp['windows']} held-out windows; paired "
                f"bootstrap of per-window KL, B = {n_boot}, Holm over all pairs; Δ = auto − arm, negative = "
                "auto better):",
                "",
                "| level | arm | model bytes | vs auto bytes | KL | Δ KL vs auto [95 % CI] | p (Holm) | verdict |",
                "| --- | --- | ---: | ---: | ---: | --- | ---: | --- |",
            ]
            arms = {a["name"]: a for a in cp["arms"]}
            for level in (50, 25):
                auto = arms[f"auto-{level}"]
                lines.append(
                    f"| {level} % | **auto-{level}** | {auto['bytes']:,} | | **{_f(auto['kl'])}** | | | |"
                )
                for c in [c for c in cp["comparisons"] if c["level"] == level]:
                    a = arms[c["b"]]
                    rel = a["bytes"] - auto["bytes"]
                    lines.append(
                        f"| {level} % | {c['b']} | {a['bytes']:,} | {'+' if rel > 0 else ''}{rel:,} | "
                        f"{_f(a['kl'])} | {_f(c['delta'], 3)} "
                        f"[{_f(c['ci_low'], 3)}, {_f(c['ci_high'], 3)}] | {_f(c.get('p_adjusted'), 3)} | "
                        f"{c['verdict']} |"
                    )
            lines.append("")
            secs = {a["name"]: a.get("compress_seconds") for a in cp["arms"]}
            single = [v for k, v in secs.items() if v is not None and not k.startswith("auto")]
            lines += [
                f"Plan build time (calibration excluded; estimation, sensitivity forwards, allocation, "
                f"measurement): auto-50 {_f(secs.get('auto-50'), 3)} s, auto-25 {_f(secs.get('auto-25'), 3)} s"
                + (f" (single-method arms at most {max(single):.2f} s)" if single else "")
                + f". The whole comparison took {cp['seconds']:.0f} s.",
                "",
            ]
            for level in (50, 25):
                h = cp["auto"][level] if level in cp["auto"] else cp["auto"][str(level)]
                lines += [
                    f"auto-{level} per layer (routed bytes {h['routed_bytes']:,} of budget "
                    f"{h['budget_routed_bytes']:,}; estimated KL {_f(h['est_kl'])}, measured on calibration "
                    f"tokens {_f(h.get('measured_kl'))}):",
                    "",
                    "| layer | gate | representations chosen | est. KL | measured KL (layer alone) |",
                    "| ---: | --- | --- | ---: | ---: |",
                ]
                for row in h["layers"]:
                    ch = ", ".join(f"{k} × {v}" for k, v in row["choices"].items())
                    lines.append(
                        f"| {row['layer']} | {row['gate']} | {ch} | {_f(row['est_kl'])} | "
                        f"{_f(row.get('measured_kl'))} |"
                    )
                lines.append("")
    return "\n".join(lines) + "\n"


def write_benchmarks(text: str, path: Path) -> None:
    from _bench_md import write_section

    write_section(SECTION, text, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", action="append", default=None)
    ap.add_argument("--out", type=Path, default=Path("build/bench_auto"))
    ap.add_argument("--part", choices=["all", "spearman", "compare"], default="all")
    ap.add_argument("--report", type=Path, default=None, help="only render results.json files under this dir")
    ap.add_argument("--write", action="store_true", help="update the BENCHMARKS.md section")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = args.out  # scratch: stats stores, compare reports
    res_dir = args.report or Path(__file__).resolve().parent / "results" / "auto"  # committed results
    res_dir.mkdir(parents=True, exist_ok=True)
    if args.report is None:
        out.mkdir(parents=True, exist_ok=True)
        for fixture in args.fixture or ["olmoe-tiny", "qwen3-moe-tiny"]:
            file = res_dir / f"results-{Path(fixture).name}.json"
            res = json.loads(file.read_text()) if file.exists() else {}
            if args.part in ("all", "spearman"):
                res["spearman"] = run_spearman(fixture, out)
                file.write_text(json.dumps(res, indent=1))
            if args.part in ("all", "compare"):
                res["compare"] = run_compare_part(fixture, out)
                file.write_text(json.dumps(res, indent=1))
    results = {
        f.stem.removeprefix("results-"): json.loads(f.read_text())
        for f in sorted(res_dir.glob("results-*.json"))
    }
    text = markdown(results)
    print(text)
    if args.write:
        write_benchmarks(text, Path(__file__).resolve().parents[1] / "BENCHMARKS.md")


if __name__ == "__main__":
    main()
