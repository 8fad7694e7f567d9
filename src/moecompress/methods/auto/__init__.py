"""`auto`: budget-optimal compression — per slot and per layer, the representation that loses least for
the bytes it saves (issue 9; docs/auto.md, whose "Code layout" lists the modules of this package).

1. **Candidates** per slot (candidates.py, estimate.py, pairs.py): keep (the expert's bytes), reroute (0 bytes;
   gate keep or renorm), drop (0), constant (H values), tilt of rank r (2Hr + H), partial copy at a rank-r tilt's
   parameter budget, remap to a kept prototype of the same layer (0 extra bytes), and PuzzleMoE packed
   pairs (both slots decided jointly); and the slot's own expert kept at 8, 4, 3 or 2 bits (``bits``;
   quant.py, issue 14). Each has an estimated loss L_e: closed forms from gate²-weighted moments, exact
   substitution errors, for pairs a token-sample estimate, for quantized keeps the GPTQ residual
   tr(ΔW_d H_mid_g2 ΔW_dᵀ)/N plus a token-sample estimate of the gate/up part.
2. **Layer modes** (frontier.py): a layer is either *reroute-style* (gate keep or renorm: removed slots are
   deleted from / masked in the router; slots may be kept or remapped) or *replace-style* (gate replace: the
   original top-k is unchanged and a removed slot computes its operator at its gate, or zero). Per
   layer and mode a greedy walk from "keep everything" applies, step by step, the single-slot change
   with the least added loss per byte saved (changes that save nothing but lower the loss first),
   giving a frontier of layer states (bytes, loss).
3. **Allocation** across layers (solver.py, a multiple-choice knapsack): layer losses are scaled by the layer's
   measured sensitivity s_l (sensitivity.py); a Lagrangian walk takes, over all layers, the frontier step with
   the least loss per byte saved until the routed bytes fit the budget, then single-layer and two-layer
   exchanges that lower the total loss within the budget are applied until none is left; uniform
   quantization of every layer at one width is always compared (``uniform_bits_check``). Ties break
   toward the lower layer / slot / candidate order, so the plan is deterministic.
4. **Output** (materialise.py, report.py): an ordinary CompressionPlan (mixed per-slot representations +
   tensors) whose ``params["auto"]`` holds the per-layer table: choices, bytes, estimated error and KL, the
   error measured on a token sample, and the measured KL.

Byte accounting and the budget: config.py; what the budget reserves for the weight files' headers, which it
bounds too (issue 48): reserve.py. The entry point, `build.build_auto`, is registered here.
"""

from ..quantize import HESSIAN_CHUNK
from ..registry import ViewUse, register_method
from .build import build_auto
from .config import AutoConfig, hessians_only, needs_stats

# streamed, square statistics come `HESSIAN_CHUNK` experts per extra pass of the layer when GPTQ's Hessians are
# the only ones (as quant's); the operators' [H, H] moments keep the default chunk (8 experts held 2.2 GB on the
# wide model). Each extra pass runs the whole decoder layer again, so fewer passes are fewer layer forwards.
# the view: a layer as stored and one float32 layer, the embeddings and head (sensitivity probes and measured KL
# are full-model forwards). The statistics passes lend their own layer, and the sampled layer errors now run in
# the restore pass on it; measured KL (measure=True) still reads each layer again after the plan. The stored
# layer was set against the run before that change (counting the lent layer as free came out just below its
# peak, BENCHMARKS.md "Streaming compress"), and stays until a run after it is compared.
register_method(
    "auto",
    AutoConfig,
    build_auto,
    needs_stats,
    family="auto",
    streamed_stats=True,
    view_use=lambda config: ViewUse(stored=1.0, compute=1.0, forwards=True),
    streamed_chunk=lambda config: HESSIAN_CHUNK if hessians_only(config) else None,
)


def _register_stats():
    from ..needs import register_method_stats

    # a store for either search: the full one needs every statistic the fast one does, and its operators' moments
    register_method_stats("auto", needs_stats(AutoConfig(search="full")))


_register_stats()
