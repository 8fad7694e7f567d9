"""Names the exporters need: a submodule's name inside its parent, and native (fused) tensor names back to a
family's on-disk names."""

from __future__ import annotations

from ..errors import MoECompressError


def child_name(parent, child) -> str:
    for name, mod in parent.named_modules():
        if mod is child:
            return name
    raise MoECompressError(
        "Cannot locate a MoE submodule by name; this architecture is not supported by the exporters."
    )


def revert_names(model, tensors: dict) -> dict:
    """Native (fused) names -> the family's on-disk names, as save_pretrained does."""
    if not tensors:
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)
