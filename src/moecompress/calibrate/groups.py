"""Statistics of several groups of calibration sequences from one streamed pass (resampling studies).

A study of how statistics vary between draws of calibration text (`moecompress.workflows.drift`) needs each draw's
statistics separately. Calibrating each draw on its own streams the checkpoint once per draw; here the
draws are concatenated into one `CalibrationData` and pushed through the checkpoint once. Every MoE layer
gets one set of collectors per group, and each batch feeds its own group's set: the group sizes must be
multiples of the batch size, so no batch straddles two groups, and each group's batches are exactly the
ones a calibration of that group alone would run (the same statistics, bit for bit; tested).

The result stays in memory, one ``{layer: {name: tensor}}`` per group: no store, no resume, one process.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import torch

from ..data import CalibrationData
from ..errors import MoECompressError
from .registry import DEFAULT_STATS, collectors_for, resolve_stats

GroupStats = dict[int, dict[str, torch.Tensor]]


def _group_of_batches(batches, sizes: Sequence[int], batch_size: int) -> dict[int, int]:
    ends = list(itertools.accumulate(sizes))
    out = {}
    for b, rows in batches:
        g = bisect.bisect_right(ends, rows.start)
        if rows.stop > ends[g]:
            raise MoECompressError(
                f"Calibration groups of {list(sizes)} sequences do not split into batches of "
                f"{batch_size}; make every group a multiple of the batch size."
            )
        out[b] = g
    return out


def calibrate_groups(
    model: str,
    data: CalibrationData,
    sizes: Sequence[int],
    stats=None,
    *,
    batch_size: int = 8,
    dtype: str | None = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> list[GroupStats]:
    """Per-group statistics of `model` on `data`, whose rows are `sizes[0]` sequences of group 0, then group 1, …

    stats: statistic names, as for `calibrate` (the routing defaults are always gathered)."""
    from ..checkpoint import CheckpointReader
    from ..models import parse_dtype
    from .hooks import LayerObserver
    from .runner import SequentialRunner

    if not sizes or min(sizes) < 1 or sum(sizes) != data.num_sequences:
        raise MoECompressError(
            f"Calibration groups of {list(sizes)} sequences do not add up to the "
            f"{data.num_sequences} sequences given; pass one positive size per group."
        )
    classes = collectors_for(sorted(set(resolve_stats(stats)) | set(DEFAULT_STATS)))
    reader = CheckpointReader(model, trust_remote_code)
    runner = SequentialRunner(
        reader, data, device, None if dtype in (None, "auto") else parse_dtype(dtype), batch_size
    )
    group_of = _group_of_batches(runner.batches, sizes, batch_size)
    adapter = runner.adapter
    out: list[GroupStats] = [{} for _ in sizes]
    runner.embed()
    try:
        for i in runner.moe_passes():
            sets = [[cls(adapter, i, device) for cls in classes] for _ in sizes]
            obs = LayerObserver(adapter, i, sets[0])
            obs.attach()
            try:
                runner.run_layer(
                    i, observer=obs, before_batch=lambda b, obs=obs, sets=sets: obs.use(sets[group_of[b]])
                )
            finally:
                obs.detach()
            for g, collectors in enumerate(sets):
                out[g][i] = {k: v.detach().cpu() for c in collectors for k, v in c.finalize().items()}
    finally:
        runner.cache.clear()
    return out
