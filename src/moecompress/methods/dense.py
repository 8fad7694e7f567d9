"""MoE → dense conversion (Algorithm 1 of "Pruning and Distilling Mixture-of-Experts into Dense LMs").

Per MoE layer with E experts of width I, router top-k = k:

1. **Score** every expert with a criterion and keep the top K ≥ k (K = k is pure pruning):
   SF c_e;  PP (1/N) Σ_t p_e(t);  PS (1/N) Σ_{t: e∈top-k} p_e(t) = CP·c_e/N;
   CP (1/c_e) Σ_{t: e∈top-k} p_e(t);  ACP = CP·sqrt((1/c_e) Σ_{t: e∈top-k} ‖f_e(t)‖²);
   DO-CP / DO-ACP: greedy max of log det(K_S + λI), K_ij = sqrt(I_i I_j)·G_ij with G the expert-output
   Gram matrix over all tokens and I the CP / ACP importance (`scoring.doptimal`). Each is an entry of the one
   criteria registry (`scoring.registry`, `CRITERION_ENTRY`).
2. **Group** the K experts into k groups (Appendix G): RR (rank r → group r mod k), WC (average-linkage
   clustering of the flattened [gate; up; down] weights, cosine), RC (average linkage of router rows,
   cosine), AB (the k best are anchors, the rest join the anchor with the most similar router row),
   OC (average linkage on d = 1 − G_ij/sqrt(G_ii G_jj), the empirical output cosine).
3. **Merge** inside group g by score-weighted averaging: W^(g) = Σ_{e∈G_g} w_e W_e, w_e = s_e / Σ_{G_g} s.
4. **Concatenate** (Appendix H): gate/up stacked by rows, down by columns, each group's down scaled by α_g:
   uniform α_g = ρ/k; proportional α_g = ρ·Σ_{e∈G_g} s_e / Σ_{e∈S} s_e; gate α_g = Σ_{e∈G_g} w_e ḡ_e
   with ḡ_e = (1/c_e) Σ_{t: e∈top-k} g_e(t), the mean gate weight the MoE applies to e (the paper's choice
   for routers that do not renormalise, DeepSeek-V2-Lite). ρ is the router's routed_scaling_factor, or
   with ``mass_scale`` the measured mean top-k routing mass (1/N) Σ_t Σ_{e∈top-k(t)} g_e(t) — for a
   renormalising router the two agree. Shared experts are appended unscaled (Qwen2-MoE's sigmoid-gated
   shared expert is scaled by its mean gate when folded; see docs/dense.md).

The dense FFN of one layer computes  y = W_down act(W_gate x + b_g) ⊙ (W_up x + b_u) + b_d  and, because
block concatenation keeps every group's intermediate activations apart,  y = Σ_g α_g f_g(x) (+ shared),
with f_g the merged group's expert (Eq. 10 of the paper). Biases (GPT-OSS) are merged like weights,
gate/up biases concatenated, down biases summed as Σ_g α_g b_g.

Statistics are per-layer tensors named as the calibration collectors name them: ``counts`` [E],
``tokens`` [], ``routing_mass`` [E], ``pp`` [E], ``cp`` [E], ``out_norm_sq_mean`` [E], ``gram`` [E, E]
and, for a folded Qwen2-MoE shared expert, ``shared_gate_mean`` []. `collect_dense_stats` gathers them
with a full forward when no stats store is at hand.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ..errors import MoECompressError
from ..models import ExpertActivation, ExpertWeights, MoEAdapter
from ..scoring import doptimal_kernel, greedy_doptimal
from ..scoring.registry import get_criterion
from .context import MappingStats, MethodContext, StatsView
from .needs import register_method_stats
from .registry import register_method

Criterion = Literal["frequency", "pp", "ps", "cp", "acp", "do-cp", "do-acp"]
Grouping = Literal["rr", "wc", "rc", "ab", "oc"]
Scaling = Literal["uniform", "proportional", "gate"]
CRITERIA: tuple[str, ...] = ("frequency", "pp", "ps", "cp", "acp", "do-cp", "do-acp")
# each criterion's entry in the one criteria registry (scoring/registry.py); ACP and DO-ACP are evaluated on the
# store's means ("dense-acp"), which rounds differently from prune's ACP in the last bits
CRITERION_ENTRY: dict[str, str] = {
    "frequency": "frequency",
    "pp": "pp",
    "ps": "ps",
    "cp": "cp",
    "acp": "dense-acp",
    "do-cp": "do-cp",
    "do-acp": "dense-do-acp",
}
GROUPINGS: tuple[str, ...] = ("rr", "wc", "rc", "ab", "oc")
SCALINGS: tuple[str, ...] = ("uniform", "proportional", "gate")
_ALIASES = {
    "sf": "frequency",
    "freq": "frequency",
    "do_cp": "do-cp",
    "docp": "do-cp",
    "do_acp": "do-acp",
    "doacp": "do-acp",
    "round-robin": "rr",
    "anchor": "ab",
    "weight": "wc",
    "router": "rc",
    "output": "oc",
    "prop": "proportional",
}

Stats = Mapping[int, Mapping[str, torch.Tensor]]


class DenseConfig(BaseModel):
    """Recipe parameters of the `dense` method (`moecompress dense`, `compress --method dense`)."""

    model_config = ConfigDict(extra="forbid")

    criterion: Criterion = "do-acp"
    K: int | None = Field(None, ge=1, description="experts kept per layer before grouping (default: top-k)")
    grouping: Grouping = "rr"
    scaling: Scaling = "uniform"
    mass_scale: bool = (
        False  # scale α by the measured mean top-k routing mass instead of routed_scaling_factor
    )
    shared_gate: Literal["fold", "exact"] = (
        "fold"  # Qwen2-MoE: fold mean sigmoid gate (dense) or keep (1-expert MoE)
    )
    target: Literal["auto", "dense", "moe"] = (
        "auto"  # student class: dense family, or same MoE class with 1 expert
    )


def canonical(name: str, allowed: tuple[str, ...], what: str) -> str:
    """Normalise a user-facing name ('DO-ACP', 'sf', 'RR') or refuse it with the list of choices."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in allowed:
        raise MoECompressError(f"Unknown {what} '{name}'; choose one of {', '.join(allowed)}.")
    return key


def needs_stats(config: DenseConfig | None = None) -> list[str]:
    """Statistic names a conversion with `config` reads (all of them for None): its criterion's (registry),
    the routing mass and counts every scaling reads, and the Gram matrix for output clustering."""
    criteria = CRITERIA if config is None else (config.criterion,)
    need = ["counts", "tokens", "routing_mass"]
    for c in criteria:
        need += get_criterion(CRITERION_ENTRY[c]).stats
    if config is None or config.grouping == "oc":
        need.append("gram")
    return list(dict.fromkeys(need))


# ----------------------------------------------------------------------------- scores and selection
def _get(stats: Mapping[str, torch.Tensor], name: str, layer: int | None = None) -> torch.Tensor:
    if name not in stats:
        where = f" for layer {layer}" if layer is not None else ""
        raise MoECompressError(
            f"The calibration statistics lack '{name}'{where}; recalibrate with the dense method's "
            f"statistics ({', '.join(needs_stats())}) or pass a calibration text to --calib."
        )
    return torch.as_tensor(stats[name]).double()


def importance(stats: Mapping[str, torch.Tensor], criterion: str, layer: int | None = None) -> torch.Tensor:
    """Per-expert base importance s_e [E] (float64) of a criterion (its registry entry's score); DO-* use their
    CP / ACP importance."""
    entry = get_criterion(CRITERION_ENTRY[canonical(criterion, CRITERIA, "criterion")])
    return entry.score(lambda name: _get(stats, name, layer), -1 if layer is None else layer, 0)


def _by_score(scores: torch.Tensor) -> list[int]:
    """Indices by descending score, lower index first on ties."""
    return sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))


def select_experts(
    stats: Mapping[str, torch.Tensor], criterion: str, K: int, layer: int | None = None
) -> list[int]:
    """The K kept experts in rank order (best first; greedy selection order for DO-*)."""
    criterion = canonical(criterion, CRITERIA, "criterion")
    s = importance(stats, criterion, layer)
    if not 1 <= K <= len(s):
        raise MoECompressError(
            f"K={K} is outside 1..{len(s)} (the layer's experts); pass a K between top-k and {len(s)}."
        )
    if get_criterion(CRITERION_ENTRY[criterion]).doptimal:
        return greedy_doptimal(doptimal_kernel(s, _get(stats, "gram", layer)), K)
    return _by_score(s)[:K]


# ----------------------------------------------------------------------------- grouping
def average_linkage(dist: torch.Tensor, k: int) -> list[list[int]]:
    """Average-linkage agglomerative clustering of n items into k clusters (indices into dist).

    Merges the closest pair of clusters until k remain; cluster distance is the mean pairwise
    distance (Lance–Williams update). Ties merge the lowest (i, j) pair: deterministic.
    """
    n = dist.shape[0]
    d = dist.double().clone()
    d.fill_diagonal_(float("inf"))
    members: dict[int, list[int]] = {i: [i] for i in range(n)}
    alive = torch.ones(n, dtype=torch.bool)
    while len(members) > k:
        masked = d.masked_fill(~(alive[:, None] & alive[None, :]), float("inf"))
        flat = int(torch.argmin(masked))  # first minimum in row-major order: lowest (i, j)
        i, j = divmod(flat, n)
        i, j = min(i, j), max(i, j)
        ni, nj = len(members[i]), len(members[j])
        new = (ni * d[i] + nj * d[j]) / (ni + nj)
        d[i], d[:, i] = new, new
        d[i, i] = float("inf")
        alive[j] = False
        d[j], d[:, j] = float("inf"), float("inf")
        members[i] += members.pop(j)
    return list(members.values())


def _cosine_distance(x: torch.Tensor) -> torch.Tensor:
    x = F.normalize(x.double().reshape(x.shape[0], -1), dim=1)
    return (1.0 - x @ x.T).clamp_min(0.0)


def output_distance(gram: torch.Tensor) -> torch.Tensor:
    """d(i, j) = 1 − ρ_ij, ρ_ij = G_ij / sqrt(G_ii G_jj) (0 where a norm is 0), Eq. 154."""
    g = gram.double()
    v = g.diagonal()
    denom = (v[:, None] * v[None, :]).sqrt()
    rho = torch.where(denom > 0, g / denom.clamp_min(1e-300), torch.zeros_like(g))
    return 1.0 - rho


def group_experts(
    selected: list[int],
    k: int,
    grouping: str,
    *,
    experts: ExpertWeights | None = None,
    router: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
) -> list[list[int]]:
    """Partition the ranked selection into k groups of expert ids.

    `selected` is in rank order (best first). `experts` is the layer's stack (WC), `router` its router
    weight [E, H] (RC, AB), `gram` its output Gram matrix [E, E] (OC). Groups come back ordered by their
    best member's rank, members in rank order.
    """
    grouping = canonical(grouping, GROUPINGS, "grouping")
    K = len(selected)
    if k > K:
        raise MoECompressError(
            f"Cannot form {k} groups (the router's top-k) from K={K} experts; pass K >= {k}."
        )
    rank = {e: r for r, e in enumerate(selected)}
    if K == k:
        return [[e] for e in selected]
    idx = torch.tensor(selected)
    if grouping == "rr":
        groups = [[e for r, e in enumerate(selected) if r % k == g] for g in range(k)]
    elif grouping == "ab":
        if router is None:
            raise MoECompressError("Anchor-based grouping needs the router weights; pass the model.")
        anchors = selected[:k]
        groups = [[a] for a in anchors]
        sim = 1.0 - _cosine_distance(router.detach()[idx])  # [K, K] in selection order
        for r in range(k, K):
            best = max(range(k), key=lambda g: (float(sim[r, g]), -g))
            groups[best].append(selected[r])
    else:
        if grouping == "wc":
            if experts is None:
                raise MoECompressError("Weight clustering needs the expert weights; pass the model.")
            flat = torch.cat(
                [t.detach()[idx].reshape(K, -1).double() for t in (experts.gate, experts.up, experts.down)], 1
            )
            dist = _cosine_distance(flat)
        elif grouping == "rc":
            if router is None:
                raise MoECompressError("Router clustering needs the router weights; pass the model.")
            dist = _cosine_distance(router.detach()[idx])
        else:  # oc
            if gram is None:
                raise MoECompressError(
                    "Output clustering needs the expert-output Gram matrix (stat 'gram'); "
                    "calibrate with all-experts statistics or pass a calibration text to --calib."
                )
            dist = output_distance(gram)[idx][:, idx]
        groups = [[selected[r] for r in c] for c in average_linkage(dist, k)]
    groups = [sorted(g, key=rank.__getitem__) for g in groups]
    return sorted(groups, key=lambda g: rank[g[0]])


# ----------------------------------------------------------------------------- merge, scale, concatenate
def merge_weights(members: list[int], scores: torch.Tensor) -> list[float]:
    """w_e = s_e / Σ_{G_g} s (uniform when the group's scores sum to 0)."""
    s = torch.stack([scores[e] for e in members]).double().clamp_min(0)
    total = float(s.sum())
    if total <= 0 or not math.isfinite(total):
        return [1.0 / len(members)] * len(members)
    return (s / total).tolist()


def merge_group(experts: ExpertWeights, members: list[int], weights: list[float]) -> ExpertWeights:
    """Score-weighted parameter average of the group (identity for one member), in float64."""
    w = torch.tensor(weights, dtype=torch.float64)
    idx = torch.tensor(members)

    def avg(t: torch.Tensor) -> torch.Tensor:
        sel = t.detach()[idx].double()
        return (w.reshape(-1, *([1] * (sel.dim() - 1))) * sel).sum(0)

    return experts.map(avg)


def group_alphas(
    groups: list[list[int]],
    scores: torch.Tensor,
    scaling: str,
    *,
    rho: float = 1.0,
    gate_mean: torch.Tensor | None = None,
    weights: list[list[float]] | None = None,
) -> list[float]:
    """α_g per group: uniform ρ/k, proportional ρ·(Σ_{G_g} s)/(Σ_S s), or gate Σ_{G_g} w_e ḡ_e (module doc)."""
    scaling = canonical(scaling, SCALINGS, "scaling")
    k = len(groups)
    if scaling == "uniform":
        return [rho / k] * k
    if scaling == "proportional":
        sums = [float(sum(max(float(scores[e]), 0.0) for e in g)) for g in groups]
        total = sum(sums)
        if total <= 0:
            return [rho / k] * k
        return [rho * s / total for s in sums]
    if gate_mean is None:
        raise MoECompressError(
            "Gate scaling needs each expert's mean gate weight (stats 'routing_mass' and 'counts')."
        )
    weights = weights or [merge_weights(g, scores) for g in groups]
    return [float(sum(w * float(gate_mean[e]) for e, w in zip(g, ws))) for g, ws in zip(groups, weights)]


def concat_ffn(parts: list[ExpertWeights], alphas: list[float]) -> ExpertWeights:
    """One FFN from k experts: gate/up stacked by rows, down by columns scaled by α_g; Σ_g α_g b_down_g."""
    gate = torch.cat([p.gate for p in parts], 0)
    up = torch.cat([p.up for p in parts], 0)
    down = torch.cat([a * p.down for p, a in zip(parts, alphas)], 1)
    out = ExpertWeights(gate, up, down)
    if parts[0].has_bias:
        out.gate_bias = torch.cat([p.gate_bias for p in parts], 0)
        out.up_bias = torch.cat([p.up_bias for p in parts], 0)
        out.down_bias = sum(a * p.down_bias for p, a in zip(parts, alphas))
    return out


def append_ffn(a: ExpertWeights, b: ExpertWeights, scale: float = 1.0) -> ExpertWeights:
    """a followed by b's neurons (b's down scaled by `scale`); a missing bias counts as zeros."""
    out = ExpertWeights(
        torch.cat([a.gate, b.gate.to(a.gate)], 0),
        torch.cat([a.up, b.up.to(a.up)], 0),
        torch.cat([a.down, scale * b.down.to(a.down)], 1),
    )
    if a.has_bias or b.has_bias:

        def bias(w: ExpertWeights, name: str, n: int) -> torch.Tensor:
            t = getattr(w, name)
            return torch.zeros(n, dtype=a.gate.dtype) if t is None else t.to(a.gate.dtype)

        out.gate_bias = torch.cat(
            [bias(a, "gate_bias", a.gate.shape[0]), bias(b, "gate_bias", b.gate.shape[0])]
        )
        out.up_bias = torch.cat([bias(a, "up_bias", a.up.shape[0]), bias(b, "up_bias", b.up.shape[0])])
        out.down_bias = bias(a, "down_bias", a.down.shape[0]) + scale * bias(b, "down_bias", b.down.shape[0])
    return out


def pad_ffn(w: ExpertWeights, width: int) -> ExpertWeights:
    """Zero neurons up to `width`: exact, since act(0)·0 = 0 and zero down columns add nothing."""
    extra = width - w.gate.shape[0]
    if extra < 0:
        raise MoECompressError(f"Cannot pad an FFN of width {w.gate.shape[0]} down to {width}.")
    if extra == 0:
        return w
    z = lambda *s: torch.zeros(*s, dtype=w.gate.dtype)
    out = ExpertWeights(
        torch.cat([w.gate, z(extra, w.gate.shape[1])]),
        torch.cat([w.up, z(extra, w.up.shape[1])]),
        torch.cat([w.down, z(w.down.shape[0], extra)], 1),
        w.gate_bias,
        w.up_bias,
        w.down_bias,
    )
    if w.gate_bias is not None:
        out.gate_bias = torch.cat([w.gate_bias, z(extra)])
        out.up_bias = torch.cat([w.up_bias, z(extra)])
    return out


def ffn_apply(w: ExpertWeights, x: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """y = down(act(gate x + b_g, up x + b_u)) + b_d for a dense FFN (same maths as one expert)."""
    g = F.linear(x, w.gate.to(x.dtype), None if w.gate_bias is None else w.gate_bias.to(x.dtype))
    u = F.linear(x, w.up.to(x.dtype), None if w.up_bias is None else w.up_bias.to(x.dtype))
    return F.linear(act(g, u), w.down.to(x.dtype), None if w.down_bias is None else w.down_bias.to(x.dtype))


# ----------------------------------------------------------------------------- one layer, the model
@dataclass
class DenseLayer:
    """The converted FFN of one MoE layer: routed part (k concatenated groups) and the shared experts."""

    layer: int
    routed: ExpertWeights  # [k·I, H] / [H, k·I], float64
    shared: ExpertWeights | None  # the layer's shared experts as one FFN, or None
    shared_scale: float  # 1 (unscaled), or Qwen2-MoE's mean sigmoid gate when folded
    act: ExpertActivation
    plan: dict

    def ffn(self, append_shared: bool = True) -> ExpertWeights:
        if append_shared and self.shared is not None:
            return append_ffn(self.routed, self.shared, self.shared_scale)
        return self.routed


@dataclass
class DenseConversion:
    """Every MoE layer converted, plus the plan-like description saved beside the student."""

    config: DenseConfig
    layers: dict[int, DenseLayer]
    plan: dict = field(default_factory=dict)
    fold_shared: bool = True  # shared experts folded into the dense FFN (False: kept apart, one-expert MoE)

    def ffn(self, i: int) -> ExpertWeights:
        return self.layers[i].ffn(self.fold_shared)


def _shared_weights(adapter: MoEAdapter, i: int) -> ExpertWeights | None:
    """The layer's shared expert(s) as one FFN [I_s, H] (DeepSeek stacks n_shared experts in one MLP)."""
    shared = adapter.layer(i).shared
    if shared is None:
        return None
    lin = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, nn.Linear) for m in lin):
        raise MoECompressError(
            f"The shared expert of layer {i} is not a gate/up/down MLP; this family's shared "
            "experts cannot be folded into a dense FFN yet."
        )
    g, u, d = lin
    return ExpertWeights(
        g.weight.detach().double(),
        u.weight.detach().double(),
        d.weight.detach().double(),
        None if g.bias is None else g.bias.detach().double(),
        None if u.bias is None else u.bias.detach().double(),
        None if d.bias is None else d.bias.detach().double(),
    )


def convert_layer(
    adapter: MoEAdapter,
    i: int,
    stats: Mapping[str, torch.Tensor],
    config: DenseConfig,
    fold_shared: bool = True,
) -> DenseLayer:
    """Score → top-K → k groups → merge → scale → concatenate for MoE layer i (module doc)."""
    spec = adapter.router_spec(i)
    k, E = spec.top_k, spec.num_experts
    K = config.K or k
    if K < k:
        raise MoECompressError(
            f"K={K} is smaller than the router's top-k={k} in layer {i}; pass K >= {k} "
            "(K = top-k is pure pruning)."
        )
    if K > E:
        raise MoECompressError(f"K={K} exceeds the {E} experts of layer {i}; pass K <= {E}.")
    scores = importance(stats, config.criterion, i)
    selected = select_experts(stats, config.criterion, K, i)
    experts = adapter.experts(i)
    router_w, _, _ = adapter.router_params(i)
    gram = _get(stats, "gram", i) if config.grouping == "oc" and K > k else None
    groups = group_experts(selected, k, config.grouping, experts=experts, router=router_w, gram=gram)
    weights = [merge_weights(g, scores) for g in groups]
    counts = _get(stats, "counts", i)
    mass = _get(stats, "routing_mass", i)
    n = max(float(_get(stats, "tokens", i).reshape(-1)[0]), 1.0)
    mean_mass = float(mass.sum()) / n  # (1/N) Σ_t Σ_{e∈top-k(t)} g_e(t)
    rho = mean_mass if config.mass_scale else float(spec.routed_scaling_factor)
    gate_mean = torch.where(counts > 0, mass / counts.clamp_min(1), torch.zeros_like(mass))
    alphas = group_alphas(groups, scores, config.scaling, rho=rho, gate_mean=gate_mean, weights=weights)
    parts = [merge_group(experts, g, w) for g, w in zip(groups, weights)]
    routed = concat_ffn(parts, alphas)
    width = adapter.intermediate_size(i)
    shared = _shared_weights(adapter, i)
    shared_scale = 1.0
    shared_gate = adapter.layer(i).shared_gate is not None
    if shared is not None and shared_gate and fold_shared:
        if "shared_gate_mean" not in stats:
            raise MoECompressError(
                f"Folding layer {i}'s sigmoid-gated shared expert into a dense FFN needs its mean gate (stat "
                "'shared_gate_mean'); pass a calibration text to --calib, or use --shared-gate exact (one-expert MoE)."
            )
        shared_scale = float(torch.as_tensor(stats["shared_gate_mean"]).double().reshape(-1)[0])
    plan = {
        "layer": i,
        "num_experts": E,
        "top_k": k,
        "K": K,
        "router": spec.describe(),
        "scores": [round(float(x), 8) for x in scores],
        "selected": selected,
        "groups": [
            {
                "experts": g,
                "merge_weights": [round(x, 8) for x in w],
                "alpha": round(a, 8),
                "rows": [j * width, (j + 1) * width],
            }
            for j, (g, w, a) in enumerate(zip(groups, weights, alphas))
        ],
        "alpha_base": round(rho, 8),
        "mean_topk_mass": round(mean_mass, 8),
        "routed_width": k * width,
        "shared": None
        if shared is None
        else {
            "width": int(shared.gate.shape[0]),
            "gated": shared_gate,
            "folded": bool(fold_shared),
            "scale": round(shared_scale, 8) if fold_shared else None,
        },
    }
    return DenseLayer(i, routed, shared, shared_scale, adapter.layer(i).act, plan)


def convert(
    model_or_adapter,
    stats: Stats,
    config: DenseConfig | None = None,
    *,
    fold_shared: bool = True,
    progress: bool = True,
) -> DenseConversion:
    """Convert every MoE layer of a loaded model (see module doc); stats maps layer -> {name: tensor}."""
    config = config or DenseConfig()
    adapter = model_or_adapter if isinstance(model_or_adapter, MoEAdapter) else MoEAdapter(model_or_adapter)
    from rich.progress import Progress

    layers: dict[int, DenseLayer] = {}
    with Progress(transient=True, disable=not progress) as bar:
        job = bar.add_task("dense conversion", total=len(adapter.moe_layers))
        for i in adapter.moe_layers:
            if i not in stats:
                raise MoECompressError(
                    f"The calibration statistics have no entry for MoE layer {i}; they were made "
                    "for another model — recalibrate this one."
                )
            layers[i] = convert_layer(adapter, i, stats[i], config, fold_shared)
            bar.advance(job)
    plan = {
        "method": "dense",
        "params": config.model_dump(),
        "model_type": adapter.model_type,
        "fold_shared": fold_shared,
        "layers": [layers[i].plan for i in sorted(layers)],
    }
    return DenseConversion(config, layers, plan, fold_shared)


# ----------------------------------------------------------------------------- in-place view (sweeps)
class DenseFFN(nn.Module):
    """A converted layer as a module, installed in place of the MoE block through `MoEAdapter.set_block`."""

    def __init__(self, ffn: ExpertWeights, act: ExpertActivation, returns_tuple: bool = False, dtype=None):
        super().__init__()
        dtype = dtype or torch.float32
        for name, t in ffn.tensors().items():
            self.register_buffer(name, t.to(dtype), persistent=False)
        self.has_bias = ffn.has_bias
        self.act = act
        self.returns_tuple = returns_tuple

    def weights(self) -> ExpertWeights:
        b = self.has_bias
        return ExpertWeights(
            self.gate,
            self.up,
            self.down,
            self.gate_bias if b else None,
            self.up_bias if b else None,
            self.down_bias if b else None,
        )

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        out = ffn_apply(self.weights(), hidden_states, self.act)
        return (out, None) if self.returns_tuple else out


@contextlib.contextmanager
def dense_view(model_or_adapter, conversion: DenseConversion):
    """Temporarily run the model with every MoE block replaced by its dense FFN (restored on exit).

    The result computes what the exported dense student computes (same attention path, same FFN), so
    the pre-distillation sweep needs no checkpoint per configuration.
    """
    adapter = model_or_adapter if isinstance(model_or_adapter, MoEAdapter) else MoEAdapter(model_or_adapter)
    saved = {i: adapter.layer(i).block for i in adapter.moe_layers}
    try:
        for i in adapter.moe_layers:
            dt = adapter.expert_dtype(i)
            layer = conversion.layers[i]
            block = DenseFFN(layer.ffn(conversion.fold_shared), layer.act, adapter.returns_tuple, dtype=dt)
            if not conversion.fold_shared and layer.shared is not None:
                block = _WithShared(block, adapter, i)
            adapter.set_block(i, block)
        yield adapter.model
    finally:
        for i, block in saved.items():
            adapter.set_block(i, block)


class _WithShared(nn.Module):
    """Dense routed FFN plus the layer's original (gated) shared expert: the one-expert-MoE student."""

    def __init__(self, dense: DenseFFN, adapter: MoEAdapter, i: int):
        super().__init__()
        self.dense, self._adapter, self._i = dense, [adapter], i

    def forward(self, hidden_states, *args, **kwargs):
        out = self.dense(hidden_states)
        shape = hidden_states.shape
        shared = self._adapter[0].shared_forward(self._i, hidden_states.reshape(-1, shape[-1])).reshape(shape)
        if isinstance(out, tuple):
            return (out[0] + shared, *out[1:])
        return out + shared


# ----------------------------------------------------------------------------- statistics without a store
@torch.no_grad()
def collect_dense_stats(
    model, input_ids: torch.Tensor, batch_size: int = 8, gram: bool = True, progress: bool = True
) -> dict[int, dict[str, torch.Tensor]]:
    """The statistics of the module doc from a full forward over packed sequences input_ids [B, T].

    Float64 sums over every token (packed text, no padding). `gram` runs every expert on every token
    (E/k times the MoE compute). Also records Qwen2-MoE's mean shared-expert gate.
    """
    adapter = MoEAdapter(model)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    sums: dict[int, dict[str, torch.Tensor]] = {}
    handles = []

    def make_hook(i: int):
        E = adapter.num_experts(i)

        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            x = h.reshape(-1, h.shape[-1])
            r = adapter.route(i, x)
            s = sums.setdefault(
                i,
                {
                    n: torch.zeros(E, dtype=torch.float64)
                    for n in ("counts", "routing_mass", "prob", "prob_sel", "out_sq")
                },
            )
            s.setdefault("tokens", torch.zeros((), dtype=torch.float64))
            idx = r.index.reshape(-1)
            s["tokens"] += x.shape[0]
            s["counts"] += torch.bincount(idx, minlength=E).double()
            s["routing_mass"].index_add_(0, idx, r.weight.reshape(-1).double())
            probs = r.probs.double()
            s["prob"] += probs.sum(0)
            s["prob_sel"].index_add_(0, idx, probs.gather(1, r.index).reshape(-1))
            outs = []
            for e in range(E):
                tok = (r.index == e).any(-1)
                if gram:
                    y = adapter.expert_forward(i, e, x).double()
                    outs.append(y)
                    s["out_sq"][e] += y[tok].square().sum()
                elif tok.any():
                    s["out_sq"][e] += adapter.expert_forward(i, e, x[tok]).double().square().sum()
            if gram:
                f = torch.stack(outs).reshape(E, -1)
                s["gram"] = s.get("gram", torch.zeros(E, E, dtype=torch.float64)) + f @ f.T
            gate = adapter.layer(i).shared_gate
            if gate is not None:
                s["shared_gate"] = (
                    s.get("shared_gate", torch.zeros((), dtype=torch.float64))
                    + torch.sigmoid(gate(x).double()).sum()
                )

        return hook

    for i in adapter.moe_layers:
        handles.append(adapter.layer(i).block.register_forward_pre_hook(make_hook(i), with_kwargs=True))
    # a streamed teacher's skeleton is on the meta device until its first forward: never send the ids there
    dev = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    from rich.progress import Progress

    try:
        with Progress(transient=True, disable=not progress) as bar:
            job = bar.add_task("dense statistics", total=input_ids.shape[0])
            for b in range(0, input_ids.shape[0], batch_size):
                model(input_ids=input_ids[b : b + batch_size].to(dev), use_cache=False)
                bar.advance(job, min(batch_size, input_ids.shape[0] - b))
    finally:
        for h in handles:
            h.remove()
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i, s in sums.items():
        n = s["tokens"].clamp_min(1)
        c = s["counts"]
        d = {
            "counts": c.long(),
            "tokens": s["tokens"].long(),
            "routing_mass": s["routing_mass"],
            "pp": s["prob"] / n,
            "cp": torch.where(c > 0, s["prob_sel"] / c.clamp_min(1), torch.zeros_like(c)),
            "out_norm_sq_mean": torch.where(c > 0, s["out_sq"] / c.clamp_min(1), torch.zeros_like(c)),
        }
        if "gram" in s:
            d["gram"] = s["gram"] / n
        if "shared_gate" in s:
            d["shared_gate_mean"] = s["shared_gate"] / n
        out[i] = d
    return out


# ----------------------------------------------------------------------------- method registry entry
def stats_mapping(stats: StatsView | Stats | None) -> Stats:
    """{layer: {name: tensor}} from a `StatsView` (a calibration `StatsStore`: ``.layers`` / ``.layer(i)``) or a
    mapping (as it is, also when wrapped in `MappingStats`)."""
    if stats is None:
        raise MoECompressError(
            "The dense method needs calibration statistics; run moecompress calibrate "
            "--for-method dense first (or pass --calib SPEC)."
        )
    if isinstance(stats, Mapping):
        return stats
    if isinstance(stats, MappingStats):
        return stats.mapping
    return {int(i): stats.layer(int(i)) for i in stats.layers}


def build(config: DenseConfig, context: MethodContext):
    """Registry entry: a CompressionPlan in which every router slot of a layer maps to its dense FFN.

    Each MoE layer stores one ``dense_group`` expert (the k concatenated groups, width k·I, supplied
    as plan tensors ``dense.<layer>.gate|up|down``) under the ``aggregate`` gate: the router's
    selected weights are summed and the FFN runs once, so the stored FFN is divided by the mean
    top-k routing mass M̂ — for a renormalising router Σ g = M̂ on every token and the block equals
    the dense FFN exactly; otherwise it equals it on average. Shared experts stay the runtime's own.
    The dense method's real output is the dense checkpoint (`moecompress dense`,
    `moecompress.distill.dense_export.export_dense`).
    """
    from ..plan import CompressionPlan, LayerPlan, ModelInfo, Scope, StoredExpert
    from .streamed import plan_tensor_store

    adapter = context.adapter
    stats = stats_mapping(context.stats)
    info = ModelInfo.from_model(adapter)
    tensors = plan_tensor_store(adapter)  # streamed view: on disk layer by layer
    scopes, layers, layer_plans = [], [], []
    for i in adapter.moe_layers:
        # one layer at a time, as `convert` does it, but its float64 FFN is dropped once its plan tensors are made
        # (converting every layer first held all of them at once)
        if i not in stats:
            raise MoECompressError(
                f"The calibration statistics have no entry for MoE layer {i}; they were made "
                "for another model — recalibrate this one."
            )
        dl = convert_layer(adapter, i, stats[i], config, False)
        lp = dl.plan
        layer_plans.append(lp)
        dtype = adapter.expert_dtype(i)
        ffn = dl.routed
        mass = lp["mean_topk_mass"] if lp["mean_topk_mass"] > 0 else 1.0
        key = f"dense.{i}"
        tensors.update(
            {
                f"{key}.{name}": (t / mass if name in ("down", "down_bias") else t).to(dtype)
                for name, t in ffn.tensors().items()
            }
        )
        width = int(ffn.gate.shape[0])
        del dl, ffn
        sources = [(i, e) for g in lp["groups"] for e in g["experts"]]
        weights = [g["alpha"] for g in lp["groups"]] if lp["K"] == lp["top_k"] else None
        scopes.append(
            Scope(
                id=f"layer{i}",
                layers=[i],
                stored=[
                    StoredExpert(
                        id=0,
                        sources=sources,
                        construction="dense_group",
                        weights=weights,
                        tensor=key,
                        intermediate_size=width,
                    )
                ],
            )
        )
        layers.append(LayerPlan(layer=i, scope=f"layer{i}", gate="aggregate", slots=[0] * lp["num_experts"]))
    params = dict(config.model_dump(), layers=layer_plans)
    return CompressionPlan(model=info, scopes=scopes, layers=layers, method="dense", params=params), tensors


register_method("dense", DenseConfig, build, needs_stats=needs_stats, family="dense")

register_method_stats("dense", needs_stats())  # `moecompress calibrate --for-method dense`
