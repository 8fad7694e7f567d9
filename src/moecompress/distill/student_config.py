"""Which class a dense student is written as (`student_target`) and its config (`student_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MoECompressError
from ..methods.dense_fit import DenseConfig
from ..models import FAMILIES, MoEAdapter
from ..models.families import expert_count_keys

# teacher model_type -> dense model_type with the identical attention + norm path (`FamilySpec.dense_family`;
# the teacher's own type: the same class with every layer dense through first_k_dense_replace)
DENSE_TARGETS = {f.model_type: f.dense_family for f in FAMILIES.values() if f.dense_family is not None}


@dataclass(frozen=True)
class StudentTarget:
    kind: str  # "dense" (a dense class) or "moe" (same MoE class, one expert, top-1)
    model_type: str
    reason: str

    @property
    def fold_shared(self) -> bool:
        return self.kind == "dense"


def student_target(adapter: MoEAdapter, config: DenseConfig | None = None) -> StudentTarget:
    """Which class the student of this teacher is written as (module doc)."""
    config = config or DenseConfig()
    mt = adapter.model_type
    dense = DENSE_TARGETS.get(mt)
    if config.target == "moe":
        if dense == mt:
            raise MoECompressError(
                f"A {mt} student is always written dense (every layer dense through "
                "first_k_dense_replace, exact); drop --target moe."
            )
        return StudentTarget("moe", mt, "one-expert top-1 form requested")
    why_not = None
    if dense is None:
        why_not = f"transformers has no dense {mt} sibling with the identical attention and norm path"
    elif adapter.family.shared_gate_attr is not None and config.shared_gate == "exact":
        why_not = "the sigmoid-gated shared expert is kept exactly (--shared-gate exact)"
    elif not getattr(adapter.config, "qkv_bias", True):  # a Qwen2-MoE switch the dense Qwen2 class lacks
        why_not = f"this {mt} has no q/k/v biases, which {dense} always has"
    if why_not is None:
        return StudentTarget("dense", dense, f"{dense} has the same attention and norm path as {mt}")
    if config.target == "dense":
        raise MoECompressError(
            f"A dense {mt} student is not possible: {why_not}; use --target auto for the "
            "one-expert MoE form (exactly dense)."
        )
    return StudentTarget("moe", mt, why_not + "; written as the same MoE class with one expert, top-1")


def _config_dict(config) -> dict:
    d = config.to_dict()
    for k in (
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "auto_map",
        "dtype",
        "torch_dtype",
    ):
        d.pop(k, None)
    return d


def student_config(adapter: MoEAdapter, target: StudentTarget, width: int):
    """The student's config: the teacher's fields the student class knows, FFN width `width`."""
    from transformers import AutoConfig

    teacher = adapter.config
    d = _config_dict(teacher)
    L = len(adapter.decoder_layers)
    if target.kind == "moe":
        for key in expert_count_keys(teacher):
            d[key] = 1
        d["num_experts_per_tok"] = 1
        d["moe_intermediate_size" if "moe_intermediate_size" in d else "intermediate_size"] = width
        for key, value in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0)):
            if d.get(key) is not None:
                d[key] = value
        if "topk_method" in d:
            d["topk_method"] = "greedy"
        cfg = AutoConfig.for_model(target.model_type, **d)
    elif target.model_type == adapter.model_type:  # the same class, every layer dense
        d["first_k_dense_replace"] = L
        d["intermediate_size"] = width
        cfg = AutoConfig.for_model(target.model_type, **d)
    else:
        known = set(AutoConfig.for_model(target.model_type).to_dict()) | {"rope_parameters", "rope_scaling"}
        kept = {k: v for k, v in d.items() if k in known}
        kept["intermediate_size"] = width
        if "layer_types" in known and "layer_types" not in d and target.model_type != "mistral":
            # Qwen3-MoE applies its sliding window (if any) to every layer
            kind = "sliding_attention" if getattr(teacher, "sliding_window", None) else "full_attention"
            kept["layer_types"] = [kind] * L
        kept.pop("mlp_only_layers", None)
        cfg = AutoConfig.for_model(target.model_type, **kept)
    dt = next(p.dtype for p in adapter.model.parameters())
    cfg.dtype = dt
    return cfg
