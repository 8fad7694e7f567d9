"""`moecompress compare` and `moecompress demo`: several arms, one calibration, the same items, one report.

For each arm: build the plan from the shared stats, export it in its format, load the export back
(so what is evaluated is what was written), evaluate perplexity + KL to the original + lm-eval
tasks on identical items, measure bytes and latency. Matched-storage RTN quantization baselines
and the original model are arms too. `write_report` turns the results into report.md + PNGs.

This package holds the run (`run_compare`) and the checks made before it; beside it are `runner` (the
calibrations and the loop over the arms), `arm` (one arm: original, plan or dense), `journal` (the finished
arms of an interrupted run), `progress` (the display) and `ranking` (the summary table the CLI prints).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .journal import ArmJournal
from .progress import ArmProgress
from .runner import run_arms

if TYPE_CHECKING:  # the recipe schema imports the quantizer and through it the runtime and transformers
    from ..recipe import Recipe


def check_distill_settings(recipe: Recipe) -> None:
    """Validate every arm's `distill:` block before any compute (it used to be read only after calibration and
    export): dense arms only, `data` a data spec, every other key a `DistillConfig` field."""
    from pydantic import ValidationError

    from ..data import parse_spec
    from ..distill import DistillConfig
    from ..errors import MoECompressError
    from ..methods import get_method

    for arm in recipe.arms:
        if not arm.distill:
            continue
        name = arm.display_name()
        if get_method(arm.method).family != "dense":
            raise MoECompressError(
                f"Arm '{name}' has a 'distill' block, but only dense arms are distilled; remove "
                "it or use a dense method."
            )
        settings = dict(arm.distill)
        data = settings.pop("data", "fixture-calib")
        if not isinstance(data, str):
            raise MoECompressError(
                f"Arm '{name}': distill field 'data' must be a data spec such as fixture-calib, "
                f"not a {type(data).__name__}; fix the recipe."
            )
        parse_spec(data)
        try:
            DistillConfig(**settings)
        except ValidationError as exc:
            errs = exc.errors()  # a misspelt key also makes its correct name "missing": name the typo
            e = next((x for x in errs if x["type"] == "extra_forbidden"), errs[0])
            loc = ".".join(str(p) for p in e["loc"]) or "distill"
            raise MoECompressError(
                f"Arm '{name}': field 'distill.{loc}' is invalid ({e['msg']}); fix the recipe."
            ) from None


def _check_arms(recipe: Recipe) -> None:
    """Every arm's name, `distill:` block and export format, refused in a sentence before any compute."""
    from ..validate import check_name
    from ..workflows.pipeline import check_format_name

    for arm in recipe.arms:
        check_name(arm.display_name())
    check_distill_settings(recipe)
    for arm in recipe.arms:
        check_format_name(arm.format)


def _journalled(
    out: Path, journal: ArmJournal, resume: bool, run: Callable[[dict[str, dict[str, Any]]], dict[str, Any]]
) -> dict[str, Any]:
    """`run(done)` with `out` claimed and the journal started (`done`: the arms it holds when `resume`). The
    journal is removed when the run ends or fails, and kept for --resume when it is interrupted (Ctrl-C,
    SIGTERM)."""
    from ..atomic import claim

    with claim(out):
        done = journal.start(resume)
        try:
            results = run(done)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the finished arms stay for --resume
            raise
        except BaseException:
            journal.remove()
            raise
        journal.remove()
    return results


def _identity(recipe: Recipe, model_path: str, keep_checkpoints: bool) -> dict:
    """What a resumed run must share with the interrupted one: the recipe, the model's fingerprint and whether
    checkpoints are kept (`ArmJournal`)."""
    from ..workflows.pipeline import model_fingerprint

    return dict(
        recipe=recipe.model_dump(mode="json"),
        model=model_fingerprint(model_path),
        keep_checkpoints=keep_checkpoints,
    )


def run_compare(
    recipe: Recipe,
    out: str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    keep_checkpoints: bool = True,
    pairs: list[tuple[str, str]] | None = None,
    verbose: bool = False,
    allow_nan: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Run every arm of `recipe`; write report.md, PNGs, results.json under `out`; return the results.

    `pairs` chooses the paired comparisons (default: every arm against the original). The report
    appears complete or not at all: a failed or killed run leaves the previous report untouched.
    `progress` shows one progress display across the arms (one line per finished arm); the libraries'
    own bars and logs are silenced unless `verbose`, which instead shows every bar as it comes.
    An arm whose metrics are NaN or infinite ends the run (exit 1) unless `allow_nan`.
    Finished arms are kept in ``.OUT.partial/`` (`ArmJournal`) while the run goes on; an interrupted run (Ctrl-C,
    SIGTERM) leaves it there and `resume` continues from it, computing only the arms left.
    """
    from ..atomic import atomic_dir, check_output
    from ..models.loading import resolve_fixture
    from ..quiet import quiet_libraries

    out = Path(out)
    recipe = with_quant_baselines(recipe)
    model_path = resolve_fixture(recipe.model)
    specs = [recipe.calibration] + [a.calibration for a in recipe.arms if a.calibration is not None]
    protect = [model_path] + [c.data for c in specs if Path(c.data).is_dir()]  # stats stores this run reads
    _check_arms(recipe)
    # the previous report stays in place until this one is complete (atomic_dir renames at the end)
    check_output(out, overwrite, protect, kind="report")
    track = ArmProgress(2 + len(recipe.arms), enabled=progress and not verbose)
    journal = ArmJournal(out, _identity(recipe, model_path, keep_checkpoints))

    def run(done: dict[str, dict[str, Any]]) -> dict[str, Any]:
        with (
            quiet_libraries(not verbose),
            track,
            atomic_dir(out, overwrite=overwrite, protect=protect, kind="report") as tmp,
        ):
            return run_arms(
                recipe,
                out,
                tmp,
                model_path,
                progress and verbose,
                keep_checkpoints,
                pairs,
                track,
                allow_nan,
                journal,
                done,
            )

    return _journalled(out, journal, resume, run)


def with_quant_baselines(recipe: Recipe) -> Recipe:
    """`recipe` plus one pure-quantization arm (method 'quant', GPTQ) per `eval.quant_baselines` spec: the
    reference every structural arm is held against (skipped when the recipe already has that arm)."""
    from ..recipe import ArmSpec

    have = {
        (a.method, a.params.get("quant"), a.params.get("algo", "gptq"))
        for a in recipe.arms
        if a.quant is None
    }
    extra = [
        ArmSpec(method="quant", params={"quant": spec, "algo": "gptq"})
        for spec in recipe.eval.quant_baselines
        if ("quant", spec, "gptq") not in have
    ]
    return recipe.model_copy(update={"arms": [*recipe.arms, *extra]}) if extra else recipe
