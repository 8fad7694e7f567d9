"""The weight files' share of `auto`'s budget (issue 48, item 3; docs/auto.md, "The budget and the byte count").

The budget bounds the bytes of the weight files written, headers included. What those files hold beyond the plan's
tensors is the exporters' knowledge (`export.auto_reserve`), and methods never import export: the exporter
registers its upper bound here when it is imported (`register_file_overhead`), and `auto` asks `file_overhead`.
With no exporter loaded (a plan built in memory, never written) nothing is reserved.
"""

from __future__ import annotations

from collections.abc import Callable

from ...plan import ModelInfo

_OVERHEAD: list[Callable] = []


def register_file_overhead(fn: Callable) -> None:
    """Set the function `fn(config, adapter, info, files) -> bytes` that bounds the weight files' non-tensor bytes."""
    _OVERHEAD[:] = [fn]


def file_overhead(config, adapter, info: ModelInfo, files: int) -> int:
    """Upper bound of the weight files' bytes beyond the plan's tensors, for any plan `auto` may choose with `config`
    and `files` bytes of weight files; 0 when no exporter is loaded."""
    return _OVERHEAD[0](config, adapter, info, files) if _OVERHEAD else 0


def files_budget(config, info: ModelInfo, budget: int) -> int:
    """The bytes the weight files may hold: the budget, plus, with ``budget_scope: routed``, the tensors outside
    its scope as the original stores them (`ModelInfo.other_bytes`, which a routed budget leaves unchanged)."""
    return budget + (info.other_bytes if config.budget_scope == "routed" else 0)
