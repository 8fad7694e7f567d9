"""`moecompress compare` and `moecompress demo`: several arms, one calibration, the same items, one report.

For each arm: build the plan from the shared stats, export it in its format, load the export back
(so what is evaluated is what was written), evaluate perplexity + KL to the original + lm-eval
tasks on identical items, measure bytes and latency. Matched-storage RTN quantization baselines
and the original model are arms too. `write_report` turns the results into report.md + PNGs.
"""

from __future__ import annotations

import json
import shutil
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # the recipe schema imports the quantizer and through it the runtime and transformers
    from .recipe import Recipe

console = Console(stderr=True)


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _evaluate(
    model, tokenizer, recipe: Recipe, reference, progress: bool, arm: str, allow_nan: bool = False
) -> dict[str, dict]:
    """The arm's metrics; NaN / infinite ones stop the run right after that arm (`check_finite`) unless allowed."""
    from .eval.runner import check_finite, evaluate_model

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


def check_distill_settings(recipe: Recipe) -> None:
    """Validate every arm's `distill:` block before any compute (it used to be read only after calibration and
    export): dense arms only, `data` a data spec, every other key a `DistillConfig` field."""
    from pydantic import ValidationError

    from .data import parse_spec
    from .distill.trainer import DistillConfig
    from .errors import MoECompressError
    from .methods import get_method

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


def _latency(model, path, recipe: Recipe) -> dict[str, Any]:
    from .eval.bench import benchmark

    if not recipe.eval.latency:
        from .eval.bench import resident_bytes

        return {"bytes": {"resident": resident_bytes(model)}}
    return benchmark(model, path, prompt_len=64, new_tokens=16, batch_size=1, warmup=1, repeats=3)


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
    from .atomic import atomic_dir, check_output
    from .models.loading import resolve_fixture
    from .validate import check_name

    out = Path(out)
    recipe = with_quant_baselines(recipe)
    model_path = resolve_fixture(recipe.model)
    specs = [recipe.calibration] + [a.calibration for a in recipe.arms if a.calibration is not None]
    protect = [model_path] + [c.data for c in specs if Path(c.data).is_dir()]  # stats stores this run reads
    for arm in recipe.arms:
        check_name(arm.display_name())
    check_distill_settings(recipe)
    from .pipeline import check_format_name

    for arm in recipe.arms:
        check_format_name(arm.format)
    # the previous report stays in place until this one is complete (atomic_dir renames at the end)
    check_output(out, overwrite, protect, kind="report")
    from .atomic import claim
    from .pipeline import model_fingerprint
    from .quiet import quiet_libraries

    track = ArmProgress(2 + len(recipe.arms), enabled=progress and not verbose)
    journal = ArmJournal(
        out,
        dict(
            recipe=recipe.model_dump(mode="json"),
            model=model_fingerprint(model_path),
            keep_checkpoints=keep_checkpoints,
        ),
    )
    with claim(out):
        done = journal.start(resume)
        try:
            with (
                quiet_libraries(not verbose),
                track,
                atomic_dir(out, overwrite=overwrite, protect=protect, kind="report") as tmp,
            ):
                results = _run_arms(
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
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the finished arms stay for --resume
            raise
        except BaseException:
            journal.remove()
            raise
        journal.remove()
    return results


class ArmJournal:
    """The finished arms of a `compare` run in progress, in ``.OUT.partial/`` beside the report: the shared
    calibration store, each finished arm's results (``arms/NAME.json``) and checkpoint. `start(resume=True)`
    after an interruption returns the finished arms, so only the others are computed; the run's identity
    (recipe, model fingerprint, whether checkpoints are kept) must match, as `calibrate --resume` requires."""

    def __init__(self, out: Path, identity: dict):
        self.dir = out.parent / f".{out.name}.partial"
        self.identity = identity

    def start(self, resume: bool) -> dict[str, dict[str, Any]]:
        from .atomic import write_file
        from .errors import MoECompressError

        run = self.dir / "run.json"
        old = self._read(run)
        if self.dir.exists() and old is None:  # never delete what moecompress did not write
            raise MoECompressError(
                f"{self.dir} is in the way of this report's partial run and was not written by "
                "moecompress (no readable run.json); remove it or choose another --out."
            )
        if resume and old is not None:
            if old.get("identity") != self.identity:
                raise MoECompressError(
                    f"The interrupted run in {self.dir} was made with another recipe, model or "
                    "--keep-checkpoints setting; drop --resume to start over or pass the same ones."
                )
            return {p.stem: json.loads(p.read_text()) for p in sorted((self.dir / "arms").glob("*.json"))}
        shutil.rmtree(self.dir, ignore_errors=True)  # ours: a stale partial run of this output
        (self.dir / "arms").mkdir(parents=True)
        write_file(run, json.dumps({"identity": self.identity}))
        return {}

    @staticmethod
    def _read(run: Path) -> dict | None:
        try:
            got = json.loads(run.read_text())
        except (OSError, ValueError):
            return None
        return got if isinstance(got, dict) and "identity" in got else None

    def save(self, entry: dict[str, Any]) -> None:
        from .atomic import write_file

        write_file(self.dir / "arms" / f"{entry['name']}.json", json.dumps(entry))

    def fresh(self, sub: str, name: str) -> Path:
        """`sub/name` under the journal, emptied: what an interrupted attempt at the arm left is not reused."""
        path = self.dir / sub / name
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class ArmProgress:
    """One rich progress display across the arms: a bar with the current arm and stage, and one line
    per finished arm (size and KL). Disabled, it prints each arm's header line as before (verbose)."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total, self._progress, self._task = enabled, total, None, None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("calibrating", total=self.total)
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        return False

    def stage(self, arm: str, what: str, header: str | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"{arm}: {what}")
        elif header is not None:
            console.print(header)

    def done(self, entry: dict[str, Any]) -> None:
        if self._progress is None:
            return
        from .atomic import human_bytes

        agg = next(
            (v.get("aggregate", {}) for k, v in entry.get("metrics", {}).items() if k.startswith("ppl:")), {}
        )
        size = entry.get("bytes", {}).get("model")
        kl = agg.get("kl")
        self._progress.console.print(
            f"  [green]✓[/] {entry['name']:<24} {human_bytes(size) if size else '-':>10}"
            + (f"  KL {kl:.4f}" if kl is not None else "")
        )
        self._progress.advance(self._task)

    def calibrated(self, seconds: float) -> None:
        if self._progress is not None:
            self._progress.console.print(f"  [green]✓[/] calibration ({seconds:.0f} s)")
            self._progress.advance(self._task)


def with_quant_baselines(recipe: Recipe) -> Recipe:
    """`recipe` plus one pure-quantization arm (method 'quant', GPTQ) per `eval.quant_baselines` spec: the
    reference every structural arm is held against (skipped when the recipe already has that arm)."""
    from .recipe import ArmSpec

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


def _run_arms(
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
    from .eval.loading import eval_dtype, load_for_eval
    from .eval.report import write_report
    from .eval.runner import model_info, plan_arm_fields
    from .export import export, load
    from .methods import get_method
    from .models import load_model
    from .pipeline import choose_format, make_plan, needs_for, resolve_calibration

    work = tmp / ".work"  # offload scratch: inside the temporary, so a kill leaves one thing to clean
    work.mkdir()
    tokenizer = _tokenizer(model_path)
    cal = recipe.calibration

    def calibrate_for(spec, arms, where: Path):
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

    # one calibration serves every arm without its own; an arm with its own spec (its domain) shares it only
    # with the arms that name the same spec
    own = sorted({a.calibration.model_dump_json() for a in recipe.arms if a.calibration is not None})
    shared_arms = [a for a in recipe.arms if a.calibration is None]
    # in the journal: a resumed run finds the finished store there and reuses it
    stats, calib_seconds = calibrate_for(cal, shared_arms, journal.dir) if shared_arms else (None, 0.0)
    track.calibrated(calib_seconds)
    arm_stats: dict[str, tuple] = {}
    for k, key in enumerate(own):
        group = [
            a for a in recipe.arms if a.calibration is not None and a.calibration.model_dump_json() == key
        ]
        spec = group[0].calibration
        st, sec = calibrate_for(spec, group, journal.dir / f"arm-calibration-{k}")
        arm_stats[key] = (st, _calibration_info(st, spec, sec))

    def stats_of(arm):
        return stats if arm.calibration is None else arm_stats[arm.calibration.model_dump_json()][0]

    def own_calibration(arm) -> dict:
        return (
            {}
            if arm.calibration is None
            else {"calibration": arm_stats[arm.calibration.model_dump_json()][1]}
        )

    # every evaluated model in one dtype (default: the checkpoint's own), offloaded when it does not fit
    dtype = eval_dtype(recipe.eval.dtype, model_path)
    evaluate_load = partial(
        load_for_eval, dtype=dtype, max_memory=recipe.eval.max_memory, offload_dir=work / "offload"
    )
    reference, ref_eval = evaluate_load(model_path, loader=load_model)
    arms: list[dict[str, Any]] = []

    def finished(entry: dict[str, Any]) -> None:
        arms.append(entry)
        journal.save(entry)
        track.done(entry)

    if "original" in done:
        arms.append(done["original"])
        track.done(done["original"])
    else:
        track.stage("original", "evaluating", header=f"[bold]original[/] {model_path}")
        original = dict(
            name="original",
            method="none",
            kind="original",
            path=model_path,
            export_format="hf",
            metrics=_evaluate(reference, tokenizer, recipe, reference, progress, "original", allow_nan),
            eval=ref_eval,
            **_latency(reference, model_path, recipe),
        )
        from .plan import CompressionPlan

        original["bytes"]["model"] = CompressionPlan.identity(reference).logical_bytes().total
        finished(original)

    for arm in recipe.arms:
        name = arm.display_name()
        if name in done:  # finished before an interruption (--resume)
            arms.append(done[name])
            track.done(done[name])
            continue
        track.stage(
            name,
            "compressing",
            header=f"[bold]{name}[/] ({arm.method} {arm.params}{f' + {arm.quant.quant}' if arm.quant else ''})",
        )
        ckpt = journal.fresh("checkpoints", name)
        if get_method(arm.method).family == "dense":
            journal.fresh(".distill", name)
            entry = _dense_arm(
                arm,
                name,
                model_path,
                stats_of(arm),
                journal.dir,
                recipe,
                tokenizer,
                reference,
                progress,
                evaluate_load,
                allow_nan,
            )
            finished(dict(entry, path=str(out / "checkpoints" / name), **own_calibration(arm)))
            continue
        t1 = time.perf_counter()  # the arm's plan streams from the checkpoint, one layer at a time
        plan, tensors = make_plan(
            model_path,
            arm.method,
            arm.params,
            stats_of(arm),
            quant=arm.quant,
            seed=recipe.seed,
            progress=progress,
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
        model, arm_eval = evaluate_load(ckpt, loader=load)
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
            metrics=_evaluate(model, tokenizer, recipe, reference, progress, name, allow_nan),
            eval=arm_eval,
        )
        entry.update(_latency(model, ckpt, recipe))
        entry["bytes"].update(
            model=result.logical_bytes, disk=result.bytes_on_disk, weights=result.weight_bytes
        )
        entry.update(own_calibration(arm))
        finished(entry)
        del model

    results = dict(
        model=model_info(reference, model_path, name=Path(model_path).name),
        calibration=_calibration_info(stats, cal, calib_seconds),
        arms=arms,
        settings={"seed": recipe.seed, "eval_dtype": dtype},
        notes=_notes(recipe, dtype, arms),
    )
    shutil.rmtree(work)
    if keep_checkpoints and (journal.dir / "checkpoints").is_dir():
        (journal.dir / "checkpoints").rename(tmp / "checkpoints")
    track.stage("report", "comparisons and plots")
    write_report(results, tmp, pairs=pairs)
    return results


def _dense_arm(
    arm,
    name,
    model_path,
    stats,
    out,
    recipe,
    tokenizer,
    reference,
    progress,
    evaluate_load,
    allow_nan: bool = False,
) -> dict[str, Any]:
    """MoE → dense: the arm is the standard dense checkpoint itself, loaded with plain transformers."""
    from .distill.dense_export import export_dense
    from .methods import parse_config
    from .models import load_model

    ckpt = out / "checkpoints" / name
    t1 = time.perf_counter()
    summary = export_dense(
        model_path,
        ckpt,
        parse_config(arm.method, arm.params),
        dtype="float32",
        calib={i: stats.layer(i) for i in stats.layers},
        progress=progress,
    )
    seconds = time.perf_counter() - t1
    distilled = None
    if arm.distill:
        from .distill.trainer import distill

        settings = dict(arm.distill)
        data = settings.pop("data", "fixture-calib")
        # the teacher in the evaluation dtype (the checkpoint's own by default), not replicated in float32
        run = distill(
            model_path,
            ckpt,
            data,
            out=out / ".distill" / name,
            teacher_dtype=evaluate_load.keywords["dtype"],
            progress=progress,
            **settings,
        )
        shutil.rmtree(ckpt)
        shutil.copytree(run.student_dir, ckpt)
        shutil.rmtree(out / ".distill", ignore_errors=True)
        distilled = dict(run.metrics, data=data, **settings)
        seconds = time.perf_counter() - t1
    model, arm_eval = evaluate_load(ckpt, loader=load_model)
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
        metrics=_evaluate(model, tokenizer, recipe, reference, progress, name, allow_nan),
        eval=arm_eval,
    )
    entry.update(_latency(model, ckpt, recipe))
    entry["bytes"].update(model=weights, disk=summary["bytes"], weights=weights)
    return entry


def _calibration_info(stats, cal, seconds: float) -> dict[str, Any] | None:
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


def _notes(recipe: Recipe, dtype: str = "float32", arms: list[dict[str, Any]] = ()) -> list[str]:
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


TABLE_WIDTH = 100  # the ranking table is laid out for (at most) this many terminal columns


def ranking_table(results: dict[str, Any]) -> Table:
    """Arms ranked by KL to the original (lower is better), with bytes — the demo's summary. The same rows
    as `eval.report.ranking_rows` (written as ranking.md); print it with `width=TABLE_WIDTH`: long arm
    names wrap inside their cell rather than being cut."""
    from rich import box

    from .eval.report import ranking_rows

    header, rows = ranking_rows(results)
    table = Table(
        title="arms ranked by KL to the original (same windows)", box=box.SIMPLE_HEAD, pad_edge=False
    )
    for i, col in enumerate(header):
        if i == 0:
            table.add_column(col, justify="left", overflow="fold", ratio=1, min_width=12)
        else:
            # fold, never ellipsize: on a terminal narrower than TABLE_WIDTH cells wrap instead of being cut
            table.add_column(col, justify="left" if col == "kind" else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def summary_console():
    """The console the ranking table is printed on: a file or pipe has no width of its own (rich would assume
    80 columns and squeeze the table), so it gets TABLE_WIDTH."""
    c = Console()
    return c if c.is_terminal else Console(width=TABLE_WIDTH)


def table_width(console) -> int:
    """The ranking table's width: TABLE_WIDTH, or the terminal's when it is narrower (a file or pipe has no
    width of its own, so it gets TABLE_WIDTH rather than rich's 80-column default)."""
    return min(console.width, TABLE_WIDTH) if console.is_terminal else TABLE_WIDTH
