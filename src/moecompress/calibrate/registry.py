"""Which statistics each compression method needs (``--for-method``), extendable by method modules.

A method module declares its needs once, at import::

    from moecompress.calibrate import register_method_stats
    register_method_stats("my-method", ["counts", "reap"])
"""

from __future__ import annotations

from ..errors import MoECompressError
from .collectors import STAT_PROVIDERS

DEFAULT_STATS = ("counts", "tokens", "routing_mass", "pp", "cp")

_METHOD_STATS: dict[str, tuple[str, ...]] = {
    "frequency": ("counts", "tokens"),
    "routing-mass": ("counts", "tokens", "routing_mass"),
    "pp": ("counts", "tokens", "pp"),
    "cp": ("counts", "tokens", "cp"),
    "reap": ("counts", "tokens", "reap"),
    "ean": ("counts", "tokens", "ean"),
    "mone": ("counts", "tokens", "routing_mass", "out_mean", "out_var"),
    "sge": ("counts", "tokens", "routing_mass", "out_norm_mean", "out_norm_sq_mean"),
    "tilt": ("counts", "tokens", "out_mean", "input_moment", "cross_moment", "moment_experts", "moment_count",
             "moment_in_mean", "moment_out_mean"),
    "conmoe": ("counts", "tokens", "routing_mass", "reap"),
    "m-smoe": ("counts", "tokens", "routing_mass", "router_logit_corr"),
    "hc-smoe": ("counts", "tokens", "out_mean_all", "gram"),
    "puzzlemoe": ("counts", "tokens", "in_channel_norm", "mid_channel_norm"),
    "moe-to-dense": ("counts", "tokens", "routing_mass", "reap", "mid_channel_norm"),
    # GPTQ: per-expert input Hessians (calibrate/hessian.py); gptq-g2 weights each token by its gate²
    "quant": ("counts", "tokens", "hessian_in", "hessian_mid"),
    "gptq": ("counts", "tokens", "hessian_in", "hessian_mid"),
    "gptq-g2": ("counts", "tokens", "hessian_in_g2", "hessian_mid_g2"),
}


def register_method_stats(method: str, stats, extend: bool = True) -> None:
    """Declare the statistics `method` needs; with extend=True they are added to any already declared."""
    unknown = [s for s in stats if s not in STAT_PROVIDERS]
    if unknown:
        raise ValueError(f"method '{method}' asks for unknown statistic '{unknown[0]}'")
    old = _METHOD_STATS.get(method, ()) if extend else ()
    _METHOD_STATS[method] = tuple(dict.fromkeys([*old, *stats]))


def _import_method_modules() -> None:
    """Method modules declare their needs when imported: import them all (failures are theirs to report)."""
    import contextlib
    import importlib
    import pkgutil

    try:
        import moecompress.methods as pkg
    except Exception:
        return
    for info in pkgutil.iter_modules(pkg.__path__):
        with contextlib.suppress(Exception):  # a broken method module must not break calibration
            importlib.import_module(f"moecompress.methods.{info.name}")


def stats_for_method(method: str) -> tuple[str, ...]:
    if method not in _METHOD_STATS:
        _import_method_modules()
    try:
        return _METHOD_STATS[method]
    except KeyError:
        raise MoECompressError(f"Unknown method '{method}' for --for-method; known: {', '.join(sorted(_METHOD_STATS))} "
                               "(or pass --stats names).") from None


def known_methods() -> list[str]:
    return sorted(_METHOD_STATS)


def resolve_stats(stats=None, for_method=None) -> list[str]:
    """Requested statistic names: explicit names, plus a method's, else the routing defaults; sorted, unique."""
    names: list[str] = []
    if isinstance(stats, str):
        stats = [s.strip() for s in stats.split(",") if s.strip()]
    if stats:
        names += list(stats)
    if for_method:
        for m in ([for_method] if isinstance(for_method, str) else for_method):
            names += list(stats_for_method(m))
    if not names:
        names = list(DEFAULT_STATS)
    unknown = [s for s in names if s not in STAT_PROVIDERS]
    if unknown:
        raise MoECompressError(f"Unknown statistic '{unknown[0]}'; known statistics: "
                               f"{', '.join(sorted(STAT_PROVIDERS))}.")
    return sorted(set(names))
