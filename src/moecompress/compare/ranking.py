"""The summary table of a `compare` run printed on the terminal: arms ranked by KL to the original, the same
rows as ranking.md (`eval.report_tables.ranking_rows`), laid out for at most `TABLE_WIDTH` columns."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

TABLE_WIDTH = 100  # the ranking table is laid out for (at most) this many terminal columns


def ranking_table(results: dict[str, Any]) -> Table:
    """Arms ranked by KL to the original (lower is better), with bytes — the demo's summary. The same rows
    as `eval.report_tables.ranking_rows` (written as ranking.md); print it with `width=TABLE_WIDTH`: long arm
    names wrap inside their cell rather than being cut."""
    from rich import box

    from ..eval.report_tables import ranking_rows

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
        table.add_row(*(Text(str(cell)) for cell in row))  # arm names are the user's: never rich markup
    return table


def summary_console():
    """The console the ranking table is printed on: a file or pipe has no width of its own (rich would assume
    80 columns and squeeze the table), so it gets TABLE_WIDTH."""
    c = Console(markup=False)  # its lines embed paths: never rich markup
    return c if c.is_terminal else Console(width=TABLE_WIDTH, markup=False)


def table_width(console) -> int:
    """The ranking table's width: TABLE_WIDTH, or the terminal's when it is narrower (a file or pipe has no
    width of its own, so it gets TABLE_WIDTH rather than rich's 80-column default)."""
    return min(console.width, TABLE_WIDTH) if console.is_terminal else TABLE_WIDTH
