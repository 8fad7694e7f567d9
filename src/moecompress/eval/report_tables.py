"""The report's building blocks as markdown: value and size formatting, tables, the metric columns of the arms
table, and the ranking of arms by KL to the original (ranking.md, and the CLI's summary table)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..atomic import human_bytes
from .schema import Results


def human(n: int | float | None) -> str:
    """A size as every verb prints it (`atomic.human_bytes`), "—" when unknown."""
    return "—" if n is None else human_bytes(n)


def fmt(v: Any, digits: int = 4) -> str:
    """A metric as the report prints it: `digits` decimals, 3 significant digits when tiny or huge, "—" if absent."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.{digits}f}"
    return str(v)


def _cell(s: Any) -> str:
    """A value as one markdown table cell (pipes escaped, newlines as spaces)."""
    return str(s).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table of `rows` under `header`."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def task_columns(res: Results) -> list[tuple[str, str]]:
    """The arms table's metric columns (task, metric): ppl and KL of each perplexity stream, each task's primary."""
    cols: list[tuple[str, str]] = []
    for a in res.arms:
        for t, e in a.metrics.items():
            keys = ["ppl", "kl"] if e.output_type == "perplexity" else [e.primary]
            for m in keys:
                if m and m in e.aggregate and (t, m) not in cols:
                    cols.append((t, m))
    return cols


KIND_LABEL = {
    "original": "original",
    "quant_baseline": "quant ref",
    "compressed": "compressed",
    "materialized": "materialized",
}


def ranking_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """The summary table (header, rows) of arms ranked by KL to the original, lowest first: arm, kind, size,
    size vs the original, routed bits per weight (bpw), KL, perplexity, and each lm-eval task's primary metric. Printed by the CLI
    (`compare.ranking.ranking_table`) and written as ranking.md, from the same rows."""
    arms = results["arms"]
    tasks: list[tuple[str, str]] = []
    for a in arms:
        for t, e in a["metrics"].items():
            if e.get("output_type") != "perplexity" and e.get("primary") and (t, e["primary"]) not in tasks:
                tasks.append((t, e["primary"]))
    base = next((a for a in arms if a.get("kind") == "original"), None)
    base_b = (base["bytes"].get("model") or base["bytes"].get("disk")) if base else None
    keyed = []
    for a in arms:
        agg = next((v.get("aggregate", {}) for k, v in a["metrics"].items() if k.startswith("ppl:")), {})
        b = a["bytes"].get("model") or a["bytes"].get("disk")
        kl, ppl = agg.get("kl"), agg.get("ppl")
        bpw = a.get("bits_per_weight")
        row = [
            a["name"],
            KIND_LABEL.get(a.get("kind"), a.get("kind") or "—"),
            human_bytes(b) if b else "—",
            f"{100 * b / base_b:.0f}%" if b and base_b else "—",
            f"{bpw:.2f}" if bpw is not None else "—",
            f"{kl:.4f}" if kl is not None else "—",
            f"{ppl:.2f}" if ppl is not None else "—",
        ]
        for t, m in tasks:
            v = a["metrics"].get(t, {}).get("aggregate", {}).get(m)
            row.append(f"{v:.3f}" if isinstance(v, (int, float)) else "—")
        keyed.append((kl if isinstance(kl, (int, float)) and kl == kl else math.inf, row))
    header = ["arm", "kind", "size", "vs orig", "bpw", "KL", "ppl"] + [t for t, _ in tasks]
    return header, [r for _, r in sorted(keyed, key=lambda x: x[0])]


def ranking_markdown(results: dict) -> str:
    """ranking.md: the ranking rows as a markdown table with a note on what KL and size mean."""
    header, rows = ranking_rows(results)
    tasks = header[6:]
    note = (
        "KL = mean KL(original ‖ arm) per token on the held-out windows; size = the plan's bytes (else bytes on "
        "disk)" + ("; task columns: each task's primary metric" if tasks else "") + "."
    )
    return "\n".join(["# Arms ranked by KL to the original", "", md_table(header, rows), "", note]) + "\n"
