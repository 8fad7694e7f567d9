"""The report's PNG plots: quality vs size with its Pareto frontier, per-task paired differences, and the
routed experts each arm kept per layer (matplotlib, Agg backend, imported only when a plot is drawn)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .schema import Arm, Results, arm_bytes


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


def _reference_line(ax, name: str, x: float) -> None:
    """The baseline whose value is 0 or absent on this panel (KL of the original is 0): a dotted vertical
    line at its size, labelled, instead of a point a log axis cannot show."""
    ax.axvline(x, color="black", linestyle=":", linewidth=1)
    ax.annotate(
        f"{name} (0)",
        (x, 1),
        xycoords=("data", "axes fraction"),
        xytext=(-3, -12),
        textcoords="offset points",
        ha="right",
        fontsize=7,
    )


def _scatter_arms(ax, res: Results, sized, key: str, log: bool, methods: list[str], div: float):
    """One panel's points: every sized arm with a value for `key` (the baseline as a star), coloured and marked
    by method; returns the points (size in the plot's unit, value) and their arm names, in drawing order."""
    pts, names = [], []
    for a, b in sized:
        y = _panel_value(a, key)
        if a.name == res.baseline and (y is None or y <= 0):  # KL of the original is 0: a reference line
            _reference_line(ax, a.name, b / div)
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
    return pts, names


def _log_y_axis(ax) -> None:
    """A log y axis with plain-number ticks at 1, 2 and 5 of every decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _method_legend(fig, methods: list[str]) -> None:
    """One legend entry per method (colour and marker) plus the Pareto frontier, below the panels."""
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
        pts, names = _scatter_arms(ax, res, sized, key, log, methods, div)
        front = pareto_front(pts)
        if len(front) >= 2:
            fx, fy = [pts[i][0] for i in front], [pts[i][1] for i in front]
            ax.step(fx, fy, where="post", color="0.35", linestyle="--", linewidth=1, zorder=2)
        if log:
            _log_y_axis(ax)
        ax.set_xlabel(f"model size ({unit})")
        ax.set_ylabel(label + " (lower is better)")
        ax.grid(True, which="major", alpha=0.3)
        ax.margins(x=0.14, y=0.08)
        # every arm is labelled on the first panel; the others label the frontier only (the same arms sit at
        # the same x, so repeating every name there only adds clutter)
        shown = range(len(pts)) if ax is axes[0][0] else front
        _label_points(ax, [pts[i] for i in shown], [names[i] for i in shown], [i in front for i in shown])
    _method_legend(fig, methods)
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
