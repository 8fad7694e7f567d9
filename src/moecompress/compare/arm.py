"""One arm of a `compare` run: the original, a plan arm (built, exported, loaded back) or a dense arm (the
standard dense checkpoint, optionally distilled), each evaluated on the same items as every other arm and
measured (bytes, latency) into its results entry."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the recipe schema imports the quantizer and through it the runtime and transformers
    from ..recipe import ArmSpec, Recipe
    from .progress import ArmProgress


def tokenizer_for(path: str):
    """The model's tokenizer, or None when it has none (lm-eval tasks are then skipped)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # never None: no prompt
    except (OSError, ValueError):
        return None


def evaluate_arm(
    model, tokenizer, recipe: Recipe, reference, progress: bool, arm: str, allow_nan: bool = False
) -> dict[str, dict]:
    """The arm's metrics; NaN / infinite ones stop the run right after that arm (`check_finite`) unless allowed."""
    from ..eval.runner import check_finite, evaluate_model

    ev = recipe.eval
    tasks = ev.tasks if tokenizer is not None else []
    metrics = evaluate_model(
        model,
        tokenizer,
        tasks=tasks,
        ppl=ev.ppl,
        reference=reference,
        limit=ev.limit,
        num_fewshot=ev.num_fewshot,
        batch_size=ev.batch_size,
        window=ev.window,
        max_tokens=ev.max_tokens,
        progress=progress,
    )
    check_finite(arm, metrics, allow_nan)
    return metrics


def latency(model, path, recipe: Recipe) -> dict[str, Any]:
    """The arm's bytes and, when the recipe asks for it, its latency and memory (`eval.bench.benchmark`)."""
    from ..eval.bench import benchmark

    if not recipe.eval.latency:
        from ..eval.bench import resident_bytes

        return {"bytes": {"resident": resident_bytes(model)}}
    return benchmark(model, path, prompt_len=64, new_tokens=16, batch_size=1, warmup=1, repeats=3)


@dataclass
class ArmEval:
    """What every arm of one run is evaluated with: the recipe's settings, the tokenizer, the original model as
    the KL reference, the loader of evaluated checkpoints (`eval.loading.load_for_eval` with the run's dtype,
    memory limit and offload folder) and whether NaN metrics are allowed."""

    recipe: Recipe
    tokenizer: Any
    reference: Any
    progress: bool
    evaluate_load: Callable
    allow_nan: bool = False

    def metrics(self, model, name: str) -> dict[str, dict]:
        """`evaluate_arm` of `model` as the arm `name`."""
        return evaluate_arm(
            model, self.tokenizer, self.recipe, self.reference, self.progress, name, self.allow_nan
        )


def original_arm(model_path: str, ref_eval: dict, ev: ArmEval) -> dict[str, Any]:
    """The original model's entry: its metrics against itself, its latency, and its logical bytes."""
    original = dict(
        name="original",
        method="none",
        kind="original",
        path=model_path,
        export_format="hf",
        metrics=ev.metrics(ev.reference, "original"),
        eval=ref_eval,
        **latency(ev.reference, model_path, ev.recipe),
    )
    from ..plan import CompressionPlan

    original["bytes"]["model"] = CompressionPlan.identity(ev.reference).logical_bytes().total
    return original


def plan_arm(
    arm: ArmSpec, name: str, ckpt: Path, out: Path, model_path: str, stats, ev: ArmEval, track: ArmProgress
) -> dict[str, Any]:
    """A plan arm: the plan streamed from the checkpoint, exported to `ckpt` in its format, loaded back and
    evaluated; paths in the entry name the report's `out`."""
    from ..eval.runner import plan_arm_fields
    from ..export import export, load
    from ..workflows.pipeline import choose_format, make_plan

    recipe, progress = ev.recipe, ev.progress
    t1 = time.perf_counter()  # the arm's plan streams from the checkpoint, one layer at a time
    plan, tensors = make_plan(
        model_path, arm.method, arm.params, stats, quant=arm.quant, seed=recipe.seed, progress=progress
    )
    build_seconds = time.perf_counter() - t1
    fmt = choose_format(plan, arm.format)
    track.stage(name, "exporting")
    result = export(
        model_path,
        plan,
        ckpt,
        format=fmt,
        tensors=tensors,
        recipe={
            "model": recipe.model,
            "method": arm.method,
            "params": arm.params,
            "quant": arm.quant.model_dump() if arm.quant else None,
        },
        quiet=not progress,
    )
    track.stage(name, "evaluating")
    model, arm_eval = ev.evaluate_load(ckpt, loader=load)
    entry = plan_arm_fields(plan, tensors)
    kind = "quant_baseline" if arm.method == "quant" else "compressed"
    entry.update(
        name=name,
        method=arm.method,
        params=arm.params,
        ratio=arm.params.get("ratio"),
        kind="materialized" if result.evaluation_only else kind,
        export_format=fmt,
        path=str(out / "checkpoints" / name),
        compress_seconds=round(build_seconds, 3),
        metrics=ev.metrics(model, name),
        eval=arm_eval,
    )
    entry.update(latency(model, ckpt, recipe))
    entry["bytes"].update(model=result.logical_bytes, disk=result.bytes_on_disk, weights=result.weight_bytes)
    del model
    return entry


def _distill_student(arm: ArmSpec, name: str, model_path: str, ckpt: Path, out: Path, ev: ArmEval) -> dict:
    """Distil the dense student in `ckpt` from the original (the arm's `distill:` settings) and put the
    distilled student in its place; returns the distillation's metrics and settings."""
    from ..distill.trainer import distill

    settings = dict(arm.distill)
    data = settings.pop("data", "fixture-calib")
    # the teacher in the evaluation dtype (the checkpoint's own by default), not replicated in float32
    run = distill(
        model_path,
        ckpt,
        data,
        out=out / ".distill" / name,
        teacher_dtype=ev.evaluate_load.keywords["dtype"],
        progress=ev.progress,
        **settings,
    )
    shutil.rmtree(ckpt)
    shutil.copytree(run.student_dir, ckpt)
    shutil.rmtree(out / ".distill", ignore_errors=True)
    return dict(run.metrics, data=data, **settings)


def dense_arm(arm: ArmSpec, name: str, model_path: str, stats, out: Path, ev: ArmEval) -> dict[str, Any]:
    """MoE → dense: the arm is the standard dense checkpoint itself, loaded with plain transformers."""
    from ..distill.dense_export import export_dense
    from ..methods import parse_config
    from ..models import load_model

    ckpt = out / "checkpoints" / name
    t1 = time.perf_counter()
    summary = export_dense(
        model_path,
        ckpt,
        parse_config(arm.method, arm.params),
        dtype="float32",
        calib={i: stats.layer(i) for i in stats.layers},
        progress=ev.progress,
    )
    seconds = time.perf_counter() - t1
    distilled = None
    if arm.distill:
        distilled = _distill_student(arm, name, model_path, ckpt, out, ev)
        seconds = time.perf_counter() - t1
    model, arm_eval = ev.evaluate_load(ckpt, loader=load_model)
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    entry = dict(
        name=name,
        method=arm.method,
        params=arm.params,
        kind="compressed",
        export_format="dense",
        gate_semantics="n/a (dense FFN)",
        operator=None,
        path=str(ckpt),
        compress_seconds=round(seconds, 3),
        student=summary.get("student_class"),
        distilled=distilled,
        metrics=ev.metrics(model, name),
        eval=arm_eval,
    )
    entry.update(latency(model, ckpt, recipe=ev.recipe))
    entry["bytes"].update(model=weights, disk=summary["bytes"], weights=weights)
    return entry
