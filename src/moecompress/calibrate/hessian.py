r"""Per-expert GPTQ input Hessians over routed tokens, and the Hessian of a merged expert.

GPTQ quantizes a projection W [out, in] to minimise Σ_t ||(W - Ŵ) x_t||², whose Hessian in Ŵ's rows is
2 Σ_t x_t x_tᵀ over the projection's inputs x_t. In expert e those inputs are (notation of
`collectors.py`):

    hessian_in_e     = Σ_{t∈T_e} h_t h_tᵀ                 [E, H, H]  (input of gate/up projections);
    hessian_mid_e    = Σ_{t∈T_e} a_e(h_t) a_e(h_t)ᵀ       [E, I, I]  (input of the down projection);
    hessian_in_g2_e  = Σ_{t∈T_e} g_e(t)² h_t h_tᵀ         [E, H, H]  (gate²-weighted: the error that reaches
    hessian_mid_g2_e = Σ_{t∈T_e} g_e(t)² a_e a_eᵀ         [E, I, I]   the block output is g_e(t)(W - Ŵ)x_t).

They are plain sums (not means), so Hessians of several experts add exactly and a store can be split
and summed across runs; GPTQ itself is invariant to the scale of H (its damping is relative to mean
diag H). The token count |T_e| is the routing collector's ``counts``. Sums are accumulated in float64
and stored in float32 (GPTQ works in float32; halving the store matters, see docs/calibration.md).
float16 storage is not offered: a sum of squares of block inputs overflows its 65504 range.

Parameter ``hessian_layers``: None (every MoE layer) or a list of MoE layer ids. Other layers hold no
accumulator and store empty [0, H, H] / [0, I, I] tensors, which bounds memory and store size on real
models (gather the Hessians a chunk of layers at a time).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import MoECompressError
from .collectors import Collector
from .observe import Observation


def _hessian_layers(collector: Collector) -> bool:
    """Whether this collector's layer is among ``hessian_layers`` (refusing ids that are no MoE layer)."""
    sel = collector.params.get("hessian_layers")
    if sel is None:
        return True
    try:
        sel = sorted({int(i) for i in sel})
    except (TypeError, ValueError):
        raise MoECompressError(
            f"hessian_layers must be a list of layer ids, not {sel!r}; pass e.g. [0, 1]."
        ) from None
    moe = list(collector.adapter.moe_layers)
    bad = [i for i in sel if i not in moe]
    if bad:
        raise MoECompressError(
            f"hessian_layers names layer {bad[0]}, which is not a MoE layer; pass ids among {moe}."
        )
    return collector.layer in sel


class _HessianBase(Collector):
    """Σ w_t x_t x_tᵀ per expert for x = block input (``part = "in"``) or the intermediate activation ("mid").

    One collector per statistic: a run that needs only the down projection's Hessian (auto with
    round-to-nearest) never accumulates the [E, H, H] input sums, the largest per-layer sums there are."""

    part: str = "in"
    weighted: bool = False  # weight each token by g_e(t)²
    stored_dtype = torch.float32

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.D = self.H if self.part == "in" else self.adapter.intermediate_size(self.layer)
        self.active = _hessian_layers(self)
        self.experts = self.square_experts()
        if self.active:  # an excluded layer holds no sums, so nothing is all-reduced for it
            self.zeros(self.part, len(self.experts), self.D, self.D)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.square = cls.symmetric = cls.provides

    def update(self, obs: Observation) -> None:
        if not self.active:
            return
        total = self.sums[self.part]
        for k, e in enumerate(self.experts):
            tok, _ = obs.routed(e)
            if tok.numel() == 0:
                continue
            # [n_e, H] block inputs or [n_e, I] intermediate activations
            x = (obs.x[tok] if self.part == "in" else obs.intermediate(e)).to(torch.float64)
            if self.weighted:  # Σ g² x xᵀ = (g x)ᵀ (g x)
                x = obs.gate(e).to(torch.float64)[:, None] * x
            total[k] += x.T @ x

    def finalize(self) -> dict[str, torch.Tensor]:
        from .symmetric import mirror_

        (name,) = self.provides
        if not self.active:
            return {name: torch.zeros(0, self.D, self.D, dtype=self.stored_dtype)}
        # exactly symmetric (a no-op where the float64 sums of x xᵀ already are), so a store keeps the upper
        # triangle alone and rebuilds these very matrices
        return {name: mirror_(self.sums[self.part].to(self.stored_dtype))}

    def stat_bytes(self, packed: bool = True) -> int:
        from .symmetric import packed_size

        size = torch.empty((), dtype=self.stored_dtype).element_size()
        if not self.active:
            return 0
        return len(self.experts) * (packed_size(self.D) if packed else self.D * self.D) * size

    def counts(self):
        return None


class HessianInCollector(_HessianBase):
    r"""hessian_in_e = Σ_{t∈T_e} h_t h_tᵀ [E, H, H]."""

    name, provides, part = "hessian_in", ("hessian_in",), "in"
    needs = frozenset({"routing"})


class HessianMidCollector(_HessianBase):
    r"""hessian_mid_e = Σ_{t∈T_e} a_e(h_t) a_e(h_t)ᵀ [E, I, I]."""

    name, provides, part = "hessian_mid", ("hessian_mid",), "mid"
    needs = frozenset({"routing", "intermediate"})


class GateSquaredHessianInCollector(_HessianBase):
    r"""hessian_in_g2_e = Σ_{t∈T_e} g_e(t)² h_t h_tᵀ [E, H, H]."""

    name, provides, part, weighted = "hessian_in_g2", ("hessian_in_g2",), "in", True
    needs = frozenset({"routing"})


class GateSquaredHessianMidCollector(_HessianBase):
    r"""hessian_mid_g2_e = Σ_{t∈T_e} g_e(t)² a_e a_eᵀ [E, I, I]."""

    name, provides, part, weighted = "hessian_mid_g2", ("hessian_mid_g2",), "mid", True
    needs = frozenset({"routing", "intermediate"})


class GateSquaredMidDiagCollector(Collector):
    r"""hessian_mid_g2_diag_e = diag(hessian_mid_g2_e) = Σ_{t∈T_e} g_e(t)² a_e ⊙ a_e [E, I]: one vector per
    expert, gathered in the layer's own pass (not a square statistic). `auto`'s fast search prices
    round-to-nearest codes from it without reading any expert's [I, I] Hessian (methods/auto/quant.py)."""

    name, provides = "hessian_mid_g2_diag", ("hessian_mid_g2_diag",)
    needs = frozenset({"routing", "intermediate"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("diag", self.E, self.adapter.intermediate_size(self.layer))

    def update(self, obs: Observation) -> None:
        for e in range(self.E):
            tok, _ = obs.routed(e)
            if tok.numel():
                ga = obs.gate(e).to(torch.float64)[:, None] * obs.intermediate(e).to(torch.float64)
                self.sums["diag"][e] += ga.square().sum(0)

    def finalize(self) -> dict[str, torch.Tensor]:
        return {"hessian_mid_g2_diag": self.sums["diag"].to(torch.float32)}

    def counts(self):
        return None


def _stat(stats, layer: int, name: str) -> torch.Tensor:
    if hasattr(stats, "get") and not isinstance(stats, dict):  # a StatsStore
        return stats.get(layer, name)
    try:
        return stats[layer][name]
    except KeyError:
        raise MoECompressError(
            f"The statistics lack '{name}' for layer {layer}; re-run calibration with --for-method quant."
        ) from None


def union_hessian(
    stats, layer: int, sources: Iterable, kind: str = "in", g2: bool = False
) -> tuple[torch.Tensor, int]:
    r"""Hessian (float64) and token count of a stored expert built from `sources`.

    H_S = Σ_{s∈S} hessian_{kind}_s = Σ_t m_t(S) x_t x_tᵀ,  n_S = Σ_{s∈S} counts_s,  m_t(S) = |K(t) ∩ S|.

    Args:
        stats: a `StatsStore` or ``{layer: {name: tensor}}``.
        layer: the layer of sources given as plain expert ids.
        sources: expert ids, or ``(layer, expert)`` pairs as in `StoredExpert.sources`.
        kind: "in" (gate/up input) or "mid" (down input).
        g2: use the gate²-weighted Hessians.

    What is exact: for ``kind="in"`` the sum is the exact Hessian of the merged expert's input over the
    union of its sources' tokens, counting a token once per source it selected (m_t(S) times). That is the
    merged expert's GPTQ objective summed over routing slots: a token that selected two sources of the
    same merged expert passes through it in both slots. Counting each token once (set union) would need
    pairwise co-routing sums the store does not hold; with top-k routing, m_t(S) ≤ min(k, |S|).
    With ``g2`` each slot keeps its own gate, Σ_s g_s², whereas the merged output's error carries
    (Σ_s g_s)²; the cross terms 2 g_a g_b of co-routed tokens are dropped (an approximation from below).

    What is an approximation: for ``kind="mid"`` the merged expert's intermediate activation a_m(h)
    differs from its sources' a_s(h), and the sum is Σ_s Σ_{t∈T_s} a_s a_sᵀ, the sources' own activations
    in their neuron order. It is the right shape when the merge keeps neuron j of every source in neuron j
    (weighted / elementwise merges) and a stand-in until a second pass over the merged model measures
    a_m. Sources of different widths (neuron concatenation) have no such sum and are refused.
    """
    if kind not in ("in", "mid"):
        raise MoECompressError(f"kind must be 'in' or 'mid', not '{kind}'.")
    name = f"hessian_{kind}" + ("_g2" if g2 else "")
    pairs = [
        (int(s[0]), int(s[1])) if isinstance(s, (tuple, list)) else (int(layer), int(s)) for s in sources
    ]
    if not pairs:
        raise MoECompressError("A merged expert needs at least one source; pass its (layer, expert) pairs.")
    total, count = None, 0
    for li, e in pairs:
        h = _stat(stats, li, name)
        if h.shape[0] == 0:
            raise MoECompressError(
                f"The statistics hold no '{name}' for layer {li} (gathered for other layers "
                "only, hessian_layers); re-run calibration including this layer."
            )
        if not 0 <= e < h.shape[0]:
            raise MoECompressError(f"Source expert {e} is out of range: layer {li} has {h.shape[0]} experts.")
        he = h[e].to(torch.float64)
        if total is not None and he.shape != total.shape:
            raise MoECompressError(
                f"Sources of widths {tuple(total.shape)} and {tuple(he.shape)} have no summed "
                f"'{name}'; merge sources of one width."
            )
        total = he if total is None else total + he
        count += int(_stat(stats, li, "counts")[e])
    return total, count
