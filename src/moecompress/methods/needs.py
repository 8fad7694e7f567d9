"""Which statistics each compression method needs (``calibrate --for-method``), owned by the methods layer.

Calibration gathers statistics by name and knows nothing about methods; the front end turns a method
name into statistic names here. A registered method (`registry.register_method`) is known by its name with
no further line: `--for-method NAME` gathers what it reads with its default config. A module declares a
name only where that is not enough: an alias of one setting, or a union that serves every setting::

    register_method_stats("gptq-g2", quant_stats(QuantConfig(weighting="gate2")))

Per-criterion needs (prune, dense, conmoe) come from the one criteria registry (`scoring.registry`).
"""

from __future__ import annotations

from ..calibrate.registry import STAT_PROVIDERS
from ..errors import MoECompressError

# Names a module declares beside its registered methods: criteria, aliases (`gptq-g2`) and unions (`prune`,
# every criterion's statistics). A registered method with no declaration needs what its default config reads.
_DECLARED: dict[str, tuple[str, ...]] = {}


def register_method_stats(method: str, stats, extend: bool = True) -> None:
    """Declare the statistics `method` needs; with extend=True they are added to any already declared."""
    unknown = [s for s in stats if s not in STAT_PROVIDERS]
    if unknown:
        raise ValueError(f"method '{method}' asks for unknown statistic '{unknown[0]}'")
    old = _DECLARED.get(method, ()) if extend else ()
    _DECLARED[method] = tuple(dict.fromkeys([*old, *stats]))


def _load() -> None:
    """Register the built-in methods (an explicit list in methods/registry.py, no package scan)."""
    from .registry import _load_builtin_methods

    _load_builtin_methods()


def stats_for_method(method: str) -> tuple[str, ...]:
    """What `calibrate --for-method METHOD` gathers: the module's declaration for that name, else what the
    registered method reads with its default config (`MethodEntry.stats_for`)."""
    from .registry import METHODS

    _load()
    if method in _DECLARED:
        return _DECLARED[method]
    entry = METHODS.get(method)
    if entry is None:
        raise MoECompressError(
            f"Unknown method '{method}' for --for-method; known: {', '.join(known_methods())} "
            "(or pass --stats names)."
        )
    return tuple(entry.stats_for(entry.config_cls()))


def known_methods() -> list[str]:
    from .registry import METHODS

    _load()
    return sorted({*_DECLARED, *METHODS})


def stats_to_gather(stats=None, for_method=None) -> list[str] | None:
    """Explicit statistic names (list or comma string) plus each named method's needs; None when neither."""
    names: list[str] = []
    if isinstance(stats, str):
        stats = [s.strip() for s in stats.split(",") if s.strip()]
    names += list(stats or [])
    if for_method:
        for m in [for_method] if isinstance(for_method, str) else for_method:
            names += list(stats_for_method(m))
    return names or None
