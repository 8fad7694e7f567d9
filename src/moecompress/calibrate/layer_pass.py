"""One MoE layer's statistics pass (`gather`) and what a run keeps of a finished layer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import MoECompressError


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of `t` is finite. A NaN or infinite element makes the sum non-finite, so the sum
    decides alone when it is finite; only an overflowing sum of finite values needs the element-wise check,
    whose boolean copy of `t` cost 4 % of an `auto` run on the wide model (py-spy)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _check_finite(layer: int, stats: dict[str, torch.Tensor], dtype=None, weights=()) -> None:
    """Refuse non-finite statistics. Collectors never divide by zero, so the model itself produced them:
    NaN / infinite `weights` (the layer's, still loaded), or in a 16-bit dtype an overflow (float32 helps).
    Advising --dtype float32 for broken weights did not help, so that advice is given only where it can."""
    for name, t in stats.items():
        if t.is_floating_point() and not _all_finite(t):
            if any(
                w.is_floating_point() and not w.is_meta and not bool(torch.isfinite(w).all()) for w in weights
            ):
                raise MoECompressError(
                    f"Decoder layer {layer} of the checkpoint holds NaN or infinite weights, so "
                    "its statistics are not finite; check or re-download the checkpoint."
                )
            if dtype in (torch.float32, torch.float64):
                raise MoECompressError(
                    f"Statistic {name} of layer {layer} is not finite even in "
                    f"{str(dtype).replace('torch.', '')}: the checkpoint's weights (or its router) "
                    "hold NaN or infinite values; check or re-download the checkpoint."
                )
            raise MoECompressError(
                f"Statistic {name} of layer {layer} is not finite: the model's activations "
                "overflowed in this dtype; re-run with --dtype float32."
            )


def gather(
    runner,
    i: int,
    classes,
    params: dict,
    device,
    *,
    write: bool = True,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Layer i's statistics from collectors of `classes`: every batch through the loaded layer, observed
    (outputs written as the next layer's inputs when `write`), sums reduced across ranks, finalized on CPU."""
    from . import distributed as dist
    from .hooks import LayerObserver

    collectors = [cls(runner.adapter, i, device, **params) for cls in classes]
    obs = LayerObserver(runner.adapter, i, collectors)
    obs.attach()
    try:
        runner.run_layer(i, observer=obs, write=write, on_batch=on_batch)
    finally:
        obs.detach()
    dist.all_reduce_sums(collectors)
    stats_i = {}
    for c in collectors:
        stats_i.update({k: v.detach().cpu() for k, v in c.finalize().items()})
    _check_finite(i, stats_i, runner.dtype, list(runner.adapter.decoder_layers[i].parameters()))
    return stats_i


def layer_summary(stats_i: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the end of a run reads of a finished layer's statistics: every name with its shape (meta tensors,
    no memory) and the expert counts (unreached experts). Keeping every layer's full statistics until the store
    is written held them all at once: input/cross moments alone are E·H² float64 values per layer."""
    return {
        k: v if k == "counts" else torch.empty(v.shape, dtype=v.dtype, device="meta")
        for k, v in stats_i.items()
    }


def restore_block(adapter, i: int) -> None:
    """Put back layer i's original MoE block if a transform swapped it (the skeleton stays loadable)."""
    if i in adapter.layers:
        adapter.set_block(i, adapter.layer(i).block)
