"""How a `moecompress` run ends: exit codes, one-sentence errors and signals, for every verb.

Exit 0 on success, 2 with one sentence on bad input (a `MoECompressError`, a usage error, a corrupt
safetensors file) and on a full disk, 130 on Ctrl-C and 143 on SIGTERM after every unfinished output was
removed, 1 with one traceback on a bug (docs/architecture.md, "Bad input").
"""

from __future__ import annotations

import errno
import os
import signal
import sys

import typer
from rich.console import Console
from typer import _click as click  # typer >= 0.20 vendors click; pinned in constraints.txt

from ..errors import MoECompressError
from ..memory import bound_kernel_caches

try:
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # pragma: no cover - safetensors is a hard dependency

    class _SafetensorError(Exception):
        pass


err_console = Console(stderr=True, soft_wrap=True)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM arrived: unwinds like KeyboardInterrupt so every `atomic_dir` removes its temporary."""


_SIGNAL_NAMES = {2: "Ctrl-C (SIGINT)", 15: "SIGTERM"}


def _on_signal(signum, frame):
    if _received:  # a second signal while cleaning up: let the cleanup finish
        return
    _received.append(signum)
    raise Interrupted(signum)


_received: list[int] = []


def _interrupted(verb: str | None) -> None:
    signum = _received[0] if _received else 2
    # the verbs with --resume say how to continue (compare and demo keep their finished arms); others must not
    hint = {
        "calibrate": " (run the same calibrate with --resume to continue)",
        "compare": " (finished arms were kept: run the same compare with --resume to continue)",
        "demo": " (finished arms were kept: run demo with --resume to continue)",
    }.get(verb or "", "")
    err_console.print(
        f"[bold red]interrupted:[/] {_SIGNAL_NAMES.get(signum, signum)}; unfinished outputs were "
        f"removed{hint}.",
        highlight=False,
    )
    sys.exit(128 + signum)


def run(app: typer.Typer, argv: list[str] | None = None) -> None:
    """Run `app` on `argv` (default: the process's arguments) and exit with the code of the module docstring."""
    verb = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    bound_kernel_caches()
    _received.clear()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread (an in-process caller): keep the defaults
            pass
    try:
        try:
            rc = app(args=argv, standalone_mode=False)
        except Exception:
            if not _received:
                raise
            # the signal's exception was raised inside native code that turned it into another one (safetensors'
            # reader makes a ValueError of it); the unwinding has removed the unfinished outputs all the same
            rc = None
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
        _interrupted(verb)
    except _SafetensorError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        err_console.print(
            f"[bold red]error:[/] A safetensors file is truncated or corrupt ({first}); re-download or "
            "re-export the checkpoint.",
            highlight=False,
        )
        sys.exit(2)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" while writing {exc.filename}" if exc.filename else ""
        err_console.print(
            f"[bold red]error:[/] The disk is full{where}; free space there, or point --out (and "
            "TMPDIR, where plans keep their tensors until the export) at a larger disk, then run "
            "again (the unfinished output was removed).",
            highlight=False,
        )
        sys.exit(2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # typer returns 130 for a KeyboardInterrupt it caught, and a command's typer.Exit code
    if _received or rc == 130:
        _interrupted(verb)
    if isinstance(rc, int) and rc:
        sys.exit(rc)
