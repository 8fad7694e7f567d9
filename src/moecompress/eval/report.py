"""report.md + PNG plots + results.json from a results dict (schema in `schema.py`).

Every report prints the five-item reporting checklist; an item the results do not support is
listed as MISSING with what would satisfy it, never left out.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic import human_bytes
from ..errors import MoECompressError
from .schema import SCHEMA, Arm, Results, arm_bytes, validate_results
from .stats import apply_holm, paired_bootstrap_tasks

AVERAGE = "task average"

CHECKLIST_TITLES = (
    "Router convention of the model and the gate semantics each arm used",
    "Replacement operators compared on a fixed mask",
    "At least one generative task",
    "Calibration domain, source and token count",
    "Matched-storage quantization baseline (RTN, group-wise, symmetric, 4/3-bit on routed experts)",
)


# ----------------------------------------------------------------------------------- comparisons
def min_replicates(m: int, alpha: float = 0.05) -> int:
    """Default B: at least 1000 and enough that Holm over m comparisons can reach significance.

    The smallest bootstrap p is 2/(B+1), and Holm multiplies the smallest p by m, so B must exceed
    2m/alpha - 1 for any verdict to be possible; we take 4x that margin.
    """
    return max(1000, math.ceil(8 * m / alpha))


def compare_arms(
    results: dict | Results,
    pairs: Sequence[tuple[str, str]] | None = None,
    *,
    B: int | None = None,
    seed: int = 0,
    alpha: float = 0.05,
) -> list[dict]:
    """Paired bootstrap of every (A, B) pair (default: each arm vs the baseline) on every shared task.

    Per pair: one comparison per task on its primary metric (perplexity streams: per-window mean
    nll), plus the task average over the lm-eval tasks when there are two or more with the same
    direction. Holm correction runs over all comparisons returned (one family). B defaults to
    `min_replicates(number of comparisons, alpha)`; every comparison uses the same `seed`.
    """
    res = results if isinstance(results, Results) else validate_results(results)
    arms = {a.name: a for a in res.arms}
    if pairs is None:
        pairs = [(a.name, res.baseline) for a in res.arms if a.name != res.baseline]
    jobs: list[
        tuple
    ] = []  # (a, b, task label, {task: (ids, vals)} for A, same for B, metric, higher_is_better)
    for na, nb in pairs:
        for n in (na, nb):
            if n not in arms:
                raise MoECompressError(f"No arm named '{n}' in the results; arms are {', '.join(arms)}.")
        a, b = arms[na], arms[nb]
        lm_tasks = {}
        for t in [t for t in a.metrics if t in b.metrics]:
            ea, eb = a.metrics[t], b.metrics[t]
            metric = ea.primary
            if metric not in ea.items or metric not in eb.items:
                continue
            hib = ea.higher_is_better.get(metric, True)
            jobs.append(
                (
                    na,
                    nb,
                    t,
                    {t: (ea.items["ids"], ea.items[metric])},
                    {t: (eb.items["ids"], eb.items[metric])},
                    metric,
                    hib,
                )
            )
            if ea.output_type != "perplexity":
                lm_tasks[t] = (metric, hib)
        if len(lm_tasks) >= 2 and len({h for _, h in lm_tasks.values()}) == 1:
            ta = {t: (a.metrics[t].items["ids"], a.metrics[t].items[m]) for t, (m, _) in lm_tasks.items()}
            tb = {t: (b.metrics[t].items["ids"], b.metrics[t].items[m]) for t, (m, _) in lm_tasks.items()}
            jobs.append((na, nb, AVERAGE, ta, tb, "primary", next(iter(lm_tasks.values()))[1]))
    B = B if B is not None else min_replicates(len(jobs), alpha)
    out: list[dict] = []
    for na, nb, label, ta, tb, metric, hib in jobs:
        r = paired_bootstrap_tasks(
            ta, tb, metric=metric, higher_is_better=hib, B=B, seed=seed, alpha=alpha
        ).to_dict()
        r.pop("per_task")
        out.append(dict(r, a=na, b=nb, task=label, **({"tasks": list(ta)} if label == AVERAGE else {})))
    apply_holm(out, alpha)
    return out


# ------------------------------------------------------------------------------------ checklist
def checklist(results: dict | Results) -> list[dict]:
    """The five reporting items: {"item", "title", "done", "detail"} (detail says what is missing)."""
    res = results if isinstance(results, Results) else validate_results(results)
    items = []

    # 1. router convention + gate semantics per arm
    conv = res.model.router_convention
    needs = [a for a in res.arms if a.kind != "original"]
    lacking = [a.name for a in needs if not a.gate_semantics]
    sem = "; ".join(f"{a.name}: {a.gate_semantics or 'not recorded'}" for a in needs) or "no compressed arms"
    if conv and not lacking:
        items.append((True, f"router: {conv}. Gate semantics — {sem}."))
    else:
        miss = ([] if conv else ["the model's router convention"]) + (
            [f"gate semantics of {', '.join(lacking)}"] if lacking else []
        )
        items.append((False, f"not recorded: {' and '.join(miss)}."))

    # 2. fixed-mask operator comparison: two or more arms sharing a mask with different operators
    by_mask: dict[str, set] = {}
    for a in res.arms:
        if a.mask_id:
            by_mask.setdefault(a.mask_id, set()).add(a.operator or "none")
    fixed = {m: ops for m, ops in by_mask.items() if len(ops) >= 2}
    if fixed:
        items.append(
            (
                True,
                "; ".join(f"mask {m[:12]}: operators {', '.join(sorted(ops))}" for m, ops in fixed.items())
                + ".",
            )
        )
    else:
        items.append(
            (
                False,
                "no two arms share a retained-expert mask (mask_id) with different replacement "
                "operators, so operator effects are confounded with mask effects.",
            )
        )

    # 3. a generative task
    gen = sorted({t for a in res.arms for t, e in a.metrics.items() if e.output_type == "generate_until"})
    items.append(
        (True, f"generative task(s): {', '.join(gen)}.")
        if gen
        else (
            False,
            "no generate_until task was evaluated (e.g. fixture_gen, gsm8k); multiple-choice accuracy "
            "alone can hide generation collapse.",
        )
    )

    # 4. calibration domain, source, token count
    cal = res.calibration
    fields = {
        "domain": cal.domain if cal else None,
        "source": cal.source if cal else None,
        "tokens": cal.tokens if cal else None,
    }
    missing = [k for k, v in fields.items() if v in (None, "")]
    own = [(a.name, c) for a in res.arms if (c := (a.model_extra or {}).get("calibration"))]
    each = "".join(
        f"; arm {n}: domain {c.get('domain')}, source {c.get('source')} ({c.get('origin')}), "
        f"{c.get('tokens') or 0:,} tokens"
        for n, c in own
    )
    if not missing:
        items.append((True, f"domain: {cal.domain}; source: {cal.source}; tokens: {cal.tokens:,}{each}."))
    elif own and cal is None:  # every arm calibrated on its own spec
        items.append((True, each.lstrip("; ") + "."))
    else:
        items.append((False, f"calibration {', '.join(missing)} not recorded{each}."))

    # 5. matched-storage quantization baseline
    quant = [a for a in res.arms if a.kind == "quant_baseline" and a.metrics]
    if quant:
        desc = []
        for a in quant:
            bpw = (a.model_extra or {}).get("bits_per_weight")
            size = arm_bytes(a)
            desc.append(f"{a.name} ({bpw:.3f} bits/weight incl. scales, " if bpw else f"{a.name} (")
            desc[-1] += f"{_human(size)})" if size is not None else "size not recorded)"
        items.append((True, "; ".join(desc) + "."))
    else:
        items.append(
            (
                False,
                "no evaluated pure-quantization arm (method 'quant', kind 'quant_baseline'); add "
                "eval.quant_baselines or an arm with method quant.",
            )
        )
    return [
        dict(item=i + 1, title=CHECKLIST_TITLES[i], done=d, detail=det) for i, (d, det) in enumerate(items)
    ]


def checklist_markdown(items: list[dict]) -> str:
    lines = []
    for it in items:
        mark = "done" if it["done"] else "MISSING"
        lines.append(f"{it['item']}. **{mark}** — {it['title']}: {it['detail']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- format
def _human(n: int | float | None) -> str:
    """A size as every verb prints it (`atomic.human_bytes`), "—" when unknown."""
    return "—" if n is None else human_bytes(n)


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.{digits}f}"
    return str(v)


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _task_columns(res: Results) -> list[tuple[str, str]]:
    cols: list[tuple[str, str]] = []
    for a in res.arms:
        for t, e in a.metrics.items():
            keys = ["ppl", "kl"] if e.output_type == "perplexity" else [e.primary]
            for m in keys:
                if m and m in e.aggregate and (t, m) not in cols:
                    cols.append((t, m))
    return cols


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        try:
            return _json_safe(x.item())
        except (TypeError, ValueError):
            pass
    if hasattr(x, "tolist"):
        return _json_safe(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def _write_atomic(path: Path, data: str | bytes) -> None:
    """`atomic.write_file`: complete or absent, fsynced, its temporary removed on any failure (a full disk)."""
    from ..atomic import write_file

    write_file(path, data)


def write_results(path: Path, results: dict) -> None:
    """The results dict as the JSON file `eval --out` writes (atomically: complete or absent)."""
    _write_atomic(path, json.dumps(_json_safe(results), indent=1) + "\n")


# --------------------------------------------------------------------------------------- ranking
KIND_LABEL = {
    "original": "original",
    "quant_baseline": "quant ref",
    "compressed": "compressed",
    "materialized": "materialized",
}


def ranking_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """The summary table (header, rows) of arms ranked by KL to the original, lowest first: arm, kind, size,
    size vs the original, routed bits per weight (bpw), KL, perplexity, and each lm-eval task's primary metric. Printed by the CLI
    (`compare.ranking_table`) and written as ranking.md, from the same rows."""
    from ..atomic import human_bytes

    arms = results["arms"]
    tasks: list[tuple[str, str]] = []
    for a in arms:
        for t, e in a["metrics"].items():
            if e.get("output_type") != "perplexity" and e.get("primary") and (t, e["primary"]) not in tasks:
                tasks.append((t, e["primary"]))
    base = next((a for a in arms if a.get("kind") == "original"), None)
    base_b = (base["bytes"].get("model") or base["bytes"].get("disk")) if base else None
    keyed = []
    for a in arms:
        agg = next((v.get("aggregate", {}) for k, v in a["metrics"].items() if k.startswith("ppl:")), {})
        b = a["bytes"].get("model") or a["bytes"].get("disk")
        kl, ppl = agg.get("kl"), agg.get("ppl")
        bpw = a.get("bits_per_weight")
        row = [
            a["name"],
            KIND_LABEL.get(a.get("kind"), a.get("kind") or "—"),
            human_bytes(b) if b else "—",
            f"{100 * b / base_b:.0f}%" if b and base_b else "—",
            f"{bpw:.2f}" if bpw is not None else "—",
            f"{kl:.4f}" if kl is not None else "—",
            f"{ppl:.2f}" if ppl is not None else "—",
        ]
        for t, m in tasks:
            v = a["metrics"].get(t, {}).get("aggregate", {}).get(m)
            row.append(f"{v:.3f}" if isinstance(v, (int, float)) else "—")
        keyed.append((kl if isinstance(kl, (int, float)) and kl == kl else math.inf, row))
    header = ["arm", "kind", "size", "vs orig", "bpw", "KL", "ppl"] + [t for t, _ in tasks]
    return header, [r for _, r in sorted(keyed, key=lambda x: x[0])]


def ranking_markdown(results: dict) -> str:
    header, rows = ranking_rows(results)
    tasks = header[6:]
    note = (
        "KL = mean KL(original ‖ arm) per token on the held-out windows; size = the plan's bytes (else bytes on "
        "disk)" + ("; task columns: each task's primary metric" if tasks else "") + "."
    )
    return "\n".join(["# Arms ranked by KL to the original", "", _table(header, rows), "", note]) + "\n"


# ----------------------------------------------------------------------------------------- plots
def _quality_points(res: Results) -> list[tuple[str, str, bool]]:
    """(panel key, y label, log axis) for the quality-vs-bytes panels that have data. KL and perplexity span
    orders of magnitude across arms, so both are on log axes; the task panel appears only where a task
    discriminates (`discriminating_tasks`)."""
    panels = []
    ppl = [t for a in res.arms for t, e in a.metrics.items() if e.output_type == "perplexity"]
    if ppl:
        if any("kl" in a.metrics[t].aggregate for a in res.arms for t in a.metrics if t == ppl[0]):
            panels.append(("kl", "KL(original ‖ arm), nats/token", True))
        panels.append(("ppl", f"perplexity on {ppl[0].removeprefix('ppl:')}", True))
    return panels


def _panel_value(arm: Arm, key: str) -> float | None:
    for e in arm.metrics.values():
        if e.output_type == "perplexity" and key in e.aggregate:
            return e.aggregate[key]
    return None


def _unit(max_bytes: float) -> tuple[float, str]:
    for div, name in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if max_bytes >= div:
            return div, name
    return 1, "bytes"


def _style(i: int):
    markers = "os^Dv<>pXh*"
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return cmap(i % 10), markers[i % len(markers)]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (fewer bytes and lower value), by bytes."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_quality_vs_bytes(res: Results, path: Path) -> Path | None:
    """One panel per quality measure (log axis), size on x; every point labelled with its arm, colour and
    marker by method (one legend entry per method), the Pareto frontier drawn as a step line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _quality_points(res)
    sized = [(a, arm_bytes(a)) for a in res.arms if arm_bytes(a) is not None]
    if not panels or not sized:
        return None
    div, unit = _unit(max(b for _, b in sized))
    methods = list(dict.fromkeys(a.method for a, _ in sized))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(7.0 * len(panels), 5.6), squeeze=False, constrained_layout=True
    )
    for ax, (key, label, log) in zip(axes[0], panels):
        pts, names = [], []
        for a, b in sized:
            y = _panel_value(a, key)
            if a.name == res.baseline and (y is None or y <= 0):  # KL of the original is 0: a reference line
                ax.axvline(b / div, color="black", linestyle=":", linewidth=1)
                ax.annotate(
                    f"{a.name} (0)",
                    (b / div, 1),
                    xycoords=("data", "axes fraction"),
                    xytext=(-3, -12),
                    textcoords="offset points",
                    ha="right",
                    fontsize=7,
                )
                continue
            if y is None or (log and y <= 0):
                continue
            color, marker = _style(methods.index(a.method))
            is_base = a.name == res.baseline
            ax.scatter(
                b / div,
                y,
                s=130 if is_base else 42,
                marker="*" if is_base else marker,
                color=color,
                edgecolor="black",
                linewidth=0.5,
                zorder=3,
            )
            pts.append((b / div, y))
            names.append(a.name)
        front = pareto_front(pts)
        if len(front) >= 2:
            fx, fy = [pts[i][0] for i in front], [pts[i][1] for i in front]
            ax.step(fx, fy, where="post", color="0.35", linestyle="--", linewidth=1, zorder=2)
        if log:
            from matplotlib.ticker import FuncFormatter, LogLocator

            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xlabel(f"model size ({unit})")
        ax.set_ylabel(label + " (lower is better)")
        ax.grid(True, which="major", alpha=0.3)
        ax.margins(x=0.14, y=0.08)
        # every arm is labelled on the first panel; the others label the frontier only (the same arms sit at
        # the same x, so repeating every name there only adds clutter)
        shown = range(len(pts)) if ax is axes[0][0] else front
        _label_points(ax, [pts[i] for i in shown], [names[i] for i in shown], [i in front for i in shown])
    from matplotlib.lines import Line2D

    handles = [
        Line2D(
            [],
            [],
            linestyle="",
            marker=_style(i)[1],
            color=_style(i)[0],
            markeredgecolor="black",
            markersize=7,
            label="original" if m in ("none", "original") else m,
        )
        for i, m in enumerate(methods)
    ]
    handles.append(Line2D([], [], color="0.35", linestyle="--", label="Pareto frontier (bold labels)"))
    fig.legend(
        handles=handles, loc="outside lower center", ncol=min(6, len(handles)), fontsize=8, frameon=False
    )
    fig.suptitle(f"Quality vs size — {res.model.name or res.model.model_type or 'model'}", fontsize=12)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label_points(ax, pts, names, bold, fontsize: float = 6.5) -> None:
    """Place each label at the first of a few offsets around its point where it overlaps no label placed
    before it (greedy, in display pixels; a label's box is estimated from its length)."""
    fig = ax.figure
    scale = fig.dpi / 72.0  # points -> pixels
    char_w, h = 0.55 * fontsize * scale, 1.2 * fontsize * scale
    placed: list[tuple[float, float, float, float]] = []
    offsets = [(4, 3), (4, -9), (-4, 3), (-4, -9), (4, 11), (4, -17), (-4, 11), (-4, -17), (4, 19), (4, -25)]
    ax.get_xlim(), ax.get_ylim()  # settle the autoscaled limits before converting to pixels
    order = sorted(range(len(pts)), key=lambda i: (not bold[i], pts[i][1]))
    for i in order:
        px, py = ax.transData.transform(pts[i])
        w = char_w * len(names[i])
        choice = offsets[0]
        for dx, dy in offsets:
            x0 = px + dx * scale - (w if dx < 0 else 0)
            box = (x0, py + dy * scale, x0 + w, py + dy * scale + h)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                choice = (dx, dy)
                break
        dx, dy = choice
        x0 = px + dx * scale - (w if dx < 0 else 0)
        placed.append((x0, py + dy * scale, x0 + w, py + dy * scale + h))
        ax.annotate(
            names[i],
            pts[i],
            xytext=(dx, dy),
            textcoords="offset points",
            fontsize=fontsize,
            ha="right" if dx < 0 else "left",
            va="bottom",
            fontweight="bold" if bold[i] else "normal",
            color="0.15",
        )


def discriminating(comparisons: list[dict]) -> list[dict]:
    """The comparisons of the tasks where at least one paired interval excludes 0: a task on which every
    arm is indistinguishable from its reference says nothing, so it is not plotted."""
    tasks = {c["task"] for c in comparisons if c["ci_low"] > 0 or c["ci_high"] < 0}
    return [c for c in comparisons if c["task"] in tasks]


def _metric_axis_label(metric: str, baseline: str) -> str:
    names = {
        "nll": "Δ mean NLL, nats/token (lower is better)",
        "acc": "Δ accuracy (higher is better)",
        "acc_norm": "Δ length-normalised accuracy (higher is better)",
        "exact_match": "Δ exact match (higher is better)",
        "kl": "Δ KL, nats/token (lower is better)",
        "primary": "Δ mean primary score (higher is better)",
    }
    return f"{names.get(metric, f'Δ {metric}')}, arm − {baseline}"


def plot_task_deltas(comparisons: list[dict], baseline: str, path: Path) -> Path | None:
    """One panel per task (side by side), one row per arm (the arm names are the y labels, so no legend):
    Δ = arm − reference with its paired interval; filled = Holm-significant, hollow = not detectable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not comparisons:
        return None
    tasks = list(dict.fromkeys(c["task"] for c in comparisons))
    arms = list(dict.fromkeys(c["a"] for c in comparisons))
    fig, axes = plt.subplots(
        1,
        len(tasks),
        figsize=(min(18.0, max(6.4, 3.6 * len(tasks) + 2.4)), 0.28 * len(arms) + 2.1),
        squeeze=False,
        sharey=True,
        constrained_layout=True,
    )
    for ax, task in zip(axes[0], tasks):
        sub = {c["a"]: c for c in comparisons if c["task"] == task}
        for r, arm in enumerate(arms):
            c = sub.get(arm)
            if c is None:
                continue
            sig = c["verdict"] != "not detectably different"
            color = (
                "#c53030"
                if sig and c["delta"] * (1 if c.get("higher_is_better", True) else -1) < 0
                else ("#2f855a" if sig else "0.45")
            )
            ax.errorbar(
                [c["delta"]],
                [r],
                xerr=[[c["delta"] - c["ci_low"]], [c["ci_high"] - c["delta"]]],
                fmt="o",
                color=color,
                mfc=color if sig else "white",
                capsize=2.5,
                markersize=5,
            )
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(task, fontsize=9)
        metric = next(c["metric"] for c in comparisons if c["task"] == task)
        ax.set_xlabel(_metric_axis_label(metric, baseline), fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(arms)))
    axes[0][0].set_yticklabels(arms, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle(
        f"Paired differences vs {baseline}, 95% bootstrap interval\n"
        "filled: Holm-significant (red worse, green better); hollow: not detectably different",
        fontsize=9,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def per_layer_cells(arm: Arm) -> dict[int, tuple[int, int, int, int]]:
    """layer -> (kept as itself, merged into / served by another stored expert, replaced by an operator,
    dropped) for one arm; the four add up to the layer's original routed experts."""
    out = {}
    for k, r in enumerate(arm.per_layer or []):
        out[int(r.get("layer", k))] = tuple(
            int(r.get(f) or 0) for f in ("retained", "remapped", "operators", "dropped")
        )
    return out


def plot_per_layer(res: Results, path: Path) -> Path | None:
    """One heatmap, arms × layers: colour = fraction of the layer's experts kept as themselves; each cell
    reads kept/merged/dropped (dropped includes experts replaced by an operator, marked +op)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    arms = [a for a in res.arms if a.per_layer]
    if not arms:
        return None
    cells = [per_layer_cells(a) for a in arms]
    layers = sorted({i for c in cells for i in c})
    frac = np.full((len(arms), len(layers)), np.nan)
    for r, c in enumerate(cells):
        for j, layer in enumerate(layers):
            if layer in c:
                frac[r, j] = c[layer][0] / max(1, sum(c[layer]))
    annotate = len(layers) <= 24
    width = min(18.0, max(6.5, (0.62 if annotate else 0.22) * len(layers) + 4.0))
    fig, ax = plt.subplots(figsize=(width, 0.3 * len(arms) + 1.7), constrained_layout=True)
    im = ax.imshow(frac, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    if annotate:
        for r, c in enumerate(cells):
            for j, layer in enumerate(layers):
                if layer not in c:
                    continue
                kept, merged, ops, dropped = c[layer]
                text = f"{kept}/{merged}/{dropped + ops}" + ("+op" if ops else "")
                ax.text(
                    j,
                    r,
                    text,
                    ha="center",
                    va="center",
                    fontsize=7.5,
                    color="white" if frac[r, j] < 0.55 else "black",
                )
    ax.set_yticks(range(len(arms)))
    ax.set_yticklabels([a.name for a in arms], fontsize=8)
    step = max(1, len(layers) // 24)
    ax.set_xticks(range(0, len(layers), step))
    ax.set_xticklabels([str(layers[j]) for j in range(0, len(layers), step)], fontsize=8)
    ax.set_xlabel("decoder layer" + ("   (cells: kept / merged / dropped)" if annotate else ""))
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.01, label="fraction of experts kept as themselves")
    ax.set_title("Routed experts per layer", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- report
def render_markdown(
    res: Results, comparisons: list[dict], items: list[dict], plots: dict[str, Path | None], settings: dict
) -> str:
    base = next(a for a in res.arms if a.name == res.baseline)
    base_bytes = arm_bytes(base)
    m = res.model
    out = [f"# moecompress report — {m.name or m.path or m.model_type or 'model'}", ""]
    out.append(
        f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; machine-readable "
        "results (incl. per-item scores) in `results.json`."
    )
    out.append("")
    facts = [
        ("model", m.name or m.path),
        ("model type", m.model_type),
        ("router convention", m.router_convention),
    ]
    for key in ("num_experts", "top_k", "moe_layers", "dtype"):
        if (m.model_extra or {}).get(key) is not None:
            facts.append((key.replace("_", " "), m.model_extra[key]))
    out.append(_table(["", ""], [(k, v if v is not None else "—") for k, v in facts]))
    out += ["", "## Reporting checklist", "", checklist_markdown(items), ""]

    cols = _task_columns(res)
    out += ["## Arms", ""]
    header = [
        "arm",
        "method",
        "params",
        "gate semantics",
        "operator",
        "precision",
        "bits/weight",
        "size",
        "size vs baseline",
    ]
    header += [f"{t} {mm}" for t, mm in cols]
    rows = []
    for a in res.arms:
        b = arm_bytes(a)
        rel = f"{100 * b / base_bytes:.1f}%" if b is not None and base_bytes else "—"
        params = ", ".join(f"{k}={v}" for k, v in a.params.items()) or "—"
        extra = a.model_extra or {}
        row = [
            a.name + (" (baseline)" if a.name == res.baseline else ""),
            a.method,
            params,
            a.gate_semantics or "—",
            a.operator or "—",
            extra.get("precision") or "—",
            _fmt(extra.get("bits_per_weight"), 3),
            _human(b),
            rel,
        ]
        for t, mm in cols:
            e = a.metrics.get(t)
            row.append(_fmt(e.aggregate.get(mm)) if e else "—")
        rows.append(row)
    out += [_table(header, rows), ""]
    out.append(
        "Size: `bytes.model` (the plan's bytes: packed codes and scales for quantized experts), else bytes "
        "on disk, else resident parameter bytes. Bits/weight: stored routed-expert bits (scales and operators "
        "included) per original routed-expert weight."
    )
    out.append("")

    out += ["## Paired comparisons", ""]
    if comparisons:
        out.append(
            f"A = arm, B = the other arm (default: the baseline `{res.baseline}`), on the same items; Δ = "
            f"mean(A − B) of the primary metric (perplexity streams: per-window mean NLL). Paired bootstrap, "
            f"B = {settings['B']} replicates, seed {settings['seed']}, {100 * (1 - settings['alpha']):.0f}% "
            f"percentile interval; p from the bootstrap; Holm correction over all {len(comparisons)} "
            "comparisons. A difference whose interval contains 0 or whose Holm-adjusted p exceeds α is "
            "*not detectably different* — not equal."
        )
        out.append("")
        rows = [
            [
                c["a"],
                c["b"],
                c["task"],
                c["metric"],
                c["n"],
                _fmt(c["mean_a"]),
                _fmt(c["mean_b"]),
                _fmt(c["delta"]),
                f"[{_fmt(c['ci_low'])}, {_fmt(c['ci_high'])}]",
                _fmt(c["p"]),
                _fmt(c["p_adjusted"]),
                c["verdict"],
            ]
            for c in comparisons
        ]
        out.append(
            _table(
                [
                    "A",
                    "B",
                    "task",
                    "metric",
                    "items",
                    "A mean",
                    "B mean",
                    "Δ (A−B)",
                    "interval",
                    "p",
                    "p (Holm)",
                    "verdict",
                ],
                rows,
            )
        )
        m, nb = len(comparisons), settings["B"]
        if nb is not None and 2 * m / (nb + 1) > settings["alpha"]:
            out.append("")
            out.append(
                f"**Warning:** with B = {nb} replicates the smallest bootstrap p is 2/(B+1) = "
                f"{2 / (nb + 1):.4f}, "
                f"so after Holm over {m} comparisons no difference can reach α = {settings['alpha']}; re-run "
                f"with B ≥ {min_replicates(m, settings['alpha'])}."
            )
    else:
        out.append("No comparisons: fewer than two arms share per-item results.")
    out.append("")

    if any(a.memory or a.latency or a.bytes.disk or a.bytes.resident for a in res.arms):
        out += ["## Memory and latency", ""]
        rows = []
        for a in res.arms:
            mem, lat = a.memory or {}, a.latency or {}
            rows.append(
                [
                    a.name,
                    _human(a.bytes.disk),
                    _human(a.bytes.resident),
                    _human(mem.get("peak_bytes")),
                    _human(mem.get("peak_delta_bytes")),
                    _fmt(lat.get("prefill_tok_s"), 1),
                    _fmt(lat.get("decode_tok_s"), 1),
                ]
            )
        out.append(
            _table(
                [
                    "arm",
                    "on disk",
                    "resident params",
                    "peak memory",
                    "peak − before",
                    "prefill tok/s",
                    "decode tok/s",
                ],
                rows,
            )
        )
        lat0 = next((a.latency for a in res.arms if a.latency), None)
        if lat0:
            out.append("")
            out.append(
                f"Latency: greedy generation, batch {lat0.get('batch_size')}, prompt {lat0.get('prompt_len')} "
                f"tokens, {lat0.get('new_tokens')} new tokens, median of {lat0.get('repeats')} runs after "
                f"{lat0.get('warmup')} warm-up on {lat0.get('device')}. Peak memory: "
                f"{(next((a.memory for a in res.arms if a.memory), {}) or {}).get('kind', '—')}."
            )
        out.append("")

    quant = [a for a in res.arms if a.kind == "quant_baseline"]
    if quant:
        out += ["## Quantization reference", ""]
        rows = []
        for a in quant:
            extra = a.model_extra or {}
            rows.append(
                [
                    a.name,
                    a.params.get("quant"),
                    a.params.get("algo", "gptq"),
                    _fmt(extra.get("bits_per_weight"), 3),
                    _human(arm_bytes(a)),
                ]
            )
        out.append(_table(["arm", "spec", "algorithm", "bits/weight", "size"], rows))
        out.append("")
        out.append(
            "Pure quantization of every routed expert (method `quant`: no structural change), exported and "
            "loaded back like every other arm; docs/quantization.md states the grid."
        )
        out.append("")

    per_layer = [a for a in res.arms if a.per_layer]
    if per_layer:
        out += ["## Per-layer experts", ""]
        layers = sorted({int(r.get("layer", k)) for a in per_layer for k, r in enumerate(a.per_layer)})
        rows = []
        for a in per_layer:
            by = {int(r.get("layer", k)): r for k, r in enumerate(a.per_layer)}
            rows.append(
                [a.name]
                + [
                    f"{by[i].get('retained', '—')}/{by[i].get('experts', '—')}"
                    + (f" (+{by[i]['remapped']} remapped)" if by[i].get("remapped") else "")
                    + (f" (+{by[i]['operators']} operators)" if by[i].get("operators") else "")
                    if i in by
                    else "—"
                    for i in layers
                ]
            )
        out.append(_table(["arm"] + [f"layer {i}" for i in layers], rows))
        out.append("")
        out.append(
            "Cells: slots still served by their own expert / original routed experts (+ slots served by "
            "another stored expert or by a replacement operator)."
        )
        out.append("")

    if res.calibration is not None:
        out += ["## Calibration", ""]
        cal = res.calibration.model_dump(exclude_none=True)
        out.append(_table(["", ""], [(k, v) for k, v in cal.items()]))
        out.append("")
    own = [(a.name, c) for a in res.arms if (c := (a.model_extra or {}).get("calibration"))]
    if own:
        out += ["Arms with their own calibration (every arm is scored on the same items):", ""]
        out.append(
            _table(
                ["arm", "domain", "source", "tokens"],
                [(n, c.get("domain"), c.get("source"), f"{c.get('tokens') or 0:,}") for n, c in own],
            )
        )
        out.append("")

    shown = [(k, p) for k, p in plots.items() if p is not None]
    if shown:
        out += ["## Plots", ""]
        titles = {
            "quality_vs_bytes": "Quality vs size",
            "task_deltas": "Per-task paired differences",
            "per_layer": "Routed experts per layer",
        }
        for k, p in shown:
            out += [f"![{titles.get(k, k)}]({p.name})", ""]
        if plots.get("task_deltas") is None and comparisons:
            out += [
                "No per-task plot: on no task does any paired interval exclude 0 (see the table above).",
                "",
            ]
    if res.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in res.notes] + [""]
    return "\n".join(out)


def write_report(
    results: dict,
    out_dir,
    *,
    B: int | None = None,
    seed: int | None = None,
    alpha: float | None = None,
    pairs: Sequence[tuple[str, str]] | None = None,
) -> Path:
    """Write report.md, results.json and the PNG plots into `out_dir`; return the report path.

    Comparisons are computed (each arm vs the baseline, or `pairs`) unless `results["comparisons"]`
    is given; B / seed / alpha default to `results["settings"]`, else `min_replicates(m)` / 0 / 0.05.
    """
    res = validate_results(results)
    settings = {"B": None, "seed": 0, "alpha": 0.05, **res.settings}
    for k, v in (("B", B), ("seed", seed), ("alpha", alpha)):
        if v is not None:
            settings[k] = v
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    comparisons = results.get("comparisons")
    if comparisons is None:
        comparisons = compare_arms(
            res, pairs, B=settings["B"], seed=settings["seed"], alpha=settings["alpha"]
        )
    if comparisons:
        settings["B"] = comparisons[0]["B"]
    items = checklist(res)
    plots = {
        "quality_vs_bytes": plot_quality_vs_bytes(res, out / "quality_vs_bytes.png"),
        "task_deltas": plot_task_deltas(discriminating(comparisons), res.baseline, out / "task_deltas.png"),
        "per_layer": plot_per_layer(res, out / "per_layer_experts.png"),
    }
    full = dict(
        results,
        schema=results.get("schema", SCHEMA),
        baseline=res.baseline,
        settings=settings,
        comparisons=comparisons,
        checklist=items,
    )
    _write_atomic(out / "results.json", json.dumps(_json_safe(full), indent=1, ensure_ascii=False) + "\n")
    _write_atomic(out / "ranking.md", ranking_markdown(full))
    report = out / "report.md"
    _write_atomic(report, render_markdown(res, comparisons, items, plots, settings) + "\n")
    return report
