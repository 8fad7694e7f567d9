"""Runtime that executes any `CompressionPlan` inside an ordinary HF model."""

from .block import CompressedMoEBlock, aggregate_slots
from .build import (
    apply_plan,
    build_ops,
    build_scope,
    empty_scope,
    runtime_layout,
    scope_dtype,
    stored_weights,
)
from .decoders import register_decoder
from .experts import StoredExperts, native_tensors
from .operators import SlotOperators
from .packed import PackedScopeExperts

__all__ = [
    "CompressedMoEBlock",
    "PackedScopeExperts",
    "SlotOperators",
    "StoredExperts",
    "aggregate_slots",
    "apply_plan",
    "build_ops",
    "build_scope",
    "empty_scope",
    "native_tensors",
    "register_decoder",
    "runtime_layout",
    "scope_dtype",
    "stored_weights",
]
