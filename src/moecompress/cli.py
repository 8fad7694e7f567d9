"""The `moecompress` command line (Typer + rich). Each verb is a thin shell over a Python function."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import MoECompressError
from .atomic import human_bytes as _human

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Compress trained Mixture-of-Experts language models after training.")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)



@app.command()
def inspect(
    model: str = typer.Argument(..., help="Local checkpoint directory or hub id."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modeling code."),
) -> None:
    """Family, layers, experts, top-k, router semantics and a byte breakdown."""
    from .summary import inspect_model

    info = inspect_model(model, trust_remote_code)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    head = Table(title=f"{info['architecture']} ({info['model_type']})", show_header=False)
    head.add_row("layers", f"{info['num_layers']} ({len(info['moe_layers'])} MoE, {len(info['dense_layers'])} dense)")
    head.add_row("routed experts / layer", ", ".join(map(str, info["experts_per_layer"])))
    head.add_row("top-k", str(info["top_k"]))
    head.add_row("router", info["router_convention"])
    head.add_row("dtype", info["dtype"])
    console.print(head)
    sizes = Table(title="bytes")
    for col in ("part", "parameters", "bytes", "share"):
        sizes.add_column(col, justify="right" if col != "part" else "left")
    total = info["bytes"]["total"]
    for part in ("routed_experts", "shared_experts", "router", "rest", "total"):
        b = info["bytes"][part]
        sizes.add_row(part.replace("_", " "), f"{info['parameters'][part]:,}", _human(b), f"{100 * b / total:.1f}%")
    if "bytes_on_disk" in info:
        sizes.add_row("on disk", "", _human(info["bytes_on_disk"]), "")
    console.print(sizes)


# -- verbs contributed by other modules register here, one line each ---------------------------
from .compress_cli import compress_command; app.command("compress")(compress_command)  # noqa: E402,E702
from .compare_cli import compare_command; app.command("compare")(compare_command)  # noqa: E402,E702
from .compare_cli import demo_command; app.command("demo")(demo_command)  # noqa: E402,E702
from .grid_cli import grid_command; app.command("grid")(grid_command)  # noqa: E402,E702
from .calibrate.cli import calibrate_command; app.command("calibrate")(calibrate_command)  # noqa: E402,E702
from .eval.cli import eval_command; app.command("eval")(eval_command)  # noqa: E402,E702
from .analysis_cli import analyze_command; app.command("analyze")(analyze_command)  # noqa: E402,E702
from .distill.cli import dense_command; app.command("dense")(dense_command)  # noqa: E402,E702
from .distill.cli import dense_sweep_command; app.command("dense-sweep")(dense_sweep_command)  # noqa: E402,E702
from .distill.cli import distill_command; app.command("distill")(distill_command)  # noqa: E402,E702


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: bad input prints one sentence and exits 2, never a traceback."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        app(args=argv, standalone_mode=False)
    except MoECompressError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except (typer.Exit, SystemExit) as exc:
        code = getattr(exc, "exit_code", getattr(exc, "code", 0))
        sys.exit(code or 0)
    except Exception as exc:  # usage errors (missing argument, bad option) arrive here in non-standalone mode
        for click in _click_modules():
            if isinstance(exc, click.ClickException):
                exc.show()
                sys.exit(2)
            if isinstance(exc, click.exceptions.Abort):
                sys.exit(130)
        raise


def _click_modules():
    """Typer >= 0.20 vendors its own click (`typer._click`); older ones use click itself."""
    mods = []
    for name in ("typer._click", "click"):
        try:
            mods.append(__import__(name, fromlist=["exceptions"]))
        except ImportError:
            pass
    return mods


if __name__ == "__main__":
    main()
