"""Calibration: stream a checkpoint layer by layer over calibration text and gather per-expert statistics."""

from . import intermediate as _intermediate  # noqa: F401  (registers the mid_mean collector)
from . import remap as _remap  # noqa: F401  (registers the remap_error collector)
from . import auto_stats as _auto_stats  # noqa: F401  (registers the auto method's collectors)
from . import hessian as _hessian  # noqa: F401  (registers the GPTQ Hessian collectors)
from .api import UnreachedExpertsWarning, calibrate
from .collectors import COLLECTORS, STAT_PROVIDERS, Collector, collectors_for, register_collector
from .dryrun import ResourceEstimate
from .observe import Observation
from .registry import DEFAULT_STATS, resolve_stats
from .runner import SequentialRunner
from .hessian import union_hessian
from .store import StatsStore

__all__ = [
    "COLLECTORS", "DEFAULT_STATS", "STAT_PROVIDERS", "Collector", "Observation", "ResourceEstimate",
    "SequentialRunner", "StatsStore", "UnreachedExpertsWarning", "calibrate", "collectors_for",
    "register_collector", "resolve_stats", "union_hessian",
]
