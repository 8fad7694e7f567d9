"""`CompressionPlan`: the one interchange format between methods, the runtime and the exporters.

A plan separates the two decisions every MoE compression method makes:

1. **what is stored** — per *scope* (one MoE layer, or several neighbouring layers sharing a
   pool), a list of stored experts, each with its sources ``[(layer, expert), ...]`` and how it
   was built: ``copy`` (one source, verbatim), ``weighted_merge`` (parameter average
   ``theta = sum_i w_i theta_i``, or merged tensors the method supplies), ``elementwise_merge``
   (PuzzleMoE; tensors supplied by the method) or ``dense_group`` (the sources' neurons
   concatenated, ``f(x) = sum_i w_i f_i(x)``);
2. **what each original router slot computes** — per MoE layer, every slot maps to a stored
   expert id (an int), a replacement operator (``constant`` mean output ``c``; ``tilt``
   ``y = b + U (V^T x)`` of rank r; ``partial`` copy: a subset of an expert's neurons plus an
   output bias) or ``"drop"``; and at what gate scale (``gate``):

   * ``renorm``  — dropped slots are deleted from the router before any normalisation (what a
     physically pruned standard checkpoint computes);
   * ``keep``    — dropped slots stay in every normalisation but are never selected (trained scale);
   * ``aggregate`` — the original router selects among all slots; the weights of selected slots
     that map to the same stored expert are summed and the expert runs once (ConMoE);
   * ``replace`` — the original top-k is unchanged; a slot computes its target times its gate
     (``drop`` is the zero operator).

Weights that are not copies of original experts (merged experts, operator parameters) travel
beside the plan as ``PlanTensors = dict[str, Tensor]`` (``plan_tensors.safetensors``), keyed by
the names the plan references, so ``plan.json`` stays small and byte-deterministic.
Tensor keys under a reference ``p``: stored expert ``p.gate [I,H]``, ``p.up [I,H]``,
``p.down [H,I]`` (+ ``p.gate_bias``, ``p.up_bias``, ``p.down_bias`` for biased families);
constant ``p.value [H]``; tilt ``p.U [H,r]``, ``p.V [H,r]``, ``p.bias [H]``; partial
``p.gate [w,H]``, ``p.up [w,H]``, ``p.down [H,w]``, ``p.bias [H]`` (+ ``p.gate_bias``/``p.up_bias``).

Every stored expert also has a precision (``quant``): ``None`` keeps the model's 16-bit (or float32)
weights; a `QuantSpec` stores gate/up/down as integer codes on a group-wise grid, under
``p.{gate,up,down}.weight_packed`` (int32 words), ``.weight_scale``, ``.weight_shape`` (+
``.weight_zero_point`` when asymmetric) -- compressed-tensors' ``pack-quantized`` names -- with any
biases left in the model's dtype (``p.gate_bias`` ...). Structure and bits compose in one plan and
one byte count (docs/quantization.md).

The package: `schema` (the pydantic models a plan is made of, file names, schema version), `model_info`
(`ModelInfo`, the original model's sizes and bytes), `checks` (validation: `check`, `check_model`,
`check_tensors`), `accounting` (`logical_bytes`), `serialize` (plan.json + tensors on disk), `builders`
(`prune` / `remap`) and `core` (`CompressionPlan`, whose methods delegate to them). Import from
``moecompress.plan``; docs/plan.md describes the layout.
"""

from .core import CompressionPlan
from .model_info import ModelInfo
from .schema import (
    PLAN_FILE,
    QUANT_TENSOR_SUFFIXES,
    ConstantOp,
    LayerPlan,
    PartialOp,
    PlanTensors,
    Scope,
    StoredExpert,
    TensorQuant,
    TiltOp,
    quant_tensor_prefix,
)

__all__ = [
    "PLAN_FILE",
    "QUANT_TENSOR_SUFFIXES",
    "CompressionPlan",
    "ConstantOp",
    "LayerPlan",
    "ModelInfo",
    "PartialOp",
    "PlanTensors",
    "Scope",
    "StoredExpert",
    "TensorQuant",
    "TiltOp",
    "quant_tensor_prefix",
]
