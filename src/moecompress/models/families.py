"""One declarative description per MoE family transformers ships: everything the toolkit knows about it.

A `FamilySpec` says where the MoE block, its router, its experts and its shared experts live
inside a decoder layer, how to read the family's exact router semantics off its config, how its
experts are stored, which config key holds the expert count, what its dense student is, whether
its checkpoints can hold quantized experts in the `hf` format, and the tiny config the tests build.
Families not listed here go through the auto-detecting fallback in `adapter.py`, which finds
the same parts by shape and verifies a router convention against the HF router before use.

Adding a family is one entry here plus its tests (docs/architecture.md, "Worked example: a new family").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .router import RouterSpec
from .storage import FusedLayout

# config keys that may hold the routed-expert count, searched for families not declared here
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


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
    layout: FusedLayout = (
        "fused"  # the experts module's 3-D storage (GPT-OSS: transposed, interleaved, biased)
    )
    expert_count_key: str = "num_experts"  # the config.json key holding the routed-expert count
    # the dense model type with the identical attention + norm path (the student class of `dense`); the family's
    # own model type when every layer can be made dense in place (DeepSeek's first_k_dense_replace)
    dense_family: str | None = None
    # can the `hf` format hold its experts quantized? compressed-tensors quantizes per-expert 2-D
    # ``mlp.experts.E.{gate,up,down}_proj`` weights (`export.ct`); checkpoints that store the experts fused on disk
    # (GPT-OSS's gate_up_proj, Granite-MoE's input_linear) or under other names (Mixtral's w1/w2/w3) cannot
    hf_quantized: bool = True
    # where a decoder layer keeps its attention and (in dense layers: DeepSeek's first_k_dense_replace) its dense MLP;
    # `tensor_classes` reads them to give every weight a class (attention, dense_mlp, ...)
    attention_attr: str = "self_attn"
    dense_mlp_attr: str = "mlp"
    # config kwargs of the tiny random model the tests build (`testing.tiny_model`); None: no tiny model
    tiny: dict[str, Any] | None = field(default=None, hash=False)


def _softmax_topk(norm: bool | None = None):
    def make(config, e: int, k: int) -> RouterSpec:
        n = bool(getattr(config, "norm_topk_prob", False)) if norm is None else norm
        return RouterSpec(num_experts=e, top_k=k, norm_topk_prob=n)

    return make


def _deepseek_v2(config, e: int, k: int) -> RouterSpec:
    grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
    return RouterSpec(
        num_experts=e,
        top_k=k,
        norm_topk_prob=False,
        fp32_logits=True,
        n_group=int(config.n_group) if grouped else 1,
        topk_group=int(config.topk_group) if grouped else 1,
        group_score="max",
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


def _deepseek_v3(config, e: int, k: int) -> RouterSpec:
    return RouterSpec(
        num_experts=e,
        top_k=k,
        scoring="sigmoid",
        norm_topk_prob=bool(config.norm_topk_prob),
        has_correction_bias=True,
        n_group=int(config.n_group or 1),
        topk_group=int(config.topk_group or 1),
        group_score="top2_sum",
        routed_scaling_factor=float(config.routed_scaling_factor),
        norm_eps=1e-20,
        fp32_logits=True,
    )


def _topk_then_softmax(bias: bool):
    def make(config, e: int, k: int) -> RouterSpec:
        return RouterSpec(num_experts=e, top_k=k, topk_before_softmax=True, has_bias=bias)

    return make


_TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES: dict[str, FamilySpec] = {
    f.model_type: f
    for f in [
        FamilySpec(
            "qwen3_moe",
            _softmax_topk(),
            dense_family="qwen3",
            tiny=dict(
                _TINY,
                head_dim=8,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
            ),
        ),
        FamilySpec(
            "qwen2_moe",
            _softmax_topk(),
            shared_attr="shared_expert",
            shared_gate_attr="shared_expert_gate",
            dense_family="qwen2",
            tiny=dict(
                _TINY,
                intermediate_size=64,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=24,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=False,
            ),
        ),
        FamilySpec(
            "olmoe",
            _softmax_topk(),
            tiny=dict(
                _TINY, intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False
            ),
        ),
        FamilySpec(
            "mixtral",
            _softmax_topk(norm=True),
            expert_count_key="num_local_experts",
            dense_family="mistral",
            hf_quantized=False,
            tiny=dict(_TINY, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
        ),
        FamilySpec(
            "deepseek_v2",
            _deepseek_v2,
            shared_attr="shared_experts",
            expert_count_key="n_routed_experts",
            dense_family="deepseek_v2",
            tiny=dict(
                _TINY,
                intermediate_size=48,
                moe_intermediate_size=16,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=8,
                head_dim=8,
                num_key_value_heads=4,
                topk_method="group_limited_greedy",
                n_group=4,
                topk_group=2,
                routed_scaling_factor=1.5,
                num_hidden_layers=3,
            ),
        ),
        FamilySpec(
            "deepseek_v3",
            _deepseek_v3,
            shared_attr="shared_experts",
            expert_count_key="n_routed_experts",
            dense_family="deepseek_v3",
            tiny=dict(
                _TINY,
                intermediate_size=48,
                moe_intermediate_size=16,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=8,
                head_dim=8,
                num_key_value_heads=4,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                num_hidden_layers=3,
            ),
        ),
        FamilySpec(
            "gpt_oss",
            _topk_then_softmax(bias=True),
            router_attr="router",
            block_returns_tuple=True,
            layout="gpt_oss",
            expert_count_key="num_local_experts",
            hf_quantized=False,
            tiny=dict(
                _TINY,
                head_dim=8,
                intermediate_size=16,
                num_local_experts=8,
                num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"],
                sliding_window=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
        ),
        FamilySpec(
            "granitemoe",
            _topk_then_softmax(bias=False),
            block_attrs=("block_sparse_moe",),
            router_attr="router",
            expert_count_key="num_local_experts",
            dense_family="granite",
            hf_quantized=False,
            tiny=dict(_TINY, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
        ),
        # Beam: DeepSeek-V3 router, but routed_scaling_factor is applied by the block after the experts
        # (the fallback rejects it because the HF router's weights are unscaled); equal to scaling the weights.
        FamilySpec("beam", _deepseek_v3, router_attr="gate"),
    ]
}


def expert_count_keys(config) -> tuple[str, ...]:
    """The attributes of `config` (as its ``to_dict`` names them) that hold the routed-expert count: the
    family's declared key, or for an undeclared family every common key the config has."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    aliases = getattr(config, "attribute_map", {})
    present = config.to_dict()
    keys = (family.expert_count_key,) if family is not None else EXPERT_COUNT_KEYS
    return tuple(k for k in dict.fromkeys(aliases.get(k, k) for k in keys) if k in present)
