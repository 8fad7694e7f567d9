"""The architectures the GGUF writer covers (`ARCHES`) and what differs between them (export/gguf.py writes the file).

Each entry records what llama.cpp's graph for the architecture computes where the GGUF cannot say otherwise, read
from its ``src/models/*.cpp`` and ``src/llama-model.cpp`` and its converter's class for the family
(``convert_hf_to_gguf.py`` / ``conversion/*.py``). The per-family parts are here too:

* DeepSeek-V2 (``deepseek2``): MLA attention as the converter writes it for llama.cpp's absorbed attention:
  ``kv_b_proj`` split per head into ``attn_k_b`` ([H, kv_lora, nope], transposed) and ``attn_v_b`` ([H, v, kv_lora]),
  no ``attn_kv_b`` (llama.cpp refuses a file with tensors it does not load); ``head_count_kv`` 1,
  ``key_length`` kv_lora + rope, ``value_length`` kv_lora, the ``*_mla`` lengths, ``rope.dimension_count`` the rope
  part, ``leading_dense_block_count`` (first_k_dense_replace: ``ffn_gate/up/down``), ``expert_shared_count``,
  ``expert_weights_scale`` (routed_scaling_factor); ``expert_weights_norm`` false and ``expert_gating_func`` softmax
  written explicitly (llama.cpp's defaults, which the converter leaves implicit); ``q_lora_rank`` 0 for a model
  with ``q_proj`` (the converter omits it, but llama.cpp reads the key for every model not 26 or 27 layers deep).
* GPT-OSS (``gpt-oss``): experts un-fused and un-transposed into ``ffn_{gate,up,down}_exps`` with their biases
  (``*_exps.bias``), attention sinks as ``attn_sinks.weight``, the router's bias, ``sliding_window``; llama.cpp
  hard-codes the clamped SwiGLU (alpha 1.702, limit 7) and sliding attention on even layers, so a config that
  differs is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MoECompressError


@dataclass(frozen=True)
class Arch:
    """What llama.cpp's graph for one architecture computes, where the GGUF cannot say otherwise."""

    arch: str  # gguf.MODEL_ARCH member
    renormalises: bool  # its build_moe_ffn call renormalises the top-k weights (norm_w, hard-coded or as this writer sets it)
    output_required: bool  # it needs output.weight (no fallback to token_embd for a tied head)
    expert_width_key: bool  # the expert width goes in expert_feed_forward_length (else feed_forward_length)
    rope_permuted: bool = False  # q/k rows permuted to GGML's rope layout, as the converter's LlamaModel does
    leading_dense: bool = False  # dense decoder layers before the MoE ones (leading_dense_block_count)
    expert_bias: bool = False  # experts carry biases (ffn_*_exps.bias)


# llama.cpp's src/models/{olmoe,qwen3moe,qwen2moe,llama,granite,deepseek2,openai-moe-iswa}.cpp and its converter's
# classes for these families
ARCHES = {
    "olmoe": Arch("OLMOE", renormalises=False, output_required=True, expert_width_key=False),
    "qwen3_moe": Arch("QWEN3MOE", renormalises=True, output_required=False, expert_width_key=True),
    "qwen2_moe": Arch("QWEN2MOE", renormalises=False, output_required=True, expert_width_key=True),
    "mixtral": Arch(
        "LLAMA", renormalises=True, output_required=False, expert_width_key=False, rope_permuted=True
    ),
    "granitemoe": Arch(
        "GRANITE_MOE", renormalises=True, output_required=False, expert_width_key=False, rope_permuted=True
    ),
    # expert_weights_norm is written false: DeepSeek-V2's router does not renormalise its top-k weights
    "deepseek_v2": Arch(
        "DEEPSEEK2", renormalises=False, output_required=False, expert_width_key=True, leading_dense=True
    ),
    # softmax over the top-k logits (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT): renormalised by construction
    "gpt_oss": Arch(
        "GPT_OSS", renormalises=True, output_required=True, expert_width_key=True, expert_bias=True
    ),
}
# Granite's multipliers, as its converter names them in the GGUF (llama.cpp requires the logit scale)
SCALES = (
    ("attention_multiplier", "add_attention_scale"),
    ("embedding_multiplier", "add_embedding_scale"),
    ("residual_multiplier", "add_residual_scale"),
    ("logits_scaling", "add_logit_scale"),
)
# llama.cpp's swiglu_oai constants (build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE)
_OAI_LIMIT = 7.0


def _refuse(what: str) -> MoECompressError:
    return MoECompressError(
        f"{what}; export with format='hf' and convert with llama.cpp's convert_hf_to_gguf.py."
    )


def dense_reason(plan, arch: Arch) -> str | None:
    """Why llama.cpp's `arch` cannot hold `plan`'s dense decoder layers (a clause), or None: only DeepSeek-V2's
    leading ones (first_k_dense_replace, llama.cpp's leading_dense_block_count) are held, and only as they are."""
    info = plan.model
    moe, n = sorted(lp.layer for lp in plan.layers), info.num_hidden_layers
    if moe == list(range(n)):
        return None
    if arch.leading_dense and moe == sorted(li.layer for li in info.layers) == list(range(n - len(moe), n)):
        return None
    if arch.leading_dense:
        return (
            f"some of its MoE layers are made dense, and llama.cpp's {arch.arch.lower()} holds only the model's "
            "leading dense layers"
        )
    return f"some of its decoder layers are dense, which llama.cpp's {arch.arch.lower()} cannot hold"


def check_family_config(cfg, model_type: str) -> None:
    """Refuse (one sentence) a DeepSeek-V2 or GPT-OSS config whose computation llama.cpp's graph does not express."""
    if model_type == "deepseek_v2" and not getattr(cfg, "n_shared_experts", None):
        raise _refuse("This DeepSeek-V2 model has no shared experts, which llama.cpp's deepseek2 requires")
    if model_type != "gpt_oss":
        return
    n = cfg.num_hidden_layers
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if list(getattr(cfg, "layer_types", None) or pattern) != pattern:
        raise _refuse(
            "This GPT-OSS model's sliding-attention layers are not the even ones, the only pattern llama.cpp's "
            "gpt-oss computes"
        )
    if float(getattr(cfg, "swiglu_limit", _OAI_LIMIT)) != _OAI_LIMIT:
        raise _refuse(
            f"This GPT-OSS model clamps its SwiGLU at {cfg.swiglu_limit}, and llama.cpp's gpt-oss at {_OAI_LIMIT}"
        )


def tensor_reason(model_type: str, name: str) -> str | None:
    """Why llama.cpp cannot hold the non-expert weight `name` quantized (a clause), or None when it can."""
    if model_type == "deepseek_v2" and name.endswith("kv_b_proj.weight"):
        return (
            f"its attention weight '{name}' is quantized, and llama.cpp's deepseek2 stores it transposed per head "
            "(attn_k_b), across the Q8_0/Q5_0/Q4_0 blocks"
        )
    return None


def add_attention_hparams(w, cfg, model_type: str) -> None:
    """The KV-head count and key/value lengths: DeepSeek-V2's MLA as its converter writes them, else the config's."""
    if model_type != "deepseek_v2":
        w.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None)
        if head_dim:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        return
    kv, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_head_count_kv(1)  # MLA with absorption: MQA over the compressed KV
    w.add_key_length(kv + rope)
    w.add_value_length(kv)
    w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_kv_lora_rank(kv)
    w.add_q_lora_rank(cfg.q_lora_rank or 0)  # 0: q_proj (attn_q), read by llama.cpp whatever the depth
    w.add_rope_dimension_count(rope)


def add_family_hparams(w, cfg, model_type: str, leading_dense: int) -> None:
    """The keys only one family has: DeepSeek-V2's dense lead, shared experts and routing; GPT-OSS's window."""
    import gguf

    if model_type == "deepseek_v2":
        w.add_vocab_size(cfg.vocab_size)
        w.add_leading_dense_block_count(leading_dense)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(float(cfg.routed_scaling_factor))
        w.add_expert_weights_norm(False)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    elif model_type == "gpt_oss":
        w.add_sliding_window(cfg.sliding_window)


def native_state(model_type: str, state: dict, cfg) -> dict:
    """`state` (checkpoint names) with the tensors llama.cpp stores differently renamed or split: DeepSeek-V2's
    kv_b_proj as k_b_proj / v_b_proj (which gguf's name map knows as attn_k_b / attn_v_b)."""
    if model_type != "deepseek_v2":
        return state
    out = {}
    for name, t in state.items():
        if not name.endswith("self_attn.kv_b_proj.weight"):
            out[name] = t
            continue
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = t.reshape(cfg.num_attention_heads, nope + v, t.shape[-1])
        k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
        out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2)  # [H, kv_lora, nope]
        out[name.replace("kv_b_proj", "v_b_proj")] = v_b  # [H, v, kv_lora]
    return out


def full_name(gname: str) -> str:
    """A GGUF tensor name with its ``.weight`` suffix (GPT-OSS's sinks are a bare parameter in the checkpoint)."""
    return gname if gname.endswith((".weight", ".bias")) else gname + ".weight"
