"""llama.cpp's CPU arithmetic on a GGUF's tensor types, reproduced in our runtime (issue 31): `emulate_llama_cpp`.

llama.cpp (ggml-cpu) multiplies a weight of type T by activations first converted to T's ``vec_dot_type``:

* ``Q8_0``, ``Q5_0``, ``Q4_0`` weights: activations quantized to ``Q8_0``, per block of 32 values
  d = fp16(max|x| / 127), q = round-half-even(x · 127 / max|x|), x̂ = q·d (`q8_0`; the AVX path of
  ``quantize_row_q8_0``, which this machine's build runs);
* ``BF16`` / ``F16`` weights: activations rounded to bf16 / fp16;
* ``F32`` weights (norms, routers, every 1-D tensor): none.

The products are then exact in float32 (int8·int8 sums scaled by d_w·d_x; bf16·bf16), and a quantized weight is
code·d exactly, where our default runtime rounds code·scale through bf16 as a compressed-tensors loader does. So
`emulate_llama_cpp` sets a runtime model (float32) to compute what llama.cpp computes from the plan's GGUF
(`export.gguf`): every matmul input rounded by its weight's GGUF type, quantized experts dequantized exactly.
What it does not reproduce: llama.cpp's F16 KV cache (K, V and the attention probabilities in fp16) and its
summation order; "GGUF inside llama.cpp" in BENCHMARKS.md measures what remains (docs/export.md).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import MoECompressError
from ..plan import CompressionPlan
from .gguf import BLOCK, exact_type, reason

ARITHMETICS = ("exact", "llama.cpp")
ATTENTION = "moecompress_llama_cpp"  # the transformers attention implementation `attention` is registered as


def check_arithmetic(name: str) -> None:
    """One sentence for an arithmetic `load` / `evaluate` do not know."""
    if name not in ARITHMETICS:
        raise MoECompressError(f"Arithmetic '{name}' is not known; use {' or '.join(ARITHMETICS)}.")


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (float32, last dim a multiple of 32) through llama.cpp's Q8_0 activation quantizer and back."""
    *lead, n = x.shape
    blocks = x.float().reshape(*lead, n // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (amax / 127).to(torch.float16).float()
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def _through(dtype: torch.dtype):
    return lambda x: x.to(dtype).to(x.dtype)


def rounding_for(kind: str):
    """The activation rounding llama.cpp applies before a matmul with a weight of GGUF type `kind` (None: none)."""
    if kind in ("Q8_0", "Q5_0", "Q4_0"):
        return q8_0
    return {"BF16": _through(torch.bfloat16), "F16": _through(torch.float16)}.get(kind)


def float_kind(plan: CompressionPlan) -> str:
    """The GGUF type of an unquantized 2-D weight: the checkpoint's own dtype (`export.gguf`, ``_put``)."""
    return {"bfloat16": "BF16", "float16": "F16"}.get(plan.model.dtype, "F32")


def weight_kind(plan: CompressionPlan, name: str) -> str:
    """The GGUF type of checkpoint weight `name` of a linear layer outside the routed experts."""
    tq = plan.tensor_quant.get(name)
    return float_kind(plan) if tq is None else exact_type(tq.quant)


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """llama.cpp's attention without flash attention (llama-cpp-python's default), as a transformers attention
    function: K and V read from its F16 cache, Q and the softmax probabilities converted to fp16 for the two
    matmuls (the cache's ``vec_dot_type``), scores and softmax in float32. query [B, H, T, D], key/value
    [B, H_kv, S, D] -> ([B, T, H, D], probabilities)."""
    half = _through(torch.float16)
    groups = query.shape[1] // key.shape[1]
    k = half(key).repeat_interleave(groups, dim=1)
    v = half(value).repeat_interleave(groups, dim=1)
    scores = (half(query) @ k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : k.shape[-2]]
    probs = torch.softmax(scores, dim=-1)
    return (half(probs) @ v).transpose(1, 2).contiguous(), probs


def _use_attention(model: nn.Module) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    model.set_attn_implementation(ATTENTION)


def _pre_hook(fn):
    return lambda module, args: (fn(args[0]), *args[1:])


def emulate_llama_cpp(model: nn.Module) -> nn.Module:
    """Set `model` (a runtime model of a plan, in float32) to compute as llama.cpp computes the plan's GGUF; in
    place, returned. Refused in one sentence when the plan has no GGUF or the model is not float32."""
    from ..runtime import CompressedMoEBlock
    from ..runtime.quantized import QuantizedStoredExperts

    plan = getattr(model, "_moecompress_plan", None)
    blocks = [m for m in model.modules() if isinstance(m, CompressedMoEBlock)]
    if plan is None or not blocks:
        raise MoECompressError(
            "arithmetic='llama.cpp' needs a model that runs a plan in moecompress's runtime: use a compact export."
        )
    if (why := reason(plan)) is not None:
        raise MoECompressError(f"llama.cpp cannot run this plan ({why}), so its arithmetic is not emulated.")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise MoECompressError("llama.cpp's arithmetic is emulated in float32: load with dtype='float32'.")
    if any(hasattr(m, "sinks") for m in model.modules()):
        raise MoECompressError("arithmetic='llama.cpp' does not cover attention sinks (GPT-OSS) yet.")
    # MLA (DeepSeek-V2/V3's kv_a_proj_with_mqa): llama.cpp's deepseek2 graph attends over the latent cache
    if any(hasattr(m, "kv_a_proj_with_mqa") for m in model.modules()):
        raise MoECompressError(
            "arithmetic='llama.cpp' does not cover multi-head latent attention (DeepSeek), which llama.cpp computes "
            "in the latent space; check its GGUF inside llama.cpp."
        )
    if any(tq.kind == "router" for tq in plan.tensor_quant.values()):
        raise MoECompressError(
            "arithmetic='llama.cpp' does not cover a quantized router; keep routers unquantized."
        )
    skip: set[int] = set()  # a block's router (F32 in a GGUF) and experts (rounded by their own module)
    for blk in blocks:
        shared = blk.shared_module()
        skip.update({id(m) for m in blk.modules()} - {id(m) for m in (shared.modules() if shared else ())})
        stored = blk.stored
        if isinstance(stored, QuantizedStoredExperts):
            kinds = {exact_type(s.spec) if s.spec is not None else float_kind(plan) for s in stored.experts}
            for slot in stored.experts:
                slot.weight_rounding = torch.float32
        else:
            kinds = {float_kind(plan)}
        (kind,) = kinds  # a GGUF has one type per layer's expert stack (`reason` checked it)
        stored.input_rounding = rounding_for(kind)
    _use_attention(model)
    names = {id(p): n for n, p in model.named_parameters()}  # a tied head is the embedding's tensor
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module) not in skip:
            fn = rounding_for(weight_kind(plan, names[id(module.weight)]))
            if fn is not None:
                module.register_forward_pre_hook(_pre_hook(fn))
    return model
