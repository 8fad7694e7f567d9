"""Silence the libraries' own progress bars and chatter (transformers, lm-eval, datasets, huggingface_hub,
compressed-tensors' loguru) while a command shows one progress display of its own.

Each library's off switch is used where it has one; lm-eval draws plain `tqdm` bars with no switch that
`simple_evaluate` passes on, so inside the context every `tqdm` bar is created disabled. Everything is
restored on exit, so `--verbose` (no context) and library users see the libraries as they are.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

LOGGERS = (
    "transformers",
    "lm_eval",
    "lm-eval",
    "datasets",
    "huggingface_hub",
    "accelerate",
    "evaluate",
    "compressed_tensors",
    "llmcompressor",
    "torch.distributed",
)
LOGURU = ("compressed_tensors", "llmcompressor")


@contextlib.contextmanager
def quiet_libraries(enabled: bool = True) -> Iterator[None]:
    """Within the block no library progress bar is drawn and library logs below ERROR are dropped."""
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        _tqdm_disabled(stack)
        _transformers(stack)
        _datasets(stack)
        _hub(stack)
        for name in list(LOGGERS) + [
            n
            for n in logging.root.manager.loggerDict
            if n.split(".")[0] in {x.split(".")[0] for x in LOGGERS}
        ]:
            log = logging.getLogger(name)
            old = log.level
            log.setLevel(logging.ERROR)
            stack.callback(log.setLevel, old)
        _loguru(stack)
        _lm_eval_git(stack)
        yield


def _tqdm_disabled(stack: contextlib.ExitStack) -> None:
    try:
        from tqdm import std
    except ImportError:
        return
    original = std.tqdm.__init__

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    std.tqdm.__init__ = __init__
    stack.callback(setattr, std.tqdm, "__init__", original)


def _transformers(stack: contextlib.ExitStack) -> None:
    try:
        from transformers.utils import logging as tlog
    except ImportError:
        return
    was_enabled, level = tlog.is_progress_bar_enabled(), tlog.get_verbosity()
    tlog.disable_progress_bar()
    tlog.set_verbosity_error()
    stack.callback(tlog.set_verbosity, level)
    if was_enabled:
        stack.callback(tlog.enable_progress_bar)


def _datasets(stack: contextlib.ExitStack) -> None:
    try:
        import datasets
    except ImportError:
        return
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    if was_enabled:
        stack.callback(datasets.enable_progress_bars)


def _hub(stack: contextlib.ExitStack) -> None:
    try:
        from huggingface_hub.utils import (
            are_progress_bars_disabled,
            disable_progress_bars,
            enable_progress_bars,
        )
    except ImportError:
        return
    if not are_progress_bars_disabled():
        disable_progress_bars()
        stack.callback(enable_progress_bars)


def _loguru(stack: contextlib.ExitStack) -> None:
    try:
        from loguru import logger
    except ImportError:
        return
    for name in LOGURU:
        logger.disable(name)
        stack.callback(logger.enable, name)


def _lm_eval_git(stack: contextlib.ExitStack) -> None:
    """lm-eval records `git describe` of the working directory; outside a repository git's "fatal: not a git
    repository" goes straight to the terminal (fd 2), once per evaluation. Ask git quietly instead."""
    try:
        import lm_eval.evaluator as ev
    except ImportError:
        return
    import subprocess

    def git_hash():
        try:
            return (
                subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)
                .strip()
                .decode()
            )
        except (subprocess.CalledProcessError, FileNotFoundError):
            return None

    old = ev.get_git_commit_hash
    ev.get_git_commit_hash = git_hash
    stack.callback(setattr, ev, "get_git_commit_hash", old)
