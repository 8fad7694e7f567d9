"""Plans built from a keep list or a slot assignment (`CompressionPlan.prune` / `remap`): per layer one scope
of copies of original experts. The functions take the plan class as an argument."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .model_info import ModelInfo
from .schema import GateSemantics, LayerPlan, Scope, StoredExpert


def _copies(layer: int, experts: Sequence[int]) -> Scope:
    """The scope of one layer storing a copy of each of `experts`, in order."""
    return Scope(
        id=f"layer{layer}",
        layers=[layer],
        stored=[StoredExpert(id=j, sources=[(layer, e)]) for j, e in enumerate(experts)],
    )


def prune(
    cls,
    model,
    keep: Mapping[int, Sequence[int]],
    gate: GateSemantics = "renorm",
    method: str = "prune",
    params: dict | None = None,
    source: str | None = None,
):
    """Keep the listed experts of each layer (copies); every other slot is dropped, at gate `gate`."""
    info = model if isinstance(model, ModelInfo) else ModelInfo.from_model(model, source)
    scopes, layers = [], []
    for li in info.layers:
        kept = sorted(set(int(e) for e in keep.get(li.layer, range(li.num_experts))))
        scopes.append(_copies(li.layer, kept))
        pos = {e: j for j, e in enumerate(kept)}
        layers.append(
            LayerPlan(
                layer=li.layer,
                scope=f"layer{li.layer}",
                gate=gate,
                slots=[pos.get(e, "drop") for e in range(li.num_experts)],
            )
        )
    return cls(model=info, scopes=scopes, layers=layers, method=method, params=params or {})


def remap(
    cls,
    model,
    assignment: Mapping[int, Sequence[int]],
    gate: GateSemantics = "aggregate",
    method: str = "remap",
    params: dict | None = None,
    source: str | None = None,
):
    """Per layer, slot e computes original expert assignment[e] (a retained prototype), stored once."""
    info = model if isinstance(model, ModelInfo) else ModelInfo.from_model(model, source)
    scopes, layers = [], []
    for li in info.layers:
        assign = [int(a) for a in assignment.get(li.layer, range(li.num_experts))]
        protos = sorted(set(assign))
        scopes.append(_copies(li.layer, protos))
        pos = {e: j for j, e in enumerate(protos)}
        layers.append(
            LayerPlan(layer=li.layer, scope=f"layer{li.layer}", gate=gate, slots=[pos[a] for a in assign])
        )
    return cls(model=info, scopes=scopes, layers=layers, method=method, params=params or {})
