"""The `moecompress` command line (Typer + rich): one module per verb, each a thin shell that parses its
options, calls a Python function (the public ones are in `moecompress.api`) and prints the result.

A new verb is `cli/<verb>.py` plus one line here.
"""

from __future__ import annotations

import typer

from . import analyze, calibrate, compare, compress, dense, distill, eval, grid, inspect
from .entry import run

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Compress trained Mixture-of-Experts language models after training.",
)

app.command("inspect")(inspect.inspect_command)
app.command("compress")(compress.compress_command)
app.command("compare")(compare.compare_command)
app.command("demo")(compare.demo_command)
app.command("grid")(grid.grid_command)
app.command("calibrate")(calibrate.calibrate_command)
app.command("eval")(eval.eval_command)
app.command("analyze")(analyze.analyze_command)
app.command("dense")(dense.dense_command)
app.command("dense-sweep")(dense.dense_sweep_command)
app.command("distill")(distill.distill_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point (`moecompress`, `python -m moecompress[.cli]`): exit 0 on success, 2 with one sentence on
    bad input, 130 on Ctrl-C, 143 on SIGTERM (after removing unfinished outputs), 1 with one traceback on a
    bug (`entry.run`)."""
    run(app, argv)
