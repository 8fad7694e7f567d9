"""One declarative description per MoE family transformers ships.

A `FamilySpec` says where the MoE block, its router, its experts and its shared experts live
inside a decoder layer, and how to read the family's exact router semantics off its config.
Families not listed here go through the auto-detecting fallback in `adapter.py`, which finds
the same parts by shape and verifies a router convention against the HF router before use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .router import RouterSpec


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    router_spec: Callable[[object, int, int], RouterSpec]  # (config, num_experts, top_k) -> spec
    block_attrs: tuple[str, ...] = ("mlp",)
    router_attr: str = "gate"
    experts_attr: str = "experts"
    shared_attr: str | None = None
    shared_gate_attr: str | None = None  # Qwen2-MoE: sigmoid(shared_expert_gate(h)) scales the shared expert
    block_returns_tuple: bool = False  # GPT-OSS's MLP returns (hidden, router_scores)
    dense_family: str | None = None  # the dense model type with the same attention/norm path


def _softmax_topk(norm: bool | None = None):
    def make(config, e: int, k: int) -> RouterSpec:
        n = bool(getattr(config, "norm_topk_prob", False)) if norm is None else norm
        return RouterSpec(num_experts=e, top_k=k, norm_topk_prob=n)

    return make


def _deepseek_v2(config, e: int, k: int) -> RouterSpec:
    grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
    return RouterSpec(
        num_experts=e, top_k=k, norm_topk_prob=False, fp32_logits=True,
        n_group=int(config.n_group) if grouped else 1, topk_group=int(config.topk_group) if grouped else 1,
        group_score="max", routed_scaling_factor=float(config.routed_scaling_factor),
    )


def _deepseek_v3(config, e: int, k: int) -> RouterSpec:
    return RouterSpec(
        num_experts=e, top_k=k, scoring="sigmoid", norm_topk_prob=bool(config.norm_topk_prob),
        has_correction_bias=True, n_group=int(config.n_group or 1), topk_group=int(config.topk_group or 1),
        group_score="top2_sum", routed_scaling_factor=float(config.routed_scaling_factor),
        norm_eps=1e-20, fp32_logits=True,
    )


def _topk_then_softmax(bias: bool):
    def make(config, e: int, k: int) -> RouterSpec:
        return RouterSpec(num_experts=e, top_k=k, topk_before_softmax=True, has_bias=bias)

    return make


FAMILIES: dict[str, FamilySpec] = {
    f.model_type: f
    for f in [
        FamilySpec("qwen3_moe", _softmax_topk(), dense_family="qwen3"),
        FamilySpec("qwen2_moe", _softmax_topk(), shared_attr="shared_expert", shared_gate_attr="shared_expert_gate",
                   dense_family="qwen2"),
        FamilySpec("olmoe", _softmax_topk()),
        FamilySpec("mixtral", _softmax_topk(norm=True), dense_family="mistral"),
        FamilySpec("deepseek_v2", _deepseek_v2, shared_attr="shared_experts"),
        FamilySpec("deepseek_v3", _deepseek_v3, shared_attr="shared_experts"),
        FamilySpec("gpt_oss", _topk_then_softmax(bias=True), router_attr="router", block_returns_tuple=True),
        FamilySpec("granitemoe", _topk_then_softmax(bias=False), block_attrs=("block_sparse_moe",),
                   router_attr="router"),
        # Beam: DeepSeek-V3 router, but routed_scaling_factor is applied by the block after the experts
        # (the fallback rejects it because the HF router's weights are unscaled); equal to scaling the weights.
        FamilySpec("beam", _deepseek_v3, router_attr="gate"),
    ]
}
