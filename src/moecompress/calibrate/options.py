"""How a calibration runs besides its model and data: `CalibrationOptions` (the keywords of `calibrate`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import MoECompressError

# transform(i, layer, adapter, stats_i) -> a module whose outputs feed layer i + 1, or None (see `calibrate`)
Transform = Callable[[int, nn.Module, object, dict | None], nn.Module | None]


class UnreachedExpertsWarning(UserWarning):
    """Some experts received no calibration token: their statistics are 0 (never NaN)."""


def layer_ids(spec) -> list[int]:
    """'0,1,2' or an iterable of ints -> sorted unique layer ids (one sentence for anything else)."""
    try:
        items = spec.split(",") if isinstance(spec, str) else list(spec)
        return sorted({int(i) for i in items if not isinstance(i, str) or i.strip()})
    except (TypeError, ValueError):
        raise MoECompressError(
            f"hessian_layers '{spec}' is not a list of layer ids such as '0,1,2'; fix it."
        ) from None


@dataclass(frozen=True)
class CalibrationOptions:
    """How a calibration runs, besides its model and data (the keywords of `calibrate`, documented there)."""

    seq_len: int = 2048
    out: str | Path | None = None
    stats: Sequence[str] | str | None = None
    offload_dir: str | Path | None = None
    resume: bool = False
    dry_run: bool = False
    batch_size: int = 8
    dtype: str | torch.dtype | None = "auto"
    seed: int = 0
    device: str | None = None
    padding: bool = False
    chat_template: bool = False
    tokenizer: str | None = None
    moment_experts: Any = None
    hessian_layers: Any = None
    transform: Transform | None = None
    on_layer_end: Callable[[int, dict | None], None] | None = None
    overwrite: bool = False
    progress: bool = True
    trust_remote_code: bool = False
    keep_partial: bool = True
