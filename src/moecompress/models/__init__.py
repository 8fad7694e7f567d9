"""Model adapters: the only code that touches MoE internals."""

from .adapter import MoEAdapter, MoELayer
from .families import FAMILIES, FamilySpec
from .loading import load_config, load_model, parse_dtype, resolve_source, skeleton
from .router import RouterSpec, Routing, route
from .storage import ExpertActivation, ExpertStorage, ExpertWeights, expert_apply, expert_intermediate

__all__ = [
    "FAMILIES",
    "ExpertActivation",
    "ExpertStorage",
    "ExpertWeights",
    "FamilySpec",
    "MoEAdapter",
    "MoELayer",
    "RouterSpec",
    "Routing",
    "expert_apply",
    "expert_intermediate",
    "load_config",
    "load_model",
    "parse_dtype",
    "resolve_source",
    "route",
    "skeleton",
]
