"""MoE → dense conversion of a loaded model: every MoE layer scored, grouped, merged, scaled and concatenated
into one dense FFN (`convert_layer`, `convert`; the maths in `dense_fit`), and the converted model run in place
of the MoE blocks (`dense_view`) for sweeps without a checkpoint per configuration."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import MoECompressError
from ..models import ExpertActivation, ExpertWeights, MoEAdapter
from .dense_fit import (
    DenseConfig,
    Stats,
    append_ffn,
    concat_ffn,
    ffn_apply,
    get_stat,
    group_alphas,
    group_experts,
    importance,
    merge_group,
    merge_weights,
    select_experts,
)


# ----------------------------------------------------------------------------- one layer, the model
@dataclass
class DenseLayer:
    """The converted FFN of one MoE layer: routed part (k concatenated groups) and the shared experts."""

    layer: int
    routed: ExpertWeights  # [k·I, H] / [H, k·I], float64
    shared: ExpertWeights | None  # the layer's shared experts as one FFN, or None
    shared_scale: float  # 1 (unscaled), or Qwen2-MoE's mean sigmoid gate when folded
    act: ExpertActivation
    plan: dict

    def ffn(self, append_shared: bool = True) -> ExpertWeights:
        if append_shared and self.shared is not None:
            return append_ffn(self.routed, self.shared, self.shared_scale)
        return self.routed


@dataclass
class DenseConversion:
    """Every MoE layer converted, plus the plan-like description saved beside the student."""

    config: DenseConfig
    layers: dict[int, DenseLayer]
    plan: dict = field(default_factory=dict)
    fold_shared: bool = True  # shared experts folded into the dense FFN (False: kept apart, one-expert MoE)

    def ffn(self, i: int) -> ExpertWeights:
        return self.layers[i].ffn(self.fold_shared)


def _shared_weights(adapter: MoEAdapter, i: int) -> ExpertWeights | None:
    """The layer's shared expert(s) as one FFN [I_s, H] (DeepSeek stacks n_shared experts in one MLP)."""
    shared = adapter.layer(i).shared
    if shared is None:
        return None
    lin = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, nn.Linear) for m in lin):
        raise MoECompressError(
            f"The shared expert of layer {i} is not a gate/up/down MLP; this family's shared "
            "experts cannot be folded into a dense FFN yet."
        )
    return mlp_weights(shared)


def mlp_weights(m: nn.Module) -> ExpertWeights:
    """A gate/up/down MLP's weights and biases as float64 `ExpertWeights`."""
    g, u, d = m.gate_proj, m.up_proj, m.down_proj
    return ExpertWeights(
        g.weight.detach().double(),
        u.weight.detach().double(),
        d.weight.detach().double(),
        None if g.bias is None else g.bias.detach().double(),
        None if u.bias is None else u.bias.detach().double(),
        None if d.bias is None else d.bias.detach().double(),
    )


def _kept_count(config: DenseConfig, top_k: int, num_experts: int, i: int) -> int:
    """K, the experts layer i keeps before grouping: the config's K (default: the router's top-k), refused
    below top-k or above the layer's experts."""
    k, E = top_k, num_experts
    K = config.K or k
    if K < k:
        raise MoECompressError(
            f"K={K} is smaller than the router's top-k={k} in layer {i}; pass K >= {k} "
            "(K = top-k is pure pruning)."
        )
    if K > E:
        raise MoECompressError(f"K={K} exceeds the {E} experts of layer {i}; pass K <= {E}.")
    return K


def _routing_scale(stats: Mapping[str, torch.Tensor], i: int, config: DenseConfig, spec):
    """(ρ, the measured mean top-k routing mass, each expert's mean gate weight ḡ_e [E]) of layer i: ρ is the
    router's routed_scaling_factor, or the measured mass with ``mass_scale``."""
    counts = get_stat(stats, "counts", i)
    mass = get_stat(stats, "routing_mass", i)
    n = max(float(get_stat(stats, "tokens", i).reshape(-1)[0]), 1.0)
    mean_mass = float(mass.sum()) / n  # (1/N) Σ_t Σ_{e∈top-k(t)} g_e(t)
    rho = mean_mass if config.mass_scale else float(spec.routed_scaling_factor)
    gate_mean = torch.where(counts > 0, mass / counts.clamp_min(1), torch.zeros_like(mass))
    return rho, mean_mass, gate_mean


def _shared_scale(
    stats: Mapping[str, torch.Tensor], i: int, shared: ExpertWeights | None, gated: bool, fold_shared: bool
) -> float:
    """The factor layer i's shared expert is appended with: 1, or its mean sigmoid gate when a gated shared
    expert (Qwen2-MoE) is folded into the dense FFN."""
    shared_scale = 1.0
    if shared is not None and gated and fold_shared:
        if "shared_gate_mean" not in stats:
            raise MoECompressError(
                f"Folding layer {i}'s sigmoid-gated shared expert into a dense FFN needs its mean gate (stat "
                "'shared_gate_mean'); pass a calibration text to --calib, or use --shared-gate exact (one-expert MoE)."
            )
        shared_scale = float(torch.as_tensor(stats["shared_gate_mean"]).double().reshape(-1)[0])
    return shared_scale


def _shared_plan(shared: ExpertWeights | None, gated: bool, fold_shared: bool, scale: float) -> dict | None:
    """The plan's description of layer i's shared expert (None without one)."""
    if shared is None:
        return None
    return {
        "width": int(shared.gate.shape[0]),
        "gated": gated,
        "folded": bool(fold_shared),
        "scale": round(scale, 8) if fold_shared else None,
    }


def convert_layer(
    adapter: MoEAdapter,
    i: int,
    stats: Mapping[str, torch.Tensor],
    config: DenseConfig,
    fold_shared: bool = True,
) -> DenseLayer:
    """Score → top-K → k groups → merge → scale → concatenate for MoE layer i (`dense_fit`'s module doc)."""
    spec = adapter.router_spec(i)
    k, E = spec.top_k, spec.num_experts
    K = _kept_count(config, k, E, i)
    scores = importance(stats, config.criterion, i)
    selected = select_experts(stats, config.criterion, K, i)
    experts = adapter.experts(i)
    router_w, _, _ = adapter.router_params(i)
    gram = get_stat(stats, "gram", i) if config.grouping == "oc" and K > k else None
    groups = group_experts(selected, k, config.grouping, experts=experts, router=router_w, gram=gram)
    weights = [merge_weights(g, scores) for g in groups]
    rho, mean_mass, gate_mean = _routing_scale(stats, i, config, spec)
    alphas = group_alphas(groups, scores, config.scaling, rho=rho, gate_mean=gate_mean, weights=weights)
    parts = [merge_group(experts, g, w) for g, w in zip(groups, weights)]
    routed = concat_ffn(parts, alphas)
    width = adapter.intermediate_size(i)
    shared = _shared_weights(adapter, i)
    shared_gate = adapter.layer(i).shared_gate is not None
    shared_scale = _shared_scale(stats, i, shared, shared_gate, fold_shared)
    plan = {
        "layer": i,
        "num_experts": E,
        "top_k": k,
        "K": K,
        "router": spec.describe(),
        "scores": [round(float(x), 8) for x in scores],
        "selected": selected,
        "groups": [
            {
                "experts": g,
                "merge_weights": [round(x, 8) for x in w],
                "alpha": round(a, 8),
                "rows": [j * width, (j + 1) * width],
            }
            for j, (g, w, a) in enumerate(zip(groups, weights, alphas))
        ],
        "alpha_base": round(rho, 8),
        "mean_topk_mass": round(mean_mass, 8),
        "routed_width": k * width,
        "shared": _shared_plan(shared, shared_gate, fold_shared, shared_scale),
    }
    return DenseLayer(i, routed, shared, shared_scale, adapter.layer(i).act, plan)


def convert(
    model_or_adapter,
    stats: Stats,
    config: DenseConfig | None = None,
    *,
    fold_shared: bool = True,
    progress: bool = True,
) -> DenseConversion:
    """Convert every MoE layer of a loaded model (see module doc); stats maps layer -> {name: tensor}."""
    config = config or DenseConfig()
    adapter = model_or_adapter if isinstance(model_or_adapter, MoEAdapter) else MoEAdapter(model_or_adapter)
    from rich.progress import Progress

    layers: dict[int, DenseLayer] = {}
    with Progress(transient=True, disable=not progress) as bar:
        job = bar.add_task("dense conversion", total=len(adapter.moe_layers))
        for i in adapter.moe_layers:
            if i not in stats:
                raise MoECompressError(
                    f"The calibration statistics have no entry for MoE layer {i}; they were made "
                    "for another model — recalibrate this one."
                )
            layers[i] = convert_layer(adapter, i, stats[i], config, fold_shared)
            bar.advance(job)
    plan = {
        "method": "dense",
        "params": config.model_dump(),
        "model_type": adapter.model_type,
        "fold_shared": fold_shared,
        "layers": [layers[i].plan for i in sorted(layers)],
    }
    return DenseConversion(config, layers, plan, fold_shared)


# ----------------------------------------------------------------------------- in-place view (sweeps)
class DenseFFN(nn.Module):
    """A converted layer as a module, installed in place of the MoE block through `MoEAdapter.set_block`."""

    def __init__(self, ffn: ExpertWeights, act: ExpertActivation, returns_tuple: bool = False, dtype=None):
        super().__init__()
        dtype = dtype or torch.float32
        for name, t in ffn.tensors().items():
            self.register_buffer(name, t.to(dtype), persistent=False)
        self.has_bias = ffn.has_bias
        self.act = act
        self.returns_tuple = returns_tuple

    def weights(self) -> ExpertWeights:
        b = self.has_bias
        return ExpertWeights(
            self.gate,
            self.up,
            self.down,
            self.gate_bias if b else None,
            self.up_bias if b else None,
            self.down_bias if b else None,
        )

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        out = ffn_apply(self.weights(), hidden_states, self.act)
        return (out, None) if self.returns_tuple else out


@contextlib.contextmanager
def dense_view(model_or_adapter, conversion: DenseConversion):
    """Temporarily run the model with every MoE block replaced by its dense FFN (restored on exit).

    The result computes what the exported dense student computes (same attention path, same FFN), so
    the pre-distillation sweep needs no checkpoint per configuration.
    """
    adapter = model_or_adapter if isinstance(model_or_adapter, MoEAdapter) else MoEAdapter(model_or_adapter)
    saved = {i: adapter.layer(i).block for i in adapter.moe_layers}
    try:
        for i in adapter.moe_layers:
            dt = adapter.expert_dtype(i)
            layer = conversion.layers[i]
            block = DenseFFN(layer.ffn(conversion.fold_shared), layer.act, adapter.returns_tuple, dtype=dt)
            if not conversion.fold_shared and layer.shared is not None:
                block = _WithShared(block, adapter, i)
            adapter.set_block(i, block)
        yield adapter.model
    finally:
        for i, block in saved.items():
            adapter.set_block(i, block)


class _WithShared(nn.Module):
    """Dense routed FFN plus the layer's original (gated) shared expert: the one-expert-MoE student."""

    def __init__(self, dense: DenseFFN, adapter: MoEAdapter, i: int):
        super().__init__()
        self.dense, self._adapter, self._i = dense, [adapter], i

    def forward(self, hidden_states, *args, **kwargs):
        out = self.dense(hidden_states)
        shape = hidden_states.shape
        shared = self._adapter[0].shared_forward(self._i, hidden_states.reshape(-1, shape[-1])).reshape(shape)
        if isinstance(out, tuple):
            return (out[0] + shared, *out[1:])
        return out + shared
