"""MoE → dense conversion, the fitting maths (Algorithm 1 of "Pruning and Distilling Mixture-of-Experts into Dense LMs").

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

This module holds the recipe parameters (`DenseConfig`) and the maths of the steps above; `dense_convert` applies
them layer by layer to a model (`convert`, `dense_view`), `dense_stats` gathers the statistics without a store
(`collect_dense_stats`) and `dense` is the method's registry entry (`build`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from ..errors import MoECompressError
from ..models import ExpertActivation, ExpertWeights
from ..scoring import doptimal_kernel, greedy_doptimal
from ..scoring.registry import get_criterion

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
def get_stat(stats: Mapping[str, torch.Tensor], name: str, layer: int | None = None) -> torch.Tensor:
    """The statistic `name` as a float64 tensor, or a sentence saying how to recalibrate when it is missing."""
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
    return entry.score(lambda name: get_stat(stats, name, layer), -1 if layer is None else layer, 0)


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
        return greedy_doptimal(doptimal_kernel(s, get_stat(stats, "gram", layer)), K)
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
