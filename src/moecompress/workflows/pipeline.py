"""The steps `compress` and `compare` share: statistics a method needs, calibration if needed, the plan
(streamed from the checkpoint, then quantized) and the export format.

The verbs themselves (`moecompress.compress`, `moecompress.compare`, ...) are in `api.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import MoECompressError
from ..methods import MethodContext, get_method, parse_config
from ..models import MoEAdapter


def resolve_calibration(
    model: str,
    calib: str | os.PathLike | None,
    needs: list[str],
    *,
    seq_len: int = 256,
    seed: int = 0,
    batch_size: int = 8,
    work_dir: str | os.PathLike | None = None,
    dtype: str = "auto",
    progress: bool = True,
    moment_experts=None,
    name: str = "stats",
    overwrite: bool = True,
):
    """A StatsStore holding at least `needs`: an existing store directory, or a data spec to calibrate on.

    A spec is calibrated into `work_dir/<name>`, an output like any other (docs/architecture.md,
    "Outputs"): a finished store with the same inputs there is reused, and without `overwrite` a store
    of another model or other settings is refused, not replaced (compress passes its own --overwrite;
    compare calibrates inside its fresh report directory). Nobody resumes this calibration, so an
    interrupted one leaves no ``.NAME.partial`` behind. Returns None when the method needs no statistics
    and none was given.
    """
    from ..calibrate import StatsStore, calibrate

    if calib is None:
        if needs:
            raise MoECompressError(
                "This method needs calibration statistics; pass --calib with a stats directory "
                "from moecompress calibrate or a data spec such as fixture-calib:64."
            )
        return None
    if Path(calib).is_dir():  # a directory is a stats store or nothing: never read it as a data spec
        store = StatsStore.load(calib, model_fingerprint=model_fingerprint(model))
        store.require(*needs)
        store.check_model(*model_structure(model))
        return store
    out = Path(work_dir or ".") / name
    return calibrate(
        model,
        str(calib),
        seq_len=seq_len,
        out=out,
        stats=sorted(set(needs)),
        batch_size=batch_size,
        dtype=dtype,
        seed=seed,
        progress=progress,
        moment_experts=moment_experts,
        overwrite=overwrite,
        keep_partial=False,
    )


def calibrate_for(
    model: str,
    calib: str | os.PathLike | None,
    method: str,
    params: dict[str, Any] | None,
    quant=None,
    *,
    seq_len: int = 256,
    seed: int = 0,
    work_dir: str | os.PathLike | None = None,
    progress: bool = True,
    overwrite: bool = True,
    calib_mode: str = "one-pass",
):
    """The statistics `method` with `params` (and `quant`) reads, as `resolve_calibration` gives them.

    `calib_mode` "sequential" takes each layer's statistics on the outputs of the already-quantized layers
    before it (`StreamedStats(sequential=True)`); it needs `quant`'s streamed GPTQ (a data spec, not a store).

    A method whose build reads input/cross moments of a subset of experts (prune's tilt: the removed
    ones, `MethodEntry.moment_experts`), calibrated from a data spec, is calibrated in two passes:
    first every other statistic, then the moments of the experts that first pass's selection names
    (`work_dir/stats-moments`). Moments are per-expert sums over the same tokens either way, so the plan is
    bit-identical to one pass over every expert; the heaviest statistics shrink to the removed experts."""
    from ..calibrate.collectors import MomentCollector
    from ..methods.context import ChainedStats

    needs = needs_for(method, params, quant)
    check_calib_mode(calib_mode, method, calib, quant)
    if streams_statistics(method, calib, quant):
        from ..calibrate.streamed import StreamedStats

        return StreamedStats(
            model,
            str(calib),
            needs,
            seq_len=seq_len,
            seed=seed,
            chunk=streamed_chunk(method, calib, quant, params),
            sequential=calib_mode == "sequential",
        )
    entry, moments = get_method(method), sorted(set(needs) & set(MomentCollector.provides))
    staged = moments and entry.moment_experts is not None and calib is not None and not Path(calib).is_dir()
    common = dict(seq_len=seq_len, seed=seed, work_dir=work_dir, progress=progress, overwrite=overwrite)
    if not staged:
        return resolve_calibration(model, calib, needs, **common)
    first = resolve_calibration(model, calib, [n for n in needs if n not in moments], **common)
    view = open_view(model)
    subset = entry.moment_experts(parse_config(method, params), view, first)
    view.release()
    if subset is None:
        return first
    second = resolve_calibration(model, calib, moments, **common, moment_experts=subset, name="stats-moments")
    return ChainedStats(first, second)


def check_calib_mode(calib_mode: str, method: str, calib, quant=None) -> None:
    """Refuse, before any compute, a calibration mode this run cannot honour: sequential statistics are taken
    while `compress --method quant` (GPTQ) streams a data spec, the only build that hands its quantized layers
    back to the pass (`LayerStats.replace_expert`)."""
    if calib_mode not in ("one-pass", "sequential"):
        raise MoECompressError(f"--calib-mode '{calib_mode}' is not known: use one-pass or sequential.")
    if calib_mode == "sequential" and not (method == "quant" and streams_statistics(method, calib, quant)):
        raise MoECompressError(
            "--calib-mode sequential works with --method quant (GPTQ) calibrated from a data "
            "spec (--calib fixture-calib:64, not a stats directory); drop it or use that."
        )


def streams_statistics(method: str, calib, quant=None) -> bool:
    """Whether `calibrate_for` gives `method` statistics computed layer by layer as it reads them
    (`calibrate.streamed.StreamedStats`: nothing stored, docs/calibration.md) instead of a store: a method
    that reads them in layer order (`MethodEntry.streamed_stats`: auto, quant), calibrated from a data spec, with no
    quantization stage after it (that stage reads every layer's Hessians)."""
    return (
        get_method(method).streamed_stats
        and calib is not None
        and not Path(calib).is_dir()
        and quant_config(quant) is None
    )


def streamed_chunk(method: str, calib, quant=None, params: dict[str, Any] | None = None) -> int | None:
    """The experts per square-statistics pass when `streams_statistics` (for `params`), else None."""
    from ..calibrate.streamed import CHUNK

    if not streams_statistics(method, calib, quant):
        return None
    return get_method(method).chunk_for(parse_config(method, params or {})) or CHUNK


def moment_fraction(method: str, params: dict[str, Any] | None) -> float | None:
    """For the dry-run: the fraction of each layer's experts `calibrate_for`'s second pass gathers moments of
    (a staged method's removal ratio; None when moments, if any, are gathered for every expert)."""
    if get_method(method).moment_experts is None:
        return None
    return getattr(parse_config(method, params), "ratio", None)


def model_structure(model: str) -> tuple[list[int], dict[int, int], int, dict[int, int]]:
    """(MoE layers, experts per MoE layer, hidden size, top-k per MoE layer) of checkpoint `model`, from its config
    alone (a meta skeleton: no weights read): what a stats store's tensors must fit (`StatsStore.check_model`)."""
    from ..models import load_config, skeleton

    adapter = MoEAdapter(skeleton(load_config(model)))
    layers = adapter.moe_layers
    return (
        layers,
        {i: adapter.num_experts(i) for i in layers},
        adapter.hidden_size,
        {i: adapter.top_k(i) for i in layers},
    )


def model_fingerprint(model: str) -> str | None:
    """The checkpoint fingerprint a stats store records (None for a hub id, which has no local files)."""
    from ..checkpoint import checkpoint_fingerprint
    from ..models import resolve_source

    src = resolve_source(model)
    return checkpoint_fingerprint(src) if Path(src).is_dir() else None


def build_plan(
    adapter: MoEAdapter,
    method: str,
    params: dict[str, Any] | None,
    stats=None,
    seed: int = 0,
    progress: bool = False,
):
    """(plan, tensors) of `method` with `params` on an in-memory model."""
    entry = get_method(method)
    config = parse_config(method, params)
    return entry.build(config, MethodContext(adapter, stats, seed, progress))


def needs_for(method: str, params: dict[str, Any] | None, quant: dict[str, Any] | None = None) -> list[str]:
    """Statistics `method` (and the quantization stage, when asked) read."""
    from ..methods.quantize import quant_stats

    entry = get_method(method)
    return sorted(set(entry.stats_for(parse_config(method, params))) | set(quant_stats(quant_config(quant))))


def quant_config(quant: dict[str, Any] | str | None):
    """A recipe's ``quant:`` field (``w4g128`` or ``{quant: w4g128, algo: gptq, weighting: gate2}``) validated."""
    if quant is None:
        return None
    if isinstance(quant, BaseModel):  # validated already (a recipe arm's, or the API's): the same object
        return parse_config("quant", quant)
    return parse_config("quant", {"quant": quant} if isinstance(quant, str) else quant)


def quantize(adapter: MoEAdapter, plan, tensors, quant, stats=None, progress: bool = False):
    """Quantize the stored experts of (plan, tensors) when a ``quant`` setting is given, and the non-expert tensor
    classes it names (`methods.tensor_quant`)."""
    config = quant_config(quant)
    if config is None:
        return plan, tensors
    from ..methods.quantize import quantize_plan
    from ..methods.tensor_quant import hessian_source, quantize_tensors

    source = lambda l, e: adapter.layer(l).storage.read(e)
    if config.quant is not None:
        plan, tensors = quantize_plan(plan, tensors, source, config, stats, progress)
    return quantize_tensors(
        plan, tensors, adapter, config.class_specs(adapter), hessian_source(adapter, stats)
    )


def check_quant_classes(
    model: str, quant, params: dict[str, Any] | None = None, method: str | None = None
) -> None:
    """Refuse, before any compute, a quantization setting naming a tensor class this checkpoint lacks or a spec a
    class cannot take (one sentence): resolved on a meta skeleton of `model` (no weights read)."""
    config = quant_config(quant)
    if config is None and method == "quant":
        config = parse_config("quant", params)
    if config is None or not config.has_tensor_classes():
        return
    from ..models import load_config, skeleton

    config.class_specs(MoEAdapter(skeleton(load_config(model))))


def check_format_name(requested: str) -> None:
    """Refuse an unknown format name before any compute (`choose_format` meets it only after the plan)."""
    from ..export.formats import format_class

    if requested != "auto":
        format_class(requested)


def check_target_name(target: str, format: str = "auto") -> None:
    """Refuse, before any compute, an unknown target or a format the target's runtime does not load."""
    from ..plan.targets import get_target

    fmt = get_target(target).format
    if fmt is not None and format not in ("auto", fmt):
        raise MoECompressError(f"{target} loads --format {fmt}, not {format}; drop --format or --target.")


def target_format(plan, target: str, requested: str = "auto") -> str:
    """The export format for `plan` served by `target` (issue 31, item 3): ``auto`` becomes the format the runtime
    loads (llama.cpp: gguf; vLLM, transformers: hf), and a plan that format cannot hold is refused in one sentence
    naming why (whatever method made it)."""
    from ..plan.targets import get_target

    runtime = get_target(target)
    if runtime.format is None:
        return choose_format(plan, requested)
    from ..export.formats import format_class

    fmt = runtime.format
    why = format_class(fmt).reason(plan)
    if why is None and runtime.reason is not None:
        why = runtime.reason(plan)
    if why is not None:
        hint = f" (auto --target {target} searches only what it runs)"
        raise MoECompressError(
            f"This plan cannot run in {target}: {why}; change the method's settings{hint}, or "
            "drop --target to write it for moecompress's runtime."
        )
    return fmt


def check_imatrix(calib, format: str, target: str) -> None:
    """Refuse, before any compute and in one sentence, an ``--imatrix`` this run cannot write: it needs a GGUF
    output and a statistics store with the experts' channel norms, gathered from calibration text it can re-read
    (the other linears' input moments come from one more pass over it)."""
    from ..calibrate.store import load_stats
    from ..export.imatrix import EXPERT_STATS
    from ..plan.targets import get_target

    if not (format == "gguf" or (format == "auto" and get_target(target).format == "gguf")):
        raise MoECompressError(
            "--imatrix belongs with a GGUF output; add --format gguf or --target llama.cpp."
        )
    if calib is None or not Path(calib).is_dir():
        raise MoECompressError(
            f"--imatrix reads a statistics store: calibrate with --stats {','.join(EXPERT_STATS)} "
            "(and what the method needs) and pass the store as --calib."
        )
    store = load_stats(calib)
    store.require(*EXPERT_STATS)
    spec = str(store.meta.get("data", {}).get("spec", ""))
    if not spec or spec.startswith("tokens:"):
        raise MoECompressError(
            "--imatrix re-reads the calibration text for the attention inputs, but this store was "
            "gathered from token ids; calibrate from a data spec (e.g. fixture-calib:64)."
        )


def imatrix_writer(model: str, plan, stats):
    """The `export` extra that writes llama.cpp's importance matrix (`export.imatrix`) into a GGUF output: the
    experts' entries from the store's channel norms and routed counts, the other linears' from the diagonal of
    their input Hessians, streamed over the calibration data the store records (`check_imatrix` first)."""
    from ..export.imatrix import IMATRIX_FILE, expert_entries, linear_entries, write_imatrix

    entries = expert_entries(plan, stats)

    def write(directory: Path) -> None:
        import gguf

        from ..export.gguf import ARCHES
        from ..methods.auto.tensors import hessians
        from ..models.tensor_classes import quantizable, tensor_classes, tensor_shapes

        adapter = open_view(model)
        cls, shapes = tensor_classes(adapter), tensor_shapes(adapter)
        names = [
            n
            for n, c in cls.items()
            if c in ("attention", "shared", "dense_mlp", "lm_head") and quantizable(n, shapes[n], c)
        ]
        data = stats.meta.get("data", {})
        diag = {
            n: h.diagonal().clone() for _, hs in hessians(adapter, stats, None)(names) for n, h in hs.items()
        }
        adapter.release()
        tokens = int(stats.get(adapter.moe_layers[0], "tokens"))
        name_map = gguf.get_tensor_name_map(
            getattr(gguf.MODEL_ARCH, ARCHES[plan.model.model_type].arch), plan.model.num_hidden_layers
        )
        seq = int(data.get("seq_len", 0) or 0)
        write_imatrix(
            directory / IMATRIX_FILE,
            {**entries, **linear_entries(diag, tokens, name_map)},
            [str(data.get("spec", ""))],
            seq,
            tokens // seq if seq else 0,
        )

    return write


def choose_format(plan, requested: str = "auto") -> str:
    """The export format for `plan`: for ``auto`` the first of `export.formats.AUTO_ORDER` that holds it (`hf`
    when a vanilla config can express it, else `compact`, else `packed` for PuzzleMoE packed merges); a named
    format when it holds the plan, else one sentence naming the format `auto` would use."""
    from ..export.formats import auto_format, format_class

    if requested == "auto":
        return auto_format(plan)
    why = format_class(requested).reason(plan)
    if why is not None:
        raise MoECompressError(
            f"The '{requested}' format cannot express this plan ({why}); use --format {auto_format(plan)}."
        )
    return requested


def open_view(model: str, dtype: str = "float32"):
    """The streamed, read-only method view of checkpoint `model` (`checkpoint.view.StreamedAdapter`):
    weights one decoder layer at a time, handed out in `dtype` (the arithmetic dtype of the methods)."""
    from ..checkpoint.view import StreamedAdapter
    from ..models import parse_dtype

    return StreamedAdapter(model, compute_dtype=parse_dtype(dtype))


def make_plan(
    model: str,
    method: str,
    params: dict[str, Any] | None,
    stats=None,
    *,
    quant=None,
    seed: int = 0,
    dtype: str = "float32",
    progress: bool = False,
):
    """(plan, tensors) of `method` with `params` on checkpoint `model`, quantized when `quant` is given.

    The method sees the streamed view (`open_view`): one decoder layer in memory at a time, never the whole
    model. Export from the checkpoint path afterwards: plans that also change weights outside the experts
    (merged router rows of M-SMoE/HC-SMoE `router: merge`) carry them as plan tensors, which the exporter
    writes into each layer as it streams it (`merging.merged_router_state`)."""
    adapter = open_view(model, dtype)
    plan, tensors = build_plan(adapter, method, params, stats, seed, progress)
    plan, tensors = quantize(adapter, plan, tensors, quant, stats, progress)
    adapter.release()
    return plan, tensors
