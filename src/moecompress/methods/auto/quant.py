r"""Quantized keeps for ``auto`` (issue 14): every stored expert also comes at every bit width.

For slot e kept at b bits, Q = (Q_g, Q_u, Q_d) the GPTQ (or RTN) codes of its gate, up and down
projections, the loss is the same gate²-weighted output error per calibration token as every other
candidate (estimate.py):

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
as they are (``quantize_experts(..., done=...)``), so what is estimated is what is stored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ...models.storage import ExpertWeights, expert_intermediate
from ...quant import QuantizedTensor, gptq, rtn
from ...quant.gptq import diagonal_loss, factor
from ...quant.spec import QuantSpec
from .moments import LayerMoments
from .solver import Candidate

HESSIANS = {"uniform": ("hessian_in", "hessian_mid"), "gate2": ("hessian_in_g2", "hessian_mid_g2")}
MID_DIAG = "hessian_mid_g2_diag"  # diag(H_mid_g2) [E, I]


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
    if algo == "gptq":  # + the fast search's RTN pricing (`proxy_candidates`): one vector per expert
        names |= {*HESSIANS[weighting], MID_DIAG}
    return names


def _quantize(w: torch.Tensor, hf, spec: QuantSpec) -> QuantizedTensor:
    return gptq(w, None, spec, hf) if spec.algo == "gptq" else rtn(w, spec)


def quant_candidates(
    adapter,
    stats,
    m: LayerMoments,
    bits: list[int],
    group: int | None,
    algo: str,
    weighting: str,
    el: int,
    experts: list[int] | dict[int, int] | None = None,
    keep_codes: bool = True,
    chunk: int = 8,
) -> list[list[Candidate]]:
    """Per slot of layer m.layer, one ``Candidate("quant", loss, bits, bytes, op=QuantKeep)`` per bit width < 16
    (ordered by decreasing bits); `experts` and the others of their chunks only (None: every slot; the others get
    no candidates). `experts` as {expert: width}: each chunk only at the widths its asked experts have, its
    Hessians gathered and factorised once for all of them (`restore`: one pass per chunk, not one per width).

    The layer is quantized `chunk` experts at a time (GPTQ batched over a chunk equals per-matrix runs,
    tests/test_quant_core.py), each chunk's Hessians read row by row, so a layer of big experts never has
    every expert's float32 weights, codes and Hessians in memory at once. A chunk is always the same experts,
    whichever of them are asked for: batched products on several threads need not round alike for another
    batch, and `auto.materialise.restore` must get back the codes `auto.setup.prepare` estimated bit for bit.
    keep_codes=False leaves ``op`` None (the estimate only: `restore` computes the codes of the experts a plan
    keeps quantized)."""
    layer = m.layer
    widths = sorted({b for b in bits if b < 16}, reverse=True)
    e_all = adapter.num_experts(layer)
    out: list[list[Candidate]] = [[] for _ in range(e_all)]
    chunk = min(chunk, stats.chunk or chunk)  # streamed statistics gather that many experts at once
    chunks = None if experts is None else {e // chunk for e in experts}
    todo = [e for e in range(e_all) if chunks is None or e // chunk in chunks]
    if not widths or not todo:
        return out

    def chunk_widths(ids: list[int]) -> list[int]:
        if not isinstance(experts, dict):
            return widths
        return [b for b in widths if any(experts.get(e) == b for e in ids)]

    n_tok = float(stats.get(layer, "tokens").double().sum().clamp(min=1))
    with torch.no_grad():
        routed = _routed_sample(adapter, m, todo)
        w = adapter.experts_at_rest(layer)  # the stored precision; each chunk upcast on its own
        for lo in range(0, len(todo), chunk):
            ids = todo[lo : lo + chunk]
            job = _Chunk(adapter, stats, layer, w, ids, quant_spec(widths[0], group, algo), weighting)
            for b in chunk_widths(ids):
                for e, c in zip(ids, job.candidates(b, routed, n_tok, len(m.sample), el, keep_codes)):
                    out[e].append(c)
    return out


def _routed_sample(adapter, m: LayerMoments, todo: list[int]) -> dict[int, tuple]:
    """Per expert of `todo`: its routed tokens of the layer's token sample, their g² and original activations."""
    layer = m.layer
    act = adapter.layer(layer).act
    x = m.sample.to(torch.float32)
    r = adapter.route(layer, x.to(adapter.expert_dtype(layer)))
    routed = {}
    for e in todo:
        tok, slot = torch.where(r.index == e)
        xe = x[tok]
        a = (
            expert_intermediate(adapter.get_expert(layer, e).map(lambda t: t.float()), xe, act)
            if len(tok)
            else None
        )
        routed[e] = (xe, r.weight[tok, slot].double().square(), a)
    return routed


class _Chunk:
    """`chunk` experts of one layer in float32, their gate²-weighted mid Hessians and (GPTQ) the factorised
    Hessians, shared by every width."""

    def __init__(
        self,
        adapter,
        stats,
        layer: int,
        w,
        ids: list[int],
        first: QuantSpec,
        weighting: str,
        h_mid: bool = True,
        diag: bool = False,
    ):
        """h_mid: read the experts' [I, I] H_mid_g2 (the exact down part); diag: read diag(H_mid_g2) (its
        diagonal estimate, `candidates(diag=True)`)."""
        self.ids, self.act = ids, adapter.layer(layer).act
        self.i_dim, self.h = w.gate.shape[1:]
        self.has_bias = w.gate_bias is not None
        self.group, self.algo = first.group_size, first.algo
        self.gate, self.up, self.down = (getattr(w, n)[ids].float() for n in ("gate", "up", "down"))
        self.biases = [None if t is None else t[ids].float() for t in (w.gate_bias, w.up_bias, w.down_bias)]
        self.h_mid = stats.get_rows(layer, "hessian_mid_g2", ids).double() if h_mid else None  # [C, I, I]
        self.mid_diag = stats.get(layer, MID_DIAG)[ids].double() if diag else None  # [C, I] Σ g² a ⊙ a
        self.f_in = self.f_mid = None
        if (
            first.algo == "gptq"
        ):  # one factorisation per Hessian for gate, up and every width (damping is shared)
            hin_name, hmid_name = HESSIANS[weighting]
            self.f_in = factor(stats.get_rows(layer, hin_name, ids), first)
            self.f_mid = factor(stats.get_rows(layer, hmid_name, ids), first)

    def candidates(
        self,
        b: int,
        routed: dict,
        n_tok: float,
        s_n: int,
        el: int,
        keep_codes: bool,
        algo: str | None = None,
        diag: bool = False,
    ):
        """The chunk's experts' candidates at `b` bits, in the order of `ids` (`algo`: another than the chunk's;
        `diag`: the down part's diagonal estimate, `_down_part`)."""
        spec = quant_spec(b, self.group, algo or self.algo)
        q = {
            "gate": _quantize(self.gate, self.f_in, spec),
            "up": _quantize(self.up, self.f_in, spec),
            "down": _quantize(self.down, self.f_mid, spec),
        }
        deq = {k: v.dequantize(torch.float32) for k, v in q.items()}  # bf16 grid values, exact in float32
        down_part = self._down_part(deq["down"], diag) / n_tok
        nbytes = expert_quant_bytes(spec, self.i_dim, self.h, self.has_bias, el)
        out = []
        for k, e in enumerate(self.ids):
            loss = max(float(down_part[k]), 0.0) + self._gate_up_part(k, deq, routed[e], s_n)
            op = _codes_of(q, k, spec) if keep_codes else None
            out.append(Candidate("quant", loss, b, nbytes, op=op))
        return out

    def _down_part(self, deq_down: torch.Tensor, diag: bool) -> torch.Tensor:
        """tr(ΔW_d H_mid_g2 ΔW_dᵀ) per expert [C]; with `diag` its diagonal part Σ_j H_jj Σ_i ΔW_ij², which
        the cross terms of independent rounding errors leave unbiased (round-to-nearest codes only,
        `proxy_candidates`), from one vector per expert instead of its [I, I] Hessian."""
        if diag:
            return diagonal_loss(self.down, deq_down, self.mid_diag)
        d_down = self.down.double() - deq_down.double()  # [C, H, I]
        return ((d_down @ self.h_mid) * d_down).sum((-2, -1))

    def _gate_up_part(self, k: int, deq: dict, routed: tuple, s_n: int) -> float:
        """(1/S) Σ g² ‖Q_d (a − â)‖² of expert k of the chunk on its sampled tokens (0 when none reach it)."""
        xe, g2, a = routed
        if a is None:
            return 0.0
        we = ExpertWeights(
            deq["gate"][k], deq["up"][k], deq["down"][k], *(None if t is None else t[k] for t in self.biases)
        )
        diff = F.linear(a - expert_intermediate(we, xe, self.act), deq["down"][k]).double()
        return float(g2 @ diff.square().sum(-1)) / s_n


def _codes_of(q: dict[str, QuantizedTensor], k: int, spec: QuantSpec) -> QuantKeep:
    """Expert k's codes of the chunk's batched codes `q`."""
    return QuantKeep(
        spec,
        {
            n: QuantizedTensor(
                v.codes[k].clone(), v.scale[k].clone(), None if v.zero is None else v.zero[k].clone(), spec
            )
            for n, v in q.items()
        },
    )


RATIO_EXPERTS = 4  # experts per layer quantized both ways for r_{l,b} (`proxy_candidates`; docs/auto.md)


def proxy_candidates(
    adapter, stats, m: LayerMoments, bits: list[int], group: int | None, weighting: str, el: int, chunk: int
) -> list[list[Candidate]]:
    """``search: fast``: every slot's quantized keeps priced without GPTQ on every expert. The layer's first
    `RATIO_EXPERTS` experts are quantized both ways at each width b, giving r_{l,b} = Σ L_e(GPTQ) / Σ L_e(RTN) over
    them; they keep their GPTQ estimates, every other expert's is r_{l,b} · L_e(RTN). L_e(RTN) takes the down
    part's diagonal estimate (`_Chunk._down_part`) from diag(H_mid_g2), so only the ratio's experts read their
    [I, I] Hessians (on streamed statistics: two square-statistics passes of a layer, not one per chunk of every
    expert), and r_{l,b} also absorbs what the diagonal leaves out. A few experts' GPTQ per layer and width
    instead of every expert's; no codes are kept (`gptq_codes` computes the chosen widths'). The experts are read
    `chunk` at a time, and the result does not depend on `chunk` (a streamed store's or an in-memory one's)."""
    layer = m.layer
    widths = sorted({b for b in bits if b < 16}, reverse=True)
    e_all = adapter.num_experts(layer)
    out: list[list[Candidate]] = [[] for _ in range(e_all)]
    if not widths:
        return out
    chunk = min(chunk, stats.chunk or chunk)
    n_tok = float(stats.get(layer, "tokens").double().sum().clamp(min=1))
    n_ratio = min(RATIO_EXPERTS, e_all)
    groups = [list(range(lo, min(lo + chunk, n_ratio))) for lo in range(0, n_ratio, chunk)]
    groups += [list(range(lo, min(lo + chunk, e_all))) for lo in range(n_ratio, e_all, chunk)]
    losses: dict[str, dict[int, list[float]]] = {
        "rtn": {b: [] for b in widths},
        "gptq": {b: [] for b in widths},
    }
    with torch.no_grad():
        routed = _routed_sample(adapter, m, list(range(e_all)))
        w = adapter.experts_at_rest(layer)
        for ids in groups:
            sample = ids[0] < n_ratio  # the ratio's experts come first: r_{l,b} is known for the rest
            job = _Chunk(
                adapter,
                stats,
                layer,
                w,
                ids,
                quant_spec(widths[0], group, "gptq" if sample else "rtn"),
                weighting,
                h_mid=sample,
                diag=True,
            )
            for b in widths:
                got = job.candidates(b, routed, n_tok, len(m.sample), el, False, algo="rtn", diag=True)
                if sample:
                    losses["rtn"][b] += [c.loss for c in got]
                    got = job.candidates(b, routed, n_tok, len(m.sample), el, False)
                    losses["gptq"][b] += [c.loss for c in got]
                else:
                    rtn_sum = sum(losses["rtn"][b])  # in expert order, whatever the chunk
                    ratio = sum(losses["gptq"][b]) / rtn_sum if rtn_sum > 0 else 1.0
                    got = [replace(c, loss=c.loss * ratio) for c in got]
                for e, c in zip(ids, got):
                    out[e].append(c)
    return out


def gptq_codes(
    adapter, stats, layer: int, width: dict[int, int], group: int | None, weighting: str, chunk: int = 16
) -> dict[int, QuantKeep]:
    """GPTQ codes of the experts `width` asks for ({expert: bits}), each at its width: the experts of one width
    quantized `chunk` at a time (``search: fast``'s `restore`; no estimate is computed again)."""
    chunk = min(chunk, stats.chunk or chunk)
    hin_name, hmid_name = HESSIANS[weighting]
    w = adapter.experts_at_rest(layer)
    out: dict[int, QuantKeep] = {}
    with torch.no_grad():
        for b in sorted(set(width.values()), reverse=True):
            spec = quant_spec(b, group, "gptq")
            asked = sorted(e for e, eb in width.items() if eb == b)
            for lo in range(0, len(asked), chunk):
                ids = asked[lo : lo + chunk]
                f_in = factor(stats.get_rows(layer, hin_name, ids), spec)
                f_mid = factor(stats.get_rows(layer, hmid_name, ids), spec)
                q = {n: gptq(getattr(w, n)[ids].float(), None, spec, f_in) for n in ("gate", "up")}
                q["down"] = gptq(w.down[ids].float(), None, spec, f_mid)
                out.update({e: _codes_of(q, k, spec) for k, e in enumerate(ids)})
    return out
