"""Which statistics each compression method needs (``calibrate --for-method``), owned by the methods layer.

Calibration gathers statistics by name and knows nothing about methods; the front end turns a method
name into statistic names here. A method module declares its needs once, at registration::

    from moecompress.methods.needs import register_method_stats
    register_method_stats("my-method", ["counts", "reap"])

Per-criterion needs (prune, dense, conmoe) come from the one criteria registry (`scoring.registry`).
"""

from __future__ import annotations

from ..calibrate.registry import STAT_PROVIDERS
from ..errors import MoECompressError

# Methods whose needs are not declared by a method module; criteria register below in _builtin().
_METHOD_STATS: dict[str, tuple[str, ...]] = {
    "tilt": (
        "counts",
        "tokens",
        "out_mean",
        "input_moment",
        "cross_moment",
        "moment_experts",
        "moment_count",
        "moment_in_mean",
        "moment_out_mean",
    ),
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


def _load() -> None:
    """Register the built-in methods (an explicit list in methods/registry.py, no package scan)."""
    from .registry import _load_builtin_methods

    _load_builtin_methods()


def stats_for_method(method: str) -> tuple[str, ...]:
    if method not in _METHOD_STATS:
        _load()
    try:
        return _METHOD_STATS[method]
    except KeyError:
        raise MoECompressError(
            f"Unknown method '{method}' for --for-method; known: {', '.join(sorted(_METHOD_STATS))} "
            "(or pass --stats names)."
        ) from None


def known_methods() -> list[str]:
    _load()
    return sorted(_METHOD_STATS)


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
