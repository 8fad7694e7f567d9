"""`calibrate(...)`: the Python face of ``moecompress calibrate``.

`calibrate` takes keywords (the CLI's options); they form a `CalibrationOptions`, and a `Calibration`
resolves the inputs and runs it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import MoECompressError
from .layer_pass import gather, layer_summary, restore_block
from .options import CalibrationOptions, Transform, UnreachedExpertsWarning, layer_ids
from .registry import DEFAULT_STATS, collectors_for, resolve_stats
from .run_meta import run_identity, settings_differ, store_meta
from .store import PartialRun, StatsStore, write_store


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # progress goes to stderr so that --json output on stdout stays parseable
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


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
    transform: Transform | None = None,
    on_layer_end: Callable[[int, dict | None], None] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
    keep_partial: bool = True,
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
        keep_partial: keep ``.OUT.partial`` when the run is interrupted (Ctrl-C, SIGTERM), for `resume`;
            False for calibrations nobody resumes (compress's implicit ``<out>-calib/stats``). Any other
            failure always removes it: nothing there is worth resuming from, and a full disk needs the space.

    Returns:
        `StatsStore` (or `ResourceEstimate` with dry_run).

    The keywords are `CalibrationOptions`; ``Calibration(model, data, options).run()`` is the same call.
    """
    keywords = {k: v for k, v in locals().items() if k not in ("model", "data")}  # the options' fields
    options = CalibrationOptions(**keywords)
    return Calibration(model, data, options)._run(warn_stacklevel=4)  # the warning names calibrate's caller


class Calibration:
    """One calibration run: the inputs resolved and checked on construction (no compute), `run()` does it.

    `run` reuses a finished store that answers the request, refuses a foreign one, estimates resources
    (and stops there for a dry run), then streams the model layer by layer: each MoE layer's collectors
    observe its batches, its statistics are saved to the resumable partial run, and the store is written
    when the last layer is done.
    """

    def __init__(
        self, model: str, data, options: CalibrationOptions = CalibrationOptions(), stream: bool = False
    ):
        from ..checkpoint import CheckpointReader
        from ..data import CalibrationData, load_calibration, load_tokenizer
        from ..models import parse_dtype
        from . import distributed as dist

        o = self.options = options
        if o.out is None and not (o.dry_run or stream):  # stream: `StreamedStats`, which writes nothing
            raise MoECompressError("Pass an output directory for the statistics (--out DIR).")
        if o.batch_size < 1:
            raise MoECompressError(f"--batch-size must be at least 1, not {o.batch_size}.")
        names = resolve_stats(o.stats)
        self.names = sorted(set(names) | set(DEFAULT_STATS))
        self.classes = collectors_for(self.names)
        self.params = {"moment_experts": o.moment_experts} if o.moment_experts is not None else {}
        if o.hessian_layers is not None:
            self.params["hessian_layers"] = layer_ids(o.hessian_layers)
        self.reader = CheckpointReader(model, o.trust_remote_code)
        self.dtype = None if o.dtype in (None, "auto") else parse_dtype(o.dtype)
        self.rank, self.world = dist.world()
        from ..validate import check_device

        check_device(o.device)  # `--device bogus` is a sentence naming the device, not a torch traceback
        self.device = dist.default_device(o.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise MoECompressError(
                "--device cuda was requested but no CUDA device is available; pass --device cpu."
            )
        if isinstance(data, CalibrationData):
            self.calib = data
        else:
            self.calib = load_calibration(
                str(data),
                load_tokenizer(str(self.reader.path), o.tokenizer, o.trust_remote_code),
                o.seq_len,
                o.seed,
                o.padding,
                o.chat_template,
            )
        self.out = None if o.out is None else Path(o.out)
        self.fingerprint = self.reader.fingerprint()
        from ..atomic import fingerprint_inputs
        from ..checkpoint import checkpoint_fingerprint

        self.inputs = fingerprint_inputs(
            [self.reader.path], checkpoint_fingerprint
        )  # checked before the rename
        self.identity = run_identity(
            self.reader,
            self.fingerprint,
            self.calib,
            self.names,
            self.params,
            self.dtype or "auto",
            self.device,
            o.batch_size,
        )

    def run(self):
        """The `StatsStore` (or, for a dry run, the `ResourceEstimate`)."""
        return self._run(warn_stacklevel=4)

    def _run(self, warn_stacklevel: int):
        # warn_stacklevel: the frame an unreached-experts warning names, counted from `_stream`
        o = self.options
        existing = self._existing_store()
        if existing is not None:
            return existing
        if self.out is not None and not o.dry_run:
            from ..atomic import check_output

            check_output(
                self.out, o.overwrite, protect=[self.reader.path], kind="stats"
            )  # before any compute
        est = self._estimate()
        if o.dry_run:
            from .dryrun import probe_time

            return probe_time(
                self.reader,
                self.calib,
                self.device,
                self.dtype,
                o.batch_size,
                self.world,
                self.classes,
                self.params,
                est,
            )
        from .dryrun import refuse_if_too_big

        refuse_if_too_big(est)
        return self._stream(warn_stacklevel)

    def _existing_store(self) -> StatsStore | None:
        """A finished store at `out`: reused when it answers this request, refused when it is foreign."""
        o, out = self.options, self.out
        if not (
            out is not None
            and out.is_dir()
            and (out / "stats.json").is_file()
            and not o.overwrite
            and not o.dry_run
        ):
            return None
        existing = StatsStore.load(out, model_fingerprint=self.fingerprint, data_spec=self.calib.spec)
        if existing.meta["data"]["fingerprint"] != self.calib.fingerprint():
            raise MoECompressError(
                f"The stats store {out} was computed on other tokens of '{self.calib.spec}' "
                "(another seq_len, seed or tokenizer); choose another --out or pass --overwrite."
            )
        differ = settings_differ(existing.meta, self.params, self.dtype, o.batch_size, self.device)
        if differ:
            key, old, new = differ
            raise MoECompressError(
                f"The stats store {out} was computed with {key} {old}, not {new}; pass "
                "--overwrite to recompute it or choose another --out."
            )
        if existing.has(*self.names):
            return existing
        raise MoECompressError(
            f"The stats store {out} lacks "
            f"{', '.join(n for n in self.names if not existing.has(n))}; pass --overwrite to "
            "recompute it with these statistics or choose another --out."
        )

    def _estimate(self):
        from ..models import MoEAdapter
        from .dryrun import estimate

        o = self.options
        meta_adapter = MoEAdapter(self.reader._skeleton)  # the reader's own meta skeleton: structure only
        return estimate(
            self.reader,
            self.calib,
            meta_adapter,
            self.device,
            self.dtype,
            o.batch_size,
            self.world,
            o.offload_dir,
            self.out or Path.cwd() / "stats",
            self.classes,
            self.params,
            o.transform is not None,
        )

    def _stream(self, warn_stacklevel: int) -> StatsStore:
        """Run every decoder layer in order (resuming a partial run), then write the store.

        However the run ends, rank 0 lets go of the output's lock (`PartialRun.start` took it) and removes
        the partial run, except after an interruption a resume may continue (`keep_partial`); a run that
        was refused the lock touches nothing."""
        partial = PartialRun(self.out)
        try:
            return self._layers(partial, warn_stacklevel + 1)
        except BaseException as exc:
            if self.rank == 0 and partial.holding:
                if isinstance(exc, KeyboardInterrupt) and self.options.keep_partial:
                    partial.close()
                else:
                    partial.remove()
            raise

    def _layers(self, partial: PartialRun, warn_stacklevel: int) -> StatsStore:
        """Every decoder layer through its pass (after the finished prefix of a resumed run), then the store."""
        from . import distributed as dist

        finished = self._start(partial)
        runner = self._runner()
        moe = runner.adapter.moe_layers
        done = _finished_prefix(moe, finished)
        layer_stats: dict[int, dict] = {i: layer_summary(partial.load_layer(i)) for i in done}
        start = (max(done) + 1) if done else 0
        self._pass_layers(runner, partial, layer_stats, done, start)
        unreached = self._warn_unreached(layer_stats, moe, warn_stacklevel + 1)
        dist.barrier()
        if self.rank == 0:
            store = self._write(runner.adapter, partial, layer_stats, unreached)
        runner.cache.clear()
        dist.barrier()
        return store if self.rank == 0 else StatsStore.load(self.out)

    def _start(self, partial: PartialRun) -> list[int]:
        """Rank 0 starts (or resumes) the partial run; every rank gets its finished layers, or its refusal."""
        from . import distributed as dist

        finished, error = None, None
        if self.rank == 0:
            try:
                finished = partial.start(self.identity, self.options.resume)
            except MoECompressError as exc:
                error = str(exc)
        finished, error = dist.broadcast_object((finished, error))
        if error:
            raise MoECompressError(error)
        return finished

    def _runner(self):
        """The `SequentialRunner` that streams this run's model over its batches."""
        from .runner import SequentialRunner

        o = self.options
        return SequentialRunner(
            self.reader,
            self.calib,
            self.device,
            self.dtype,
            o.batch_size,
            self.rank,
            self.world,
            o.offload_dir,
            o.transform is not None,
            run_key=f"{self.fingerprint}:{self.calib.fingerprint()}:{self.rank}/{self.world}",
        )

    def _pass_layers(
        self, runner, partial: PartialRun, layer_stats: dict[int, dict], done: list[int], start: int
    ) -> None:
        """Layers `start`.. through their passes under the progress bars, after replaying the finished prefix
        `done` when no cached hidden state is left; `layer_stats` gains each MoE layer's summary."""
        o = self.options
        last = max(runner.adapter.moe_layers)
        with _progress(o.progress and self.rank == 0) as bar:
            layers_task = bar.add_task("layers", total=last + 1, completed=start)
            batch_task = bar.add_task("batches", total=len(runner.batches))
            todo = start <= last  # a run killed after its last layer only has the store left to write
            restored = bool(done) and todo and runner.restore(start - 1)
            if todo:
                runner.embed(store_hidden=not restored)
            if done and todo and not restored:
                self._replay(runner, start, layer_stats, partial, bar, layers_task)
            for i in range(start, last + 1):
                bar.update(layers_task, description=f"layer {i}/{last}")
                bar.reset(batch_task, total=len(runner.batches))
                stats_i = self._layer(runner, i, partial, lambda: bar.advance(batch_task))
                if stats_i is not None:
                    layer_stats[i] = layer_summary(
                        stats_i
                    )  # the layer's file holds the values; keep no second copy
                bar.advance(layers_task)
                if o.on_layer_end is not None:
                    o.on_layer_end(i, stats_i)
                del stats_i  # else this layer's sums stay alive while the next layer accumulates its own

    def _warn_unreached(self, layer_stats: dict[int, dict], moe: list[int], warn_stacklevel: int) -> dict:
        """{layer: experts} no calibration token reached; rank 0 warns of them (`UnreachedExpertsWarning`)."""
        unreached = {i: torch.nonzero(layer_stats[i]["counts"] == 0).flatten().tolist() for i in moe}
        unreached = {i: v for i, v in unreached.items() if v}
        if unreached and self.rank == 0:
            listing = "; ".join(f"layer {i}: experts {v}" for i, v in unreached.items())
            warnings.warn(
                f"No calibration token reached some experts ({listing}); their statistics are 0. Use more "
                "or more varied calibration data if a method needs them.",
                UnreachedExpertsWarning,
                stacklevel=warn_stacklevel,
            )
        return unreached

    def _write(
        self, adapter, partial: PartialRun, layer_stats: dict[int, dict], unreached: dict
    ) -> StatsStore:
        """Rank 0: the store written from the partial run (its metadata from `store_meta`), the partial removed."""
        o = self.options
        meta = store_meta(
            self.reader,
            self.fingerprint,
            adapter,
            self.calib,
            self.names,
            self.params,
            self.dtype,
            o.batch_size,
            layer_stats,
            unreached,
            self.device,
        )
        store = write_store(
            self.out, partial, adapter.moe_layers, meta, inputs=self.inputs, overwrite=o.overwrite
        )
        partial.remove()
        return store

    def _replay(
        self, runner, start: int, layer_stats: dict[int, dict], partial: PartialRun, bar, layers_task
    ) -> None:
        """Replay the finished prefix (forward only) to rebuild its outputs when no cached hidden state is left."""
        from .hooks import LayerObserver

        adapter, moe, transform = runner.adapter, runner.adapter.moe_layers, self.options.transform
        for i in range(start):
            bar.update(layers_task, description=f"replay layer {i}")
            layer = runner.load_layer(i)
            if i in moe:  # the statistics pass's exact computation path, so outputs are bit-identical
                obs = LayerObserver(
                    adapter, i, [cls(adapter, i, "meta", **self.params) for cls in self.classes], mute=True
                )
                obs.attach()
                try:
                    runner.run_layer(i, observer=obs)
                finally:
                    obs.detach()
            repl = (
                transform(i, layer, adapter, partial.load_layer(i) if i in layer_stats else None)
                if transform is not None
                else None
            )
            if i not in moe or isinstance(repl, nn.Module):
                runner.run_layer(i, layer=repl if isinstance(repl, nn.Module) else None)
            restore_block(adapter, i)
            runner.commit(i)
            runner.free_layer(i)

    def _layer(self, runner, i: int, partial: PartialRun, advance: Callable[[], None]) -> dict | None:
        """Layer i's pass: statistics of an MoE layer (saved to the partial run), then its outputs committed."""
        from . import distributed as dist

        adapter, transform = runner.adapter, self.options.transform
        layer = runner.load_layer(i)
        stats_i = None
        if i in adapter.moe_layers:
            stats_i = gather(runner, i, self.classes, self.params, self.device, on_batch=advance)
            if self.rank == 0:
                partial.save_layer(i, stats_i)
            repl = transform(i, layer, adapter, stats_i) if transform is not None else None
            if isinstance(repl, nn.Module):
                runner.run_layer(i, layer=repl)
        else:
            repl = transform(i, layer, adapter, None) if transform is not None else None
            runner.run_layer(i, layer=repl if isinstance(repl, nn.Module) else None, on_batch=advance)
        restore_block(adapter, i)
        dist.barrier()
        runner.commit(i)
        runner.free_layer(i)
        return stats_i


def _finished_prefix(moe: list[int], finished) -> list[int]:
    """The longest prefix of MoE layers a resumed run finished: layers finish in order, so it resumes after it."""
    finished = sorted(i for i in finished if i in moe)
    done = []
    for i in moe:
        if i in finished:
            done.append(i)
        else:
            break
    return done
