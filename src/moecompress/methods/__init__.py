"""Compression methods: each reads statistics and weights and returns a CompressionPlan."""

from .context import MappingStats, MethodContext, StatsView
from .needs import known_methods, register_method_stats, stats_for_method, stats_to_gather
from .registry import METHODS, MethodEntry, get_method, parse_config, register_method

__all__ = [
    "METHODS",
    "MappingStats",
    "MethodContext",
    "MethodEntry",
    "StatsView",
    "get_method",
    "parse_config",
    "register_method",
    "known_methods",
    "register_method_stats",
    "stats_for_method",
    "stats_to_gather",
]
