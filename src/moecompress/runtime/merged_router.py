"""Merged router rows carried in a plan's tensors (M-SMoE / HC-SMoE with ``router: merge``).

A plan's tensors may hold, per layer, the merged router rows under ``router.layer{l}.*`` (`.weight` [K, H],
`.bias`, `.e_score_correction_bias`), in kept-slot order. Applying them is part of executing or exporting
the plan, so it lives with the runtime, below the methods that produce them and the exporters that write them.
"""

from __future__ import annotations

import torch


def router_tensor_prefix(layer: int) -> str:
    """PlanTensors prefix of a layer's merged router rows (`.weight` [K, H], `.bias`, `.e_score_correction_bias`)."""
    return f"router.layer{layer}"


def install_merged_router(model_or_adapter, plan, tensors) -> int:
    """Write a router-merging plan's merged rows into the kept slots of the original routers (in place).

    Under `renorm`, dropped slots are deleted from the router, so the kept rows alone decide routing:
    overwriting them with the merged rows makes the original-size model (and its runtime / hf export)
    route exactly like the K-expert merged router. Returns the number of layers changed (0 for plans
    without merged router rows)."""
    from ..models import MoEAdapter

    adapter = model_or_adapter if isinstance(model_or_adapter, MoEAdapter) else MoEAdapter(model_or_adapter)
    changed = 0
    with torch.no_grad():
        for lp in plan.layers:
            prefix = router_tensor_prefix(lp.layer)
            if f"{prefix}.weight" not in (tensors or {}):
                continue
            kept = [e for e, s in enumerate(lp.slots) if s != "drop"]
            order = [lp.slots[e] for e in kept]
            weight, bias, corr = adapter.router_params(lp.layer)
            for name, param in (("weight", weight), ("bias", bias), ("e_score_correction_bias", corr)):
                key = f"{prefix}.{name}"
                if key in tensors and param is not None:
                    param[kept] = tensors[key][order].to(param.dtype).to(param.device)
            changed += 1
    return changed


def merged_router_state(plan, tensors, layer: int, state: dict, router_rel: str) -> dict:
    """Layer `layer`'s state dict with the plan's merged router rows written into its kept slots.

    The streamed counterpart of `install_merged_router`: the exporter applies it to each layer as it reads
    it from the checkpoint, so a router-merging plan never needs the model in memory. `router_rel` is the
    router's name prefix in `state` (``mlp.gate.``); rows are cast to the checkpoint tensor's dtype, exactly
    as installing them in the float32 model and writing that model in the checkpoint's dtype did."""
    prefix = router_tensor_prefix(layer)
    if f"{prefix}.weight" not in (tensors or {}):
        return state
    lp = plan.layer(layer)
    kept = [e for e, s in enumerate(lp.slots) if s != "drop"]
    order = [lp.slots[e] for e in kept]
    out = dict(state)
    for name in ("weight", "bias", "e_score_correction_bias"):
        key, rel = f"{prefix}.{name}", f"{router_rel}{name}"
        if key in tensors and rel in state:
            t = state[rel].detach().clone()
            t[kept] = tensors[key][order].to(t.dtype)
            out[rel] = t
    return out
