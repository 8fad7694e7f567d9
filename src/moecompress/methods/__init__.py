"""Compression methods: each reads statistics and weights and returns a CompressionPlan."""

from .needs import known_methods, register_method_stats, stats_for_method, stats_to_gather
from .registry import METHODS, MethodContext, MethodEntry, get_method, parse_config, register_method

__all__ = ["METHODS", "MethodContext", "MethodEntry", "get_method", "parse_config", "register_method",
           "known_methods", "register_method_stats", "stats_for_method", "stats_to_gather"]
