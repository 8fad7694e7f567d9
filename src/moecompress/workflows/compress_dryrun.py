"""`compress --dry-run`: memory, disk and time of a streamed compression before any work.

The streamed `compress` holds, at its peak, one of: calibration's (the calibrate dry-run estimator's own
formula: one layer being read and fused, the activation cache, the collectors' sums), the method view's
(what the method declares it holds, `methods.registry.ViewUse`: layers as stored, layers in the compute
dtype, the embeddings too when it runs forwards; nothing for plans built from statistics alone), or the
exporter's (one layer read and fused). Peak = interpreter baseline + the largest of the three. Disk: the
output is at most the checkpoint's size, plus the statistics. Time: one layer's read is timed, then scaled
by the passes over the checkpoint each phase makes; a method's own arithmetic is not counted (it is most of
the time of the fitting methods, `auto`'s especially), and the row says so.
BENCHMARKS.md, "Streaming compress", sets these estimates beside the measured peaks and times.

Statistics each way (a method that reads statistics): *streamed* (`pipeline.streams_statistics`: `auto` and
`quant` from a data spec) writes none, and holds one layer's statistics in memory while the method works on
it; a *kept store* (`moecompress calibrate --out DIR`, then `--calib DIR`; every other method, and `compress`
itself for them, under ``<out>-calib``) takes each collector's `stat_bytes` on disk, the symmetric ones as
upper triangles (stats store format 2; the format 1 size, full matrices, is given beside it), and calibration
holds one layer's float64 sums, twice. Both are reported for a method that can stream.

A directory holding a ``config.json`` and no weights is estimated from its meta skeleton alone: sizes at the
config's dtype (bfloat16 when it names none), the fusing factor from whether transformers converts the family's
on-disk keys, and no time (nothing to read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import human_bytes
from ..disk import free_bytes, tag_bytes
from ..errors import MoECompressError


@dataclass
class CompressEstimate:
    peak_memory_bytes: int
    calibration_bytes: int
    plan_bytes: int
    export_bytes: int
    disk_bytes: int
    time_s: float | None  # None: no weights to time (a config.json alone)
    checkpoint_bytes: int
    disk_available_bytes: int | None = None  # free where --out goes (None: no output path given)
    # the statistics each way (module doc); None where the method reads none, or (streamed) cannot stream them
    stats_streamed_disk_bytes: int | None = None  # nothing is written: 0
    stats_streamed_memory_bytes: int | None = (
        None  # one layer's statistics (square rows of a chunk), held twice
    )
    stats_kept_disk_bytes: int | None = None  # a kept store, symmetric statistics as upper triangles
    stats_kept_full_bytes: int | None = None  # the same store with every matrix whole (format 1)
    stats_kept_memory_bytes: int | None = None  # calibrating it: one layer's float64 sums, held twice
    stats_streamed: bool = False  # this run streams its statistics (else it reads or writes a store)
    config_only: bool = False  # estimated from a config.json without weights

    def to_dict(self) -> dict:
        return dict(vars(self))

    def rows(self) -> list[tuple[str, str]]:
        time = (
            "unknown (a config.json without weights: nothing to time)"
            if self.time_s is None
            else f"{self.time_s:.0f} s"
        )
        rows = [
            ("peak memory", human_bytes(self.peak_memory_bytes)),
            ("  calibration phase", human_bytes(self.calibration_bytes)),
            ("  plan building (streamed view)", human_bytes(self.plan_bytes)),
            ("  export (streamed)", human_bytes(self.export_bytes)),
            (
                "checkpoint on disk" + (" (from config.json, no weights)" if self.config_only else ""),
                human_bytes(self.checkpoint_bytes),
            ),
            (
                "disk needed (output upper bound + statistics)",
                human_bytes(self.disk_bytes)
                + (
                    ""
                    if self.disk_available_bytes is None
                    else f" ({human_bytes(self.disk_available_bytes)} free where --out goes)"
                ),
            ),
        ]
        if self.stats_streamed_memory_bytes is not None:
            rows.append(
                (
                    "statistics streamed (--calib a data spec"
                    + ("; this run)" if self.stats_streamed else ")"),
                    (
                        f"{human_bytes(self.stats_streamed_disk_bytes)} on disk (no per-expert matrix written), "
                        f"{human_bytes(self.stats_streamed_memory_bytes)} in memory at a layer"
                    ),
                )
            )
        if self.stats_kept_disk_bytes is not None:
            rows.append(
                (
                    "statistics kept as a store (calibrate --out DIR, then --calib DIR"
                    + (")" if self.stats_streamed else "; this run)"),
                    (
                        f"{human_bytes(self.stats_kept_disk_bytes)} on disk (symmetric matrices as upper "
                        f"triangles; {human_bytes(self.stats_kept_full_bytes)} as full matrices), "
                        f"{human_bytes(self.stats_kept_memory_bytes)} in memory while calibrating a layer"
                    ),
                )
            )
        rows.append(("time of the checkpoint reads (the method's own arithmetic not counted)", time))
        return rows


class _ConfigOnly:
    """What `estimate_compress` reads of a checkpoint, for a directory holding a config.json and no weights:
    sizes from the meta skeleton at the config's dtype (bfloat16 when it names none)."""

    def __init__(self, path: Path):
        import torch
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        from ..checkpoint import CheckpointReader
        from ..models import MoEAdapter, load_config, skeleton

        self.path = path
        self.config = load_config(str(path))
        self._skeleton = skeleton(self.config)
        self.layers_prefix, self.num_layers = CheckpointReader._find_layers(self._skeleton, MoEAdapter)
        dtype = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None) or "bfloat16"
        dtype = getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype
        self.elem = dtype.itemsize
        self._bytes: dict[int | None, int] = {}
        prefix = self.layers_prefix + "."
        for name, p in self._skeleton.named_parameters():  # tied weights once
            key = int(name[len(prefix) :].split(".")[0]) if name.startswith(prefix) else None
            self._bytes[key] = self._bytes.get(key, 0) + p.numel() * self.elem
        # per-expert keys on disk, fused on reading (as CheckpointReader.converts finds them in real shards)
        self._converts = any(
            isinstance(m, WeightConverter) for m in get_model_conversion_mapping(self._skeleton)
        )

    def layer_bytes(self, i: int | None) -> int:
        return self._bytes.get(i, 0)

    def converts(self, i: int | None) -> bool:
        return self._converts and i is not None

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes.values())


def _config_only(model: str) -> Path | None:
    """`model` as a local directory holding a config.json and no safetensors weights, else None."""
    p = Path(model)
    if (
        p.is_dir()
        and (p / "config.json").is_file()
        and not any(p.glob("*.safetensors"))
        and not (p / "model.safetensors.index.json").is_file()
    ):
        return p
    return None


def estimate_compress(
    model: str,
    method: str,
    params: dict | None,
    calib,
    seq_len: int,
    dtype_bytes: int = 4,
    stats: list[str] = (),
    moment_fraction: float | None = None,
    streamed_chunk: int | None = None,
    out=None,
) -> CompressEstimate:
    """The estimate of the module doc for `compress(model, method, params, calib=calib)`.

    stats: the statistics the method reads (their collectors' one-layer sums count towards calibration's
    memory, held twice as at finalize, and every layer's statistics towards the disk). moment_fraction: the
    method gathers input/cross moments in a second pass for this fraction of each layer's experts (prune's
    tilt: the removed ones, `MethodEntry.moment_experts`), else for every expert. streamed_chunk: the statistics
    are streamed (`calibrate.streamed`, `pipeline.streams_statistics`): nothing on disk, one layer's statistics
    but the square ones, and the square ones of this many experts, in memory while the plan is built (the two
    phases' memory adds up); two calibration passes. The time counts checkpoint reads only, not a method's
    own arithmetic (auto's fits and GPTQ dominate on wide layers). out: the output directory, whose disk's free
    space is reported (not refused: the output is usually well below its upper bound)."""
    from ..methods.registry import get_method, parse_config

    entry = get_method(method)
    config = parse_config(method, params)
    view = entry.view_for(config)
    ck = _measure_checkpoint(model)
    scale = dtype_bytes / ck.disk_elem
    calib_bytes, calib_passes, stats_bytes = _calibration_memory(
        ck, calib, seq_len, list(stats), moment_fraction, streamed_chunk
    )
    plan_bytes = int(
        ck.layer_disk * view.stored
        + ck.layer_disk * scale * view.compute
        + (ck.non_layer_disk * scale if view.forwards else 0)
    )
    export_bytes = int(ck.factor * ck.layer_disk + ck.non_layer_disk)
    # streamed statistics are gathered while the method works on the layer: the two phases overlap
    overlap = (
        calib_bytes + plan_bytes if streamed_chunk is not None and stats else max(calib_bytes, plan_bytes)
    )
    peak = ck.baseline + max(overlap, export_bytes)
    passes = calib_passes + 1 + (1 if view.stored or view.compute else 0)  # + export, + the view's reads
    chunk = entry.chunk_for(config)
    each_way = _statistics_each_way(ck.adapter, entry, chunk, list(stats), moment_fraction) if stats else {}
    return CompressEstimate(
        peak_memory_bytes=int(peak),
        calibration_bytes=calib_bytes,
        plan_bytes=plan_bytes,
        export_bytes=export_bytes,
        disk_bytes=ck.ckpt + stats_bytes,
        checkpoint_bytes=ck.ckpt,
        time_s=None if ck.t_layer is None else ck.t_layer * ck.reader.num_layers * passes,
        disk_available_bytes=None if out is None else free_bytes(out),
        **each_way,
        stats_streamed=bool(stats) and streamed_chunk is not None,
        config_only=ck.config_dir is not None,
    )


@dataclass
class _Measured:
    """What `estimate_compress` reads of the checkpoint (`_measure_checkpoint`)."""

    reader: object
    config_dir: Path | None
    adapter: object
    baseline: int  # the process's resident memory before the timed read
    disk_elem: int  # bytes per stored element
    layer_disk: int  # the largest decoder layer's bytes on disk
    non_layer_disk: int  # the bytes outside the decoder layers
    ckpt: int  # the checkpoint's bytes
    t_layer: float | None  # one timed layer read, seconds (None for a config-only model)
    factor: float  # calibrate dry-run's measured fusing factor
    hidden: int


def _measure_checkpoint(model: str) -> _Measured:
    """Open `model` (a checkpoint, or a config-only directory) and measure what the estimate needs, one layer
    read timed."""
    import psutil

    from ..checkpoint import CheckpointReader
    from ..models import MoEAdapter

    config_dir = _config_only(model)
    reader = CheckpointReader(model) if config_dir is None else _ConfigOnly(config_dir)
    baseline = psutil.Process().memory_info().rss  # before the timed read, which would count a layer twice
    adapter = MoEAdapter(reader._skeleton)
    moe = adapter.moe_layers
    disk_elem, layer_disk, ckpt, t_layer = _first_layer_read(reader, moe, config_dir)
    layer_disk = max(layer_disk, *(reader.layer_bytes(i) for i in range(reader.num_layers)))
    non_layer_disk = reader.layer_bytes(None)
    factor = (
        3.5 if any(reader.converts(i) for i in moe) else 2.0
    )  # calibrate dry-run's measured fusing factor
    hidden = int(reader.config.hidden_size)
    return _Measured(
        reader,
        config_dir,
        adapter,
        baseline,
        disk_elem,
        layer_disk,
        non_layer_disk,
        ckpt,
        t_layer,
        factor,
        hidden,
    )


def _first_layer_read(reader, moe: list[int], config_dir: Path | None):
    """The checkpoint's bytes per stored element, the first MoE layer's bytes on disk, the checkpoint's bytes and
    the seconds one timed read of that layer takes (None and the config's numbers for a config-only model)."""
    from safetensors import safe_open

    from ..memory import release_freed_memory

    if config_dir is not None:
        return reader.elem, 0, reader.total_bytes, None
    sample = reader.layer_keys(moe[0])[:1]
    disk_elem = 2
    if sample:
        with safe_open(str(reader._key_file[sample[0]]), framework="pt") as f:
            disk_elem = tag_bytes(f.get_slice(sample[0]).get_dtype(), 2)
    t0 = time.perf_counter()
    layer_disk = reader.layer_bytes(moe[0])
    reader.native_state(moe[0])  # the one timed read
    t_layer = time.perf_counter() - t0
    release_freed_memory()
    ckpt = sum(p.stat().st_size for p in Path(reader.path).glob("*.safetensors"))
    return disk_elem, layer_disk, ckpt, t_layer


def _calibration_memory(
    ck: _Measured, calib, seq_len: int, stats: list[str], moment_fraction, streamed_chunk
) -> tuple[int, int, int]:
    """Calibration's memory (one fused layer, the hidden states, the statistics), its passes over the checkpoint
    and its statistics' bytes on disk, when `calib` is a data spec (else zeros)."""
    calib_bytes, calib_passes, stats_bytes = 0, 0, 0
    if calib is not None and not Path(calib).is_dir():
        spec = str(calib)
        seqs = int(spec.rsplit(":", 1)[1]) if ":" in spec and spec.rsplit(":", 1)[1].isdigit() else 64
        calib_bytes = int(ck.factor * ck.layer_disk + 2 * seqs * seq_len * ck.hidden * 4)
        calib_passes = 1
        if stats and streamed_chunk is not None:
            calib_bytes += 2 * _streamed_statistics(ck.adapter, stats, streamed_chunk)
            calib_passes += 1
        elif stats:
            acc, stats_bytes = _statistics(ck.adapter, stats, moment_fraction)
            calib_bytes += 2 * acc
            calib_passes += moment_fraction is not None
    return calib_bytes, calib_passes, stats_bytes


def _statistics_each_way(
    adapter, entry, chunk: int | None, stats: list[str], moment_fraction: float | None
) -> dict:
    """The statistics' disk and memory streamed (when `entry` can stream them) and kept as a store (module doc)."""
    from ..calibrate.streamed import CHUNK

    acc, kept = _statistics(adapter, stats, moment_fraction)
    _, full = _statistics(adapter, stats, moment_fraction, packed=False)
    out = {
        "stats_kept_disk_bytes": int(kept),
        "stats_kept_full_bytes": int(full),
        "stats_kept_memory_bytes": int(2 * acc),
    }
    if entry.streamed_stats:
        out.update(
            stats_streamed_disk_bytes=0,
            stats_streamed_memory_bytes=int(2 * _streamed_statistics(adapter, stats, chunk or CHUNK)),
        )
    return out


def _statistics(
    adapter, stats: list[str], moment_fraction: float | None, packed: bool = True
) -> tuple[int, int]:
    """(largest one-layer collector sums, statistics of every layer) in bytes, from the collectors' shapes;
    with `moment_fraction`, the moments are a second pass over that fraction of each layer's experts.
    `packed`: symmetric statistics as a store keeps them (upper triangles); False: full matrices (format 1)."""
    from ..calibrate.collectors import MomentCollector
    from ..calibrate.dryrun import stat_sizes
    from ..calibrate.registry import collectors_for

    moe = adapter.moe_layers
    moments = [s for s in stats if s in MomentCollector.provides]
    if moment_fraction is None or not moments:
        return stat_sizes(adapter, moe, collectors_for(stats), {}, packed)
    first = [s for s in stats if s not in moments]
    acc1, fin1 = stat_sizes(adapter, moe, collectors_for(first), {}, packed) if first else (0, 0)
    subset = {i: list(range(round(adapter.num_experts(i) * moment_fraction))) for i in moe}
    acc2, fin2 = stat_sizes(adapter, moe, [MomentCollector], {"moment_experts": subset}, packed)
    return max(acc1, acc2), fin1 + fin2


def _streamed_statistics(adapter, stats: list[str], chunk: int) -> int:
    """Largest one-layer bytes of streamed statistics: the layer's sums without their square rows, plus the
    square rows of `chunk` experts (`calibrate.streamed.LayerStats`)."""
    from ..calibrate.dryrun import stat_sizes
    from ..calibrate.registry import collectors_for

    moe = adapter.moe_layers
    classes = collectors_for(stats)
    rest, _ = stat_sizes(adapter, moe, classes, {"square_experts": []})
    chunk = min(chunk, max(adapter.num_experts(i) for i in moe))
    rows, _ = stat_sizes(
        adapter, moe, [c for c in classes if c.square], {"square_experts": list(range(chunk))}
    )
    return rest + rows


def refuse_if_over(est: CompressEstimate, max_memory: int) -> None:
    if est.peak_memory_bytes > max_memory:
        raise MoECompressError(
            f"Compressing needs about {human_bytes(est.peak_memory_bytes)} of memory but "
            f"--max-memory allows {human_bytes(max_memory)}; raise --max-memory or use a method "
            "with a smaller scope."
        )
