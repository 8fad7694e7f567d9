"""Refusals that depend only on the options, before any compute: a plan of the form a method makes with its
config (`preview_plan`), judged by the export format's own `reason` (`check_format_early`).

`compress --target llama.cpp --operator tilt` used to calibrate into ``<out>-calib`` and build the plan before the
GGUF writer refused its operators; the form of the plan (operators in the removed slots, the gate, packed merges)
never depended on the statistics, only which experts go does.
"""

from __future__ import annotations

from ..errors import MoECompressError


def check_format_early(
    model: str, method: str, config, target: str = "moecompress", format: str = "auto"
) -> None:
    """Refuse, before any compute (a calibration included), a ``--format`` or ``--target`` that cannot hold the
    plan `method` makes with `config` whatever its statistics say: a prune with replacement operators (tilt,
    constant, partial), remapped slots or a gate the runtime's router cannot express, PuzzleMoE's packed merges.
    The sentence is the one `pipeline.target_format` / `pipeline.choose_format` gives after the plan (they judge
    `preview_plan`, a plan of the same form); a refusal that depends on the statistics still comes after them."""
    from ..plan.targets import get_target
    from .pipeline import choose_format, target_format

    constrained = get_target(target).format is not None
    if not constrained and format == "auto":
        return  # auto picks a format that holds the plan
    try:
        preview = preview_plan(model, method, config)
    except MoECompressError:  # a plan the build itself refuses: its own sentence comes from the build
        return
    if preview is None:
        return
    if constrained:
        target_format(preview, target, format)
    else:
        choose_format(preview, format)


def preview_plan(model: str, method: str, config):
    """A plan of the form `method` with `config` builds on checkpoint `model`, for the refusals that depend only
    on the options (`check_format_early`), or None for a method whose form depends on its statistics.

    Which experts go is the statistics' choice; the form is not: prune removes ``num_kept`` of each layer and
    puts in their slots what its operator makes (`methods.prune.build_prune`), PuzzleMoE merges groups of its
    layout into packed experts (`methods.puzzle.build_puzzle`). Read from the config alone (no weights)."""
    from ..models import MoEAdapter, load_config, resolve_source, skeleton
    from ..plan import CompressionPlan
    from ..plan.model_info import ModelInfo

    layer = {"prune": _prune_layer, "puzzlemoe": _puzzle_layer}.get(method)
    if layer is None:
        return None
    source = resolve_source(model)
    info = ModelInfo.from_model(
        MoEAdapter(skeleton(load_config(source))), source=str(source), checkpoint=source
    )
    scopes, layers = zip(*(layer(config, li.layer, li.num_experts) for li in info.layers))
    return CompressionPlan(model=info, scopes=list(scopes), layers=list(layers), method=method)


def _prune_layer(config, i: int, count: int):
    """(scope, layer plan) of prune's form in layer `i`: the first ``num_kept`` experts kept (which ones is the
    statistics' choice), each removed slot what `config.operator` puts there, at its gate."""
    from ..plan.schema import ConstantOp, LayerPlan, PartialOp, Scope, StoredExpert, TiltOp
    from ..scoring import num_kept

    kept = num_kept(count, config.ratio)
    op = config.operator
    if op in ("reroute", "drop"):
        removed, gate = "drop", config.gate if op == "reroute" else "replace"
    elif op == "remap":
        removed, gate = 0, "aggregate"
    elif op == "constant" or (op == "tilt" and config.rank == 0):
        removed, gate = ConstantOp(tensor="preview"), "replace"
    elif op == "tilt":
        removed, gate = TiltOp(rank=config.rank, tensor="preview"), "replace"
    else:  # partial
        removed, gate = PartialOp(source=(i, 0), width=1, tensor="preview"), "replace"
    scope = Scope(
        id=f"layer{i}", layers=[i], stored=[StoredExpert(id=e, sources=[(i, e)]) for e in range(kept)]
    )
    slots = [e if e < kept else removed for e in range(count)]
    return scope, LayerPlan(layer=i, scope=f"layer{i}", gate=gate, slots=slots)


def _puzzle_layer(config, i: int, count: int):
    """(scope, layer plan) of PuzzleMoE's form in layer `i`: the groups of its layout (`group_layout`) each one
    packed stored expert, every other expert a copy."""
    from ..methods.puzzle import group_layout
    from ..plan.schema import LayerPlan, Scope, StoredExpert

    g, n = group_layout(count, config.ratio, config.group_size)
    merged, packing = n * g, (f"group{g}-bf16" if g > 2 else "pair-bf16")
    stored = [
        StoredExpert(
            id=k,
            sources=[(i, e) for e in range(k * g, (k + 1) * g)],
            construction="elementwise_merge",
            tensor=f"preview{k}",
            packing=packing,
        )
        for k in range(n)
    ]
    stored += [StoredExpert(id=n + j, sources=[(i, e)]) for j, e in enumerate(range(merged, count))]
    slots = [e // g if e < merged else n + e - merged for e in range(count)]
    return Scope(id=f"layer{i}", layers=[i], stored=stored), LayerPlan(
        layer=i, scope=f"layer{i}", gate="replace", slots=slots
    )
