"""Calibration: stream a checkpoint layer by layer over calibration text and gather per-expert statistics."""

from .api import Calibration, calibrate
from .collectors import Collector
from .dryrun import ResourceEstimate

# imported after the runner: in the other order the streamed view's full-model forward (auto's sensitivity
# passes) gives NaN logits on the fixtures; an import-order dependency not yet traced (closing note, issue 16)
from .hessian import union_hessian  # noqa: I001
from .observe import Observation
from .options import CalibrationOptions, UnreachedExpertsWarning
from .registry import (
    COLLECTORS,
    DEFAULT_STATS,
    STAT_PROVIDERS,
    collectors_for,
    register_collector,
    resolve_stats,
)
from .runner import SequentialRunner
from .store import StatsStore

__all__ = [
    "COLLECTORS",
    "Calibration",
    "CalibrationOptions",
    "DEFAULT_STATS",
    "STAT_PROVIDERS",
    "Collector",
    "Observation",
    "ResourceEstimate",
    "SequentialRunner",
    "StatsStore",
    "UnreachedExpertsWarning",
    "calibrate",
    "collectors_for",
    "register_collector",
    "resolve_stats",
    "union_hessian",
]
