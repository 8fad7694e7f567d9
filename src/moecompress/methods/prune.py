"""Expert pruning: any selection criterion × any replacement operator × any gate scale.

`select_experts` decides which experts each layer keeps (criterion + budget); `build_prune` decides
what a removed slot computes (operator) and at which gate scale, and returns a CompressionPlan.
Holding the mask fixed while varying the operator is the fixed-mask comparison of the
replacement-operators paper; `moecompress grid` does exactly that.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import MoECompressError
from ..models import MoEAdapter
from ..plan import CompressionPlan, ConstantOp, LayerPlan, ModelInfo, PartialOp, Scope, StoredExpert, TiltOp
from ..scoring import criteria as C
from ..scoring import doptimal_kernel, greedy_doptimal, nonuniform_keep, num_kept, rank, uniform_keep
from ..scoring.distance import pairwise_distance
from ..scoring.registry import LayerInputs, criteria, get_criterion
from .context import MethodContext, StatsView
from .needs import register_method_stats
from .operators import fit_tilt, neuron_energy, partial_copy_bias, partial_copy_size
from .registry import WEIGHTLESS, ViewUse, register_method

OperatorName = Literal["reroute", "drop", "constant", "tilt", "partial", "remap"]

OPERATOR_STATS: dict[str, list[str]] = {
    "reroute": [],
    "drop": [],
    "remap": [],
    "constant": ["out_mean"],
    "tilt": [
        "moment_experts",
        "moment_count",
        "moment_in_mean",
        "moment_out_mean",
        "input_moment",
        "cross_moment",
    ],
    "partial": ["mid_channel_norm", "mid_mean"],
}


class PruneConfig(BaseModel):
    """Expert pruning recipe."""

    model_config = ConfigDict(extra="forbid")

    criterion: str = Field(
        "reap",
        description="selection criterion (higher score = kept): any criterion of the "
        "registry (scoring/registry.py) under its own name",
    )
    ratio: float = Field(0.5, ge=0.0, lt=1.0, description="fraction of routed experts removed")
    allocation: Literal["uniform", "nonuniform"] = Field(
        "uniform",
        description="the removed experts spread over layers: uniform = the same ratio in every layer, "
        "nonuniform = one global ranking (called `budget` before issue 34: --budget is auto's byte budget)",
    )
    operator: OperatorName = Field("reroute", description="what a removed slot computes")
    gate: Literal["keep", "renorm"] = Field("keep", description="gate scale when rerouting")
    remap: Literal["nearest", "functional"] = Field(
        "nearest",
        description="remap target: nearest by parameter distance, or functional (best output match "
        "among the 4 nearest, accepted only when two calibration folds agree, else nearest)",
    )
    # the upper bound refuses absurd ranks (1e35) before any compute; build_prune refuses ranks above the hidden size
    rank: int = Field(
        32, ge=0, le=2**16, description="tilt rank (0 = MoNE's constant); also sets the partial-copy budget"
    )
    ridge: float = Field(1e-3, ge=0.0, allow_inf_nan=False, description="scale-free ridge of the tilt fit")
    protect_super_experts: bool = Field(True, description="never prune experts with extreme output norms")
    seed: int = Field(0, ge=0, le=2**32 - 1)

    @model_validator(mode="before")
    @classmethod
    def _no_budget(cls, data):
        # --budget means one thing, auto's byte budget (issue 34); prune's old field of that name is `allocation`
        if isinstance(data, dict) and "budget" in data:
            raise ValueError(
                "prune takes no budget (--budget is auto's byte budget); set how removals spread over "
                "layers with allocation: uniform or nonuniform, and how many with ratio"
            )
        return data

    @field_validator("criterion")
    @classmethod
    def _known_criterion(cls, v: str) -> str:
        # the registry is the one list (a criterion added there is served here; not the variants other methods use)
        if v not in criteria():
            raise ValueError(f"unknown criterion '{v}'; known: {', '.join(criteria())}")
        return v


def needs_stats(config: PruneConfig) -> list[str]:
    functional = {"remap_error"} if config.operator == "remap" and config.remap == "functional" else set()
    return sorted(
        set(get_criterion(config.criterion).stats)
        | set(OPERATOR_STATS[config.operator])
        | functional
        | ({"out_norm_sq_mean"} if config.protect_super_experts else set())
    )


def _get(stats: StatsView, layer: int, name: str) -> torch.Tensor:
    return stats.get(layer, name).double()


def _inputs(stats: StatsView, layer: int, adapter: MoEAdapter | None) -> LayerInputs:
    """The layer's statistics, and its experts' weights for a data-free criterion."""
    if adapter is None:
        return LayerInputs(lambda name: _get(stats, layer, name))
    return LayerInputs(
        lambda name: _get(stats, layer, name),
        lambda e: adapter.get_expert(layer, e),
        adapter.num_experts(layer),
    )


def layer_scores(
    criterion: str, stats: StatsView, layer: int, seed: int = 0, adapter: MoEAdapter | None = None
) -> torch.Tensor:
    """Score [E] of every expert of `layer` under `criterion` (scoring/registry.py, scoring/criteria.py equations);
    `adapter` gives a data-free criterion the experts' weights."""
    entry = get_criterion(criterion)
    if entry.doptimal:
        raise MoECompressError(
            f"Criterion '{criterion}' has no per-expert score; use it through select_experts."
        )
    return entry.score(_inputs(stats, layer, adapter), layer, seed)


def select_experts(config: PruneConfig, adapter: MoEAdapter, stats: StatsView) -> dict[int, list[int]]:
    """Kept expert ids per MoE layer (sorted), under the config's criterion and budget."""
    protected = {}
    if config.protect_super_experts:
        for i in adapter.moe_layers:
            protected[i] = C.super_experts(
                _get(stats, i, "out_norm_sq_mean") * _get(stats, i, "counts"), _get(stats, i, "counts")
            )
    if get_criterion(config.criterion).doptimal:
        if config.allocation != "uniform":
            raise MoECompressError(
                "D-optimal selection chooses a set per layer; use allocation 'uniform' with it."
            )
        keep = {}
        for i in adapter.moe_layers:
            counts = _get(stats, i, "counts")
            base = get_criterion(config.criterion).score(_inputs(stats, i, adapter), i, config.seed)
            k = num_kept(len(counts), config.ratio)
            chosen = greedy_doptimal(doptimal_kernel(base, _get(stats, i, "gram")), k)
            keep[i] = _with_protected(sorted(chosen), protected.get(i), base)
            _check_feasible(adapter, i, keep[i], config.ratio)
        return keep
    scores = {i: layer_scores(config.criterion, stats, i, config.seed, adapter) for i in adapter.moe_layers}
    if config.allocation == "nonuniform":
        keep = nonuniform_keep(scores, config.ratio, {i: adapter.top_k(i) for i in adapter.moe_layers})
        return {i: _with_protected(v, protected.get(i), scores[i]) for i, v in keep.items()}
    out = {}
    for i in adapter.moe_layers:
        spec = adapter.router_spec(i)
        out[i] = uniform_keep(
            scores[i], config.ratio, spec.top_k, protected.get(i), spec.n_group, spec.topk_group
        )
    return out


def _with_protected(kept: list[int], protected: torch.Tensor | None, scores: torch.Tensor) -> list[int]:
    """Swap protected experts in for the lowest-scored unprotected kept ones (same count)."""
    if protected is None or not protected.any():
        return kept
    missing = [e for e in range(len(protected)) if protected[e] and e not in kept]
    removable = sorted((e for e in kept if not protected[e]), key=lambda e: (float(scores[e]), -e))
    for e, out in zip(missing, removable):
        kept = [x for x in kept if x != out] + [e]
    return sorted(kept)


def _check_feasible(adapter, layer: int, kept: list[int], ratio: float) -> None:
    if len(kept) < adapter.top_k(layer):
        raise MoECompressError(
            f"Ratio {ratio} keeps {len(kept)} experts in layer {layer}, fewer than top-k="
            f"{adapter.top_k(layer)}; use a smaller ratio."
        )


# ----------------------------------------------------------------------------- operators
def _operator_for(
    config: PruneConfig,
    adapter,
    stats,
    layer: int,
    e: int,
    kept: list[int],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    distance: torch.Tensor | None,
):
    """The slot target replacing pruned expert e of `layer`, adding any parameters to `tensors`."""
    key = f"layer{layer}.expert{e}"
    if config.operator == "drop":
        return "drop"
    if config.operator == "remap":
        return kept.index(
            remap_target(
                e, kept, distance, stats.get(layer, "remap_error") if config.remap == "functional" else None
            )
        )
    if config.operator == "constant" or (config.operator == "tilt" and config.rank == 0):
        tensors[f"{key}.value"] = _get(stats, layer, "out_mean")[e].to(dtype)
        return ConstantOp(tensor=key)
    if config.operator == "tilt":
        return _tilt_op(config, adapter, stats, layer, e, key, tensors, dtype)
    return _partial_op(config, adapter, stats, layer, e, key, tensors, dtype)


def _tilt_op(config: PruneConfig, adapter, stats, layer: int, e: int, key: str, tensors: dict, dtype):
    """The tilt operator (or, for an expert no token reached, its zero constant) fitted from expert e's
    moments; its parameters go to `tensors` under `key`."""
    sel = stats.get(layer, "moment_experts").tolist()
    if e not in sel:
        raise MoECompressError(
            f"The stats store has no input/output moments for expert {e} of layer {layer}; "
            "re-run calibration with --for-method tilt."
        )
    s = sel.index(e)
    n = float(stats.get(layer, "moment_count")[s])
    # one expert's rows only: the [S, H, H] moments of a layer are never read whole
    mom = lambda name: stats.get_row(layer, name, s).double() * n  # noqa: E731  means -> sums
    tilt = fit_tilt(
        n,
        mom("moment_in_mean"),
        mom("moment_out_mean"),
        mom("input_moment"),
        mom("cross_moment"),
        rank=min(config.rank, adapter.hidden_size),
        ridge=config.ridge,
    )
    if tilt.rank == 0:  # an expert no token reached: its constant is 0
        tensors[f"{key}.value"] = tilt.b.to(dtype)
        return ConstantOp(tensor=key)
    tensors.update(
        {
            f"{key}.U": tilt.B.to(dtype),
            f"{key}.V": tilt.A.T.contiguous().to(dtype),
            f"{key}.bias": tilt.b.to(dtype),
        }
    )
    return TiltOp(rank=tilt.rank, tensor=key)


def _partial_op(config: PruneConfig, adapter, stats, layer: int, e: int, key: str, tensors: dict, dtype):
    """The partial copy of expert e: its highest-energy neurons plus a bias for the rest; its parameters go to
    `tensors` under `key`."""
    w = adapter.get_expert(layer, e)
    if w.has_bias:
        raise MoECompressError(
            "Partial copies of experts with biases (GPT-OSS) are not supported; use tilt instead."
        )
    count = float(stats.get(layer, "counts")[e])
    width = max(1, min(partial_copy_size(config.rank, adapter.hidden_size), w.down.shape[1]))
    energy = neuron_energy(_get(stats, layer, "mid_channel_norm")[e].square(), count, w.down)
    neurons = torch.tensor(sorted(rank(energy)[:width]))
    mid_sum = _get(stats, layer, "mid_mean")[e] * count
    tensors.update(
        {
            f"{key}.gate": w.gate[neurons].to(dtype),
            f"{key}.up": w.up[neurons].to(dtype),
            f"{key}.down": w.down[:, neurons].to(dtype),
            f"{key}.bias": partial_copy_bias(mid_sum, count, w.down, neurons).to(dtype),
        }
    )
    return PartialOp(source=(layer, e), width=width, tensor=key)


def remap_target(
    e: int,
    kept: list[int],
    distance: torch.Tensor,
    fold_error: torch.Tensor | None = None,
    candidates: int = 4,
) -> int:
    """The retained expert a removed slot e maps to.

    nearest: argmin over kept p of the normalised parameter distance d(e, p). functional (fold_error
    [2, E, E] = mean ‖f_e − f_p‖² on e's routed tokens of each fold): among the `candidates` nearest,
    the one with the smallest output error — accepted only when both folds pick it, else nearest.
    """
    by_distance = sorted(kept, key=lambda p: (float(distance[e, p]), p))
    if fold_error is None:
        return by_distance[0]
    pool = by_distance[:candidates]
    picks = {min(pool, key=lambda p: (float(fold_error[k, e, p]), p)) for k in (0, 1)}
    return picks.pop() if len(picks) == 1 else by_distance[0]


def build_prune(config: PruneConfig, context: MethodContext):
    """CompressionPlan (+ operator tensors) for `config` on the context's model and stats."""
    adapter, stats = context.adapter, context.stats
    if stats is None and needs_stats(config):  # a data-free criterion with reroute reads no statistics
        raise MoECompressError(
            "Pruning needs calibration statistics; run moecompress calibrate first (or pass --calib SPEC)."
        )
    if config.operator in ("tilt", "partial") and config.rank > adapter.hidden_size:
        # it used to be clamped silently to the hidden size: an operator larger than the expert it replaces
        raise MoECompressError(
            f"Rank {config.rank} (--rank or params.rank) exceeds the model's hidden size "
            f"{adapter.hidden_size}, the largest a {config.operator} can use; lower it (a rank near "
            "the hidden size already costs more than the expert it replaces)."
        )
    keep = select_experts(config, adapter, stats)
    info = ModelInfo.from_model(adapter)
    params = config.model_dump()
    if config.operator == "reroute":
        return CompressionPlan.prune(info, keep, gate=config.gate, method="prune", params=params), {}
    tensors: dict[str, torch.Tensor] = {}
    scopes, layers = [], []
    for i in adapter.moe_layers:
        kept = keep[i]
        dtype = adapter.expert_dtype(i)
        distance = pairwise_distance(adapter.experts(i)) if config.operator == "remap" else None
        slots = []
        for e in range(adapter.num_experts(i)):
            slots.append(
                kept.index(e)
                if e in kept
                else _operator_for(config, adapter, stats, i, e, kept, tensors, dtype, distance)
            )
        sid = f"layer{i}"
        scopes.append(
            Scope(
                id=sid, layers=[i], stored=[StoredExpert(id=j, sources=[(i, e)]) for j, e in enumerate(kept)]
            )
        )
        gate = "aggregate" if config.operator == "remap" else "replace"
        layers.append(LayerPlan(layer=i, scope=sid, gate=gate, slots=slots))
    return CompressionPlan(model=info, scopes=scopes, layers=layers, method="prune", params=params), tensors


def tilt_moment_experts(
    config: PruneConfig, adapter: MoEAdapter, stats: StatsView
) -> dict[int, list[int]] | None:
    """The experts whose input/cross moments a tilt build reads: the ones `select_experts` removes (None: the
    config reads no moments). Their [S, H, H] moments are the largest statistics there are (two H x H per
    expert), so `compress` gathers them for these experts only, in a second pass (pipeline.calibrate_for)."""
    if config.operator != "tilt" or config.rank == 0:
        return None
    keep = select_experts(config, adapter, stats)
    return {i: sorted(set(range(adapter.num_experts(i))) - set(keep[i])) for i in adapter.moe_layers}


def view_use(config: PruneConfig) -> ViewUse:
    """Selection and the constant and tilt operators read statistics only; remap reads a layer's experts
    (parameter distances), a partial copy and a data-free criterion one expert at a time of a layer read as
    stored."""
    if config.operator == "remap":
        return ViewUse(stored=1.0, compute=1.0)
    if (
        config.operator == "partial" or get_criterion(config.criterion).weights
    ):  # one layer's experts at a time
        return ViewUse(stored=1.0, compute=0.0)
    return WEIGHTLESS


register_method(
    "prune",
    PruneConfig,
    build_prune,
    needs_stats,
    family="prune",
    moment_experts=tilt_moment_experts,
    view_use=view_use,
)


def _register_stats() -> None:
    """`calibrate --for-method prune` gathers what every criterion reads, so one store serves them all;
    `--for-method CRITERION` what prune with that criterion (and the default operator) reads."""
    every = set()
    for criterion in criteria():
        needs = needs_stats(PruneConfig(criterion=criterion))
        register_method_stats(criterion, needs)
        every |= set(needs)
    register_method_stats("routing-mass", needs_stats(PruneConfig(criterion="mass")))
    register_method_stats("sge", ["counts", "tokens", "routing_mass", "out_norm_mean", "out_norm_sq_mean"])
    register_method_stats("prune", sorted(every))
    register_method_stats("tilt", needs_stats(PruneConfig(operator="tilt")))  # its moments, for one operator


_register_stats()
