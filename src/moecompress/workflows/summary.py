"""`moecompress inspect`: structure, router semantics and a byte breakdown of a MoE checkpoint.

Works from the config alone (the model is built on the meta device), so inspecting a
1T-parameter hub model costs no memory; bytes assume the checkpoint's stored dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..atomic import dir_bytes
from ..models import MoEAdapter, load_config, skeleton


def _numel(module) -> int:
    """Parameters plus persistent buffers (e.g. DeepSeek-V3's e_score_correction_bias): what a checkpoint stores."""
    n = sum(p.numel() for p in module.parameters())
    for sub in module.modules():
        n += sum(
            b.numel()
            for name, b in sub.named_buffers(recurse=False)
            if name not in sub._non_persistent_buffers_set
        )
    return n


def _dtype_of(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    return dtype


def inspect_model(source: str, trust_remote_code: bool = False) -> dict:
    """Family, layers, experts, top-k, router semantics and bytes per category, as plain data."""
    config = load_config(source, trust_remote_code)
    model = skeleton(config)
    adapter = MoEAdapter(model)
    elem = torch.empty((), dtype=_dtype_of(config)).element_size()
    routed = router = shared = 0
    layers = []
    for i in adapter.moe_layers:
        layer = adapter.layer(i)
        n_routed = _numel(layer.storage.module)
        n_router = _numel(layer.router)
        n_shared = sum(_numel(m) for m in (layer.shared, layer.shared_gate) if m is not None)
        routed, router, shared = routed + n_routed, router + n_router, shared + n_shared
        layers.append(
            dict(
                layer=i,
                experts=layer.storage.num_experts,
                top_k=layer.spec.top_k,
                expert_width=layer.storage.intermediate_size,
                shared=layer.shared is not None,
                router=layer.spec.describe(),
                router_verified=layer.verified,
            )
        )
    total = _numel(model)
    rest = total - routed - router - shared
    first = adapter.layer(adapter.moe_layers[0])
    out = dict(
        source=str(source),
        model_type=adapter.model_type,
        architecture=type(model).__name__,
        declared_family=adapter.family is not None,
        num_layers=len(adapter.decoder_layers),
        moe_layers=adapter.moe_layers,
        dense_layers=adapter.dense_layers,
        experts_per_layer=sorted({d["experts"] for d in layers}),
        top_k=first.spec.top_k,
        router=first.spec.to_dict(),
        router_convention=first.spec.describe(),
        dtype=str(_dtype_of(config)),
        bytes=dict(
            routed_experts=routed * elem,
            router=router * elem,
            shared_experts=shared * elem,
            rest=rest * elem,
            total=total * elem,
        ),
        parameters=dict(routed_experts=routed, router=router, shared_experts=shared, rest=rest, total=total),
        layers=layers,
    )
    if Path(str(source)).is_dir():
        out["bytes_on_disk"] = dir_bytes(source)
    return out
