"""Compression methods: each reads statistics and weights and returns a CompressionPlan."""

from .registry import METHODS, MethodContext, MethodEntry, get_method, parse_config, register_method

__all__ = ["METHODS", "MethodContext", "MethodEntry", "get_method", "parse_config", "register_method"]
