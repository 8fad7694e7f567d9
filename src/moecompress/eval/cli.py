"""`moecompress eval MODEL --tasks ... [--ppl FILE] [--reference MODEL] [--out results.json]`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import MoECompressError


def _load(source: str, dtype: str, device: str | None, trust_remote_code: bool):
    """A local export (compact into the runtime, hf/materialized) through moecompress.load, else load_model."""
    try:
        from ..api import load as export_load
    except ImportError:  # checkout without the export module
        export_load = None
    if export_load is not None and Path(source).expanduser().is_dir() and not trust_remote_code:
        return export_load(source, device_map=device, dtype=dtype)
    from ..models import load_model

    return load_model(source, dtype=dtype, device_map=device, trust_remote_code=trust_remote_code)


def _tokenizer(source: str, trust_remote_code: bool, needed: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError):
        if needed:
            raise MoECompressError(f"No tokenizer could be loaded from {source}; copy the original model's tokenizer "
                                   "files into the checkpoint directory.") from None
        return None


def _check_results_file(out: Path, overwrite: bool) -> None:
    """`--out FILE`: a new file, or (with --overwrite) a results file moecompress wrote; its directory writable."""
    import os

    if out.exists():
        if not overwrite:
            raise MoECompressError(f"{out} already exists; choose another --out or pass --overwrite.")
        try:
            ours = str(json.loads(out.read_text()).get("schema", "")).startswith("moecompress.")
        except (OSError, ValueError, AttributeError, UnicodeDecodeError):
            ours = False
        if not ours:
            raise MoECompressError(f"{out} is not a results file written by moecompress, so --overwrite will not "
                                   "replace it; pass another --out.")
    parent = out.expanduser().absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise MoECompressError(f"Cannot write {out}: {parent} is not a writable directory; pass another --out.")


def eval_command(
    model: str = typer.Argument(..., help="Checkpoint directory (HF, or compact when moecompress.load supports it)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Comma-separated lm-eval tasks, e.g. "
                                        "fixture_cloze,fixture_nextword (local) or arc_easy,hellaswag (hub)."),
    ppl: Optional[str] = typer.Option(None, "--ppl", help="Data spec or .txt/.jsonl file for perplexity, "
                                      "next-token accuracy and KL (e.g. fixture-heldout)."),
    limit: Optional[float] = typer.Option(None, help="Documents per task (int) or fraction (< 1)."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples per prompt."),
    batch_size: int = typer.Option(1, "--batch-size", help="Batch size for lm-eval and perplexity windows."),
    reference: Optional[str] = typer.Option(None, "--reference",
                                            help="Original model: KL(reference || MODEL) on --ppl."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the results dict (JSON) here."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also write report.md + PNGs into this directory."),
    include_path: Optional[list[Path]] = typer.Option(None, "--include-path",
                                                      help="Directory of local task YAML + JSONL."),
    window: int = typer.Option(512, help="Perplexity window (tokens)."),
    stride: Optional[int] = typer.Option(None, help="Perplexity stride (tokens; default = window)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Evaluate only the first N tokens of --ppl."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16."),
    device: Optional[str] = typer.Option(None, help="Device map, e.g. cpu, cuda, auto."),
    seed: int = typer.Option(1234, help="Seed for lm-eval sampling."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modeling code."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier --out results file and "
                                   "--report directory written by moecompress."),
) -> None:
    """Perplexity, next-token accuracy, KL to a reference and lm-eval tasks, with per-item results."""
    from rich.console import Console
    from rich.table import Table

    from .runner import evaluate_model, model_info

    if not tasks and not ppl:
        raise MoECompressError("Nothing to evaluate; pass --tasks (e.g. fixture_cloze,fixture_nextword) and/or --ppl FILE.")
    if reference and not ppl:
        raise MoECompressError("--reference measures KL on a text stream; pass --ppl FILE as well.")
    from ..validate import check_range

    check_range("--limit", limit, 0.0, lo_open=True, hint="pass a document count or a fraction below 1")
    check_range("--batch-size", batch_size, 1)
    check_range("--num-fewshot", num_fewshot, 0)
    check_range("--window", window, 2)
    check_range("--stride", stride, 1)
    check_range("--max-tokens", max_tokens, 1)
    if out is not None and out.is_dir():
        raise MoECompressError(f"--out {out} is a directory; pass a file path such as {out / 'results.json'}.")
    if out is not None:
        _check_results_file(out, overwrite)
    if report is not None:
        from ..atomic import check_output

        check_output(report, overwrite, flag="--report")
    if limit is not None and limit >= 1:
        limit = int(limit)
    from ..models.loading import resolve_fixture

    model = resolve_fixture(model)
    reference = resolve_fixture(reference) if reference else None
    console = Console()
    m = _load(model, dtype, device, trust_remote_code)
    tok = _tokenizer(model, trust_remote_code, needed=True)
    ref = _load(reference, dtype, device, trust_remote_code) if reference else None
    metrics = evaluate_model(m, tok, tasks=tasks, ppl=ppl, reference=ref, limit=limit, num_fewshot=num_fewshot,
                             batch_size=batch_size, include_path=include_path, window=window, stride=stride,
                             max_tokens=max_tokens, seed=seed)
    info = model_info(m, model)
    arm = {"name": info["name"], "method": "checkpoint", "kind": "original", "path": str(model),
           "bytes": info["bytes"], "metrics": metrics}
    plan = getattr(m, "_moecompress_plan", None)
    if plan is not None:  # an export: record what the plan says (gate semantics, operators, per-layer counts)
        from .runner import plan_arm_fields

        arm.update({k: v for k, v in plan_arm_fields(plan).items() if v is not None}, kind="compressed")
    results = {"schema": "moecompress.results/1", "model": info, "arms": [arm],
               "settings": {"window": window, "stride": stride or window, "max_tokens": max_tokens, "limit": limit,
                            "num_fewshot": num_fewshot, "seed": seed, "reference": reference}}
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
        from .report import _json_safe, _write_atomic

        out.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(out, json.dumps(_json_safe(results), indent=1) + "\n")
        console.print(f"results: {out}")
    if report is not None:
        from .report import write_report

        from ..atomic import atomic_dir

        with atomic_dir(report, overwrite=overwrite, kind="report") as tmp:
            write_report(results, tmp)
        console.print(f"report: {report / 'report.md'}")
