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

The selection (`conmoe_select.py`) and the distances (`conmoe_distance.py`) are pure functions of tensors;
`build_conmoe` here turns a model + statistics into a CompressionPlan.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..models import MoEAdapter
from ..scoring.registry import get_criterion
from .conmoe_distance import scope_distance, stack_scope
from .conmoe_select import ScopeConsolidation, ScoreKind, Selection, consolidate_scope, scopes
from .context import MethodContext, StatsView, stat
from .registry import ViewUse

Fusion = Literal["none", "average", "arcee"]


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
