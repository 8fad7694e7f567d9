"""The public Python API: the verbs as functions, and plans applied, exported and loaded.

    import moecompress
    moecompress.calibrate("fixture:olmoe-tiny", "fixture-calib:16", seq_len=64, out="stats/", for_method="prune")
    result = moecompress.compress("fixture:olmoe-tiny", "prune", {"criterion": "reap", "ratio": 0.5},
                                  calib="stats/", out="pruned/")
    results = moecompress.evaluate("pruned/", ppl="fixture-heldout", reference="fixture:olmoe-tiny")
    results = moecompress.compare(["a.yaml", "b.yaml"], "report/")
    model = moecompress.load("pruned/")

    model = moecompress.apply_plan(model, plan, tensors)          # in place, returns the model
    moecompress.export(model_or_dir, plan, "out/", format="compact")

The `moecompress` verbs `calibrate`, `compress`, `eval`, `compare`, `demo` and `grid` parse their options
(`moecompress.cli`) and call these functions. The steps compress and compare share are in `pipeline.py`;
the `compare` package runs a recipe's arms.

The exporters, the runtime, evaluation and the recipe schema (through the quantizer) import transformers
and lm-eval (seconds); they are imported where a function needs them, so that `import moecompress` and
`moecompress --help` stay fast.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel

# imported here, before moecompress/__init__ binds the functions `calibrate` and `compare` over the
# attributes the subpackage `moecompress.calibrate` and the module `moecompress.compare` set: imported
# later, they would set them again
from .calibrate import calibrate as gather_statistics
from .compare import run_compare
from .errors import MoECompressError
from .eval import request as evaluation_request
from .methods import parse_config, stats_to_gather
from .plan import CompressionPlan
from .plan.targets import DEFAULT_TARGET
from .validate import check_device
from .workflows.pipeline import (
    calibrate_for,
    check_calib_mode,
    check_format_name,
    check_imatrix,
    check_quant_classes,
    check_target_name,
    imatrix_writer,
    make_plan,
    quant_config,
    target_format,
)
from .workflows.preview import check_format_early

if TYPE_CHECKING:
    from .recipe import Recipe


def calibrate(
    model: str,
    data,
    *,
    out: str | os.PathLike | None = None,
    stats=None,
    for_method=None,
    seq_len: int = 2048,
    **options,
):
    """Gather per-expert statistics of checkpoint `model` over calibration `data` into a stats store at `out`.

    stats: statistic names (list or comma string); for_method: also what this method (or list of methods)
    reads, resolved through the method registry (`methods.stats_to_gather`): calibration itself knows
    statistics only by name. options: every other keyword of the calibration runner (`calibrate/api.py`:
    batch_size, dtype, seed, device, resume, dry_run, offload_dir, padding, moment_experts, overwrite, ...).
    Returns the `StatsStore` (a `ResourceEstimate` with ``dry_run=True``)."""
    return gather_statistics(
        model, data, seq_len=seq_len, out=out, stats=stats_to_gather(stats, for_method), **options
    )


def compress(
    model: str,
    method: str,
    params: dict[str, Any] | None = None,
    *,
    calib=None,
    out: str | os.PathLike,
    format: str = "auto",
    seq_len: int = 256,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
    quant=None,
    calib_mode: str = "one-pass",
    target: str = "moecompress",
    imatrix: bool = False,
):
    """Compress checkpoint `model` with `method` and write it to `out`; returns the `ExportResult`.

    calib: a stats store directory, or a data spec calibrated (once, reused) into `<out>-calib/stats`.
    format: auto | hf | compact | packed | materialized | gguf (`pipeline.choose_format`; docs/export.md).
    quant: optional weight quantization of every stored expert the method keeps (`pipeline.quant_config`).
    calib_mode: "one-pass" (every layer's statistics on the original model's activations) or "sequential"
    (on the already-quantized earlier layers; `--method quant` from a data spec, `pipeline.check_calib_mode`).
    target: the runtime that serves the output (moecompress | llama.cpp | vllm | transformers): its format is
    chosen and a plan it cannot run is refused (`pipeline.target_format`); `auto` searches only what it runs.
    imatrix: with a GGUF output, also write llama.cpp's importance matrix from the statistics store `calib`
    (``imatrix.gguf``, for `llama-quantize --imatrix`; `pipeline.imatrix_writer`).

    `out` is claimed (`atomic.claim`) for the whole run and the model and stats store are fingerprinted
    when it starts: the method reopens the model for every layer and the exporter once more, so a model
    replaced meanwhile is refused before the rename instead of exported with the old one's statistics.
    `<out>-calib/stats` obeys the same rules as `out`, `overwrite` included."""
    out = Path(out)
    model, protect, recorded, config, quant_setting = _compress_inputs(
        model, method, params, calib, out, format, overwrite, quant, calib_mode, target, imatrix
    )
    recipe = _compress_recipe(model, method, recorded, calib, seq_len, seed, quant, calib_mode, target)
    return _compress_run(
        model,
        method,
        config,
        quant_setting,
        calib,
        out,
        recipe,
        protect,
        format=format,
        target=target,
        seq_len=seq_len,
        seed=seed,
        dtype=dtype,
        progress=progress,
        overwrite=overwrite,
        calib_mode=calib_mode,
        imatrix=imatrix,
    )


def _compress_inputs(
    model, method, params, calib, out, format, overwrite, quant, calib_mode, target, imatrix
):
    """`compress`'s checks, before any compute (a calibration included): the resolved model, the inputs to
    protect, the params as recorded, the method's config and the quantization setting."""
    from .atomic import check_output
    from .models import resolve_source

    model = resolve_source(model)
    calib_dir = calib if calib is not None and Path(calib).is_dir() else None
    protect = [model, calib_dir]
    check_output(out, overwrite, protect, kind="checkpoint")  # before any compute, a calibration included
    check_target_name(target, format)
    recorded = (
        params.model_dump(mode="json", exclude_unset=True)
        if isinstance(params, BaseModel)
        else dict(params or {})
    )
    if target != DEFAULT_TARGET and method == "auto":
        params = recorded = {**recorded, "target": target}
    # validated once, here: the method's config and the quantization setting (a bad field or spec is one sentence
    # before any compute); everything below takes these objects (`parse_config` returns them as they are)
    config = parse_config(method, params)
    quant_setting = quant_config(quant)
    check_quant_classes(model, quant_setting, config, method)  # and a tensor class the model lacks
    check_format_name(format)  # and an unknown format
    check_calib_mode(
        calib_mode, method, calib, quant_setting
    )  # and a calibration mode this run cannot honour
    check_format_early(model, method, config, target, format)  # and a format the plan's form cannot take
    if imatrix:
        check_imatrix(calib, format, target)
    return model, protect, recorded, config, quant_setting


def _compress_recipe(
    model, method, recorded, calib, seq_len, seed, recorded_quant, calib_mode, target
) -> dict:
    """The recipe `compress` records with its output (the quantization setting as passed)."""
    recipe = {
        "model": str(model),
        "method": method,
        "params": recorded,
        "calib": str(calib) if calib else None,
        "seq_len": seq_len,
        "seed": seed,
        "quant": recorded_quant.model_dump(mode="json")
        if isinstance(recorded_quant, BaseModel)
        else recorded_quant,
    }
    if calib_mode != "one-pass":  # recorded only when not the default: default outputs stay as they were
        recipe["calib_mode"] = calib_mode
    if target != DEFAULT_TARGET:  # recorded only when given: default outputs stay as they were
        recipe["target"] = target
    return recipe


def _compress_run(
    model,
    method,
    params,
    quant,
    calib,
    out: Path,
    recipe: dict,
    protect,
    *,
    format,
    target,
    seq_len,
    seed,
    dtype,
    progress,
    overwrite,
    calib_mode,
    imatrix,
):
    """`compress` once its inputs are checked: `out` claimed for the run, inputs fingerprinted, statistics gathered
    (or read), the plan made and exported; the `ExportResult`."""
    from .atomic import claim, fingerprint_inputs
    from .checkpoint import checkpoint_fingerprint

    with claim(out):
        inputs = fingerprint_inputs(protect, checkpoint_fingerprint)
        stats = calibrate_for(
            model,
            calib,
            method,
            params,
            quant,
            seq_len=seq_len,
            seed=seed,
            work_dir=out.parent / f"{out.name}-calib",
            progress=progress,
            overwrite=overwrite,
            calib_mode=calib_mode,
        )
        plan, tensors = make_plan(
            model, method, params, stats, quant=quant, seed=seed, dtype=dtype, progress=progress
        )
        extras = imatrix_writer(model, plan, stats) if imatrix else None
        return export(
            model,
            plan,
            out,
            format=target_format(plan, target, format),
            tensors=tensors,
            recipe=recipe,
            overwrite=overwrite,
            protect=protect,
            inputs=inputs,
            extras=extras,
        )


def evaluate(
    model: str,
    *,
    tasks=None,
    ppl: str | None = None,
    reference: str | None = None,
    limit=None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    include_path=None,
    window: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    dtype: str = "auto",
    device: str | None = None,
    seed: int = 1234,
    trust_remote_code: bool = False,
    out: str | os.PathLike | None = None,
    report: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_task_code: bool = False,
    allow_nan: bool = False,
    arithmetic: str = "exact",
) -> dict:
    """Perplexity, next-token accuracy and KL to `reference` on `ppl`, and lm-eval `tasks`, of checkpoint
    `model` (an export of any format, or an original); returns the results dict (schema moecompress.results/1,
    one arm, per-item values). arithmetic: ``llama.cpp`` computes a compact export as llama.cpp computes its
    plan's GGUF (`load`, float32).

    out: also write the results as JSON to this file; report: also write report.md + PNGs into this directory.
    Both are checked before any model is loaded (an existing one is replaced only with `overwrite`, and only
    if moecompress wrote it; neither may be, contain or sit inside what the run reads: the model, the
    reference, a --ppl file, task directories), claimed for the run, and written only if those inputs are
    unchanged at the end.

    include_path: directories of lm-eval task YAML; lm-eval runs the Python their `!function` entries name, so
    they are read only with `trust_task_code=True` (the shipped fixture tasks need no trust).
    allow_nan: keep NaN / infinite metrics in the results; otherwise they raise `NonFiniteMetrics` (exit 1)."""
    from contextlib import ExitStack

    from .atomic import fingerprint_inputs
    from .checkpoint import checkpoint_fingerprint

    evaluation_request.check_request(tasks, ppl, reference, include_path, trust_task_code, arithmetic)
    evaluation_request.check_ranges(limit, batch_size, num_fewshot, window, stride, max_tokens, seed)
    model, reference, out, reads = evaluation_request.resolve_paths(
        model, reference, ppl, include_path, out, report, overwrite
    )
    limit = int(limit) if limit is not None and limit >= 1 else limit
    measure = dict(tasks=tasks, ppl=ppl, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size)
    measure.update(include_path=include_path, window=window, stride=stride, max_tokens=max_tokens, seed=seed)
    with ExitStack() as held:
        evaluation_request.claim_outputs(held, out, report)
        inputs = fingerprint_inputs(reads, checkpoint_fingerprint)
        loading = dict(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        results = _evaluate(model, reference, measure, loading, arithmetic, progress, allow_nan)
        inputs.check()
        evaluation_request.write_evaluation(results, out, report, overwrite, reads, inputs)
    return results


def _evaluate(model, reference, measure: dict, loading: dict, arithmetic: str, progress, allow_nan) -> dict:
    """`evaluate`'s computation, once its outputs are checked and claimed: the results dict. measure: the
    keywords of `eval.runner.evaluate_model` (tasks, ppl, limit, num_fewshot, batch_size, include_path, window,
    stride, max_tokens, seed); loading: dtype, device, trust_remote_code."""
    from .eval.loading import eval_tokenizer
    from .eval.runner import check_finite, check_reference, evaluate_model, model_info

    check_device(loading["device"])  # `--device bogus` named as such, CUDA on a CPU-only torch: one sentence
    m = _load_for_eval(model, **loading, arithmetic=arithmetic)
    tok = eval_tokenizer(model, loading["trust_remote_code"])
    ref = _load_for_eval(reference, **loading) if reference else None
    check_reference(m, ref, str(model), str(reference))  # KL only between models of one family and vocabulary
    metrics = evaluate_model(m, tok, reference=ref, progress=progress, **measure)
    info = model_info(m, model)
    check_finite(info["name"], metrics, allow_nan)
    return {
        "schema": "moecompress.results/1",
        "model": info,
        "arms": [_evaluated_arm(m, model, info, metrics)],
        "settings": {
            "window": measure["window"],
            "stride": measure["stride"] or measure["window"],
            "max_tokens": measure["max_tokens"],
            "limit": measure["limit"],
            "num_fewshot": measure["num_fewshot"],
            "seed": measure["seed"],
            "reference": reference,
            "arithmetic": arithmetic,
        },
    }


def _evaluated_arm(m, model, info: dict, metrics: dict) -> dict:
    """The one arm of `evaluate`'s results: the checkpoint, and what its plan says when it is an export."""
    from .eval.runner import plan_arm_fields

    arm = {
        "name": info["name"],
        "method": "checkpoint",
        "kind": "original",
        "path": str(model),
        "bytes": info["bytes"],
        "metrics": metrics,
    }
    plan = getattr(m, "_moecompress_plan", None)
    if plan is not None:  # an export: record what the plan says (gate semantics, operators, per-layer counts)
        arm.update({k: v for k, v in plan_arm_fields(plan).items() if v is not None}, kind="compressed")
    return arm


def compare(
    recipes: Recipe | str | os.PathLike | Sequence[Recipe | str | os.PathLike],
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    keep_checkpoints: bool = True,
    pairs: list[tuple[str, str]] | None = None,
    progress: bool = True,
    verbose: bool = False,
    allow_nan: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Run every arm of `recipes` (a `Recipe`, or recipe files whose arms are compared together) from one
    calibration, evaluate all on the same items, write report.md, ranking.md, PNGs and results.json under
    `out`; returns the results. pairs: the paired comparisons (default: every arm against the original).
    The report appears complete or not at all (`compare.run_compare`); an arm with NaN / infinite metrics
    raises `NonFiniteMetrics` unless `allow_nan`. `resume` continues an interrupted run from its finished arms
    (``.OUT.partial/``)."""
    from .recipe import Recipe, load_recipe, merge_recipes

    if not isinstance(recipes, Recipe):
        items = [recipes] if isinstance(recipes, (str, os.PathLike)) else list(recipes)
        recipes = merge_recipes([r if isinstance(r, Recipe) else load_recipe(r) for r in items])
    return run_compare(
        recipes,
        out,
        overwrite=overwrite,
        progress=progress,
        keep_checkpoints=keep_checkpoints,
        pairs=pairs,
        verbose=verbose,
        allow_nan=allow_nan,
        resume=resume,
    )


def apply_plan(model, plan: CompressionPlan, tensors: Mapping[str, torch.Tensor] | None = None):
    """Install runtime blocks executing `plan` into `model` (in place); returns the model."""
    from .runtime import apply_plan as _apply

    return _apply(model, plan, tensors)


def export(
    model_or_path,
    plan: CompressionPlan,
    out: str | os.PathLike,
    format: str = "compact",
    tensors: Mapping[str, torch.Tensor] | None = None,
    recipe=None,
    overwrite: bool = False,
    **kwargs,
):
    """Write the compressed checkpoint (``compact`` | ``hf`` | ``packed`` | ``materialized`` | ``gguf``); returns an
    `ExportResult`. kwargs: `export.core.export`'s (max_shard_size, quiet, protect)."""
    from .export import export as _export

    return _export(
        model_or_path, plan, out, format=format, tensors=tensors, recipe=recipe, overwrite=overwrite, **kwargs
    )


def load(
    path: str | os.PathLike,
    device_map=None,
    dtype="auto",
    max_memory=None,
    offload_folder=None,
    arithmetic: str = "exact",
    trust_remote_code: bool = False,
):
    """Load any export (compact/packed into the runtime; hf / materialized with plain transformers; gguf with
    transformers' GGUF loader where it reads the architecture, else refused in one sentence).
    trust_remote_code: let a plain HF checkpoint's own modeling code run (never asked for on a terminal).

    max_memory / offload_folder: with ``device_map="auto"``, what does not fit is offloaded (accelerate).
    arithmetic: ``exact`` (default), or ``llama.cpp``: a compact export loaded in float32 computes what llama.cpp's
    CPU kernels compute from the plan's GGUF (activations rounded per tensor type; docs/export.md)."""
    from .export import load as _load

    return _load(
        path,
        device_map=device_map,
        dtype=dtype,
        max_memory=max_memory,
        offload_folder=offload_folder,
        arithmetic=arithmetic,
        trust_remote_code=trust_remote_code,
    )


def _load_for_eval(
    source: str, dtype: str, device: str | None, trust_remote_code: bool, arithmetic: str = "exact"
):
    """A local export (compact into the runtime, hf/materialized, gguf) through `load`, else `models.load_model`;
    the user's trust_remote_code goes to either explicitly (a GGUF directory never runs the directory's code)."""
    if Path(source).expanduser().is_dir():
        return load(
            source, device_map=device, dtype=dtype, arithmetic=arithmetic, trust_remote_code=trust_remote_code
        )
    if arithmetic != "exact":
        raise MoECompressError(
            f"arithmetic='{arithmetic}' evaluates a compact export directory; {source} is not one."
        )
    from .models import load_model

    return load_model(source, dtype=dtype, device_map=device, trust_remote_code=trust_remote_code)
