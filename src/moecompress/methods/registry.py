"""Methods by name: a recipe is `{method: name, params: {...}}` validated by the method's pydantic config.

A method is a config class plus a build function `build(config, context) -> (CompressionPlan, tensors)`,
where `context` (a `methods.context.MethodContext`) gives the adapter, the statistics (a `StatsView`) and
the seed. `needs_stats` names the calibration statistics a config reads (prune, dense and ConMoE take them
from their criteria's entries in `scoring.registry`), so one calibration can serve every arm's needs.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import MoECompressError
from .context import MethodContext

Build = Callable[
    [BaseModel, MethodContext], tuple[Any, dict]
]  # (config, context) -> (CompressionPlan, tensors)


@dataclass(frozen=True)
class ViewUse:
    """What a build holds of the streamed checkpoint view at its peak, in decoder layers (for `compress
    --dry-run`): `stored` layers as the checkpoint stores them, `compute` layers upcast to the compute dtype,
    and the embeddings and head too when it runs full-model forwards. The default is the conservative
    "one layer as stored, a float32 copy of it and one working copy"."""

    stored: float = 1.0
    compute: float = 2.0
    forwards: bool = False


WEIGHTLESS = ViewUse(0.0, 0.0)  # plans from statistics alone: the view loads nothing


@dataclass(frozen=True)
class MethodEntry:
    name: str
    config_cls: type[BaseModel]
    build: Build
    needs_stats: Callable[[BaseModel], list[str]] | list[str] = field(default_factory=list)
    family: str = ""  # prune | consolidate | merge | elementwise | dense | auto
    # (config, adapter, stats without moments) -> {layer: experts whose moments the build reads}, or None when
    # it reads none: lets `compress` gather the [S, H, H] moments in a second pass for those experts only
    moment_experts: Callable[[BaseModel, Any, Any], dict[int, list[int]] | None] | None = None
    # the build reads its statistics one layer at a time, in order, through `calibrate.streamed.each_layer`:
    # `compress` may give it `StreamedStats` (computed per layer while it works, never stored)
    streamed_stats: bool = False
    # config -> what the build holds of the streamed view (`ViewUse`); None: the conservative default
    view_use: Callable[[BaseModel], ViewUse] | None = None
    # streamed, the experts whose square statistics one extra pass gathers (None: `calibrate.streamed.CHUNK`), or
    # config -> that number (a build whose square statistics' size depends on its config)
    streamed_chunk: int | Callable[[BaseModel], int | None] | None = None

    def stats_for(self, config: BaseModel) -> list[str]:
        """The statistic names a build with `config` reads."""
        return list(self.needs_stats(config) if callable(self.needs_stats) else self.needs_stats)

    def chunk_for(self, config: BaseModel) -> int | None:
        """The experts per square-statistics pass of a build with `config` (None: the default)."""
        return self.streamed_chunk(config) if callable(self.streamed_chunk) else self.streamed_chunk

    def view_for(self, config: BaseModel) -> ViewUse:
        """What a build with `config` holds of the streamed view (`ViewUse`)."""
        return self.view_use(config) if self.view_use is not None else ViewUse()


METHODS: dict[str, MethodEntry] = {}


def register_method(
    name: str,
    config_cls: type[BaseModel],
    build: Build,
    needs_stats: Callable[[BaseModel], list[str]] | list[str] = (),
    family: str = "",
    moment_experts=None,
    streamed_stats: bool = False,
    view_use: Callable[[BaseModel], ViewUse] | None = None,
    streamed_chunk: int | Callable[[BaseModel], int | None] | None = None,
) -> None:
    METHODS[name] = MethodEntry(
        name,
        config_cls,
        build,
        list(needs_stats) if not callable(needs_stats) else needs_stats,
        family,
        moment_experts,
        streamed_stats,
        view_use,
        streamed_chunk,
    )


def get_method(name: str) -> MethodEntry:
    _load_builtin_methods()
    try:
        return METHODS[name]
    except KeyError:
        close = difflib.get_close_matches(name, METHODS, n=3)
        hint = (
            f"did you mean {', '.join(close)}?" if close else f"known methods: {', '.join(sorted(METHODS))}."
        )
        raise MoECompressError(f"Unknown method '{name}'; {hint}") from None


def parse_config(name: str, params: dict | BaseModel | None) -> BaseModel:
    """Validate a recipe's params for method `name`; a bad field is named in one sentence. A config of the
    method's own type is returned as it is: the boundary (CLI, recipe, API) validates once and everything below
    takes that object (issue 34)."""
    entry = get_method(name)
    if isinstance(params, entry.config_cls):
        return params
    try:
        return entry.config_cls(**(params or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "params"
        if err["type"] == "extra_forbidden":
            raise MoECompressError(_foreign_parameter(loc, name)) from None
        raise MoECompressError(
            f"Recipe field '{loc}' for method '{name}' is invalid: {err['msg']}."
        ) from None


def _foreign_parameter(field: str, name: str) -> str:
    """A parameter method `name` does not take, named with its owners: "--rank applies to --method prune, not
    conmoe" (the CLI flag is the field with dashes; a recipe spells it as the field)."""
    owners = sorted(m for m, e in METHODS.items() if field in e.config_cls.model_fields)
    flag = f"--{field.replace('_', '-')}"
    takes = ", ".join(sorted(METHODS[name].config_cls.model_fields))
    if owners:
        return (
            f"{flag} (recipe field '{field}') applies to --method {' / '.join(owners)}, not {name}; drop it or "
            f"choose that method ({name} takes: {takes})."
        )
    return f"{flag} (recipe field '{field}') is not a parameter of {name}; drop it ({name} takes: {takes})."


def _load_builtin_methods() -> None:
    """Import the method modules so that they register themselves (ignoring ones not yet present)."""
    import importlib

    for mod in ("prune", "conmoe", "merging", "puzzle", "dense", "auto", "quantize"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{mod}":
                raise
