"""Statistics by name: which collector provides each statistic, and the names a calibration gathers.

Every built-in collector is named once, in `BUILTIN_COLLECTORS` below: the statistics several methods
share (``collectors.py``) and, each in a module of its own, those one method reads (prune's partial-copy
bias ``intermediate``, its functional remap ``remap``, ``auto_stats`` for auto, ``hessian`` for GPTQ).
Importing a collector module registers nothing; this list is the registry's only source of built-ins, so
what calibration can gather is readable in one place. A collector defined elsewhere (docs/calibration.md)
is added with `register_collector`.

Which statistics a *method* needs is the methods layer's knowledge (`moecompress.methods.needs`); the
front end resolves ``--for-method`` there and passes names here, so calibration never imports methods.
"""

from __future__ import annotations

from ..errors import MoECompressError
from . import auto_stats, collectors, hessian, intermediate, remap
from .collectors import Collector

COLLECTORS: dict[str, type[Collector]] = {}  # collector name -> class
STAT_PROVIDERS: dict[str, str] = {}  # stat name -> collector name

BUILTIN_COLLECTORS: tuple[type[Collector], ...] = (
    # shared by several methods
    collectors.RoutingCollector,
    collectors.ReapCollector,
    collectors.OutputMomentsCollector,
    collectors.ChannelNormCollector,
    collectors.AllExpertsCollector,
    collectors.MomentCollector,
    collectors.RouterCorrelationCollector,
    # one method's statistics
    intermediate.IntermediateMeanCollector,  # prune, partial copies: mid_mean
    remap.RemapErrorCollector,  # prune, functional remap: remap_error
    auto_stats.AutoOutputCollector,
    auto_stats.AutoAffineCollector,
    auto_stats.AutoMidCollector,  # auto
    auto_stats.AutoSubstituteCollector,
    auto_stats.AutoRerouteCollector,
    auto_stats.AutoSampleCollector,
    hessian.HessianInCollector,
    hessian.HessianMidCollector,  # GPTQ
    hessian.GateSquaredHessianInCollector,
    hessian.GateSquaredHessianMidCollector,
    hessian.GateSquaredMidDiagCollector,  # auto's fast search
)

DEFAULT_STATS = ("counts", "tokens", "routing_mass", "pp", "cp")


def register_collector(cls: type[Collector]) -> type[Collector]:
    """Make a collector and its statistics available by name (usable as a class decorator)."""
    for stat in cls.provides:
        owner = STAT_PROVIDERS.get(stat)
        if owner is not None and owner != cls.name:
            raise ValueError(f"statistic '{stat}' is already provided by collector '{owner}'")
    COLLECTORS[cls.name] = cls
    for stat in cls.provides:
        STAT_PROVIDERS[stat] = cls.name
    return cls


def _register_builtins() -> None:
    for cls in BUILTIN_COLLECTORS:
        register_collector(cls)


_register_builtins()


def _unknown(names) -> None:
    unknown = [s for s in names if s not in STAT_PROVIDERS]
    if unknown:
        raise MoECompressError(
            f"Unknown statistic '{unknown[0]}'; known statistics: {', '.join(sorted(STAT_PROVIDERS))}."
        )


def collectors_for(stats: list[str]) -> list[type[Collector]]:
    """The collector classes that provide `stats` (each once, in registration order)."""
    _unknown(stats)
    names = {STAT_PROVIDERS[s] for s in stats}
    return [cls for n, cls in COLLECTORS.items() if n in names]


def resolve_stats(stats=None) -> list[str]:
    """Requested statistic names (list or comma string), else the routing defaults; sorted, unique."""
    names: list[str] = []
    if isinstance(stats, str):
        stats = [s.strip() for s in stats.split(",") if s.strip()]
    if stats:
        names += list(stats)
    if not names:
        names = list(DEFAULT_STATS)
    _unknown(names)
    return sorted(set(names))
