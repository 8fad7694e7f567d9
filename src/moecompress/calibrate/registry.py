"""Statistic names a calibration gathers: explicit names, else the routing defaults.

Which statistics a *method* needs is the methods layer's knowledge (`moecompress.methods.needs`); the
front end resolves ``--for-method`` there and passes names here, so calibration never imports methods.
"""

from __future__ import annotations

from ..errors import MoECompressError
from .collectors import STAT_PROVIDERS

DEFAULT_STATS = ("counts", "tokens", "routing_mass", "pp", "cp")

def resolve_stats(stats=None) -> list[str]:
    """Requested statistic names (list or comma string), else the routing defaults; sorted, unique."""
    names: list[str] = []
    if isinstance(stats, str):
        stats = [s.strip() for s in stats.split(",") if s.strip()]
    if stats:
        names += list(stats)
    if not names:
        names = list(DEFAULT_STATS)
    unknown = [s for s in names if s not in STAT_PROVIDERS]
    if unknown:
        raise MoECompressError(f"Unknown statistic '{unknown[0]}'; known statistics: "
                               f"{', '.join(sorted(STAT_PROVIDERS))}.")
    return sorted(set(names))
