r"""Quantized keeps for ``auto`` (issue 14): every stored expert also comes at every bit width.

For slot e kept at b bits, Q = (Q_g, Q_u, Q_d) the GPTQ (or RTN) codes of its gate, up and down
projections, the loss is the same gate²-weighted output error per calibration token as every other
candidate (auto_estimate.py):

    L_e(Q) = (1/N) Σ_{t ∈ T_e} g_e(t)² ‖f_e(h_t) − f_Q(h_t)‖².

With a = a_e(h) the expert's intermediate activation and â the one computed by the quantized gate/up,

    f_e − f_Q = W_d a − Q_d â = (W_d − Q_d) a + Q_d (a − â),

and the estimate is the sum of the two parts' energies (their cross term, of quantization errors that are
independent across the two projections' codes, is dropped):

* down part, exact from the calibration Hessian:   tr(ΔW_d H_mid_g2 ΔW_dᵀ) / N,  ΔW_d = W_d − Q_d,
  H_mid_g2 = Σ_{t∈T_e} g_e(t)² a aᵀ (``hessian_mid_g2``, the quantity GPTQ minimises with gate² weighting);
* gate/up part, a Monte-Carlo estimate on the layer's uniform token sample (``auto_sample``, S tokens;
  the same sample PuzzleMoE pairs are scored on): (1/S) Σ_{t ∈ sample, e ∈ K(t)} g_e(t)² ‖Q_d (a − â)‖².
  The nonlinearity between the gate/up codes and the output has no closed form from H_in alone.

No model forward per candidate: one batched GPTQ per layer, projection and bit width (all experts of a
layer in one column loop), then the two sums. The codes are kept on the candidate and written into the plan
as they are (``quantize_plan(..., done=...)``), so what is estimated is what is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.storage import ExpertWeights, expert_intermediate
from ..quant import QuantizedTensor, gptq, rtn
from ..quant.spec import QuantSpec
from .auto_estimate import Candidate, LayerMoments

HESSIANS = {"uniform": ("hessian_in", "hessian_mid"), "gate2": ("hessian_in_g2", "hessian_mid_g2")}


@dataclass
class QuantKeep:
    """The codes of one expert kept at a bit width: {"gate", "up", "down"} -> QuantizedTensor."""

    spec: QuantSpec
    parts: dict[str, QuantizedTensor]


def quant_spec(bits: int, group: int | None, algo: str) -> QuantSpec:
    return QuantSpec(bits=bits, group_size=group, algo=algo)


def expert_quant_bytes(spec: QuantSpec, i: int, h: int, bias: bool, el: int) -> int:
    """Stored bytes of one expert at `spec` (gate, up [I, H], down [H, I]; biases stay at `el` bytes), as
    ``CompressionPlan.logical_bytes`` counts a quantized stored expert."""
    return 2 * spec.tensor_bytes(i, h) + spec.tensor_bytes(h, i) + ((2 * i + h) * el if bias else 0)


def quant_stats(bits: list[int], algo: str, weighting: str) -> set[str]:
    """Statistics the quantized keeps need: the gate²-weighted mid Hessian for the loss (always), the GPTQ
    Hessians of `weighting`, and the token sample for the gate/up part."""
    if all(b == 16 for b in bits):
        return set()
    names = {"tokens", "counts", "auto_sample", "hessian_mid_g2"}
    if algo == "gptq":
        names |= set(HESSIANS[weighting])
    return names


def _quantize(w: torch.Tensor, h: torch.Tensor | None, spec: QuantSpec) -> QuantizedTensor:
    return gptq(w, h, spec) if spec.algo == "gptq" else rtn(w, spec)


def quant_candidates(adapter, stats, m: LayerMoments, bits: list[int], group: int | None, algo: str,
                     weighting: str, el: int) -> list[list[Candidate]]:
    """Per slot of layer m.layer, one ``Candidate("quant", loss, bits, bytes, op=QuantKeep)`` per bit width < 16
    (ordered by decreasing bits)."""
    layer = m.layer
    widths = sorted({b for b in bits if b < 16}, reverse=True)
    w = adapter.experts(layer)
    e_all, i_dim, h = w.gate.shape
    if not widths:
        return [[] for _ in range(e_all)]
    act = adapter.layer(layer).act
    n_tok = float(stats.get(layer, "tokens").double().sum().clamp(min=1))
    h_mid = stats.get(layer, "hessian_mid_g2").double()  # [E, I, I] Σ g² a aᵀ
    if algo == "gptq":
        hin_name, hmid_name = HESSIANS[weighting]
        g_in, g_mid = stats.get(layer, hin_name).float(), stats.get(layer, hmid_name).float()
    else:
        g_in = g_mid = None
    gate, up, down = w.gate.float(), w.up.float(), w.down.float()

    # the layer's token sample and, per expert, its routed tokens, their g² and original activations
    x = m.sample.to(w.gate.device, torch.float32)
    s_n = len(x)
    with torch.no_grad():
        r = adapter.route(layer, x.to(adapter.layer(layer).router.weight.dtype))
        routed = []
        for e in range(e_all):
            tok, slot = torch.where(r.index == e)
            xe = x[tok]
            a = expert_intermediate(w.map(lambda t, e=e: t[e].float()), xe, act) if len(tok) else None
            routed.append((xe, r.weight[tok, slot].double().square(), a))

        out: list[list[Candidate]] = [[] for _ in range(e_all)]
        for b in widths:
            spec = quant_spec(b, group, algo)
            q = {"gate": _quantize(gate, g_in, spec), "up": _quantize(up, g_in, spec),
                 "down": _quantize(down, g_mid, spec)}
            deq = {k: v.dequantize(torch.float32) for k, v in q.items()}  # bf16 grid values, exact in float32
            d_down = down.double() - deq["down"].double()  # [E, H, I]
            down_part = ((d_down @ h_mid) * d_down).sum((-2, -1)) / n_tok  # tr(ΔW H ΔWᵀ)/N per expert
            nbytes = expert_quant_bytes(spec, i_dim, h, w.gate_bias is not None, el)
            for e in range(e_all):
                xe, g2, a = routed[e]
                gu = 0.0
                if a is not None:
                    we = ExpertWeights(deq["gate"][e], deq["up"][e], deq["down"][e],
                                       *(None if t is None else t[e].float()
                                         for t in (w.gate_bias, w.up_bias, w.down_bias)))
                    diff = F.linear(a - expert_intermediate(we, xe, act), deq["down"][e]).double()
                    gu = float(g2 @ diff.square().sum(-1)) / s_n
                loss = max(float(down_part[e]), 0.0) + gu
                parts = {k: QuantizedTensor(v.codes[e], v.scale[e], None if v.zero is None else v.zero[e], spec)
                         for k, v in q.items()}
                out[e].append(Candidate("quant", loss, b, nbytes, op=QuantKeep(spec, parts)))
    return out
