"""`calibrate(...)`: the Python face of ``moecompress calibrate``."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import MoECompressError
from .collectors import collectors_for
from .registry import DEFAULT_STATS, resolve_stats
from .store import FORMAT, PartialRun, StatsStore, versions, write_store


class UnreachedExpertsWarning(UserWarning):
    """Some experts received no calibration token: their statistics are 0 (never NaN)."""


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # progress goes to stderr so that --json output on stdout stays parseable
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled, transient=False)


def _identity(reader, fingerprint, calib, names, params, dtype, device, batch_size) -> dict:
    """What must match for a resumed run to give identical statistics (normalised through JSON)."""
    return json.loads(json.dumps({"model_fingerprint": fingerprint, "model_source": str(reader.path), "data_spec": calib.spec,
            "data_source": calib.spec, "data_fingerprint": calib.fingerprint(), "seq_len": calib.seq_len,
            "seed": calib.seed, "stats": names, "params": params, "dtype": str(dtype).replace("torch.", ""),
            "device": torch.device(device).type, "batch_size": batch_size}, default=str))


def _layer_ids(spec) -> list[int]:
    """'0,1,2' or an iterable of ints -> sorted unique layer ids (one sentence for anything else)."""
    try:
        items = spec.split(",") if isinstance(spec, str) else list(spec)
        return sorted({int(i) for i in items if not isinstance(i, str) or i.strip()})
    except (TypeError, ValueError):
        raise MoECompressError(f"hessian_layers '{spec}' is not a list of layer ids such as '0,1,2'; fix it.") from None


def _check_finite(layer: int, stats: dict[str, torch.Tensor]) -> None:
    for name, t in stats.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            # collectors never divide by zero, so this is the model itself overflowing
            raise MoECompressError(f"Statistic {name} of layer {layer} is not finite: the model's activations "
                                   "overflowed in this dtype; re-run with --dtype float32.")


def calibrate(
    model: str,
    data,
    seq_len: int = 2048,
    out: str | Path | None = None,
    stats=None,
    offload_dir: str | Path | None = None,
    resume: bool = False,
    dry_run: bool = False,
    batch_size: int = 8,
    dtype: str | torch.dtype | None = "auto",
    seed: int = 0,
    device: str | None = None,
    padding: bool = False,
    chat_template: bool = False,
    tokenizer: str | None = None,
    moment_experts=None,
    hessian_layers=None,
    transform: Callable[[int, nn.Module, object, dict | None], nn.Module | None] | None = None,
    on_layer_end: Callable[[int, dict | None], None] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
):
    """Gather per-expert statistics of `model` on calibration `data`, layer by layer, into a stats store.

    Args:
        model: checkpoint directory (or hub id) with safetensors weights; streamed, never loaded whole.
        data: a data spec (``c4:128``, ``fixture-calib:64``, ``file.jsonl#text+gsm8k:32``) or a
            `CalibrationData`.
        seq_len / seed / padding / chat_template / tokenizer: how a spec becomes sequences.
        out: the store directory (written atomically; a finished store with these inputs is reused).
        stats: statistic names (list or comma string); the routing statistics (counts, tokens,
            routing_mass, pp, cp) are always gathered. A method's needs: `moecompress.methods.stats_for_method`
            (what ``calibrate --for-method`` passes here).
        offload_dir: keep hidden states on disk there instead of CPU memory.
        resume: continue an interrupted run from its last finished layer (identical result).
        dry_run: only estimate memory, disk and time (one-layer probe); returns a `ResourceEstimate`.
        batch_size / dtype / device: execution (dtype "auto" = the checkpoint's; device default CUDA if present).
        moment_experts: experts whose input/cross moments to gather (None = all; list; or {layer: list}).
        hessian_layers: MoE layers whose GPTQ Hessians to gather (None = all; others store empty tensors).
        transform: ``transform(i, layer, adapter, stats_i)`` called after MoE layer i's statistics pass
            (before the pass for layers without statistics); return None to keep the layer's outputs, or a
            module (the layer changed in place, or a replacement) whose outputs feed layer i + 1, so later
            layers see the outputs of already-compressed earlier layers. Statistics always describe the
            original experts.
        on_layer_end: ``on_layer_end(i, stats_i)`` after layer i is finished and saved.

    Returns:
        `StatsStore` (or `ResourceEstimate` with dry_run).
    """
    from ..checkpoint import CheckpointReader
    from ..data import CalibrationData, load_calibration, load_tokenizer
    from ..models import parse_dtype
    from . import distributed as dist
    from .dryrun import estimate, probe_time, refuse_if_too_big
    from .hooks import LayerObserver
    from .runner import SequentialRunner

    if out is None and not dry_run:
        raise MoECompressError("Pass an output directory for the statistics (--out DIR).")
    if batch_size < 1:
        raise MoECompressError(f"--batch-size must be at least 1, not {batch_size}.")
    names = resolve_stats(stats)
    names = sorted(set(names) | set(DEFAULT_STATS))
    classes = collectors_for(names)
    params = {"moment_experts": moment_experts} if moment_experts is not None else {}
    if hessian_layers is not None:
        params["hessian_layers"] = _layer_ids(hessian_layers)
    reader = CheckpointReader(model, trust_remote_code)
    torch_dtype = None if dtype in (None, "auto") else parse_dtype(dtype)
    rank, world = dist.world()
    dev = dist.default_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MoECompressError("--device cuda was requested but no CUDA device is available; pass --device cpu.")
    if isinstance(data, CalibrationData):
        calib = data
    else:
        calib = load_calibration(str(data), load_tokenizer(str(reader.path), tokenizer), seq_len, seed, padding,
                                 chat_template)
    out = None if out is None else Path(out)
    fingerprint = reader.fingerprint()
    identity = _identity(reader, fingerprint, calib, names, params, torch_dtype or "auto", dev, batch_size)

    # a finished store at `out`: reuse it when it answers this request, refuse it when it is foreign
    if out is not None and out.is_dir() and (out / "stats.json").is_file() and not overwrite and not dry_run:
        existing = StatsStore.load(out, model_fingerprint=fingerprint, data_spec=calib.spec)
        if existing.meta["data"]["fingerprint"] != calib.fingerprint():
            raise MoECompressError(f"The stats store {out} was computed on other tokens of '{calib.spec}' (another "
                                   "seq_len, seed or tokenizer); choose another --out or pass --overwrite.")
        differ = _settings_differ(existing.meta, params, torch_dtype, batch_size, dev)
        if differ:
            key, old, new = differ
            raise MoECompressError(f"The stats store {out} was computed with {key} {old}, not {new}; pass "
                                   "--overwrite to recompute it or choose another --out.")
        if existing.has(*names):
            return existing
        raise MoECompressError(f"The stats store {out} lacks {', '.join(n for n in names if not existing.has(n))}; "
                               "pass --overwrite to recompute it with these statistics or choose another --out.")
    if out is not None and not dry_run:
        from ..atomic import check_output

        check_output(out, overwrite, protect=[reader.path])  # before any compute

    double = transform is not None
    from ..models import MoEAdapter

    meta_adapter = MoEAdapter(reader._skeleton)  # the reader's own meta skeleton: structure only
    est = estimate(reader, calib, meta_adapter, dev, torch_dtype, batch_size, world, offload_dir,
                   out or Path.cwd() / "stats", classes, params, double)
    if dry_run:
        return probe_time(reader, calib, dev, torch_dtype, batch_size, world, classes, params, est)
    refuse_if_too_big(est)

    partial = PartialRun(out)
    finished, error = None, None
    if rank == 0:
        try:
            finished = partial.start(identity, resume)
        except MoECompressError as exc:
            error = str(exc)
    finished, error = dist.broadcast_object((finished, error))
    if error:
        raise MoECompressError(error)
    runner = SequentialRunner(reader, calib, dev, torch_dtype, batch_size, rank, world, offload_dir, double,
                              run_key=f"{fingerprint}:{calib.fingerprint()}:{rank}/{world}")
    adapter = runner.adapter
    moe = adapter.moe_layers
    last = max(moe)
    finished = sorted(i for i in finished if i in moe)
    # layers finish in order: resume after the longest finished prefix of MoE layers
    done = []
    for i in moe:
        if i in finished:
            done.append(i)
        else:
            break
    layer_stats: dict[int, dict] = {i: _summary(partial.load_layer(i)) for i in done}
    start = (max(done) + 1) if done else 0

    with _progress(progress and rank == 0) as bar:
        layers_task = bar.add_task("layers", total=last + 1, completed=start)
        batch_task = bar.add_task("batches", total=len(runner.batches))
        todo = start <= last  # a run killed after its last layer only has the store left to write
        restored = bool(done) and todo and runner.restore(start - 1)
        if todo:
            runner.embed(store_hidden=not restored)
        if done and todo and not restored:  # replay the finished prefix (forward only) to rebuild its outputs
            for i in range(start):
                bar.update(layers_task, description=f"replay layer {i}")
                layer = runner.load_layer(i)
                if i in moe:  # the statistics pass's exact computation path, so outputs are bit-identical
                    obs = LayerObserver(adapter, i, [cls(adapter, i, "meta", **params) for cls in classes], mute=True)
                    obs.attach()
                    try:
                        runner.run_layer(i, observer=obs)
                    finally:
                        obs.detach()
                repl = (transform(i, layer, adapter, partial.load_layer(i) if i in layer_stats else None)
                        if transform is not None else None)
                if i not in moe or isinstance(repl, nn.Module):
                    runner.run_layer(i, layer=repl if isinstance(repl, nn.Module) else None)
                _restore_block(adapter, i)
                runner.commit(i)
                runner.free_layer(i)
        for i in range(start, last + 1):
            bar.update(layers_task, description=f"layer {i}/{last}")
            bar.reset(batch_task, total=len(runner.batches))
            advance = (lambda: bar.advance(batch_task))
            layer = runner.load_layer(i)
            stats_i = None
            if i in moe:
                collectors = [cls(adapter, i, dev, **params) for cls in classes]
                obs = LayerObserver(adapter, i, collectors)
                obs.attach()
                try:
                    runner.run_layer(i, observer=obs, on_batch=advance)
                finally:
                    obs.detach()
                dist.all_reduce_sums(collectors)
                stats_i = {}
                for c in collectors:
                    stats_i.update({k: v.detach().cpu() for k, v in c.finalize().items()})
                _check_finite(i, stats_i)
                if rank == 0:
                    partial.save_layer(i, stats_i)
                layer_stats[i] = _summary(stats_i)  # the layer's file holds the values; keep no second copy
                repl = transform(i, layer, adapter, stats_i) if transform is not None else None
                if isinstance(repl, nn.Module):
                    runner.run_layer(i, layer=repl)
            else:
                repl = transform(i, layer, adapter, None) if transform is not None else None
                runner.run_layer(i, layer=repl if isinstance(repl, nn.Module) else None, on_batch=advance)
            _restore_block(adapter, i)
            dist.barrier()
            runner.commit(i)
            runner.free_layer(i)
            bar.advance(layers_task)
            if on_layer_end is not None:
                on_layer_end(i, stats_i)

    unreached = {i: torch.nonzero(layer_stats[i]["counts"] == 0).flatten().tolist() for i in moe}
    unreached = {i: v for i, v in unreached.items() if v}
    if unreached and rank == 0:
        listing = "; ".join(f"layer {i}: experts {v}" for i, v in unreached.items())
        warnings.warn(f"No calibration token reached some experts ({listing}); their statistics are 0. Use more or "
                      "more varied calibration data if a method needs them.", UnreachedExpertsWarning, stacklevel=2)
    dist.barrier()
    if rank == 0:
        meta = _meta(reader, fingerprint, adapter, calib, names, params, torch_dtype, batch_size, layer_stats,
                     unreached, dev)
        store = write_store(out, partial, moe, meta)
        partial.remove()
    runner.cache.clear()
    dist.barrier()
    return store if rank == 0 else StatsStore.load(out)


def _summary(stats_i: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the end of a run reads of a finished layer's statistics: every name with its shape (meta tensors,
    no memory) and the expert counts (unreached experts). Keeping every layer's full statistics until the store
    is written held them all at once: input/cross moments alone are E·H² float64 values per layer."""
    return {k: v if k == "counts" else torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in stats_i.items()}


def _settings_differ(meta: dict, params: dict, dtype, batch_size: int, dev) -> tuple | None:
    """(setting, stored, requested) for the first content-changing setting that differs from the store's."""
    want = _meta_settings(params, dtype, batch_size, dev)
    for key, value in want.items():
        if key in meta and json.loads(json.dumps(meta[key], default=str)) != json.loads(json.dumps(value, default=str)):
            return {"params": "collector parameters", "dtype": "dtype", "batch_size": "batch size",
                    "device": "device"}[key], meta[key], value
    return None


def _meta_settings(params: dict, dtype, batch_size: int, dev) -> dict:
    """The settings besides model and tokens that change a store's content (recorded in stats.json)."""
    return {"params": {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()})
                       for k, v in params.items()},
            "dtype": str(dtype).replace("torch.", "") if dtype is not None else "auto",
            "batch_size": batch_size, "device": torch.device(dev).type}


def _restore_block(adapter, i: int) -> None:
    """Put back layer i's original MoE block if a transform swapped it (the skeleton stays loadable)."""
    if i in adapter.layers:
        adapter.set_block(i, adapter.layer(i).block)


def _meta(reader, fingerprint, adapter, calib, names, params, dtype, batch_size, layer_stats, unreached,
          _device="cpu") -> dict:
    cfg = reader.config
    stats_held = sorted(set().union(*(set(s) for s in layer_stats.values())))
    shapes = {n: list(layer_stats[adapter.moe_layers[0]][n].shape) for n in stats_held}
    return {
        "format": FORMAT,
        "model": {"source": str(reader.path), "fingerprint": fingerprint,
                  "model_type": getattr(cfg, "model_type", None),
                  "architecture": (getattr(cfg, "architectures", None) or [None])[0],
                  "num_layers": reader.num_layers, "moe_layers": adapter.moe_layers,
                  "num_experts": {str(i): adapter.num_experts(i) for i in adapter.moe_layers},
                  "top_k": {str(i): adapter.top_k(i) for i in adapter.moe_layers},
                  "router": {str(i): adapter.router_spec(i).describe() for i in adapter.moe_layers},
                  "hidden_size": adapter.hidden_size},
        "data": calib.to_dict(),
        "stats": stats_held,
        "requested": names,
        "shapes": shapes,
        **_meta_settings(params, dtype, batch_size, _device),
        "layers": adapter.moe_layers,
        "unreached": {str(i): v for i, v in unreached.items()},
        "versions": versions(),
        "nan_policy": "experts with no routed token get 0 for every per-token mean",
    }

