"""Statistics that are never stored: one layer at a time, computed while its consumer works on it.

A method such as ``auto`` reads, per layer, [E, H, H] statistics (gate²-weighted input moments, GPTQ
Hessians, their fold halves) that are many times the layer's own weights: for a 4.98 GB checkpoint of
24 layers × 64 experts (H = 1024), 2.75 GB per layer, 66 GB for the model. `StreamedStats` gives them to
the method the way the streamed view gives weights:

* `StreamedStats.layers()` is one calibration pass: it yields a `LayerStats` per MoE layer, in order,
  while that layer is loaded and its input hidden states are held. The pass's statistics are the same
  collectors' as `calibrate`'s, over the same batches in the same order, so they equal a store's bit for bit.
* The square statistics (`Collector.square`) are not gathered by the layer's pass. `LayerStats.get_row`
  gathers them `chunk` experts at a time, by running the layer's batches again with those experts'
  collectors only (``square_experts``), and keeps only the current chunk.
* Nothing is written to disk; a pass cannot resume. A method reads the layers more than once by starting
  another pass (auto: once to build its fronts, once to rebuild the chosen states).
* ``sequential=True`` (``--calib-mode sequential``, GPTQ's own pipeline and llm-compressor's default): the
  layer's outputs, which are the next layer's inputs, are computed after the reader is done with the layer,
  with the experts it replaced (`LayerStats.replace_expert`: the quantized ones), so each layer's statistics
  are taken on the activations of the already-compressed layers before it. One-pass (the default) computes
  every layer's inputs with the original model.

Single process only; the multi-process calibration writes a store.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import MoECompressError
from ..memory import release_freed_memory
from .api import Calibration, CalibrationOptions, gather

CHUNK = 4  # experts whose square statistics one pass gathers (8 held 2.2 GB on the wide model)


class _Named:
    """`has` / `require` over the statistic names of ``meta["stats"]`` (what the pass gathers)."""

    meta: dict

    def has(self, *names: str) -> bool:
        return all(n in self.meta["stats"] for n in names)

    def require(self, *names: str, method: str | None = None) -> None:
        missing = [n for n in names if not self.has(n)]
        if missing:
            raise MoECompressError(
                f"The streamed statistics lack '{missing[0]}'; this is a bug, please report it."
            )


class LayerStats(_Named):
    """The statistics of one MoE layer of a `StreamedStats` pass, with a store's reading interface
    (``get``, ``get_row``, ``has``, ``require``, ``meta``) for that layer only."""

    def __init__(
        self,
        layer: int,
        stats: dict[str, torch.Tensor],
        rows,
        square: frozenset[str],
        meta: dict,
        chunk: int,
        weights=None,
        replace=None,
    ):
        self.layer, self.meta, self.chunk = layer, meta, chunk
        self.sequential = replace is not None  # the pass computes the next layer's inputs after the reader
        self._replace = replace
        self.weights = (
            weights  # (checkpoint, native name -> tensor) of the pass's loaded layer, as stored; or None
        )
        self._stats, self._rows, self._square = stats, rows, square
        self._cached: tuple[list[int], dict[str, torch.Tensor]] | None = None  # (experts, their square rows)
        self.passes = 0  # square-statistics passes run so far (tests)

    def _check(self, layer: int, name: str) -> None:
        if layer != self.layer or self._rows is None:
            raise RuntimeError(
                f"Statistics of layer {layer} read while layer {self.layer}'s pass "
                f"{'is' if self._rows is not None else 'was'} current; this is a bug, please report it."
            )
        self.require(name)

    def get(self, layer: int, name: str) -> torch.Tensor:
        self._check(layer, name)
        if name not in self._square:
            return self._stats[name]
        experts = list(range(int(self._stats["counts"].numel())))
        if self.chunk < len(experts):
            raise RuntimeError(
                f"'{name}' is read one expert at a time on streamed statistics (get_row); this is a "
                "bug, please report it."
            )
        if not self._holds(experts):
            self._gather(experts)
        return self._cached[1][name]

    def get_row(self, layer: int, name: str, index: int) -> torch.Tensor:
        self._check(layer, name)
        if name not in self._square:
            return self._stats[name][index]
        if not self._holds([index]):
            lo = index - index % self.chunk
            self._gather(list(range(lo, min(lo + self.chunk, int(self._stats["counts"].numel())))))
        experts, rows = self._cached
        return rows[name][experts.index(index)].clone()  # a view would keep the whole chunk past the next one

    def get_rows(self, layer: int, name: str, ids: list[int]) -> torch.Tensor:
        """``get(layer, name)[ids]``: square statistics of at most `chunk` experts gathered together."""
        self._check(layer, name)
        if name not in self._square:
            return self._stats[name][list(ids)]
        if not self._holds(ids):
            if len(ids) > self.chunk:
                raise RuntimeError(
                    f"{len(ids)} experts' '{name}' asked for at once, more than the chunk of "
                    f"{self.chunk}; this is a bug, please report it."
                )
            self._gather(sorted(set(ids)))
        experts, rows = self._cached
        return rows[name][[experts.index(e) for e in ids]]

    def _holds(self, ids) -> bool:
        return self._cached is not None and all(e in self._cached[0] for e in ids)

    def _gather(self, experts: list[int]) -> None:
        self._cached = None  # the previous chunk goes before the next one is gathered
        release_freed_memory()
        self._cached = (experts, self._rows(experts))
        self.passes += 1

    def replace_expert(self, e: int, weights) -> None:
        """Sequential calibration: expert e of this layer computes with `weights` (`ExpertWeights`, e.g. its
        dequantized codes) when the pass computes the next layer's inputs, after the reader is done."""
        if self._replace is None:
            raise RuntimeError("replace_expert on a one-pass view; this is a bug, please report it.")
        self._replace(e, weights)

    def drop_rows(self) -> None:
        """The reader is done with square statistics for now: free the chunk held (the next read gathers)."""
        self._cached = None
        release_freed_memory()

    def close(self) -> None:
        """The pass moved on: the layer is gone, so nothing can be gathered any more."""
        self._rows, self._cached, self._stats, self.weights, self._replace = None, None, {}, None, None


class StreamedStats(_Named):
    """Statistics `names` of `model` on calibration `data`, per layer, gathered on demand (module doc)."""

    def __init__(
        self,
        model: str,
        data,
        names: list[str],
        *,
        seq_len: int = 256,
        seed: int = 0,
        batch_size: int = 8,
        dtype: str = "auto",
        chunk: int = CHUNK,
        sequential: bool = False,
    ):
        self.cal = Calibration(
            model,
            data,
            CalibrationOptions(
                seq_len=seq_len, stats=names, batch_size=batch_size, dtype=dtype, seed=seed, progress=False
            ),
            stream=True,
        )
        if self.cal.world > 1:
            raise MoECompressError(
                "Streamed statistics run in one process; calibrate into a store with "
                "moecompress calibrate (multi-process) and pass it with --calib DIR."
            )
        self.chunk, self.sequential = chunk, sequential
        self.square = frozenset().union(*(cls.square for cls in self.cal.classes))
        self.meta = {
            "data": self.cal.calib.to_dict(),
            "stats": list(self.cal.names),
            "streamed": True,
            "calib_mode": "sequential" if sequential else "one-pass",
        }

    def layers(self, only: set[str] | None = None) -> Iterator[LayerStats]:
        """One pass: a `LayerStats` per MoE layer in order, valid until the next one is asked for. `only`: the
        pass gathers just the collectors providing these statistics (a reader that needs a few of them again,
        e.g. `auto`'s fast search rebuilding GPTQ codes, skips the others' work); None: every statistic."""
        from .runner import SequentialRunner

        cal = self.cal
        runner = SequentialRunner(
            cal.reader, cal.calib, cal.device, cal.dtype, cal.options.batch_size, double_buffer=True
        )  # a layer's inputs stay for its square-statistics passes
        classes = [c for c in cal.classes if only is None or set(c.provides) & only]
        meta = self.meta if only is None else {**self.meta, "stats": sorted(only & set(self.meta["stats"]))}
        squares = [cls for cls in classes if cls.square]
        try:
            runner.embed()
            for i in runner.moe_passes():
                # sequential: the layer's outputs wait until the reader has replaced what it compressed
                stats_i = gather(
                    runner,
                    i,
                    classes,
                    {**cal.params, "square_experts": []},
                    cal.device,
                    write=not self.sequential,
                )
                stats_i = {k: v for k, v in stats_i.items() if k not in self.square}

                def rows(ids: list[int], i=i) -> dict[str, torch.Tensor]:
                    got = gather(
                        runner, i, squares, {**cal.params, "square_experts": ids}, cal.device, write=False
                    )
                    return {k: v for k, v in got.items() if k in self.square}

                weights = None
                if cal.dtype is None:  # the runner holds the layer as stored: it can be lent (`each_layer`)
                    layer = runner.model.get_submodule(f"{cal.reader.layers_prefix}.{i}")
                    prefix = f"{cal.reader.layers_prefix}.{i}"
                    weights = (
                        str(cal.reader.path),
                        {**dict(layer.named_parameters(prefix)), **dict(layer.named_buffers(prefix))},
                    )
                replace = None
                if self.sequential:

                    def replace(e: int, w, i=i) -> None:
                        with torch.no_grad():
                            runner.adapter.layer(i).storage.write(e, w)

                view = LayerStats(i, stats_i, rows, self.square, meta, self.chunk, weights, replace)
                del stats_i, weights  # held by the view only: freeing the layer must free its tensors
                yield view
                view.close()
                if self.sequential:  # the next layer's inputs, from the layer as the reader left it, computed
                    # through the same observed forward a one-pass run writes them with (its statistics unused)
                    gather(runner, i, cal.classes, {**cal.params, "square_experts": []}, cal.device)
        finally:
            runner.cache.clear()


def each_layer(
    stats, layers: list[int], adapter=None, only: set[str] | None = None
) -> Iterator[tuple[int, object]]:
    """(layer, statistics to read it from) for each of `layers` in order: a store (or None) answers for every
    layer; `StreamedStats` runs a pass and answers with each layer's `LayerStats`. The pass holds that layer's
    weights already: a streamed method view (`adapter` with ``lend``) is lent them while the consumer works on
    the layer, so the layer is in memory once, not once per reader; the view gives them back before the pass
    goes on to the next layer. `only`: the statistics a pass needs gather (`StreamedStats.layers`)."""
    if isinstance(stats, StreamedStats):
        for view in stats.layers(only):
            if view.layer not in layers:
                continue
            lent = (
                view.weights is not None
                and hasattr(adapter, "lend")
                and adapter.lend(view.layer, view.weights[1], view.weights[0])
            )
            try:
                yield view.layer, view
            finally:
                if lent:
                    adapter.unlend()
    else:
        for i in layers:
            yield i, stats
