"""The progress display of a `compare` run: one bar across the arms with the current arm and stage, and one
line per finished arm."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

console = Console(stderr=True)


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
            self._progress.update(self._task, description=escape(f"{arm}: {what}"))  # arm names: the user's
        elif header is not None:
            console.print(header)

    def done(self, entry: dict[str, Any]) -> None:
        if self._progress is None:
            return
        from ..atomic import human_bytes

        agg = next(
            (v.get("aggregate", {}) for k, v in entry.get("metrics", {}).items() if k.startswith("ppl:")), {}
        )
        size = entry.get("bytes", {}).get("model")
        kl = agg.get("kl")
        self._progress.console.print(
            f"  [green]✓[/] {escape(format(entry['name'], '<24'))} {human_bytes(size) if size else '-':>10}"
            + (f"  KL {kl:.4f}" if kl is not None else "")
        )
        self._progress.advance(self._task)

    def calibrated(self, seconds: float) -> None:
        if self._progress is not None:
            self._progress.console.print(f"  [green]✓[/] calibration ({seconds:.0f} s)")
            self._progress.advance(self._task)
