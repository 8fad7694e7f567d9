"""What a method's build function receives besides its config: the model view and the statistics.

Two typed seams. The adapter is an `MoEAdapter` (during `compress`, its streamed subclass
`checkpoint.view.StreamedAdapter`: structure from a meta skeleton, one decoder layer of weights at a
time). The statistics are a `StatsView`: the few things methods read from calibration, which a
`calibrate.StatsStore` offers and `MappingStats` offers for in-memory ``{layer: {name: tensor}}``
statistics (dense's full-forward statistics, tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import MoECompressError
from ..models import MoEAdapter


class StatsView(Protocol):
    """What a method reads from calibration statistics, by MoE layer and statistic name."""

    @property
    def layers(self) -> list[int]:
        """The MoE layers that have statistics."""

    @property
    def names(self) -> list[str]:
        """The statistic names held for every layer."""

    def has(self, *names: str) -> bool:
        """Whether every one of `names` is held."""

    def get(self, layer: int, name: str) -> torch.Tensor:
        """Statistic `name` of layer `layer`; a missing one is refused in one sentence."""

    def layer(self, layer: int) -> Mapping[str, torch.Tensor]:
        """Every statistic of one layer."""

    def get_row(self, layer: int, name: str, index: int) -> torch.Tensor:
        """``get(layer, name)[index]`` without reading the rest (one expert's [H, H] moments of an [S, H, H])."""

    def get_rows(self, layer: int, name: str, ids: list[int]) -> torch.Tensor:
        """``get(layer, name)[ids]``, read together where the view can (`calibrate.streamed.LayerStats`: one pass
        over the layer's batches per chunk of experts)."""

    @property
    def chunk(self) -> int | None:
        """How many experts' square statistics (Hessians, moments) one read gathers together, so a reader takes
        them that many at a time, by row (`calibrate.streamed.LayerStats`); None: any number, ``get`` answers."""

    def drop_rows(self) -> None:
        """The reader is done with square statistics for now: a view holding gathered rows frees them."""


class MappingStats:
    """A `StatsView` over in-memory statistics ``{layer: {name: tensor}}`` (tensors handed out as they are)."""

    def __init__(self, mapping: Mapping[int, Mapping[str, torch.Tensor]]):
        self.mapping = mapping

    @property
    def layers(self) -> list[int]:
        return list(self.mapping)

    @property
    def names(self) -> list[str]:
        per_layer = [set(v) for v in self.mapping.values()]
        return sorted(set.intersection(*per_layer)) if per_layer else []

    def has(self, *names: str) -> bool:
        return all(n in v for v in self.mapping.values() for n in names)

    def get(self, layer: int, name: str) -> torch.Tensor:
        try:
            return self.mapping[layer][name]
        except KeyError:
            raise MoECompressError(
                f"The statistics lack '{name}' for layer {layer}; re-run calibration for this method."
            ) from None

    def layer(self, layer: int) -> Mapping[str, torch.Tensor]:
        return self.mapping[layer]

    def get_row(self, layer: int, name: str, index: int) -> torch.Tensor:
        return self.get(layer, name)[index]

    def get_rows(self, layer: int, name: str, ids: list[int]) -> torch.Tensor:
        return self.get(layer, name)[list(ids)]

    chunk = None

    def drop_rows(self) -> None:
        pass


class ChainedStats:
    """A `StatsView` over several views: each statistic from the first view holding it (e.g. a first
    calibration's selection statistics and a second one's moments of the experts that selection removed)."""

    def __init__(self, *views: StatsView):
        self.views = views

    @property
    def layers(self) -> list[int]:
        return sorted(set.intersection(*(set(v.layers) for v in self.views)))

    @property
    def names(self) -> list[str]:
        return sorted({n for v in self.views for n in v.names})

    def has(self, *names: str) -> bool:
        return all(any(v.has(n) for v in self.views) for n in names)

    def _view(self, name: str) -> StatsView:
        return next((v for v in self.views if v.has(name)), self.views[0])  # the first refuses a missing one

    def get(self, layer: int, name: str) -> torch.Tensor:
        return self._view(name).get(layer, name)

    def layer(self, layer: int) -> Mapping[str, torch.Tensor]:
        return {n: self.get(layer, n) for n in self.names}

    def get_row(self, layer: int, name: str, index: int) -> torch.Tensor:
        return self._view(name).get_row(layer, name, index)

    def get_rows(self, layer: int, name: str, ids: list[int]) -> torch.Tensor:
        return self._view(name).get_rows(layer, name, ids)

    @property
    def chunk(self) -> int | None:
        return min((v.chunk for v in self.views if v.chunk is not None), default=None)

    def drop_rows(self) -> None:
        for v in self.views:
            v.drop_rows()


def stats_view(stats) -> StatsView | None:
    """`stats` as a `StatsView`: a store (anything with ``get(layer, name)``) as it is, a mapping wrapped."""
    return MappingStats(stats) if isinstance(stats, Mapping) else stats


def stat(stats: StatsView | Mapping | None, layer: int, name: str) -> torch.Tensor:
    """One statistic of one layer from a StatsView or a {layer: {name: tensor}} mapping."""
    if stats is None:
        raise MoECompressError(
            f"This method needs calibration statistics ('{name}'); run moecompress calibrate first."
        )
    return stats_view(stats).get(layer, name)


@dataclass
class MethodContext:
    """What a method's build function receives besides its config.

    adapter: the model (an `MoEAdapter`; `StreamedAdapter` during `compress`); stats: calibration statistics
    (a `StatsView`; a {layer: {name: tensor}} mapping is wrapped in `MappingStats`) or None for stats-free
    methods; seed for any randomness; progress: show rich progress bars.
    """

    adapter: MoEAdapter
    stats: StatsView | None = None
    seed: int = 0
    progress: bool = False

    def __post_init__(self):
        self.stats = stats_view(self.stats)

    @property
    def model(self) -> torch.nn.Module:
        return self.adapter.model
