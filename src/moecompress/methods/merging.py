"""Expert merging baselines (M-SMoE, HC-SMoE) and the post-hoc fusion operators used as ConMoE diagnostics.

M-SMoE (Li et al., 2024, "Merge, then compress"): per layer the K = round((1 − ρ)E) most-used experts
(selection count c_e) are cores; every other expert joins the core whose router-logit pattern is most
similar (cosine of the logit columns over calibration tokens); each group is merged by the usage-weighted
average W_g = Σ_{e∈g} c_e W_e / Σ_{e∈g} c_e.

HC-SMoE (Chen et al., 2025): per layer, hierarchical agglomerative clustering (average linkage by default;
single and complete as options) of the experts' mean outputs ō_e = (1/N) Σ_t f_e(h_t) over all N
calibration tokens (every expert run on every token) into K clusters; each cluster merged by the
frequency-weighted average (the same formula with c_e).

Either method keeps the router and sums the gate weights of slots in one group (gate semantics
`aggregate`, compact export), or merges the router rows of a group with the same weights
(r_g = Σ w̃_e r_e: a standard checkpoint with K experts, hf export).

Fusion diagnostics (ConMoE, after the prototype map is fixed):
  average – routing-weighted average of the cluster, weights = routing mass Σ_t g_e(t);
  arcee   – mergekit's `arcee_fusion`, base = the prototype: for a base θ_b and another model θ,
            importance I = |θ − θ_b| ⊙ KL(softmax(θ) ‖ softmax(θ_b)) (row-wise, broadcast over the row),
            τ = median(I) + 1.5·IQR(I), θ_fused = θ_b + 1[I ≥ τ] ⊙ (θ − θ_b).
            It is a two-model operator; a cluster is fused into its prototype one member at a time
            (members by descending routing weight, then index).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import MoECompressError
from ..models import ExpertWeights
from ..runtime.merged_router import (  # noqa: F401  (re-exported: plan-tensor conventions moved there)
    install_merged_router,
    merged_router_state,
    router_tensor_prefix,
)
from .context import MethodContext, stat

Linkage = Literal["average", "single", "complete"]
Metric = Literal["euclidean", "cosine"]


# ----------------------------------------------------------------------------- weighted averages


def normalised_weights(weights: torch.Tensor) -> torch.Tensor:
    """w̃ = w / Σ w; all-zero (no calibration token reached the group) falls back to equal weights."""
    w = weights.double().clamp_min(0.0)
    total = w.sum()
    if total <= 0:
        return torch.full_like(w, 1.0 / len(w))
    return w / total


def weighted_average(stack: ExpertWeights, weights: torch.Tensor) -> ExpertWeights:
    """Σ_i w̃_i W_i for every tensor of a stack of n experts ([n, ...]); computed in float64, returned in
    the stack's dtype."""
    w = normalised_weights(weights)

    def avg(t: torch.Tensor) -> torch.Tensor:
        return (w.view(-1, *([1] * (t.dim() - 1))) * t.double()).sum(0).to(t.dtype)

    return stack.map(avg)


def select(stack: ExpertWeights, idx: list[int]) -> ExpertWeights:
    return stack.map(lambda t: t[idx])


def merge_groups(stack: ExpertWeights, groups: list[list[int]], weights: torch.Tensor) -> list[ExpertWeights]:
    """One weighted average per group (indices into the stack)."""
    return [weighted_average(select(stack, g), weights[g]) for g in groups]


def groups_from_labels(labels: list[int]) -> list[list[int]]:
    """Label list -> groups of member indices, groups ordered by their smallest member."""
    out: dict[int, list[int]] = {}
    for e, lab in enumerate(labels):
        out.setdefault(lab, []).append(e)
    return sorted(out.values(), key=lambda g: g[0])


def merge_router_rows(
    groups: list[list[int]],
    weights: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    correction: torch.Tensor | None = None,
):
    """Router of the merged layer: row g = Σ_{e∈g} w̃_e r_e (same for bias and score-correction bias)."""

    def merge(t):
        if t is None:
            return None
        rows = []
        for g in groups:
            w = normalised_weights(weights[g])
            rows.append((w.view(-1, *([1] * (t.dim() - 1))) * t[g].double()).sum(0))
        return torch.stack(rows).to(t.dtype)

    return merge(weight), merge(bias), merge(correction)


# ----------------------------------------------------------------------------- M-SMoE


def cosine_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the columns of a matrix L [N, E] from its Gram matrix G = LᵀL [E, E]."""
    g = gram.double()
    norms = g.diagonal().clamp_min(0.0).sqrt()
    return g / (norms[:, None] * norms[None, :]).clamp_min(1e-300)


def router_logit_similarity(logits: torch.Tensor) -> torch.Tensor:
    """Cosine similarity between experts' router-logit columns over N tokens (logits [N, E]) -> [E, E]."""
    l = logits.double()
    return cosine_from_gram(l.T @ l)


def msmoe_groups(usage: torch.Tensor, similarity: torch.Tensor, k: int) -> list[list[int]]:
    """Cores = the k most-used experts (ties: lower index); every other expert joins the core with the
    highest similarity (ties: lower core index). Returns groups (core first, then members ascending),
    ordered by core index, so a group's first member is its representative slot."""
    e = len(usage)
    if not 1 <= k <= e:
        raise MoECompressError(f"M-SMoE needs between 1 and {e} groups, got {k}; use a ratio in [0, 1).")
    order = sorted(range(e), key=lambda i: (-float(usage[i]), i))
    cores = sorted(order[:k])
    groups = {c: [c] for c in cores}
    sim = similarity.double()
    for i in range(e):
        if i in groups:
            continue
        best = max(cores, key=lambda c: (float(sim[i, c]), -c))
        groups[best].append(i)
    return [[c] + sorted(groups[c][1:]) for c in cores]


# ----------------------------------------------------------------------------- HC-SMoE


def feature_distance(features: torch.Tensor, metric: Metric = "euclidean") -> torch.Tensor:
    """Pairwise distance [E, E] between rows of `features` (euclidean, or cosine distance 1 − cos)."""
    x = features.double()
    if metric == "euclidean":
        d = torch.cdist(x, x)
    elif metric == "cosine":
        d = 1.0 - cosine_from_gram(x @ x.T)
    else:
        raise MoECompressError(f"Unknown clustering metric '{metric}'; use euclidean or cosine.")
    d = (d + d.T) / 2
    d.fill_diagonal_(0.0)
    return d.clamp_min(0.0)


def agglomerative(distance: torch.Tensor, k: int, linkage: Linkage = "average") -> list[int]:
    """Agglomerative clustering into k clusters by the Lance–Williams updates
    single: min, complete: max, average: (n_i d_ik + n_j d_jk)/(n_i + n_j) (UPGMA).
    The closest pair merges first; ties go to the lexicographically lowest pair. Returns labels
    numbered by each cluster's smallest member."""
    n = distance.shape[0]
    if not 1 <= k <= n:
        raise MoECompressError(f"Cannot form {k} clusters of {n} experts; use a ratio in [0, 1).")
    d = distance.double().clone()
    d.fill_diagonal_(float("inf"))
    alive = list(range(n))
    members = {i: [i] for i in range(n)}
    while len(alive) > k:
        sub = d[alive][:, alive]
        flat = int(torch.argmin(sub))
        a, b = alive[flat // len(alive)], alive[flat % len(alive)]
        i, j = min(a, b), max(a, b)
        ni, nj = len(members[i]), len(members[j])
        if linkage == "single":
            row = torch.minimum(d[i], d[j])
        elif linkage == "complete":
            row = torch.maximum(d[i], d[j])
        elif linkage == "average":
            row = (ni * d[i] + nj * d[j]) / (ni + nj)
        else:
            raise MoECompressError(f"Unknown linkage '{linkage}'; use average, single or complete.")
        d[i], d[:, i] = row, row
        d[i, i] = float("inf")
        d[j], d[:, j] = float("inf"), float("inf")
        members[i] += members.pop(j)
        alive.remove(j)
    labels = [0] * n
    for c in alive:
        first = min(members[c])
        for m in members[c]:
            labels[m] = first
    return labels


def _scipy_clusters(distance: torch.Tensor, k: int, linkage: Linkage) -> list[int] | None:
    try:
        from scipy.cluster.hierarchy import cut_tree
        from scipy.cluster.hierarchy import linkage as sp_linkage
        from scipy.spatial.distance import squareform
    except ImportError:
        return None
    n = distance.shape[0]
    if n == 1:
        return [0]
    z = sp_linkage(squareform(distance.numpy(), checks=False), method=linkage)
    raw = cut_tree(z, n_clusters=k).reshape(-1).tolist()
    first: dict[int, int] = {}
    for e, lab in enumerate(raw):
        first.setdefault(lab, e)
    return [first[lab] for lab in raw]


def hierarchical_clusters(
    features: torch.Tensor,
    k: int,
    linkage: Linkage = "average",
    metric: Metric = "euclidean",
    backend: Literal["auto", "scipy", "torch"] = "auto",
) -> list[list[int]]:
    """HC-SMoE's clustering of experts by their mean outputs ([E, H]) into k groups (ordered by smallest
    member). scipy's linkage is used when installed (backend auto), else the built-in implementation."""
    if linkage not in ("average", "single", "complete"):
        raise MoECompressError(f"Unknown linkage '{linkage}'; use average, single or complete.")
    n = features.shape[0]
    if not 1 <= k <= n:
        raise MoECompressError(f"Cannot form {k} clusters of {n} experts; use a ratio in [0, 1).")
    dist = feature_distance(features, metric)
    labels = _scipy_clusters(dist, k, linkage) if backend in ("auto", "scipy") else None
    if labels is None:
        if backend == "scipy":
            raise MoECompressError("scipy is not installed; install it or use backend 'torch'.")
        labels = agglomerative(dist, k, linkage)
    return groups_from_labels(labels)


# ----------------------------------------------------------------------------- fusion diagnostics


def _quantiles(t: torch.Tensor, qs: list[float]) -> list[torch.Tensor]:
    """mergekit's quantile rule: sorted[floor(q·(n − 1))] with q in float32 (exact, never sampled)."""
    flat, _ = torch.sort(t.reshape(-1))
    idx = (torch.tensor(qs) * (flat.numel() - 1)).long()
    return [flat[i] for i in idx]


def arcee_fusion(base: torch.Tensor, other: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """mergekit `arcee_fusion` of one tensor: keep the base except where `other` differs importantly.

    I = |θ − θ_b| ⊙ KL(p ‖ q) with p = softmax(θ), q = softmax(θ_b) over the last dim (+ε),
    τ = median(I) + 1.5·(Q3(I) − Q1(I)), θ_fused = θ_b + 1[I ≥ τ] ⊙ (θ − θ_b).
    Computed in float32 (mergekit works in the merge dtype), returned in base's dtype.
    """
    b, o = base.float(), other.float()
    diff = (o - b).abs()
    p = torch.softmax(o, dim=-1) + eps
    q = torch.softmax(b, dim=-1) + eps
    kl = (p * torch.log(p / q)).sum(dim=-1)
    importance = diff * kl.unsqueeze(-1)
    q1, med, q3 = _quantiles(importance, [0.25, 0.5, 0.75])
    mask = (importance >= med + 1.5 * (q3 - q1)).float()
    return (b + mask * (o - b)).to(base.dtype)


def arcee_fuse_cluster(
    stack: ExpertWeights, prototype: int, members: list[int], weights: torch.Tensor | None = None
) -> ExpertWeights:
    """Fuse every other cluster member into the prototype with `arcee_fusion`, one at a time
    (descending routing weight, then index). A singleton cluster returns the prototype unchanged."""
    others = [m for m in members if m != prototype]
    if weights is not None:
        others.sort(key=lambda m: (-float(weights[m]), m))
    fused = select(stack, [prototype]).map(lambda t: t[0].clone())
    for m in others:
        nxt = select(stack, [m]).map(lambda t: t[0])
        fused = ExpertWeights(
            **{name: arcee_fusion(t, getattr(nxt, name)) for name, t in fused.tensors().items()}
        )
    return fused


def fuse_cluster(
    stack: ExpertWeights,
    prototype: int,
    members: list[int],
    weights: torch.Tensor,
    kind: Literal["average", "arcee"],
) -> ExpertWeights:
    """A fusion diagnostic for one prototype-centred cluster (indices into `stack`)."""
    if kind == "average":
        return weighted_average(select(stack, members), weights[members])
    if kind == "arcee":
        return arcee_fuse_cluster(stack, prototype, members, weights)
    raise MoECompressError(f"Unknown fusion '{kind}'; use none, average or arcee.")


# ----------------------------------------------------------------------------- methods: config -> plan

RouterMode = Literal["aggregate", "merge"]


class MSMoEConfig(BaseModel):
    """M-SMoE: usage cores, router-logit grouping, usage-weighted merging."""

    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(
        0.5, ge=0.0, lt=1.0, description="routed-expert reduction; K = round((1−ρ)E) per layer"
    )
    router: RouterMode = Field(
        "aggregate",
        description="aggregate: keep the router, sum gates (compact export); "
        "merge: merge router rows too (standard checkpoint)",
    )


class HCSMoEConfig(BaseModel):
    """HC-SMoE: hierarchical clustering of mean expert outputs, frequency-weighted merging."""

    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(
        0.5, ge=0.0, lt=1.0, description="routed-expert reduction; K = round((1−ρ)E) per layer"
    )
    linkage: Linkage = Field("average", description="average (default), single or complete linkage")
    metric: Metric = Field("euclidean", description="distance between mean outputs: euclidean or cosine")
    router: RouterMode = Field(
        "aggregate", description="aggregate (compact export) or merge (standard checkpoint)"
    )
    backend: Literal["auto", "scipy", "torch"] = Field("auto", description="clustering implementation")


def merged_plan(
    info,
    groups: dict[int, list[list[int]]],
    weights: dict[int, torch.Tensor],
    router: RouterMode,
    adapter=None,
    method: str = "merge",
    params: dict | None = None,
):
    """Plan (+ tensors) of per-layer merges: group g of layer l is stored expert g (a copy when alone, else a
    weighted merge with the normalised weights).

    router "aggregate": every slot maps to its group's expert, gate `aggregate` (the router is untouched).
    router "merge": only each group's first member (M-SMoE's core, HC-SMoE's lowest index) keeps a slot (renorm semantics, the others are dropped)
    and the plan tensors carry the merged router rows under `router.layer{l}.*`; installing them with
    `install_merged_router` before applying/exporting gives exactly a K-expert router with merged rows.
    """
    from ..plan import CompressionPlan, LayerPlan, Scope

    scopes, layers, tensors = [], [], {}
    for li in info.layers:
        gs = groups[li.layer]
        w = weights[li.layer]
        sid = f"layer{li.layer}"
        scopes.append(Scope(id=sid, layers=[li.layer], stored=_merged_stored(li.layer, gs, w)))
        slots: list = [0] * li.num_experts
        for j, g in enumerate(gs):
            for e in g:
                slots[e] = j
        if router == "aggregate":
            layers.append(LayerPlan(layer=li.layer, scope=sid, gate="aggregate", slots=slots))
            continue
        _check_router_merge(li, gs)
        firsts = {g[0]: j for j, g in enumerate(gs)}
        layers.append(
            LayerPlan(
                layer=li.layer,
                scope=sid,
                gate="renorm",
                slots=[firsts.get(e, "drop") for e in range(li.num_experts)],
            )
        )
        if adapter is None:
            raise MoECompressError("Merging router rows needs the model's routers; pass the adapter.")
        tensors.update(_merged_router_tensors(adapter, li.layer, gs, w))
    params = dict(params or {})
    plan = CompressionPlan(model=info, scopes=scopes, layers=layers, method=method, params=params)
    return plan, tensors


def _merged_stored(layer: int, gs: list[list[int]], w: torch.Tensor) -> list:
    """Layer `layer`'s stored experts: group j is stored expert j, a copy when alone, else a weighted merge with
    the normalised weights `w[g]`."""
    from ..plan import StoredExpert

    stored = []
    for j, g in enumerate(gs):
        if len(g) == 1:
            stored.append(StoredExpert(id=j, sources=[(layer, g[0])]))
        else:
            stored.append(
                StoredExpert(
                    id=j,
                    sources=[(layer, e) for e in g],
                    construction="weighted_merge",
                    weights=[float(x) for x in normalised_weights(w[g])],
                )
            )
    return stored


def _check_router_merge(li, gs: list[list[int]]) -> None:
    """Refuse merging layer `li`'s router rows into the groups `gs` where a merged router cannot route as the
    original: group-limited routing, or fewer groups than its top-k."""
    if li.n_group > 1:
        raise MoECompressError(
            f"Layer {li.layer} uses group-limited routing, which merged router rows cannot "
            "keep; use router: aggregate."
        )
    if len(gs) < li.top_k:
        raise MoECompressError(
            f"Merging layer {li.layer} into {len(gs)} experts leaves fewer than top-{li.top_k}; "
            "use a smaller ratio or router: aggregate."
        )


def _merged_router_tensors(adapter, layer: int, gs: list[list[int]], w: torch.Tensor) -> dict:
    """Layer `layer`'s merged router rows (weight, and bias / score-correction bias where it has them) under
    `router.layer{l}.*`."""
    rw, rb, rc = adapter.router_params(layer)
    mw, mb, mc = merge_router_rows(
        gs, w, rw.detach(), None if rb is None else rb.detach(), None if rc is None else rc.detach()
    )
    prefix = router_tensor_prefix(layer)
    tensors = {f"{prefix}.weight": mw}
    if mb is not None:
        tensors[f"{prefix}.bias"] = mb
    if mc is not None:
        tensors[f"{prefix}.e_score_correction_bias"] = mc
    return tensors


def _plan_of(config: MSMoEConfig | HCSMoEConfig, adapter, groups, weights, method: str):
    """`merged_plan` of a merge method's groups, under its config's router mode, recording the config."""
    from ..plan import ModelInfo

    info = ModelInfo.from_model(adapter)
    return merged_plan(info, groups, weights, config.router, adapter, method, config.model_dump(mode="json"))


def build_msmoe(config: MSMoEConfig, context: MethodContext, method: str = "m-smoe"):
    """Registry entry: M-SMoE plan (+ tensors) from counts and router-logit correlations."""
    from ..scoring.budget import num_kept

    adapter, stats = context.adapter, context.stats
    groups, weights = {}, {}
    for i in adapter.moe_layers:
        usage = stat(stats, i, "counts").double()
        sim = stat(stats, i, "router_logit_corr").double()
        groups[i] = msmoe_groups(usage, sim, num_kept(adapter.num_experts(i), config.ratio))
        weights[i] = usage
    return _plan_of(config, adapter, groups, weights, method)


def build_hcsmoe(config: HCSMoEConfig, context: MethodContext, method: str = "hc-smoe"):
    """Registry entry: HC-SMoE plan (+ tensors) from all-token mean outputs and counts."""
    from ..scoring.budget import num_kept

    adapter, stats = context.adapter, context.stats
    groups, weights = {}, {}
    for i in adapter.moe_layers:
        feats = stat(stats, i, "out_mean_all").double()
        groups[i] = hierarchical_clusters(
            feats,
            num_kept(adapter.num_experts(i), config.ratio),
            config.linkage,
            config.metric,
            config.backend,
        )
        weights[i] = stat(stats, i, "counts").double()
    return _plan_of(config, adapter, groups, weights, method)


def _register() -> None:
    from .registry import register_method

    register_method(
        "m-smoe", MSMoEConfig, build_msmoe, ["counts", "tokens", "router_logit_corr"], family="merge"
    )
    register_method(
        "hc-smoe", HCSMoEConfig, build_hcsmoe, ["counts", "tokens", "out_mean_all"], family="merge"
    )


_register()
