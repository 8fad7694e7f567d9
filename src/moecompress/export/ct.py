"""The `hf` format of a quantized plan: a compressed-tensors ``pack-quantized`` checkpoint.

This is what llm-compressor writes for MoE models and what transformers (with compressed-tensors
installed) and vLLM load (../shared/notes/compressed-tensors-moe.md): the experts are saved per
expert as 2-D weights under the family's on-disk names, each ``...experts.E.{gate,up,down}_proj.weight``
replaced by ``weight_packed`` (int32), ``weight_scale`` (bf16), ``weight_shape`` (int64 [2]) and, when
asymmetric, ``weight_zero_point``; every other tensor stays as it was; ``config.json`` carries a
``quantization_config`` whose config groups target the routed experts' projections and, for a plan that
quantizes non-expert weights (attention, shared experts, dense MLPs, lm_head), those modules by name, one group
per precision.
"""

from __future__ import annotations

import re

import torch

from ..errors import MoECompressError
from ..quant.spec import QuantSpec

EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
_PER_EXPERT = re.compile(r"^(?P<base>.*\.experts\.(?P<e>\d+)\.(?P<part>gate|up|down)_proj)\.weight$")


def quantization_config(spec: QuantSpec | None, modules: dict[str, QuantSpec] | None = None) -> dict:
    """The checkpoint's ``quantization_config``, built by compressed-tensors itself: one config group for the
    routed experts' projections at `spec` (if any), and one per precision among the quantized non-expert
    modules (`modules`: module name -> spec, e.g. attention at w4g32 and lm_head at w8c), targeting them by name
    (issue 30, item 5)."""
    from compressed_tensors import __version__ as ct_version
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    groups = {}
    if spec is not None:
        groups["group_0"] = QuantizationScheme(targets=[EXPERT_TARGET], weights=spec.quantization_args())
    by_spec: dict[str, tuple[QuantSpec, list[str]]] = {}
    for name, s in sorted((modules or {}).items()):
        by_spec.setdefault(s.model_dump_json(), (s, []))[1].append(name)
    for s, names in by_spec.values():
        groups[f"group_{len(groups)}"] = QuantizationScheme(targets=names, weights=s.quantization_args())
    ignore = [] if "lm_head" in (modules or {}) else ["lm_head"]
    qc = QuantizationConfig(
        config_groups=groups, format="pack-quantized", quantization_status="compressed", ignore=ignore
    )
    data = qc.model_dump(mode="json")
    data["quant_method"] = "compressed-tensors"
    data.setdefault("version", ct_version)
    return data


def per_expert_quantized(
    dense_named: dict[str, torch.Tensor], packed: list[dict[str, dict[str, torch.Tensor]]], where: str
) -> dict[str, torch.Tensor]:
    """Swap the per-expert dense weights that `save_pretrained` would write for their packed tensors.

    dense_named: the layer's experts in on-disk naming (``...experts.E.gate_proj.weight`` ...);
    packed[E][part]: the pack-quantized tensors of expert E's projection.
    """
    out = {}
    for name, t in dense_named.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            if name.endswith("_proj") or ".experts." in name and not name.endswith("bias"):
                raise MoECompressError(
                    f"The {where} family stores its experts fused on disk ('{name}'), which the "
                    "compressed-tensors format cannot hold quantized; use --format compact."
                )
            out[name] = t
            continue
        for key, value in packed[int(m["e"])][m["part"]].items():
            out[f"{m['base']}.{key}"] = value
    return out


from ..plan.targets import VLLM_BITS, VLLM_GROUPS, vllm_reason  # noqa: E402,F401 - the vllm target's check


def tensor_quant_problem(plan) -> str | None:
    """Why compressed-tensors cannot hold the plan's quantized non-expert weights, or None."""
    if plan.tensor_quant and None in plan.quant_specs():
        # measured (transformers 5.24, compressed-tensors 0.20.1): with a quantization_config, the loader finds
        # no tensors for unquantized fused experts ("Concatenate on tensors destined for ...gate_up_proj")
        return (
            "it quantizes non-expert weights but keeps routed experts unquantized, which transformers' "
            "compressed-tensors loader cannot read: quantize the experts too, e.g. with --quant w4c"
        )
    for name, tq in plan.tensor_quant.items():
        if tq.kind == "embeddings":
            return (
                "it quantizes the embeddings, and compressed-tensors stores quantized Linear layers only "
                "(keep the embeddings out of the quantization or use the compact format)"
            )
        group = tq.quant.group_size
        if group is not None and tq.shape[1] % group:
            return (
                f"its quantization group {group} leaves a shorter last group on {name} (input dimension "
                f"{tq.shape[1]}), which compressed-tensors cannot load"
            )
    return None
