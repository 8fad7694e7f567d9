"""The typed seams between methods and the rest: `MethodContext` (an `MoEAdapter`, a `StatsView`)."""

from __future__ import annotations

import pytest
import torch

from moecompress.calibrate import StatsStore
from moecompress.calibrate.streamed import LayerStats
from moecompress.errors import MoECompressError
from moecompress.methods import MappingStats, MethodContext, StatsView
from moecompress.methods.context import ChainedStats, stat
from moecompress.models import MoEAdapter
from moecompress.testing import tiny_model


def test_a_mapping_becomes_a_stats_view():
    counts = torch.tensor([3, 1])
    ctx = MethodContext(MoEAdapter(tiny_model("olmoe")), {1: {"counts": counts, "tokens": torch.tensor(4)}})
    assert isinstance(ctx.stats, MappingStats)
    assert (
        ctx.stats.get(1, "counts") is counts and ctx.stats.layers == [1] and ctx.stats.has("counts", "tokens")
    )
    assert ctx.stats.names == ["counts", "tokens"] and not ctx.stats.has("reap")
    with pytest.raises(MoECompressError, match="lack 'reap' for layer 1"):
        ctx.stats.get(1, "reap")
    assert stat({1: {"counts": counts}}, 1, "counts") is counts  # plain mappings still accepted
    assert torch.equal(ctx.stats.get_rows(1, "counts", [1, 0]), torch.tensor([1, 3]))
    assert MethodContext(ctx.adapter).stats is None


def test_the_stats_store_offers_the_view():
    """Everything `StatsView` names, `StatsStore` has (methods read stores through that protocol)."""
    members = [m for m in vars(StatsView) if not m.startswith("_")]
    want = {"layers", "names", "has", "get", "layer", "get_row", "get_rows", "chunk", "drop_rows"}
    assert set(members) == want
    assert all(hasattr(cls, m) for cls in (StatsStore, MappingStats, ChainedStats) for m in members)
    assert hasattr(
        LayerStats, "drop_rows"
    )  # the streamed layer view (its chunk: tests/test_streamed_stats.py)
    # stores and mappings answer `get` for any number of experts: no chunk, nothing held to drop
    assert (
        StatsStore.chunk is None
        and MappingStats({}).chunk is None
        and ChainedStats(MappingStats({})).chunk is None
    )


def test_chained_stats_reads_each_statistic_from_the_first_view_holding_it():
    a = MappingStats({1: {"counts": torch.tensor([3, 4])}, 2: {"counts": torch.tensor([5, 6])}})
    b = MappingStats({1: {"input_moment": torch.arange(8.0).reshape(2, 2, 2)}})
    chain = ChainedStats(a, b)
    assert (
        chain.layers == [1]
        and chain.names == ["counts", "input_moment"]
        and chain.has("counts", "input_moment")
    )
    assert chain.get(1, "counts") is a.get(1, "counts")
    assert torch.equal(chain.get_row(1, "input_moment", 1), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    with pytest.raises(MoECompressError, match="lack 'reap' for layer 1"):
        chain.get(1, "reap")
