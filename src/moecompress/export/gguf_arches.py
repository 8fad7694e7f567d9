"""The architectures the GGUF writer covers (`ARCHES`, filled by `register_arch`) and what differs between them, as
one `Arch` (or a subclass overriding its hooks) per family (export/gguf.py writes the file and calls the hooks).

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
    """What llama.cpp's graph for one architecture computes, where the GGUF cannot say otherwise, and the hooks
    where a family's file differs from the common one (each a no-op here; a family overrides what it needs).

    One class per family that needs hooks, registered with `register_arch` where it is defined; a family with
    none is one `register_arch` call with an `Arch(...)`."""

    arch: str  # gguf.MODEL_ARCH member
    renormalises: bool  # its build_moe_ffn call renormalises the top-k weights (norm_w, hard-coded or as this writer sets it)
    output_required: bool  # it needs output.weight (no fallback to token_embd for a tied head)
    expert_width_key: bool  # the expert width goes in expert_feed_forward_length (else feed_forward_length)
    rope_permuted: bool = False  # q/k rows permuted to GGML's rope layout, as the converter's LlamaModel does
    leading_dense: bool = False  # dense decoder layers before the MoE ones (leading_dense_block_count)
    expert_bias: bool = False  # experts carry biases (ffn_*_exps.bias)

    def check_config(self, cfg) -> None:
        """Refuse (one sentence) a config whose computation llama.cpp's graph does not express."""

    def tensor_reason(self, name: str) -> str | None:
        """Why llama.cpp cannot hold the non-expert weight `name` quantized (a clause), or None when it can."""
        return None

    def add_attention_hparams(self, w, cfg) -> None:
        """The KV-head count and key/value lengths, as the config gives them."""
        w.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None)
        if head_dim:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)

    def add_family_hparams(self, w, cfg, leading_dense: int) -> None:
        """The keys only this family has."""

    def native_state(self, state: dict, cfg) -> dict:
        """`state` (checkpoint names) with the tensors llama.cpp stores differently renamed or split."""
        return state


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


ARCHES: dict[str, Arch] = {}  # model_type -> its architecture, filled by `register_arch`


def register_arch(model_type: str, arch: Arch) -> Arch:
    """Register `arch` as what the GGUF writer writes for checkpoints of `model_type`."""
    ARCHES[model_type] = arch
    return arch


# llama.cpp's src/models/{olmoe,qwen3moe,qwen2moe,llama,granite,deepseek2,openai-moe-iswa}.cpp and its converter's
# classes for these families
register_arch("olmoe", Arch("OLMOE", renormalises=False, output_required=True, expert_width_key=False))
register_arch("qwen3_moe", Arch("QWEN3MOE", renormalises=True, output_required=False, expert_width_key=True))
register_arch("qwen2_moe", Arch("QWEN2MOE", renormalises=False, output_required=True, expert_width_key=True))
register_arch(
    "mixtral",
    Arch("LLAMA", renormalises=True, output_required=False, expert_width_key=False, rope_permuted=True),
)
register_arch(
    "granitemoe",
    Arch("GRANITE_MOE", renormalises=True, output_required=False, expert_width_key=False, rope_permuted=True),
)


@dataclass(frozen=True)
class DeepSeekV2Arch(Arch):
    """DeepSeek-V2's MLA attention, dense lead, shared experts and routing keys (module doc)."""

    def check_config(self, cfg) -> None:
        if not getattr(cfg, "n_shared_experts", None):
            raise _refuse(
                "This DeepSeek-V2 model has no shared experts, which llama.cpp's deepseek2 requires"
            )

    def tensor_reason(self, name: str) -> str | None:
        if name.endswith("kv_b_proj.weight"):
            return (
                f"its attention weight '{name}' is quantized, and llama.cpp's deepseek2 stores it transposed per "
                "head (attn_k_b), across the Q8_0/Q5_0/Q4_0 blocks"
            )
        return None

    def add_attention_hparams(self, w, cfg) -> None:
        kv, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        w.add_head_count_kv(1)  # MLA with absorption: MQA over the compressed KV
        w.add_key_length(kv + rope)
        w.add_value_length(kv)
        w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_kv_lora_rank(kv)
        w.add_q_lora_rank(cfg.q_lora_rank or 0)  # 0: q_proj (attn_q), read by llama.cpp whatever the depth
        w.add_rope_dimension_count(rope)

    def add_family_hparams(self, w, cfg, leading_dense: int) -> None:
        import gguf

        w.add_vocab_size(cfg.vocab_size)
        w.add_leading_dense_block_count(leading_dense)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(float(cfg.routed_scaling_factor))
        w.add_expert_weights_norm(False)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)

    def native_state(self, state: dict, cfg) -> dict:
        """kv_b_proj as k_b_proj / v_b_proj (which gguf's name map knows as attn_k_b / attn_v_b)."""
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


# expert_weights_norm is written false: DeepSeek-V2's router does not renormalise its top-k weights
register_arch(
    "deepseek_v2",
    DeepSeekV2Arch(
        "DEEPSEEK2", renormalises=False, output_required=False, expert_width_key=True, leading_dense=True
    ),
)


@dataclass(frozen=True)
class GptOssArch(Arch):
    """GPT-OSS: llama.cpp hard-codes its sliding pattern and clamped SwiGLU; the window is a key (module doc)."""

    def check_config(self, cfg) -> None:
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

    def add_family_hparams(self, w, cfg, leading_dense: int) -> None:
        w.add_sliding_window(cfg.sliding_window)


# softmax over the top-k logits (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT): renormalised by construction
register_arch(
    "gpt_oss",
    GptOssArch("GPT_OSS", renormalises=True, output_required=True, expert_width_key=True, expert_bias=True),
)


def full_name(gname: str) -> str:
    """A GGUF tensor name with its ``.weight`` suffix (GPT-OSS's sinks are a bare parameter in the checkpoint)."""
    return gname if gname.endswith((".weight", ".bias")) else gname + ".weight"
