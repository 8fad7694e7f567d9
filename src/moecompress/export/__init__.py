"""Exporters: checkpoints that are really smaller (hf, compact) or evaluation-only full size (materialized)."""

import sys
import types

from . import auto_reserve  # noqa: F401 - registers auto's file reserve (methods/auto/files.py)
from .core import MARKER_FILE, ExportResult, export
from .load import load
from .writer import ShardWriter

__all__ = ["MARKER_FILE", "ExportResult", "ShardWriter", "export", "load"]


class _CallableModule(types.ModuleType):
    """`moecompress.export` is both this package and the `export` function of the public API.

    Importing the subpackage rebinds the attribute `moecompress.export` to the module, so the module
    itself forwards calls to `export`: `moecompress.export(model, plan, out)` works either way.
    """

    def __call__(self, *args, **kwargs):
        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
