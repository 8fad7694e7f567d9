"""How a `moecompress` run ends: exit codes, one-sentence errors and signals, for every verb.

Exit 0 on success, 2 with one sentence on bad input (a `MoECompressError`, a usage error, a corrupt
safetensors file) and on a full disk, 130 on Ctrl-C and 143 on SIGTERM after every unfinished output was
removed, 1 with one traceback on a bug (docs/architecture.md, "Bad input").
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys

import typer
from rich.console import Console
from rich.text import Text
from typer import _click as click  # typer >= 0.20 vendors click; pinned in constraints.txt

from ..errors import MoECompressError
from ..memory import bound_kernel_caches

try:
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # pragma: no cover - safetensors is a hard dependency

    class _SafetensorError(Exception):
        pass


err_console = Console(stderr=True, soft_wrap=True)


# a message embeds user values (paths, option values, lines of a data file) verbatim: one run of more than
# _MAX_WORD characters without a space is shortened in the middle, and a whole message to _MAX_MESSAGE
_MAX_WORD, _MAX_MESSAGE = 200, 2000
_LONG_WORD = re.compile(rf"\S{{{_MAX_WORD + 1},}}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def capped(message: str) -> str:
    """`message` as one printable line of bounded length: control characters (a newline in a path) shown
    escaped, each run of more than `_MAX_WORD` non-space characters cut to its first 150 and last 40 around
    "…", and the whole cut in the middle past `_MAX_MESSAGE` (the start says what is wrong, the end what to do).
    A 300 KB value in an option was printed whole as the "one sentence"."""
    message = _CONTROL.sub(lambda m: repr(m.group(0))[1:-1], message)
    message = _LONG_WORD.sub(lambda m: m.group(0)[:150] + "…" + m.group(0)[-40:], message)
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 600] + " … " + message[-500:]
    return message


def _say(label: str, message: str) -> None:
    """Print `label` (bold red) and `message` on stderr. The message is plain text, never rich markup: it
    embeds user paths and values, where ``[/x]`` raised a MarkupError, ``[v2]`` vanished and ``[bold red]``
    was rendered."""
    err_console.print(Text.assemble((label, "bold red"), " ", capped(message)), highlight=False)


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
    _say("interrupted:", f"{_SIGNAL_NAMES.get(signum, signum)}; unfinished outputs were removed{hint}.")
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
        _say("error:", str(exc))
        sys.exit(exc.exit_code)
    except click.exceptions.ClickException as exc:  # usage errors: bad option, missing argument, wrong type
        msg = exc.format_message().strip()
        if msg:  # NoArgsIsHelpError has no message: the help it printed says it all
            _say("error:", f"{msg}{'' if msg.endswith('.') else '.'}")
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code or 0)
    except (typer.Abort, KeyboardInterrupt):
        _interrupted(verb)
    except _SafetensorError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        _say(
            "error:",
            f"A safetensors file is truncated or corrupt ({first}); re-download or re-export the checkpoint.",
        )
        sys.exit(2)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" while writing {exc.filename}" if exc.filename else ""
        _say(
            "error:",
            f"The disk is full{where}; free space there, or point --out (and TMPDIR, where plans keep "
            "their tensors until the export) at a larger disk, then run again (the unfinished output was "
            "removed).",
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
