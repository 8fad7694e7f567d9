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
    from .models.loading import resolve_fixture
    from .summary import inspect_model

    info = inspect_model(resolve_fixture(model), trust_remote_code)
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
from .calibrate_cli import calibrate_command; app.command("calibrate")(calibrate_command)  # noqa: E402,E702
from .eval.cli import eval_command; app.command("eval")(eval_command)  # noqa: E402,E702
from .analysis_cli import analyze_command; app.command("analyze")(analyze_command)  # noqa: E402,E702
from .distill.cli import dense_command; app.command("dense")(dense_command)  # noqa: E402,E702
from .distill.cli import dense_sweep_command; app.command("dense-sweep")(dense_sweep_command)  # noqa: E402,E702
from .distill.cli import distill_command; app.command("distill")(distill_command)  # noqa: E402,E702


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM arrived: unwinds like KeyboardInterrupt so every `atomic_dir` removes its temporary."""


_SIGNAL_NAMES = {2: "Ctrl-C (SIGINT)", 15: "SIGTERM"}


def _on_signal(signum, frame):
    if _received:  # a second signal while cleaning up: let the cleanup finish
        return
    _received.append(signum)
    raise Interrupted(signum)


_received: list[int] = []


def _interrupted() -> None:
    signum = _received[0] if _received else 2
    err_console.print(f"[bold red]interrupted:[/] {_SIGNAL_NAMES.get(signum, signum)}; unfinished outputs were "
                      "removed (an interrupted calibrate resumes with --resume).", highlight=False)
    sys.exit(128 + signum)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: exit 0 on success, 2 with one sentence on bad input, 130 on Ctrl-C, 143 on SIGTERM
    (after removing unfinished outputs), 1 with one traceback on a bug."""
    import signal

    from typer import _click as click  # typer >= 0.20 vendors click; pinned in constraints.txt

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _received.clear()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread (an in-process caller): keep the defaults
            pass
    try:
        rc = app(args=argv, standalone_mode=False)
    except MoECompressError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except click.exceptions.ClickException as exc:  # usage errors: bad option, missing argument, wrong type
        msg = exc.format_message().strip()
        if msg:  # NoArgsIsHelpError has no message: the help it printed says it all
            err_console.print(f"[bold red]error:[/] {msg}{'' if msg.endswith('.') else '.'}", highlight=False)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code or 0)
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
    except _SafetensorError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        err_console.print(f"[bold red]error:[/] A safetensors file is truncated or corrupt ({first}); re-download or "
                          "re-export the checkpoint.", highlight=False)
        sys.exit(2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # typer returns 130 for a KeyboardInterrupt it caught, and a command's typer.Exit code
    if _received or rc == 130:
        _interrupted()
    if isinstance(rc, int) and rc:
        sys.exit(rc)


try:
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # pragma: no cover - safetensors is a hard dependency
    class _SafetensorError(Exception):
        pass


if __name__ == "__main__":
    main()
