"""Round-to-nearest: every weight to its nearest grid point, group parameters from min/max (grid.py)."""

from __future__ import annotations

from torch import Tensor

from . import grid
from .spec import QuantSpec
from .tensor import QuantizedTensor


def rtn(w: Tensor, spec: QuantSpec) -> QuantizedTensor:
    """Q = clamp(round(W / scale + zero), qmin, qmax) with (scale, zero) = grid.qparams(W); W [..., out, in]."""
    scale, zero = grid.qparams(w, spec)
    return QuantizedTensor(codes=grid.quantize(w, scale, zero, spec), scale=scale, zero=zero, spec=spec)
