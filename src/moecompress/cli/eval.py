"""`moecompress eval MODEL --tasks ... [--ppl FILE] [--reference MODEL] [--out results.json]`: `api.evaluate`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..api import evaluate


def eval_command(
    model: str = typer.Argument(
        ..., help="Checkpoint directory (HF, or compact when moecompress.load supports it)."
    ),
    tasks: str | None = typer.Option(
        None,
        "--tasks",
        help="Comma-separated lm-eval tasks, e.g. "
        "fixture_cloze,fixture_nextword (local) or arc_easy,hellaswag (hub).",
    ),
    ppl: str | None = typer.Option(
        None,
        "--ppl",
        help="Data spec or .txt/.jsonl file for perplexity, "
        "next-token accuracy and KL (e.g. fixture-heldout).",
    ),
    limit: float | None = typer.Option(None, help="Documents per task (int) or fraction (< 1)."),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", help="Few-shot examples per prompt."),
    batch_size: int = typer.Option(1, "--batch-size", help="Batch size for lm-eval and perplexity windows."),
    reference: str | None = typer.Option(
        None, "--reference", help="Original model: KL(reference || MODEL) on --ppl."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the results dict (JSON) here."),
    report: Path | None = typer.Option(
        None, "--report", help="Also write report.md + PNGs into this directory."
    ),
    include_path: list[Path] | None = typer.Option(
        None,
        "--include-path",
        help="Directory of local task YAML + JSONL. Its YAML may "
        "name Python code (lm-eval's !function), which runs: needs "
        "--trust-task-code.",
    ),
    trust_task_code: bool = typer.Option(
        False,
        "--trust-task-code",
        help="Allow the Python code that "
        "--include-path task files name to run (only for directories you trust).",
    ),
    window: int = typer.Option(512, help="Perplexity window (tokens)."),
    stride: int | None = typer.Option(None, help="Perplexity stride (tokens; default = window)."),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", help="Evaluate only the first N tokens of --ppl."
    ),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16."),
    arithmetic: str = typer.Option(
        "exact",
        help="exact, or llama.cpp: a compact export computed as llama.cpp's CPU kernels compute the "
        "same plan's GGUF (with --dtype float32; docs/export.md).",
    ),
    device: str | None = typer.Option(None, help="Device map, e.g. cpu, cuda, auto."),
    seed: int = typer.Option(1234, help="Seed for lm-eval sampling."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modeling code."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an earlier --out results file and --report directory written by moecompress.",
    ),
    allow_nan: bool = typer.Option(
        False, "--allow-nan", help="Keep NaN or infinite metrics (stored as null) instead of exiting 1."
    ),
) -> None:
    """Perplexity, next-token accuracy, KL to a reference and lm-eval tasks, with per-item results."""
    results = evaluate(
        model,
        tasks=tasks,
        ppl=ppl,
        reference=reference,
        limit=limit,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        include_path=include_path,
        window=window,
        stride=stride,
        max_tokens=max_tokens,
        dtype=dtype,
        device=device,
        seed=seed,
        trust_remote_code=trust_remote_code,
        out=out,
        report=report,
        overwrite=overwrite,
        trust_task_code=trust_task_code,
        allow_nan=allow_nan,
        arithmetic=arithmetic,
    )
    _print_results(results, out, report)


def _print_results(results: dict, out: Path | None, report: Path | None) -> None:
    """Print each task's aggregate metrics as a table, and where the results and report were written."""
    info, metrics = results["model"], results["arms"][0]["metrics"]
    console = Console(markup=False)
    table = Table(title=f"{info['name']} ({info.get('model_type')})")
    for col in ("task", "metric", "value", "items"):
        table.add_column(col, justify="left" if col in ("task", "metric") else "right")
    for t, e in metrics.items():
        for k, v in e["aggregate"].items():
            if k.endswith("_stderr") or v is None:
                continue
            table.add_row(t, k, f"{v:.4f}" if isinstance(v, float) else str(v), str(e["n"]))
    console.print(table)
    if out is not None:
        console.print(f"results: {out}")
    if report is not None:
        console.print(f"report: {report / 'report.md'}")
