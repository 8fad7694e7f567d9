"""Resource estimates before any heavy work, and the refusal when the machine cannot hold a run.

Memory model (host): baseline process + max(non-layer tensors, one decoder layer x 2 — mapped shard
pages and the copy — or x 3.5 when per-expert keys are stacked and concatenated into fused tensors) + activation cache in RAM (sequences/world x seq_len x hidden
x bytes, twice when layer transforms need a second pass) + one batch's working set + the collectors'
float64 accumulators of one layer, twice (sums and finalized copies; the GPTQ Hessians alone are
E x (H^2 + I^2) x 8 bytes). Disk: two activation buffers with --offload-dir, plus the statistics of
every MoE layer (each collector's `stat_bytes`). Time: a one-layer probe (load the first MoE layer,
push one batch through it with and without the collectors) scaled by layer bytes and batch counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..atomic import human_bytes as _human
from ..disk import free_bytes, tag_bytes
from ..errors import MoECompressError


@dataclass
class ResourceEstimate:
    peak_memory_bytes: int
    memory_available_bytes: int
    device_memory_bytes: int | None
    device_available_bytes: int | None
    activation_cache_bytes: int
    activation_on_disk: bool
    stats_bytes: int
    disk_bytes: int
    disk_available_bytes: int
    layer_bytes: int
    non_layer_bytes: int
    time_s: float | None = None
    accumulator_bytes: int = 0  # the collectors' float64 sums of one layer (held twice at finalize)
    probe: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        """The sentence that refuses the run, or None when it fits."""
        if self.peak_memory_bytes > self.memory_available_bytes:
            hint = (
                "pass --offload-dir DIR to keep activations on disk, "
                if not self.activation_on_disk
                and self.activation_cache_bytes > self.memory_available_bytes * 0.25
                else ""
            )
            return (
                f"Calibration needs about {_human(self.peak_memory_bytes)} of memory but only "
                f"{_human(self.memory_available_bytes)} is available; {hint}use a smaller --batch-size or fewer "
                "calibration sequences."
            )
        if (
            self.device_memory_bytes is not None
            and self.device_available_bytes is not None
            and self.device_memory_bytes > self.device_available_bytes
        ):
            return (
                f"One layer with its batch needs about {_human(self.device_memory_bytes)} of GPU memory but only "
                f"{_human(self.device_available_bytes)} is free; use a smaller --batch-size, --dtype bfloat16 "
                "or --device cpu."
            )
        if self.disk_bytes > self.disk_available_bytes:
            return (
                f"Calibration needs about {_human(self.disk_bytes)} of disk (activation cache and statistics) but "
                f"only {_human(self.disk_available_bytes)} is free; free space or point --offload-dir/--out "
                "elsewhere."
            )
        return None

    def rows(self) -> list[tuple[str, str]]:
        peak = f"{_human(self.peak_memory_bytes)} of {_human(self.memory_available_bytes)} available"
        cache = f"{_human(self.activation_cache_bytes)} ({'disk' if self.activation_on_disk else 'memory'})"
        out = [
            ("peak memory (host)", peak),
            ("largest layer", _human(self.layer_bytes)),
            ("non-layer tensors", _human(self.non_layer_bytes)),
            ("activation cache", cache),
            ("collector sums (one layer)", _human(self.accumulator_bytes)),
            ("statistics", _human(self.stats_bytes)),
            ("disk", f"{_human(self.disk_bytes)} of {_human(self.disk_available_bytes)} free"),
        ]
        if self.device_memory_bytes is not None:
            gpu = f"{_human(self.device_memory_bytes)} of {_human(self.device_available_bytes or 0)} free"
            out.append(("GPU memory", gpu))
        if self.time_s is not None:
            out.append(("estimated time", f"{self.time_s:,.0f} s ({self.time_s / 3600:.2f} h)"))
        out.append(("verdict", "fits" if self.fits else self.problem()))
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        d["problem"] = self.problem()
        return d


def _elem(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stat_sizes(adapter, layers, collector_classes, params, packed: bool = True) -> tuple[int, int]:
    """(largest one-layer accumulator bytes, finalized statistic bytes of all `layers`), from collector shapes on
    meta. Accumulators are float64 sums; most statistics keep their shapes and dtypes, the Hessians are stored
    in float32, and the symmetric ones as upper triangles (each collector's `stat_bytes`; `packed=False`: as full
    matrices, stats store format 1)."""
    acc = fin = 0
    for layer in layers:
        cs = [cls(adapter, layer, "meta", **params) for cls in collector_classes]
        acc = max(acc, sum(t.numel() * t.element_size() for c in cs for t in c.sums.values()))
        fin += sum(_stat_bytes(c, packed) for c in cs)
    return acc, fin


def _stat_bytes(collector, packed: bool) -> int:
    if packed:
        return collector.stat_bytes()
    try:
        return collector.stat_bytes(packed=False)
    except TypeError:  # a collector defined elsewhere, overriding `stat_bytes()` without the argument
        return collector.stat_bytes()


def estimate(
    reader,
    data,
    adapter,
    device,
    dtype,
    batch_size: int,
    world: int,
    offload_dir,
    out,
    collector_classes,
    params,
    double_buffer: bool,
) -> ResourceEstimate:
    """The `ResourceEstimate` of a calibration (module doc: memory, disk), its time still to be probed."""
    import psutil

    cfg = reader.config
    hidden = int(cfg.hidden_size)
    moe = adapter.moe_layers
    last = max(moe)
    disk_elem = _disk_elem(reader, moe)
    comp_elem = _elem(dtype) if dtype is not None else disk_elem
    scale = comp_elem / disk_elem
    layer_bytes = int(max(reader.layer_bytes(i) for i in range(last + 1)) * scale)
    non_layer = int(reader.layer_bytes(None) * scale)
    seqs = -(-data.num_sequences // world)
    act = seqs * data.seq_len * hidden * comp_elem
    on_disk = offload_dir is not None
    ram_act = 0 if on_disk else act * (2 if double_buffer else 1)
    tokens = batch_size * data.seq_len
    batch_ws = _batch_working_set(cfg, adapter, batch_size, data.seq_len, comp_elem)
    acc, stats_total = stat_sizes(adapter, moe, collector_classes, params)
    baseline = psutil.Process().memory_info().rss
    on_gpu = torch.device(device).type == "cuda"
    # reading a layer holds its mapped shard pages and the copies; per-expert keys add the stacked and
    # concatenated fused tensors (measured ~3.5x the layer on the 4.98 GB benchmark checkpoint)
    factor = 3.5 if any(reader.converts(i) for i in range(last + 1)) else 2.0
    peak_host = (
        baseline + max(non_layer, factor * layer_bytes) + ram_act + (0 if on_gpu else batch_ws + 2 * acc)
    )
    dev_need = dev_free = None
    if on_gpu:
        dev_need = max(non_layer, layer_bytes) + 2 * tokens * hidden * comp_elem + batch_ws + 2 * acc
        dev_free = torch.cuda.mem_get_info(torch.device(device))[0]
    disk_need = stats_total + (2 * act if on_disk else 0)
    return ResourceEstimate(
        peak_memory_bytes=int(peak_host),
        memory_available_bytes=int(psutil.virtual_memory().available + baseline),
        device_memory_bytes=dev_need,
        device_available_bytes=dev_free,
        activation_cache_bytes=int(act),
        activation_on_disk=on_disk,
        stats_bytes=int(stats_total),
        disk_bytes=int(disk_need),
        disk_available_bytes=free_bytes(offload_dir or Path(out).parent),
        layer_bytes=layer_bytes,
        non_layer_bytes=non_layer,
        accumulator_bytes=int(acc),
    )


def _disk_elem(reader, moe) -> int:
    """Bytes per element of the checkpoint's stored weights (read from the first MoE layer's first tensor)."""
    sample = reader.layer_keys(moe[0])[:1]
    disk_elem = 2
    if sample:
        from safetensors import safe_open

        with safe_open(str(reader._key_file[sample[0]]), framework="pt") as f:
            disk_elem = tag_bytes(f.get_slice(sample[0]).get_dtype(), 2)
    return disk_elem


def _batch_working_set(cfg, adapter, batch_size: int, seq_len: int, comp_elem: int) -> int:
    """Bytes one batch's pass through a layer works in: hidden states, the routed experts' intermediates and
    the attention scores."""
    moe = adapter.moe_layers
    hidden = int(cfg.hidden_size)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    inter = max(adapter.intermediate_size(i) for i in moe)
    k = max(adapter.top_k(i) for i in moe)
    tokens = batch_size * seq_len
    return (
        tokens * hidden * comp_elem * 12
        + tokens * k * inter * comp_elem * 3
        + batch_size * heads * seq_len * seq_len * 4
    )


def probe_time(
    reader, data, device, dtype, batch_size: int, world: int, collector_classes, params, est: ResourceEstimate
) -> ResourceEstimate:
    """Time one layer on one batch (first MoE layer, embedding output as a stand-in input) and extrapolate."""
    from .hooks import LayerObserver
    from .runner import SequentialRunner

    one = _first_batch(data, batch_size)
    runner = SequentialRunner(reader, one, device, dtype, batch_size)
    runner.embed()
    adapter = runner.adapter
    i = adapter.moe_layers[0]
    t0 = time.perf_counter()
    runner.load_layer(i)
    t_load = time.perf_counter() - t0

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    runner.run_layer(i, write=False)
    sync()
    t_plain = time.perf_counter() - t0
    obs = LayerObserver(adapter, i, [cls(adapter, i, device, **params) for cls in collector_classes])
    obs.attach()
    try:
        t0 = time.perf_counter()
        runner.run_layer(i, observer=obs, write=False)
        sync()
        t_obs = time.perf_counter() - t0
    finally:
        obs.detach()
    probe_bytes = max(1, reader.layer_bytes(i))
    runner.free_layer(i)
    n_batches = math.ceil(math.ceil(data.num_sequences / world) / batch_size)
    est.time_s = _extrapolate(reader, adapter, n_batches, t_load, probe_bytes, t_plain, t_obs)
    est.probe = {
        "layer": i,
        "load_s": t_load,
        "batch_s_plain": t_plain,
        "batch_s_observed": t_obs,
        "batches_per_rank": n_batches,
    }
    return est


def _first_batch(data, batch_size: int):
    """The calibration data cut to its first `batch_size` sequences (the same type and settings)."""
    return type(data)(
        data.input_ids[:batch_size],
        data.attention_mask[:batch_size],
        data.spec,
        data.seq_len,
        data.seed,
        data.padded,
        data.chat_template,
        data.sources,
    )


def _extrapolate(
    reader, adapter, n_batches: int, t_load: float, probe_bytes: int, t_plain: float, t_obs: float
) -> float:
    """Seconds for every decoder layer: its load (the probe layer's `t_load` scaled by its bytes) and
    `n_batches` passes, observed in MoE layers."""
    moe = set(adapter.moe_layers)
    total = 0.0
    for j in range(max(adapter.moe_layers) + 1):
        total += t_load * reader.layer_bytes(j) / probe_bytes
        total += n_batches * (t_obs if j in moe else t_plain)
    return total


def refuse_if_too_big(est: ResourceEstimate) -> None:
    problem = est.problem()
    if problem:
        raise MoECompressError(problem)
