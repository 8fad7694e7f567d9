"""Cross-layer nearest-neighbour analysis of routed experts (ConMoE §5.4).

For every routed expert e of MoE layer l, its nearest neighbour within e's scope (consecutive groups of
`scope_size` MoE layers, as in ConMoE) under the normalised parameter distance
d(e, e') = mean_{W ∈ gate,up,down} 2‖W_e − W_e'‖_F / (‖W_e‖_F + ‖W_e'‖_F + 2ε):

  nn(e) = argmin_{e' ∈ E_G \\ {e}} d(e, e')     (ties: the earlier (layer, expert))

From it: a heatmap H[l, l'] = fraction of layer l's experts whose nearest neighbour lies in layer l'
(rows sum to 1), and the per-layer cross-layer fraction 1 − H[l, l]. Written as analysis.json (every
expert's neighbour, the matrix, the fractions) and nn_heatmap.png.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import MoECompressError


@dataclass
class NeighbourRecord:
    layer: int
    expert: int
    nn_layer: int
    nn_expert: int
    distance: float
    scope: int  # index of the scope


@dataclass
class CrossLayerAnalysis:
    model: str
    scope_size: int
    moe_layers: list[int]
    scopes: list[list[int]]
    neighbours: list[NeighbourRecord] = field(default_factory=list)
    heatmap: list[list[float]] = field(
        default_factory=list
    )  # rows: source layer, cols: nn layer (moe_layers order)
    cross_fraction: dict[int, float] = field(default_factory=dict)
    overall_cross_fraction: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cross_fraction"] = {str(k): v for k, v in self.cross_fraction.items()}
        return d


def nearest_neighbours(distance: torch.Tensor) -> tuple[list[int], list[float]]:
    """argmin_{j ≠ i} d(i, j) for every row (first index on ties) and the distance; a pool of one
    expert has no neighbour (index −1, distance nan)."""
    n = distance.shape[0]
    if n < 2:
        return [-1] * n, [float("nan")] * n
    d = distance.double().clone()
    d.fill_diagonal_(float("inf"))
    vals, idx = d.min(dim=1)
    return idx.tolist(), vals.tolist()


def analyze_scopes(
    experts_of: Callable[[int], object],
    moe_layers: list[int],
    scope_size: int,
    model_name: str = "",
    eps: float = 1e-8,
    progress: bool = False,
) -> CrossLayerAnalysis:
    """Run the analysis with `experts_of(layer)` giving that layer's stacked ExpertWeights."""
    from ..methods.conmoe_distance import scope_distance
    from ..methods.conmoe_select import scopes

    groups = scopes(moe_layers, scope_size)
    res = CrossLayerAnalysis(
        model=model_name, scope_size=scope_size, moe_layers=list(moe_layers), scopes=groups
    )
    pos = {layer: i for i, layer in enumerate(moe_layers)}
    counts = torch.zeros(len(moe_layers), len(moe_layers), dtype=torch.float64)
    for s, group in _track(list(enumerate(groups)), progress, "nearest neighbours"):
        stacks = [experts_of(layer) for layer in group]
        members = [(layer, e) for layer, st in zip(group, stacks) for e in range(st.gate.shape[0])]
        d = scope_distance(stacks, eps)
        idx, val = nearest_neighbours(d)
        for (layer, e), j, v in zip(members, idx, val):
            if j < 0:
                continue
            nl, ne = members[j]
            res.neighbours.append(NeighbourRecord(layer, e, nl, ne, float(v), s))
            counts[pos[layer], pos[nl]] += 1
    rows = counts.sum(1, keepdim=True)
    frac = torch.where(rows > 0, counts / rows.clamp_min(1), torch.zeros_like(counts))
    res.heatmap = [[round(float(x), 6) for x in row] for row in frac]
    for layer in moe_layers:
        i = pos[layer]
        res.cross_fraction[layer] = round(float(1.0 - frac[i, i]) if rows[i, 0] > 0 else 0.0, 6)
    total = counts.sum()
    res.overall_cross_fraction = (
        round(float((total - counts.diagonal().sum()) / total), 6) if total > 0 else 0.0
    )
    return res


def _track(items: list, progress: bool, what: str) -> Iterable:
    if not progress:
        return items
    from rich.progress import track

    return track(items, description=what, transient=True)


# ----------------------------------------------------------------------------- plotting


def plot_analysis(res: CrossLayerAnalysis, path: str | os.PathLike) -> Path:
    """PNG: left, the source → nearest-neighbour layer heatmap (fraction of the source layer's experts);
    right, the per-layer fraction of experts whose nearest neighbour is in another layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context():
        return _plot(plt, res, path)


def _plot(plt, res: CrossLayerAnalysis, path) -> Path:
    layers = res.moe_layers
    n = len(layers)
    mat = torch.tensor(res.heatmap, dtype=torch.float64).numpy() if n else None
    side = max(4.0, min(12.0, 0.35 * n + 2.5))
    plt.rcParams.update({"font.size": max(10.0, min(16.0, 10.0 * side / 6.0))})  # legible at every size
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(2 * side + 1.5, side), gridspec_kw={"width_ratios": [1.15, 1]}
    )
    im = ax.imshow(mat, cmap="viridis", vmin=0.0, vmax=1.0, origin="upper", aspect="equal")
    step = max(1, n // 16)
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks, [str(layers[i]) for i in ticks])
    ax.set_yticks(ticks, [str(layers[i]) for i in ticks])
    ax.set_xlabel("nearest-neighbour layer")
    ax.set_ylabel("source layer")
    ax.set_title(f"Source layer → nearest-neighbour layer\n(d within scopes of {res.scope_size} MoE layers)")
    if n <= 12:
        for i in range(n):
            for j in range(n):
                if mat[i, j] > 0:
                    ax.text(
                        j,
                        i,
                        f"{mat[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="black" if mat[i, j] > 0.6 else "white",
                    )
    cbar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cbar.set_label("fraction of source-layer experts")
    fr = [res.cross_fraction[layer] for layer in layers]
    bx.bar(range(n), fr, color="tab:orange")
    bx.set_xticks(ticks, [str(layers[i]) for i in ticks])
    bx.set_ylim(0, 1)
    bx.set_xlabel("MoE layer")
    bx.set_ylabel("cross-layer nearest-neighbour fraction")
    bx.axhline(res.overall_cross_fraction, color="black", linestyle="--", linewidth=1)
    bx.set_title(
        f"Nearest neighbour in another layer\n(dashed: all layers, {100 * res.overall_cross_fraction:.1f}%)"
    )
    if res.model:
        fig.suptitle(res.model)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ----------------------------------------------------------------------------- model entry point


def _stream_experts(source: str, trust_remote_code: bool):
    """(moe_layers, experts_of) reading one decoder layer at a time from the safetensors shards."""
    from ..checkpoint import CheckpointReader
    from ..models import MoEAdapter, skeleton

    reader = CheckpointReader(source, trust_remote_code=trust_remote_code)
    model = skeleton(reader.config)
    adapter = MoEAdapter(model)

    def experts_of(layer: int):
        reader.load_layer(model, layer)
        try:
            return adapter.experts(layer).map(lambda t: t.detach().clone())
        finally:
            reader.free_layer(model, layer)

    return adapter.moe_layers, experts_of


def analyze_model(
    source: str,
    scope_size: int = 4,
    trust_remote_code: bool = False,
    eps: float = 1e-8,
    progress: bool = False,
    model=None,
) -> CrossLayerAnalysis:
    """The analysis of a checkpoint directory / hub id (streamed layer by layer), or of a loaded `model`."""
    from ..models import MoEAdapter

    if scope_size < 1:
        raise MoECompressError(f"--scope must be at least 1 (got {scope_size}); use e.g. --scope 4.")
    if model is not None:
        adapter = MoEAdapter(model)
        layers, experts_of = adapter.moe_layers, lambda i: adapter.experts(i).map(lambda t: t.detach())
    else:
        try:
            layers, experts_of = _stream_experts(source, trust_remote_code)
        except ImportError:  # no streaming reader: load the whole model
            from ..models import load_model

            adapter = MoEAdapter(load_model(source, trust_remote_code=trust_remote_code))
            layers, experts_of = adapter.moe_layers, lambda i: adapter.experts(i).map(lambda t: t.detach())
    return analyze_scopes(experts_of, layers, scope_size, model_name=str(source), eps=eps, progress=progress)


def write_analysis(
    res: CrossLayerAnalysis, out: str | os.PathLike, overwrite: bool = False, protect=(), inputs=None
) -> Path:
    """analysis.json + nn_heatmap.png into `out` (atomically). `inputs`: the model's fingerprint from when the
    analysis started (`atomic.fingerprint_inputs`), checked before the rename."""
    from ..atomic import atomic_dir

    with atomic_dir(out, overwrite=overwrite, protect=protect, kind="analysis", inputs=inputs) as tmp:
        (Path(tmp) / "analysis.json").write_text(json.dumps(res.to_dict(), indent=1, sort_keys=True) + "\n")
        plot_analysis(res, Path(tmp) / "nn_heatmap.png")
    return Path(out)
