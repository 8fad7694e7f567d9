"""The body of a `compare` run: one calibration shared by the arms without their own (and one per distinct
arm calibration), the original and every arm evaluated in turn (`arm`), then the results, the notes the
report prints, and the report itself."""

from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from .arm import ArmEval, dense_arm, original_arm, plan_arm, tokenizer_for

if TYPE_CHECKING:  # the recipe schema imports the quantizer and through it the runtime and transformers
    from ..recipe import Recipe
    from .journal import ArmJournal
    from .progress import ArmProgress


def _calibrate(model_path: str, spec, arms, where: Path, progress: bool):
    """The statistics every one of `arms` needs, calibrated on `spec` into `where`; returns (stats, seconds)."""
    from ..workflows.pipeline import needs_for, resolve_calibration

    needs = sorted({s for arm in arms for s in needs_for(arm.method, arm.params, arm.quant)})
    t = time.perf_counter()
    st = resolve_calibration(
        model_path,
        spec.data,
        needs,
        seq_len=spec.seq_len,
        seed=spec.seed,
        batch_size=spec.batch_size,
        work_dir=where,
        dtype="float32",
        progress=progress,
    )
    return st, time.perf_counter() - t


class Calibrations:
    """The run's statistics: one calibration serves every arm without its own; an arm with its own spec (its
    domain) shares it only with the arms that name the same spec. All are kept in the journal's folder, so a
    resumed run finds the finished stores there and reuses them."""

    def __init__(
        self, recipe: Recipe, model_path: str, journal: ArmJournal, track: ArmProgress, progress: bool
    ):
        own = sorted({a.calibration.model_dump_json() for a in recipe.arms if a.calibration is not None})
        shared_arms = [a for a in recipe.arms if a.calibration is None]
        self.stats, self.seconds = (
            _calibrate(model_path, recipe.calibration, shared_arms, journal.dir, progress)
            if shared_arms
            else (None, 0.0)
        )
        track.calibrated(self.seconds)
        self.arm_stats: dict[str, tuple] = {}
        for k, key in enumerate(own):
            group = [
                a for a in recipe.arms if a.calibration is not None and a.calibration.model_dump_json() == key
            ]
            spec = group[0].calibration
            st, sec = _calibrate(model_path, spec, group, journal.dir / f"arm-calibration-{k}", progress)
            self.arm_stats[key] = (st, calibration_info(st, spec, sec))

    def stats_of(self, arm):
        """The statistics `arm` is built from: the shared ones, or those of its own calibration spec."""
        return self.stats if arm.calibration is None else self.arm_stats[arm.calibration.model_dump_json()][0]

    def own_calibration(self, arm) -> dict:
        """``{"calibration": info}`` for an arm with its own calibration spec, else nothing."""
        return (
            {}
            if arm.calibration is None
            else {"calibration": self.arm_stats[arm.calibration.model_dump_json()][1]}
        )


def _evaluate_arms(
    recipe: Recipe,
    out: Path,
    model_path: str,
    cals: Calibrations,
    ev: ArmEval,
    ref_eval: dict,
    track: ArmProgress,
    journal: ArmJournal,
    done: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """The entries of the original and of every arm, in recipe order; arms in `done` are taken as they are,
    each other one is computed, saved to the `journal` and reported to `track` as it finishes."""
    from ..methods import get_method

    arms: list[dict[str, Any]] = []

    def finished(entry: dict[str, Any]) -> None:
        arms.append(entry)
        journal.save(entry)
        track.done(entry)

    if "original" in done:
        arms.append(done["original"])
        track.done(done["original"])
    else:
        track.stage("original", "evaluating", header=f"[bold]original[/] {escape(str(model_path))}")
        finished(original_arm(model_path, ref_eval, ev))
    for arm in recipe.arms:
        name = arm.display_name()
        if name in done:  # finished before an interruption (--resume)
            arms.append(done[name])
            track.done(done[name])
            continue
        track.stage(
            name,
            "compressing",
            header=f"[bold]{escape(name)}[/] "
            + escape(f"({arm.method} {arm.params}{f' + {arm.quant.quant}' if arm.quant else ''})"),
        )
        ckpt = journal.fresh("checkpoints", name)
        if get_method(arm.method).family == "dense":
            journal.fresh(".distill", name)
            entry = dense_arm(arm, name, model_path, cals.stats_of(arm), journal.dir, ev)
            finished(dict(entry, path=str(out / "checkpoints" / name), **cals.own_calibration(arm)))
            continue
        entry = plan_arm(arm, name, ckpt, out, model_path, cals.stats_of(arm), ev, track)
        entry.update(cals.own_calibration(arm))
        finished(entry)
    return arms


def run_arms(
    recipe: Recipe,
    out: Path,
    tmp: Path,
    model_path: str,
    progress: bool,
    keep_checkpoints: bool,
    pairs,
    track: ArmProgress,
    allow_nan: bool,
    journal: ArmJournal,
    done: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The body of `run_compare`: the report is written under `tmp`, paths in the results name `out`. The shared
    calibration and the finished arms (results, checkpoints) go to the `journal`; arms in `done` are not run."""
    from ..eval.loading import eval_dtype, load_for_eval
    from ..eval.report import write_report
    from ..eval.runner import model_info
    from ..models import load_model

    work = tmp / ".work"  # offload scratch: inside the temporary, so a kill leaves one thing to clean
    work.mkdir()
    tokenizer = tokenizer_for(model_path)
    cals = Calibrations(recipe, model_path, journal, track, progress)
    # every evaluated model in one dtype (default: the checkpoint's own), offloaded when it does not fit
    dtype = eval_dtype(recipe.eval.dtype, model_path)
    evaluate_load = partial(
        load_for_eval, dtype=dtype, max_memory=recipe.eval.max_memory, offload_dir=work / "offload"
    )
    reference, ref_eval = evaluate_load(model_path, loader=load_model)
    ev = ArmEval(recipe, tokenizer, reference, progress, evaluate_load, allow_nan)
    arms = _evaluate_arms(recipe, out, model_path, cals, ev, ref_eval, track, journal, done)
    results = dict(
        model=model_info(reference, model_path, name=Path(model_path).name),
        calibration=calibration_info(cals.stats, recipe.calibration, cals.seconds),
        arms=arms,
        settings={"seed": recipe.seed, "eval_dtype": dtype},
        notes=notes(recipe, dtype, arms),
    )
    shutil.rmtree(work)
    if keep_checkpoints and (journal.dir / "checkpoints").is_dir():
        (journal.dir / "checkpoints").rename(tmp / "checkpoints")
    track.stage("report", "comparisons and plots")
    write_report(results, tmp, pairs=pairs)
    return results


def calibration_info(stats, cal, seconds: float) -> dict[str, Any] | None:
    """What the report says of a calibration: domains, source, origin of each term, tokens, settings, seconds."""
    if stats is None:
        return None
    data = stats.meta.get("data", {})
    domains = "; ".join(sorted({s.get("domain", "") for s in data.get("sources", []) if s.get("domain")}))
    # what each term drew (for a task term: the task, its split and how many documents)
    origin = "; ".join(s["origin"] for s in data.get("sources", []) if s.get("origin"))
    return dict(
        domain=domains or None,
        source=data.get("spec", cal.data),
        origin=origin or None,
        tokens=stats.token_count,
        seq_len=cal.seq_len,
        seed=cal.seed,
        seconds=round(seconds, 2),
    )


def notes(recipe: Recipe, dtype: str = "float32", arms: list[dict[str, Any]] = ()) -> list[str]:
    """The report's notes: how every arm was evaluated, how to read latency, the dtype, which arms were offloaded."""
    offloaded = [a["name"] for a in arms if a.get("eval", {}).get("offloaded")]
    extra = [f"Every model was evaluated in {dtype} (logits upcast to float32 for KL and perplexity)."]
    if offloaded:
        extra.append(
            f"Evaluated offloaded (accelerate device_map: what did not fit in memory was read from disk, "
            f"slower but the same numbers): {', '.join(offloaded)}."
        )
    return [
        f"Every arm is evaluated on the same {recipe.eval.ppl} windows (window {recipe.eval.window}) and the "
        f"same lm-eval documents (limit {recipe.eval.limit}); checkpoints were exported and loaded back "
        "before evaluation.",
        "Latency and memory are measured arm after arm, not interleaved: on a shared machine they drift with "
        "the load, so read them as indicative; benchmarks/bench_runtime_speed.py measures runtime speed side "
        "by side with repeats.",
        *extra,
    ]
