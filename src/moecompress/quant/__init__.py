"""Weight quantization of stored experts: grid, round-to-nearest and GPTQ, compressed-tensors packing.

Pure tensor code (no model, plan or runtime imports). See docs/quantization.md.

- spec.py    QuantSpec ("w4g128"), exact stored bytes
- grid.py    the integer grid (equal to compressed-tensors / llm-compressor), qparams, quantize, dequantize
- tensor.py  QuantizedTensor: codes + scales, packed()/from_packed() in CT's pack-quantized layout
- rtn.py     round-to-nearest
- gptq.py    GPTQ (Frantar et al. 2023, Alg. 1) as llm-compressor runs it, and the GPTQ objective
"""

from .gptq import GPTQ_PRECISION, gptq, gptq_loss
from .grid import dequantize, qparams, quantize
from .rtn import rtn
from .spec import QuantSpec
from .tensor import QuantizedTensor


def quantize_weight(w, spec: QuantSpec, H=None) -> QuantizedTensor:
    """Dispatch on spec.algo: GPTQ needs the input Hessian H, RTN ignores it."""
    if spec.algo == "gptq":
        if H is None:
            from ..errors import MoECompressError

            raise MoECompressError(
                "GPTQ needs calibration Hessians and none were given: calibrate first or use --quant-algo rtn."
            )
        return gptq(w, H, spec)
    return rtn(w, spec)


__all__ = [
    "GPTQ_PRECISION",
    "QuantSpec",
    "QuantizedTensor",
    "dequantize",
    "gptq",
    "gptq_loss",
    "qparams",
    "quantize",
    "quantize_weight",
    "rtn",
]
