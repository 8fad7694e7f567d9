"""Methods by name: a recipe is `{method: name, params: {...}}` validated by the method's pydantic config.

A method is a config class plus a build function `build(config, context) -> (CompressionPlan, tensors)`,
where `context` gives the adapter/model, the stats store and the seed. `needs_stats` names the
calibration statistics it reads, so one calibration can serve the union of every arm's needs.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from pydantic import BaseModel, ValidationError

from ..errors import MoECompressError


@dataclass
class MethodContext:
    """What a method's build function receives besides its config.

    adapter: the loaded model's `MoEAdapter` (weights in memory); stats: a calibration
    `StatsStore` (``stats.get(layer, name)``) or None for stats-free methods; seed for any
    randomness; progress: show rich progress bars.
    """

    adapter: Any
    stats: Any = None
    seed: int = 0
    progress: bool = False

    @property
    def model(self):
        return self.adapter.model


@dataclass(frozen=True)
class MethodEntry:
    name: str
    config_cls: type[BaseModel]
    build: Callable[..., Any]
    needs_stats: Callable[[BaseModel], list[str]] | list[str] = field(default_factory=list)
    family: str = ""  # prune | consolidate | merge | elementwise | dense | auto

    def stats_for(self, config: BaseModel) -> list[str]:
        return list(self.needs_stats(config) if callable(self.needs_stats) else self.needs_stats)


def stat(stats, layer: int, name: str) -> torch.Tensor:
    """One statistic of one layer from a StatsStore (`.get(layer, name)`) or a {layer: {name: tensor}} dict."""
    if stats is None:
        raise MoECompressError(f"This method needs calibration statistics ('{name}'); run moecompress calibrate first.")
    if hasattr(stats, "get") and not isinstance(stats, dict):
        return stats.get(layer, name)
    try:
        return stats[layer][name]
    except KeyError:
        raise MoECompressError(f"The statistics lack '{name}' for layer {layer}; re-run calibration for this method.") from None


def unpack_context(context):
    """(adapter, stats) from a build context (attributes adapter/model and stats) or an (adapter, stats) pair."""
    from ..models import MoEAdapter

    if isinstance(context, tuple):
        adapter, stats = context
    else:
        adapter = getattr(context, "adapter", None)
        if adapter is None:
            adapter = MoEAdapter(context.model)
        stats = getattr(context, "stats", None)
    if not isinstance(adapter, MoEAdapter):
        adapter = MoEAdapter(adapter)
    return adapter, stats


METHODS: dict[str, MethodEntry] = {}


def register_method(name: str, config_cls: type[BaseModel], build: Callable[..., Any],
                    needs_stats: Callable[[BaseModel], list[str]] | list[str] = (), family: str = "") -> None:
    METHODS[name] = MethodEntry(name, config_cls, build, list(needs_stats) if not callable(needs_stats)
                                else needs_stats, family)


def get_method(name: str) -> MethodEntry:
    _load_builtin_methods()
    try:
        return METHODS[name]
    except KeyError:
        close = difflib.get_close_matches(name, METHODS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"known methods: {', '.join(sorted(METHODS))}."
        raise MoECompressError(f"Unknown method '{name}'; {hint}") from None


def parse_config(name: str, params: dict | None) -> BaseModel:
    """Validate a recipe's params for method `name`; a bad field is named in one sentence."""
    entry = get_method(name)
    try:
        return entry.config_cls(**(params or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "params"
        raise MoECompressError(f"Recipe field '{loc}' for method '{name}' is invalid: {err['msg']}.") from None


def _load_builtin_methods() -> None:
    """Import the method modules so that they register themselves (ignoring ones not yet present)."""
    import importlib

    for mod in ("prune", "conmoe", "merging", "puzzle", "dense", "auto", "quantize"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{mod}":
                raise
