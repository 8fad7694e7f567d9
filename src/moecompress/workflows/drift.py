r"""Mask drift (routing-semantics paper §6.4): how far a pruning mask moves when the calibration domain
changes, against how far it moves when the same domain is resampled at a matched token budget.

For calibration specs A, B, … each is drawn R times on disjoint documents, every draw exactly the same
number of tokens (`data.disjoint_resamples`); each draw is calibrated and pruned with the same criterion
and ratio (`methods.prune.select_experts`, the masks `compress --method prune` builds). With P_{A,r}(l) the
experts draw r of A prunes in layer l, and P_{A,r} = {(l, e)} over all MoE layers,

    J(X, Y)           = 1 − |X ∩ Y| / |X ∪ Y|                     (0 when both are empty)
    resampling  W_A(l) = mean_{r < s} J(P_{A,r}(l), P_{A,s}(l))     (the same domain, other documents)
    domain   D_{A,B}(l) = mean_r J(P_{A,r}(l), P_{B,r}(l))           (draw r of A against draw r of B)
    drift ratio  ρ_{A,B} = D_{A,B} / ((W_A + W_B) / 2),  overall ρ = mean_{A<B} D_{A,B} / mean_A W_A

on the overall sets (and per layer for the plot). Identical specs give identical draws, so D = 0. The
intervals are percentile bootstraps over draws: the R draw indices are resampled with replacement (the
same indices for every spec, since domain pairs are paired by draw); W averages the pairs of distinct
draws among them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import MoECompressError

Mask = dict[int, list[int]]  # MoE layer -> pruned experts (sorted)


def jaccard_distance(a, b) -> float:
    """1 − |a ∩ b| / |a ∪ b| of two sets (0 for two empty sets)."""
    a, b = set(a), set(b)
    union = a | b
    return 0.0 if not union else 1.0 - len(a & b) / len(union)


def _flat(mask: Mask) -> set[tuple[int, int]]:
    return {(layer, e) for layer, pruned in mask.items() for e in pruned}


def _within(draws: list[Mask], idx: list[int], key) -> float:
    pairs = [(i, j) for i, j in itertools.combinations(idx, 2) if i != j]
    if not pairs:
        return float("nan")
    return sum(jaccard_distance(key(draws[i]), key(draws[j])) for i, j in pairs) / len(pairs)


def _across(a: list[Mask], b: list[Mask], idx: list[int], key) -> float:
    return sum(jaccard_distance(key(a[r]), key(b[r])) for r in idx) / len(idx)


def _ratio(across: float, within: float) -> float:
    return across / within if within > 0 else float("nan")


def drift_summary(
    masks: dict[str, list[Mask]], layers: list[int], bootstrap: int = 1000, seed: int = 0
) -> dict:
    """Resampling and domain distances (overall and per layer), drift ratios and bootstrap intervals.

    masks: spec -> its R draws' masks (every spec the same R, draw r of each paired)."""
    specs = list(masks)
    n = {len(v) for v in masks.values()}
    if len(n) != 1 or n.pop() < 2:
        raise MoECompressError("Mask drift needs the same number (at least 2) of draws for every spec.")
    R = len(masks[specs[0]])
    keys = {"overall": _flat, **{str(l): (lambda m, _l=l: m.get(_l, [])) for l in layers}}
    every = list(range(R))
    pairs = list(itertools.combinations(specs, 2))

    def stats(idx):
        w = {s: {k: _within(masks[s], idx, f) for k, f in keys.items()} for s in specs}
        d = {
            f"{a} | {b}": {k: _across(masks[a], masks[b], idx, f) for k, f in keys.items()} for a, b in pairs
        }
        return w, d

    w, d = stats(every)
    mean_w = sum(w[s]["overall"] for s in specs) / len(specs)
    out = {
        "draws": R,
        "resampling": w,
        "domain": d,
        "ratio": {
            f"{a} | {b}": _ratio(d[f"{a} | {b}"]["overall"], (w[a]["overall"] + w[b]["overall"]) / 2)
            for a, b in pairs
        },
    }
    out["overall"] = {
        "resampling": mean_w,
        "domain": sum(v["overall"] for v in d.values()) / len(d) if d else float("nan"),
    }
    out["overall"]["ratio"] = _ratio(out["overall"]["domain"], mean_w)
    gen = torch.Generator().manual_seed(seed)
    reps: dict[str, list[float]] = {k: [] for k in ["overall", *out["ratio"]]}
    for _ in range(bootstrap):
        idx = torch.randint(R, (R,), generator=gen).tolist()
        bw, bd = stats(idx)
        bmean = sum(bw[s]["overall"] for s in specs) / len(specs)
        if d:
            reps["overall"].append(_ratio(sum(v["overall"] for v in bd.values()) / len(bd), bmean))
        for a, b in pairs:
            reps[f"{a} | {b}"].append(
                _ratio(bd[f"{a} | {b}"]["overall"], (bw[a]["overall"] + bw[b]["overall"]) / 2)
            )
    out["interval"] = {k: _percentiles(v) for k, v in reps.items() if v}
    return out


def _percentiles(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    t = t[torch.isfinite(t)]
    if t.numel() == 0:
        return [float("nan"), float("nan")]
    return [float(torch.quantile(t, 0.025)), float(torch.quantile(t, 0.975))]


@dataclass
class MaskDrift:
    """One mask-drift study: settings, every draw's calibration record and masks, and the summaries."""

    model: str
    specs: list[str]
    draws: int
    sequences: int
    seq_len: int
    seed: int
    layers: list[int]
    calibration: dict[str, list[dict]] = field(default_factory=dict)  # spec label -> each draw's data record
    masks: dict[str, dict[str, list[Mask]]] = field(
        default_factory=dict
    )  # "criterion@ratio" -> label -> draws
    summary: dict[str, dict] = field(default_factory=dict)  # "criterion@ratio" -> drift_summary

    def to_dict(self) -> dict:
        return asdict(self)


def _mask_name(criterion: str, ratio: float) -> str:
    return f"{criterion}@{ratio:g}"


def mask_drift(
    model: str,
    specs: list[str],
    criteria: list[str],
    ratios: list[float],
    *,
    draws: int = 4,
    sequences: int | None = None,
    seq_len: int = 256,
    seed: int = 0,
    bootstrap: int = 1000,
    batch_size: int = 8,
) -> MaskDrift:
    """Prune masks of `model` from `draws` disjoint, token-matched draws of every spec, for every
    criterion × ratio, and their drift summaries (module docstring).

    sequences: windows of `seq_len` per draw (None: the most that every spec can fill `draws` times).
    Each spec's draws are calibrated together in one streamed pass (`calibrate.groups`)."""
    from ..checkpoint.view import StreamedAdapter
    from ..data import disjoint_resamples, load_tokenizer
    from ..methods import get_method, parse_config
    from ..models.loading import resolve_fixture, resolve_source

    if draws < 2 or not specs:
        raise MoECompressError(
            f"Mask drift needs at least one spec and two draws of each (got {len(specs)} specs, "
            f"{draws} draws); pass --draws 2 or more."
        )
    model = resolve_source(resolve_fixture(model))
    configs = {
        _mask_name(c, r): parse_config("prune", {"criterion": c, "ratio": r})
        for c in criteria
        for r in ratios
    }
    needs = sorted({n for cfg in configs.values() for n in get_method("prune").stats_for(cfg)})
    tok = load_tokenizer(model)
    if sequences is None:
        sequences = min(
            len(disjoint_resamples(s, tok, seq_len, None, draws, seed)[0].data.input_ids) for s in specs
        )
    view = StreamedAdapter(model)
    result = MaskDrift(str(model), list(specs), draws, sequences, seq_len, seed, list(view.moe_layers))
    result.masks = {name: {} for name in configs}
    labels = [
        s if specs.count(s) == 1 else f"{s} #{k + 1}" for k, s in enumerate(specs)
    ]  # a spec twice: 2 rows
    step = math.gcd(batch_size, sequences)  # batches never straddle two draws
    for spec, label in zip(specs, labels):
        picked = disjoint_resamples(spec, tok, seq_len, sequences, draws, seed)
        per_draw = _calibrate_draws(model, picked, spec, seq_len, seed, sequences, draws, needs, step)
        result.calibration[label] = [{**d.data.to_dict(), "documents": d.documents} for d in picked]
        _add_masks(result, label, configs, per_draw, view)
    result.summary = {
        name: drift_summary(m, result.layers, bootstrap, seed) for name, m in result.masks.items()
    }
    return result


def _calibrate_draws(
    model, picked, spec: str, seq_len: int, seed: int, sequences: int, draws: int, needs, step
):
    """The statistics `needs` of each of one spec's `draws` draws `picked`, calibrated together in one streamed
    pass (`calibrate.groups`) in batches of `step` sequences."""
    from ..calibrate.groups import calibrate_groups
    from ..data import CalibrationData

    joined = CalibrationData(
        torch.cat([d.data.input_ids for d in picked]),
        torch.cat([d.data.attention_mask for d in picked]),
        spec,
        seq_len,
        seed,
    )
    return calibrate_groups(model, joined, [sequences] * draws, needs, batch_size=step)


def _add_masks(result: MaskDrift, label: str, configs: dict, per_draw, view) -> None:
    """Add to `result.masks` each config's prune mask (dropped experts per layer) of every draw of spec `label`."""
    from ..methods.context import MappingStats
    from ..methods.prune import select_experts

    all_experts = {i: set(range(view.num_experts(i))) for i in view.moe_layers}
    for name, cfg in configs.items():
        result.masks[name][label] = []
        for stats in per_draw:
            kept = select_experts(cfg, view, MappingStats(stats))
            result.masks[name][label].append(
                {i: sorted(all_experts[i] - set(kept[i])) for i in view.moe_layers}
            )


def plot_drift(res: MaskDrift, name: str, path: str | os.PathLike) -> Path:
    """Heatmap of the per-layer Jaccard distance: one row per domain pair, one per spec's resampling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res.summary[name]
    rows = [(f"{p} (domain)", v) for p, v in s["domain"].items()]
    rows += [(f"{spec} (resampled)", v) for spec, v in s["resampling"].items()]
    grid = [[v[str(l)] for l in res.layers] + [v["overall"]] for _, v in rows]
    fig, ax = plt.subplots(figsize=(1.1 * len(res.layers) + 6.5, 0.5 * len(rows) + 1.6))
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(res.layers) + 1), [*map(str, res.layers), "all"])
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("MoE layer")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(
                j, i, f"{v:.2f}", ha="center", va="center", color="white" if v < 0.6 else "black", fontsize=8
            )
    ax.set_title(
        f"Jaccard distance between pruned sets, {name} ({res.draws} draws x {res.sequences * res.seq_len:,} "
        "tokens)",
        fontsize=10,
    )
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_drift(
    res: MaskDrift, out: str | os.PathLike, overwrite: bool = False, protect=(), inputs=None
) -> Path:
    """drift.json and one heatmap per criterion × ratio (drift_<criterion>_<ratio>.png) into `out`, atomically.
    `inputs`: the model's fingerprint from when the run started, checked before the rename."""
    from ..atomic import atomic_dir

    with atomic_dir(out, overwrite=overwrite, protect=protect, kind="analysis", inputs=inputs) as tmp:
        (Path(tmp) / "drift.json").write_text(json.dumps(res.to_dict(), indent=1, sort_keys=True) + "\n")
        for name in res.summary:
            plot_drift(res, name, Path(tmp) / f"drift_{name.replace('@', '_')}.png")
    return Path(out)
