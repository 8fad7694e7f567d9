"""`moecompress compare RECIPE...` and `moecompress demo` (compare on the shipped recipes): `api.compare`."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

import typer

from ..api import compare
from ..compare.ranking import ranking_table, summary_console, table_width

# the options compare and demo share, defined once
_VERBOSE = typer.Option(False, "--verbose", help="Show the libraries' own progress bars and logs.")
_ALLOW_NAN = typer.Option(
    False,
    "--allow-nan",
    help="Keep arms whose metrics are NaN or infinite (stored as null) instead of exiting 1.",
)


def compare_command(
    recipes: list[Path] = typer.Argument(
        ..., help="YAML recipes (one arm each, or files with an 'arms' list)."
    ),
    out: Path = typer.Option(Path("runs/compare"), help="Report directory (report.md, PNGs, results.json)."),
    overwrite: bool = typer.Option(False, help="Replace an existing report directory."),
    keep_checkpoints: bool = typer.Option(
        True, help="Keep each arm's exported checkpoint under OUT/checkpoints."
    ),
    verbose: bool = _VERBOSE,
    allow_nan: bool = _ALLOW_NAN,
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue an interrupted run: the arms it finished are kept, only the others are computed.",
    ),
) -> None:
    """Compress several arms from one calibration, evaluate all on the same items, write the report."""
    results = compare(
        recipes,
        out,
        overwrite=overwrite,
        keep_checkpoints=keep_checkpoints,
        verbose=verbose,
        allow_nan=allow_nan,
        resume=resume,
    )
    console = summary_console()
    console.print(ranking_table(results), width=table_width(console))
    console.print(f"report: {out / 'report.md'} (table: {out / 'ranking.md'})")


def demo_command(
    out: Path = typer.Option(Path("runs/demo"), help="Where the demo writes its report."),
    full: bool = typer.Option(
        False,
        help="Every arm of recipes/demo-full.yaml on both fixtures (slower; the default "
        "is one representative arm per method family on one fixture).",
    ),
    overwrite: bool = typer.Option(True, help="Replace a previous demo report."),
    verbose: bool = _VERBOSE,
    allow_nan: bool = _ALLOW_NAN,
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue an interrupted demo: finished arms (and, with "
        "--full, a fixture's finished report) are kept, only the rest is computed.",
    ),
) -> None:
    """Offline end to end on the shipped fixtures: calibrate once, compress, evaluate, rank, report."""
    from ..recipe import load_recipe  # the schema imports the quantizer and transformers: only here

    console = summary_console()
    names = ["demo-full.yaml"] if full else ["demo.yaml"]
    models = ["fixture:olmoe-tiny", "fixture:qwen3-moe-tiny"] if full else [None]
    for name in names:
        base = load_recipe(resources.files("moecompress") / "recipes" / name)
        for model in models:
            recipe = base if model is None else base.model_copy(update={"model": model})
            target = out if len(models) == 1 else out / recipe.model.split(":")[-1]
            if (
                resume
                and len(models) > 1
                and (target / "results.json").is_file()
                and not (target.parent / f".{target.name}.partial").exists()
            ):
                console.print(f"report: {target / 'report.md'} (finished before the interruption; kept)")
                continue
            t0 = time.perf_counter()
            results = compare(
                recipe,
                target,
                overwrite=overwrite,
                keep_checkpoints=False,
                verbose=verbose,
                allow_nan=allow_nan,
                resume=resume,
            )
            console.print(ranking_table(results), width=table_width(console))
            console.print(
                f"report: {target / 'report.md'} (table: {target / 'ranking.md'}; "
                f"{time.perf_counter() - t0:.0f} s)"
            )
