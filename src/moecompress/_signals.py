"""Ctrl-C and SIGTERM while the `moecompress` command is still starting.

Importing torch, transformers and the verbs takes seconds, and `cli.entry.run` can install its handlers
only once that is done. A signal in that window used to end in a KeyboardInterrupt traceback (or a silent
SIGTERM death). `moecompress/__init__.py` imports this module before anything heavy, and importing it runs
`install_startup_handlers`: a signal then prints one `interrupted:` line and exits 130 / 143 at once, which
is safe because nothing has been written yet. `entry.run` replaces these handlers with its own.

Only the command's own process is touched (its console script, or `python -m moecompress[.cli]`): a
program that imports moecompress as a library keeps its handlers.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


def _exit_now(signum, frame):  # pragma: no cover - runs in a subprocess (tests/test_bad_input_r2.py)
    name = _NAMES.get(signum, str(signum))
    os.write(2, f"interrupted: {name} while moecompress was starting; nothing was written.\n".encode())
    os._exit(128 + signum)


def is_cli_process() -> bool:
    """Whether this interpreter runs the `moecompress` command (console script or ``-m moecompress[.cli]``)."""
    if os.path.basename(sys.argv[0] if sys.argv else "") == "moecompress":
        return True
    argv = list(getattr(sys, "orig_argv", None) or [])
    return any(
        a == "-m" and argv[k + 1 : k + 2] in (["moecompress"], ["moecompress.cli"])
        for k, a in enumerate(argv)
    )


def install_startup_handlers() -> None:
    """In the command's process only: exit at once, with one line, on SIGINT / SIGTERM until `entry.run` starts."""
    if not is_cli_process() or threading.current_thread() is not threading.main_thread():
        return
    for sig in _NAMES:
        signal.signal(sig, _exit_now)


install_startup_handlers()
