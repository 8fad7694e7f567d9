"""report.md + PNG plots + results.json from a results dict (schema in `schema.py`).

Every report prints the five-item reporting checklist; an item the results do not support is
listed as MISSING with what would satisfy it, never left out. The parts live beside this module:
`report_comparisons` (the paired bootstrap comparisons), `report_checklist` (the checklist),
`report_tables` (formatting and the ranking table), `report_markdown` (report.md's sections) and
`report_plots` (the PNGs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from .report_checklist import checklist
from .report_comparisons import compare_arms, discriminating
from .report_markdown import render_markdown
from .report_plots import plot_per_layer, plot_quality_vs_bytes, plot_task_deltas
from .report_tables import ranking_markdown
from .schema import SCHEMA, validate_results


def _json_safe(x):
    """`x` with tensors and arrays as lists, paths as strings and NaN / infinite floats as None (JSON null)."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        try:
            return _json_safe(x.item())
        except (TypeError, ValueError):
            pass
    if hasattr(x, "tolist"):
        return _json_safe(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def _write_atomic(path: Path, data: str | bytes) -> None:
    """`atomic.write_file`: complete or absent, fsynced, its temporary removed on any failure (a full disk)."""
    from ..atomic import write_file

    write_file(path, data)


def results_text(results: dict) -> str:
    """The results dict as the JSON text `eval --out` writes."""
    return json.dumps(_json_safe(results), indent=1) + "\n"


def write_results(path: Path, results: dict) -> None:
    """The results dict as the JSON file `eval --out` writes (atomically: complete or absent)."""
    _write_atomic(path, results_text(results))


def write_report(
    results: dict,
    out_dir,
    *,
    B: int | None = None,
    seed: int | None = None,
    alpha: float | None = None,
    pairs: Sequence[tuple[str, str]] | None = None,
) -> Path:
    """Write report.md, results.json and the PNG plots into `out_dir`; return the report path.

    Comparisons are computed (each arm vs the baseline, or `pairs`) unless `results["comparisons"]`
    is given; B / seed / alpha default to `results["settings"]`, else `min_replicates(m)` / 0 / 0.05.
    """
    res = validate_results(results)
    settings = {"B": None, "seed": 0, "alpha": 0.05, **res.settings}
    for k, v in (("B", B), ("seed", seed), ("alpha", alpha)):
        if v is not None:
            settings[k] = v
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    comparisons = results.get("comparisons")
    if comparisons is None:
        comparisons = compare_arms(
            res, pairs, B=settings["B"], seed=settings["seed"], alpha=settings["alpha"]
        )
    if comparisons:
        settings["B"] = comparisons[0]["B"]
    items = checklist(res)
    plots = {
        "quality_vs_bytes": plot_quality_vs_bytes(res, out / "quality_vs_bytes.png"),
        "task_deltas": plot_task_deltas(discriminating(comparisons), res.baseline, out / "task_deltas.png"),
        "per_layer": plot_per_layer(res, out / "per_layer_experts.png"),
    }
    full = dict(
        results,
        schema=results.get("schema", SCHEMA),
        baseline=res.baseline,
        settings=settings,
        comparisons=comparisons,
        checklist=items,
    )
    _write_atomic(out / "results.json", json.dumps(_json_safe(full), indent=1, ensure_ascii=False) + "\n")
    _write_atomic(out / "ranking.md", ranking_markdown(full))
    report = out / "report.md"
    _write_atomic(report, render_markdown(res, comparisons, items, plots, settings) + "\n")
    return report
