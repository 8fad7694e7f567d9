"""The Python API of plans: apply in memory, export to disk, load back.

    model = moecompress.apply_plan(model, plan, tensors)          # in place, returns the model
    moecompress.export(model_or_dir, plan, "out/", format="compact")
    model = moecompress.load("out/")
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .plan import CompressionPlan


def apply_plan(model, plan: CompressionPlan, tensors: Mapping[str, torch.Tensor] | None = None):
    """Install runtime blocks executing `plan` into `model` (in place); returns the model."""
    from .runtime import apply_plan as _apply

    return _apply(model, plan, tensors)


def export(model_or_path, plan: CompressionPlan, out: str | os.PathLike, format: str = "compact",
           tensors: Mapping[str, torch.Tensor] | None = None, recipe=None, overwrite: bool = False, **kwargs):
    """Write the compressed checkpoint (``compact`` | ``hf`` | ``materialized``); returns an `ExportResult`."""
    from .export import export as _export

    return _export(model_or_path, plan, out, format=format, tensors=tensors, recipe=recipe, overwrite=overwrite,
                   **kwargs)


def load(path: str | os.PathLike, device_map=None, dtype="auto", max_memory=None, offload_folder=None):
    """Load any export (compact into the runtime; hf / materialized with plain transformers).

    max_memory / offload_folder: with ``device_map="auto"``, what does not fit is offloaded (accelerate)."""
    from .export import load as _load

    return _load(path, device_map=device_map, dtype=dtype, max_memory=max_memory, offload_folder=offload_folder)
