"""The `dense` method's registry entry: MoE → dense conversion (Algorithm 1 of "Pruning and Distilling
Mixture-of-Experts into Dense LMs") as a CompressionPlan, one dense FFN per MoE layer.

The conversion lives beside this module: `dense_fit` (the recipe parameters `DenseConfig` and the maths:
scores, selection, grouping, merging, scaling, concatenation; its module doc states the algorithm),
`dense_convert` (one layer and the whole model, `convert`, and `dense_view`) and `dense_stats`
(`collect_dense_stats`, the statistics without a store).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import MoECompressError
from .context import MappingStats, MethodContext, StatsView
from .dense_convert import convert_layer
from .dense_fit import DenseConfig, Stats, needs_stats
from .needs import register_method_stats
from .registry import register_method


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


def _layer_scope(adapter, i: int, stats: Stats, config: DenseConfig, tensors):
    """MoE layer i converted (as `convert` does it) into its plan tensors ``dense.<i>.*`` in `tensors`, the
    float64 FFN dropped once they are made; returns (the layer's conversion plan, its Scope, its LayerPlan)."""
    from ..plan import LayerPlan, Scope, StoredExpert

    if i not in stats:
        raise MoECompressError(
            f"The calibration statistics have no entry for MoE layer {i}; they were made "
            "for another model — recalibrate this one."
        )
    dl = convert_layer(adapter, i, stats[i], config, False)
    lp = dl.plan
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
    stored = StoredExpert(
        id=0,
        sources=sources,
        construction="dense_group",
        weights=weights,
        tensor=key,
        intermediate_size=width,
    )
    scope = Scope(id=f"layer{i}", layers=[i], stored=[stored])
    layer = LayerPlan(layer=i, scope=f"layer{i}", gate="aggregate", slots=[0] * lp["num_experts"])
    return lp, scope, layer


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
    from ..checkpoint.view import plan_tensor_store
    from ..plan import CompressionPlan, ModelInfo

    adapter = context.adapter
    stats = stats_mapping(context.stats)
    info = ModelInfo.from_model(adapter)
    tensors = plan_tensor_store(adapter)  # streamed view: on disk layer by layer
    scopes, layers, layer_plans = [], [], []
    for i in adapter.moe_layers:
        # one layer at a time, as `convert` does it, but its float64 FFN is dropped once its plan tensors are made
        # (converting every layer first held all of them at once)
        lp, scope, layer = _layer_scope(adapter, i, stats, config, tensors)
        layer_plans.append(lp)
        scopes.append(scope)
        layers.append(layer)
    params = dict(config.model_dump(), layers=layer_plans)
    return CompressionPlan(model=info, scopes=scopes, layers=layers, method="dense", params=params), tensors


register_method("dense", DenseConfig, build, needs_stats=needs_stats, family="dense")

register_method_stats("dense", needs_stats())  # `moecompress calibrate --for-method dense`
