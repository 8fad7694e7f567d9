"""ConMoE: expert-pool consolidation by prototype reassignment (train-free, no weight updates).

For a scope G of `scope_size` consecutive MoE layers with routed-expert pool E_G and reduction ρ:

  K = max(1, round((1 − ρ)|E_G|))                                     (budget)
  d(e, e')  = mean_{W ∈ gate,up,down} 2‖W_e − W_e'‖_F / (‖W_e‖_F + ‖W_e'‖_F + 2ε)   (scoring.distance)
  a_e = (1/|D_e|) Σ_{t ∈ D_e} g_e(t)·‖e(h_t)‖₂   (0 if no token selected e)        (contribution)
  b_e = min_{e' ∈ E_G \\ {e}} d(e, e')                                              (replaceability)
  Norm_G(x_e) = (x_e − min_G x) / (max_G x − min_G x + ε);  s_e = ā_e · b̄_e
  P_G = TopK_{e ∈ E_G}(s_e, K);   m_G(e) = argmin_{p ∈ P_G} d(e, p)
  consolidated block: α_p(t) = Σ_{i ∈ T(t), m_G(E_i) = p} g_i(t)     (gate semantics `aggregate`)

Variants (selected by name in the registry, or by the config's fields):
  selection "adaptive" – top-K over the whole scope (the default);
  selection "fixed_k"  – shared candidate pool and shared map, but every layer contributes an equal
                         number round((1 − ρ)E_l) of its own experts, ranked by the same scope-normalised s_e;
  scope_size 1         – layer-local consolidation (both selections coincide);
  score "usage" (c_e), "reap" (ā_e alone), "distance" (b̄_e alone) – selection ablations; the map is
  always argmin d.
Post-hoc fusion diagnostics ("average", "arcee") rebuild each prototype from its cluster after the map
is fixed (see `merging.py`); they are not part of default ConMoE.

Everything in the first half of this module is a pure function of tensors; `build_conmoe` turns a
model + statistics into a CompressionPlan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import MoECompressError
from ..models import MoEAdapter
from ..scoring.budget import num_kept
from ..scoring.criteria import reap
from ..scoring.distance import projection_distance
from ..scoring.registry import get_criterion
from .context import MethodContext, StatsView, stat
from .registry import ViewUse

Selection = Literal["adaptive", "fixed_k"]
ScoreKind = Literal["conmoe", "usage", "reap", "distance"]
Fusion = Literal["none", "average", "arcee"]


# ----------------------------------------------------------------------------- pure functions


def scopes(moe_layers: list[int], scope_size: int) -> list[list[int]]:
    """Consecutive groups of `scope_size` MoE layers (the last one may be shorter)."""
    if scope_size < 1:
        raise MoECompressError(
            f"scope_size must be at least 1 (got {scope_size}); use 1 for layer-local consolidation."
        )
    layers = sorted(moe_layers)
    return [layers[i : i + scope_size] for i in range(0, len(layers), scope_size)]


def scope_budget(pool_size: int, ratio: float) -> int:
    """K = max(1, round((1 − ρ)|E_G|)); ρ in [0, 1) is the config's to check (ConMoEConfig.ratio)."""
    return num_kept(pool_size, ratio)


def minmax_normalise(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Norm_G(x) = (x − min x) / (max x − min x + ε) over the scope."""
    x = x.double()
    return (x - x.min()) / (x.max() - x.min() + eps)


def replaceability(distance: torch.Tensor) -> torch.Tensor:
    """b_e = min_{e' ≠ e} d(e, e'); a pool of one expert has b = 0."""
    n = distance.shape[0]
    if n < 2:
        return torch.zeros(n, dtype=torch.float64)
    d = distance.double().clone()
    d.fill_diagonal_(float("inf"))
    return d.min(dim=1).values


def contribution(gate_norm_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """a_e = Σ_{t ∈ D_e} g_e(t)‖e(h_t)‖₂ / |D_e| (0 when |D_e| = 0): REAP's score."""
    return reap(gate_norm_sum, count)


@dataclass
class ScopeScores:
    """Every quantity of one scope's prototype scoring, for inspection and reports."""

    a: torch.Tensor
    b: torch.Tensor
    a_bar: torch.Tensor
    b_bar: torch.Tensor
    score: torch.Tensor  # the selection score actually used (s_e for "conmoe")


def prototype_scores(
    a: torch.Tensor,
    distance: torch.Tensor,
    kind: ScoreKind = "conmoe",
    usage: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> ScopeScores:
    """ā, b̄ and the selection score: s_e = ā_e·b̄_e ("conmoe"), c_e ("usage"), ā_e ("reap"), b̄_e ("distance")."""
    a = a.double()
    b = replaceability(distance)
    a_bar, b_bar = minmax_normalise(a, eps), minmax_normalise(b, eps)
    if kind == "conmoe":
        s = a_bar * b_bar
    elif kind == "usage":
        if usage is None:
            raise MoECompressError(
                "The 'usage' selection needs expert selection counts; calibrate with counts."
            )
        s = usage.double()
    elif kind == "reap":
        s = a_bar
    elif kind == "distance":
        s = b_bar
    else:
        raise MoECompressError(f"Unknown prototype score '{kind}'; use conmoe, usage, reap or distance.")
    return ScopeScores(a, b, a_bar, b_bar, s)


def _order(scores: ScopeScores, candidates: list[int]) -> list[int]:
    """Candidates by descending score; ties by descending ā, then b̄, then scope position (deterministic)."""
    s, a, b = scores.score, scores.a_bar, scores.b_bar
    return sorted(candidates, key=lambda i: (-float(s[i]), -float(a[i]), -float(b[i]), i))


def select_prototypes(
    scores: ScopeScores,
    k: int,
    layer_of: list[int] | None = None,
    selection: Selection = "adaptive",
    ratio: float | None = None,
) -> list[int]:
    """P_G as sorted scope positions.

    adaptive: the top-K of the whole scope. fixed_k: each layer l keeps its own top round((1 − ρ)E_l)
    (ranked by the same scope-normalised score), so every layer stores an equal share.
    """
    n = len(scores.score)
    if selection == "adaptive" or layer_of is None or len(set(layer_of)) == 1:
        return sorted(_order(scores, list(range(n)))[:k])
    if selection != "fixed_k":
        raise MoECompressError(f"Unknown selection '{selection}'; use adaptive or fixed_k.")
    if ratio is None:
        raise MoECompressError("fixed_k selection needs the reduction ratio.")
    chosen: list[int] = []
    for layer in sorted(set(layer_of)):
        own = [i for i in range(n) if layer_of[i] == layer]
        chosen += _order(scores, own)[: scope_budget(len(own), ratio)]
    return sorted(chosen)


def assign_to_prototypes(distance: torch.Tensor, prototypes: list[int]) -> list[int]:
    """m_G(e) = argmin_{p ∈ P_G} d(e, p) as scope positions; ties go to the lower position and every
    prototype maps to itself (even if another prototype is at distance 0)."""
    if not prototypes:
        raise MoECompressError("A scope has no prototypes; use a smaller reduction ratio.")
    protos = sorted(prototypes)
    d = distance.double()[:, protos]
    best = d.argmin(dim=1).tolist()  # argmin returns the first minimum: the lower position on ties
    out = [protos[j] for j in best]
    for p in protos:
        out[p] = p
    return out


@dataclass
class ScopeConsolidation:
    """Result of ConMoE on one scope: members are (layer, expert) in scope order."""

    layers: list[int]
    members: list[tuple[int, int]]
    budget: int
    scores: ScopeScores
    prototypes: list[int]  # sorted scope positions
    assignment: list[int]  # scope position -> prototype scope position
    distance: torch.Tensor = field(repr=False)

    def clusters(self) -> dict[int, list[int]]:
        """A_p = {e : m_G(e) = p} for every prototype p (positions, ascending)."""
        out: dict[int, list[int]] = {p: [] for p in self.prototypes}
        for e, p in enumerate(self.assignment):
            out[p].append(e)
        return out

    def slot_map(self) -> dict[int, list[int]]:
        """Per layer: original slot -> index of its prototype in `prototypes` (the scope's stored order)."""
        index = {p: j for j, p in enumerate(self.prototypes)}
        out: dict[int, list[int]] = {layer: [] for layer in self.layers}
        for (layer, _e), p in zip(self.members, self.assignment):
            out[layer].append(index[p])
        return out


def consolidate_scope(
    layers: list[int],
    num_experts: list[int],
    distance: torch.Tensor,
    a: torch.Tensor,
    ratio: float,
    usage: torch.Tensor | None = None,
    score: ScoreKind = "conmoe",
    selection: Selection = "adaptive",
    eps: float = 1e-8,
) -> ScopeConsolidation:
    """ConMoE on one scope from plain tensors: distance [N, N] and a [N] over the scope's experts in
    (layer, expert) order, with `num_experts[j]` experts for `layers[j]`."""
    members = [(layer, e) for layer, n in zip(layers, num_experts) for e in range(n)]
    n = len(members)
    if distance.shape != (n, n) or a.shape[0] != n:
        raise MoECompressError(
            f"Scope {layers} has {n} experts but the distance/contribution tensors do not match."
        )
    k = scope_budget(n, ratio)
    sc = prototype_scores(a, distance, score, usage, eps)
    layer_of = [m[0] for m in members]
    protos = select_prototypes(sc, k, layer_of, selection, ratio)
    assignment = assign_to_prototypes(distance, protos)
    return ScopeConsolidation(list(layers), members, len(protos), sc, protos, assignment, distance)


_DIRECT_LIMIT = (
    1 << 24
)  # elements per projection below which the whole scope goes through one cdist (128 MB float64)
PROJECTIONS = ("gate", "up", "down")


def scope_distance(expert_stacks, eps: float = 1e-8, chunk: int = 16) -> torch.Tensor:
    """d over the concatenation of per-layer stacks ([E_l, ...] each), as `pairwise_distance` of the
    stacked scope, but in blocks of `chunk` experts (float64 per block) when the scope is large, so a
    scope of big experts never needs a float64 (or even a concatenated) copy of all its weights.

    `expert_stacks` is a list of per-layer ExpertWeights, or a callable ``name -> [per-layer [E_l, ...]
    tensors]`` of one projection (gate, up, down): the distance is a sum of per-projection terms, so a
    caller that reads the scope one projection at a time holds a third of its weights, not all of them.
    """
    if callable(expert_stacks):
        part = expert_stacks
    else:

        def part(name: str) -> list[torch.Tensor]:
            return [getattr(st, name) for st in expert_stacks]

    total = None
    for name in PROJECTIONS:
        tensors = part(name)
        if len({tuple(t.shape[1:]) for t in tensors}) > 1:
            raise MoECompressError(
                "Layers in one consolidation scope have experts of different shapes; use scope_size 1."
            )
        if total is None:
            sizes = [t.shape[0] for t in tensors]
            n = sum(sizes)
            direct = sum(t.numel() for t in tensors) <= _DIRECT_LIMIT
            if not direct:
                owner = [(j, e) for j, size in enumerate(sizes) for e in range(size)]
                total = torch.zeros(n, n, dtype=torch.float64)
        if direct:  # the whole scope in one cdist: exactly `pairwise_distance` of the stacked scope
            flat = torch.cat([t.detach() for t in tensors]).reshape(n, -1).double()
            term = projection_distance(flat, eps)
            total = term if total is None else total + term
            del flat
        else:
            _add_blockwise(total, [t.reshape(t.shape[0], -1) for t in tensors], owner, eps, chunk)
        del tensors
    d = total / 3.0
    d.fill_diagonal_(0.0)
    return d


def _add_blockwise(
    total: torch.Tensor, flats: list[torch.Tensor], owner: list[tuple[int, int]], eps: float, chunk: int
) -> None:
    """total += one projection's distance term, `chunk` × `chunk` blocks at a time (rows upcast per block)."""
    n = len(owner)

    def rows(lo: int, hi: int) -> torch.Tensor:
        return torch.stack([flats[j][e] for j, e in owner[lo:hi]]).double()

    norms = torch.stack([flats[j][e].double().norm() for j, e in owner])
    for i in range(0, n, chunk):
        a = rows(i, min(n, i + chunk))
        for j in range(i, n, chunk):
            b = a if j == i else rows(j, min(n, j + chunk))
            term = 2 * torch.cdist(a, b) / (norms[i : i + chunk, None] + norms[None, j : j + chunk] + 2 * eps)
            total[i : i + chunk, j : j + chunk] += term
            if j != i:
                total[j : j + chunk, i : i + chunk] += term.T


def stack_scope(expert_stacks: list) -> object:
    """Concatenate per-layer ExpertWeights stacks ([E_l, ...]) into one scope stack ([Σ E_l, ...])."""
    from ..models import ExpertWeights

    names = expert_stacks[0].tensors().keys()
    shapes = {tuple(s.gate.shape[1:]) for s in expert_stacks}
    if len(shapes) > 1:
        raise MoECompressError(
            "Layers in one consolidation scope have experts of different shapes; use scope_size 1."
        )
    return ExpertWeights(**{k: torch.cat([getattr(s, k).detach() for s in expert_stacks]) for k in names})


# ----------------------------------------------------------------------------- method: config -> plan


class ConMoEConfig(BaseModel):
    """ConMoE recipe parameters (defaults: adaptive selection, s = ā·b̄, scope of 4 MoE layers, no fusion)."""

    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(
        0.5, ge=0.0, lt=1.0, description="routed-expert reduction ρ; K = max(1, round((1−ρ)|E_G|))"
    )
    scope_size: int = Field(
        4, ge=1, description="consecutive MoE layers sharing a prototype pool (1 = layer-local)"
    )
    selection: Selection = Field(
        "adaptive", description="adaptive: top-K over the scope; fixed_k: equal per layer"
    )
    score: ScoreKind = Field("conmoe", description="conmoe (ā·b̄), usage (c_e), reap (ā), distance (b̄)")
    fusion: Fusion = Field("none", description="post-hoc diagnostic: none, average (routing-weighted), arcee")
    eps: float = Field(1e-8, gt=0.0)


# ConMoE's per-expert scores are entries of the one criteria registry (scoring/registry.py): the contribution
# a_e is REAP's score, the "usage" ablation c_e the frequency criterion's
CONTRIBUTION, USAGE = "reap", "frequency"


def needs_stats(config: ConMoEConfig) -> list[str]:
    """Statistics (calibration store names) a ConMoE config reads."""
    need = list(get_criterion(CONTRIBUTION).stats)
    if config.score == "usage":
        need += get_criterion(USAGE).stats
    if config.fusion != "none":
        need.append("routing_mass")
    return list(dict.fromkeys(need))


def expert_scores(stats: StatsView, criterion: str, layers: list[int]) -> torch.Tensor:
    """One registry criterion's per-expert scores over a scope's layers, concatenated in scope order."""
    entry = get_criterion(criterion)
    return torch.cat([entry.score(lambda name, _i=i: stat(stats, _i, name).double(), i, 0) for i in layers])


def scope_id(layers: list[int]) -> str:
    return f"layer{layers[0]}" if len(layers) == 1 else f"layers{layers[0]}-{layers[-1]}"


def consolidate(
    adapter: MoEAdapter, stats: StatsView, config: ConMoEConfig, progress: bool = False
) -> list[ScopeConsolidation]:
    """ConMoE on every scope of a model: prototypes and the map (no plan yet)."""
    out = []
    groups = scopes(adapter.moe_layers, config.scope_size)
    items = groups
    if progress:
        from rich.progress import track

        items = track(groups, description="ConMoE scopes", transient=True)
    for group in items:
        # one projection of the scope at a time, at the stored precision (distances are float64 either way)
        d = scope_distance(
            lambda name, group=group: [adapter.expert_part_at_rest(i, name) for i in group], config.eps
        )
        a = expert_scores(stats, CONTRIBUTION, group)
        usage = expert_scores(stats, USAGE, group) if config.score == "usage" else None
        out.append(
            consolidate_scope(
                group,
                [adapter.num_experts(i) for i in group],
                d,
                a,
                config.ratio,
                usage,
                config.score,
                config.selection,
                config.eps,
            )
        )
    return out


def conmoe_plan(
    info,
    results: list[ScopeConsolidation],
    config: ConMoEConfig,
    adapter=None,
    stats=None,
    method: str = "conmoe",
):
    """The CompressionPlan (+ tensors) of a consolidation: per scope the prototypes stored once (copies),
    every slot mapped to its prototype, gate `aggregate`. With fusion, each prototype is rebuilt from its
    cluster: "average" as a weighted merge (routing-mass weights), "arcee" with supplied tensors."""
    from ..plan import CompressionPlan, LayerPlan, Scope, StoredExpert
    from .merging import arcee_fuse_cluster, normalised_weights

    tensors: dict[str, torch.Tensor] = {}
    scope_list, layer_list = [], []
    for res in results:
        sid = scope_id(res.layers)
        clusters = res.clusters()
        mass = None
        stack = None
        if config.fusion != "none":
            mass = torch.cat([stat(stats, i, "routing_mass").double() for i in res.layers])
        if config.fusion == "arcee":
            stack = stack_scope([adapter.experts(i) for i in res.layers])
        stored = []
        for j, p in enumerate(res.prototypes):
            members = [p] + [m for m in clusters[p] if m != p]
            if config.fusion == "none" or len(members) == 1:
                stored.append(StoredExpert(id=j, sources=[res.members[p]]))
            elif config.fusion == "average":
                w = normalised_weights(mass[members])
                stored.append(
                    StoredExpert(
                        id=j,
                        sources=[res.members[m] for m in members],
                        construction="weighted_merge",
                        weights=[float(x) for x in w],
                    )
                )
            else:
                prefix = f"{sid}.fused{j}"
                fused = arcee_fuse_cluster(stack, p, members, mass)
                for name, t in fused.tensors().items():
                    tensors[f"{prefix}.{name}"] = t.detach().contiguous().clone()
                stored.append(
                    StoredExpert(
                        id=j,
                        sources=[res.members[m] for m in members],
                        construction="weighted_merge",
                        tensor=prefix,
                    )
                )
        scope_list.append(Scope(id=sid, layers=list(res.layers), stored=stored))
        for layer, slots in res.slot_map().items():
            layer_list.append(LayerPlan(layer=layer, scope=sid, gate="aggregate", slots=slots))
    plan = CompressionPlan(
        model=info, scopes=scope_list, layers=layer_list, method=method, params=config.model_dump(mode="json")
    )
    return plan, tensors


def build_conmoe(config: ConMoEConfig, context: MethodContext, method: str = "conmoe"):
    """Registry entry: (plan, tensors) for a model + calibration statistics."""
    from ..plan import ModelInfo

    adapter, stats = context.adapter, context.stats
    results = consolidate(adapter, stats, config, progress=context.progress)
    return conmoe_plan(ModelInfo.from_model(adapter), results, config, adapter, stats, method=method)


# ----------------------------------------------------------------------------- registry


def _variant(name: str, **defaults):
    """A config class for a named variant: the same fields and constraints, different defaults."""
    from copy import copy

    from pydantic import create_model

    fields = {}
    for key, value in defaults.items():
        info = copy(ConMoEConfig.model_fields[key])
        info.default = value
        fields[key] = (info.annotation, info)
    return create_model(f"ConMoEConfig_{name.replace('-', '_')}", __base__=ConMoEConfig, **fields)


VARIANTS: dict[str, dict] = {
    "conmoe": {},  # adaptive, s = ā·b̄, scope 4
    "conmoe-local": {"scope_size": 1},  # layer-local consolidation
    "conmoe-fixed-k": {"selection": "fixed_k"},  # cross-layer pool, equal prototypes per layer
    "conmoe-usage": {"score": "usage"},  # selection ablations
    "conmoe-reap": {"score": "reap"},
    "conmoe-distance": {"score": "distance"},
    "conmoe-average": {"fusion": "average"},  # post-hoc fusion diagnostics
    "conmoe-arcee": {"fusion": "arcee"},
}


def view_use(config: ConMoEConfig) -> ViewUse:
    """A scope of layers, counted conservatively: one float32 copy per layer of the scope plus a working one.
    The distances read one projection of the scope at a time as stored, so the measured peak is lower (the
    exporter stacking a scope's kept experts, BENCHMARKS.md "Streaming compress")."""
    return ViewUse(stored=1.0, compute=config.scope_size + 1.0)


def _register() -> None:
    from .registry import register_method

    for name, defaults in VARIANTS.items():
        cls = ConMoEConfig if not defaults else _variant(name, **defaults)
        register_method(
            name,
            cls,
            lambda cfg, ctx, _n=name: build_conmoe(cfg, ctx, method=_n),
            needs_stats,
            family="consolidate",
            view_use=view_use,
        )
    from .needs import register_method_stats  # `moecompress calibrate --for-method conmoe-…`

    for name in VARIANTS:  # one store serves every variant and fusion
        register_method_stats(name, needs_stats(ConMoEConfig(fusion="average", score="usage")))


_register()
