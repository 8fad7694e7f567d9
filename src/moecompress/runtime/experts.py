"""`StoredExperts`: the K stored experts of one scope in ONE fused tensor set.

The tensors use the family's own fused layout and names, so a copy of an original expert is
bit-identical to its slice of the HF parameter and the exporters can write them unchanged:

* ``fused``   — ``gate_up_proj [K, 2I, H]`` (gate rows first), ``down_proj [K, H, I]``;
* ``gpt_oss`` — ``gate_up_proj [K, H, 2I]`` (gate/up interleaved), ``gate_up_proj_bias [K, 2I]``,
  ``down_proj [K, I, H]``, ``down_proj_bias [K, H]``.

The layout (`models.storage.FusedLayout`) comes from the layer's storage (`ExpertStorage.fused_layout`),
never from the family's name.

The forward mirrors transformers' experts implementations (``eager`` per-expert loop, or the
``grouped_mm`` kernel that the HF default uses) so an identity plan reproduces the original
logits exactly; token/slot pairs whose index is the sentinel ``K`` (a slot that maps to an
operator or is dropped) are skipped, not computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models import ExpertActivation, ExpertWeights
from ..models.storage import FusedLayout

_ACT_FNS: dict = {}


def glu_activation(name: str):
    """transformers' activation module for `name`, built once (ACT2FN[...] instantiates on every lookup)."""
    fn = _ACT_FNS.get(name)
    if fn is None:
        from transformers.activations import ACT2FN

        fn = _ACT_FNS[name] = ACT2FN[name]
    return fn


def _pad_rows(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad `t` along `dim` to `width` neurons (padded neurons compute exactly zero)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def native_tensors(
    weights: list[ExpertWeights],
    layout: FusedLayout,
    width: int | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Stack experts (documented orientation) into the family's fused tensors, zero-padded to `width`."""
    width = width or max(w.gate.shape[0] for w in weights)
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    if layout == "fused":
        # filled in place: stacking per-expert concatenations would hold the scope's gate/up twice
        first = cast(weights[0].gate[:0])
        k, h = len(weights), weights[0].gate.shape[1]
        gate_up = first.new_zeros(k, 2 * width, h)
        down = first.new_zeros(k, weights[0].down.shape[0], width)
        for e, w in enumerate(weights):
            i = w.gate.shape[0]
            gate_up[e, :i], gate_up[e, width : width + i] = cast(w.gate), cast(w.up)
            down[e, :, :i] = cast(w.down)
        return {"gate_up_proj": gate_up, "down_proj": down}
    gus, gubs, downs, dbs = [], [], [], []
    for w in weights:
        g, u = _pad_rows(w.gate, width, 0), _pad_rows(w.up, width, 0)
        gu = torch.empty(2 * width, g.shape[1], dtype=g.dtype, device=g.device)
        gu[0::2], gu[1::2] = g, u
        gus.append(cast(gu.T))
        gb, ub = _pad_rows(w.gate_bias, width, 0), _pad_rows(w.up_bias, width, 0)
        gub = torch.empty(2 * width, dtype=gb.dtype, device=gb.device)
        gub[0::2], gub[1::2] = gb, ub
        gubs.append(cast(gub))
        downs.append(cast(_pad_rows(w.down, width, 1).T))
        dbs.append(cast(w.down_bias))
    return {
        "gate_up_proj": torch.stack(gus),
        "gate_up_proj_bias": torch.stack(gubs),
        "down_proj": torch.stack(downs),
        "down_proj_bias": torch.stack(dbs),
    }


def _grouped_linear_fallback(x, weight, offsets, bias=None, is_transposed=False):
    out = []
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            w = weight[e] if is_transposed else weight[e].T
            out.append(x[start:end] @ w)
        start = end
    y = torch.cat(out) if out else x.new_zeros(0, weight.shape[-1] if is_transposed else weight.shape[-2])
    return y if bias is None else y + bias


try:  # the very kernel transformers' default experts implementation uses, for bit-identical results
    from transformers.integrations.moe import _grouped_linear
except ImportError:  # pragma: no cover - older transformers
    _grouped_linear = _grouped_linear_fallback


class StoredExperts(nn.Module):
    """K experts in one fused tensor set; ``forward(x, index, weight)`` like an HF experts module.

    ``input_rounding`` (None: exact) is applied to the input of each of the two matmuls, the hidden state and the
    activated intermediate: what a runtime whose kernels convert activations first computes (llama.cpp's,
    `export.gguf_arith`)."""

    input_rounding = None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        width: int,
        layout: FusedLayout,
        act: ExpertActivation,
        dtype=torch.float32,
        device=None,
        config=None,
    ):
        super().__init__()
        self.num_experts, self.hidden_size, self.width, self.layout, self.act = (
            num_experts,
            hidden_size,
            width,
            layout,
            act,
        )
        self.is_transposed = self.has_bias = (
            layout == "gpt_oss"
        )  # transposed, interleaved and biased together
        self._config = config  # read at each call: set_experts_implementation keeps working
        kw = dict(dtype=dtype, device=device)
        k, h, i = num_experts, hidden_size, width
        if layout == "fused":
            self.gate_up_proj = nn.Parameter(torch.empty(k, 2 * i, h, **kw), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(k, h, i, **kw), requires_grad=False)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(k, h, 2 * i, **kw), requires_grad=False)
            self.gate_up_proj_bias = nn.Parameter(torch.empty(k, 2 * i, **kw), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(k, i, h, **kw), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(k, h, **kw), requires_grad=False)

    @classmethod
    def from_weights(
        cls,
        weights: list[ExpertWeights],
        layout: FusedLayout,
        act: ExpertActivation,
        width=None,
        dtype=None,
        config=None,
    ) -> StoredExperts:
        tensors = native_tensors(weights, layout, width, dtype)
        first = tensors["gate_up_proj"]
        w = width or max(x.gate.shape[0] for x in weights)
        mod = cls(
            len(weights),
            weights[0].gate.shape[1],
            w,
            layout,
            act,
            dtype=first.dtype,
            device="meta",
            config=config,
        )
        for name, t in tensors.items():
            setattr(mod, name, nn.Parameter(t, requires_grad=False))
        return mod

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, width={self.width}, layout={self.layout}"

    @property
    def implementation(self) -> str:
        return getattr(self._config, "_experts_implementation", None) or "grouped_mm"

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.is_transposed:  # gate/up interleaved on the last dim
            return self.act(gate_up[..., ::2], gate_up[..., 1::2])
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act.kind != "glu":
            return self.act(gate, up)
        return glu_activation(self.act.act)(gate) * up  # = ExpertActivation, without its per-call lookup

    def _round(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.input_rounding is None else self.input_rounding(h)

    def forward(
        self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, may_skip: bool = True
    ) -> torch.Tensor:
        """x [N, H]; index [N, k] stored ids (K = skip); weight [N, k] gate weights -> [N, H].

        may_skip=False promises that no index is the sentinel K (saves a host sync per call)."""
        x = self._round(x)
        if self.implementation == "eager":
            return self._eager(x, index, weight)
        return self._grouped(x, index, weight, may_skip)

    def fused(self) -> dict[str, torch.Tensor]:
        """The fused tensors a forward multiplies with (quantized scopes dequantize them here)."""
        return {name: t for name, t in self._parameters.items() if t is not None}

    def expert_ranges(self) -> list[tuple[int, int]]:
        """Stored ids [lo, hi) whose fused tensors a forward holds at once (all of them here)."""
        return [(0, self.num_experts)]

    def fused_range(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """The fused tensors of stored experts lo..hi-1 (one of `expert_ranges`)."""
        return self.fused()

    def _eager(self, x, index, weight):
        # mirrors transformers' eager experts loop (one matmul pair per stored expert hit)
        out = torch.zeros_like(x)
        k_total = self.num_experts
        with torch.no_grad():
            mask = F.one_hot(index, num_classes=k_total + 1).permute(2, 1, 0)
            hit = [int(s) for s in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0] if s < k_total]
        for lo, hi in self.expert_ranges():
            mine = [s for s in hit if lo <= s < hi]
            if not mine:
                continue
            w = self.fused_range(lo, hi)
            for s in mine:
                pos, tok = torch.where(mask[s])
                cur = x[tok]
                if self.is_transposed:
                    h = self._apply_gate(cur @ w["gate_up_proj"][s - lo] + w["gate_up_proj_bias"][s - lo])
                    y = self._round(h) @ w["down_proj"][s - lo] + w["down_proj_bias"][s - lo]
                else:
                    h = self._apply_gate(F.linear(cur, w["gate_up_proj"][s - lo]))
                    y = F.linear(self._round(h), w["down_proj"][s - lo])
                y = y * weight[tok, pos, None]
                out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _grouped(self, x, index, weight, may_skip=True):
        # mirrors transformers' grouped_mm_experts_forward, with sentinel pairs sorted to the tail and skipped;
        # each range of experts runs on its own slice of the sorted pairs (one range: exactly the HF kernel)
        n, k = index.shape
        k_total = self.num_experts
        flat_idx, flat_w = index.reshape(-1), weight.reshape(-1)
        ids, perm = torch.sort(flat_idx)
        n_valid = int((flat_idx < k_total).sum()) if may_skip else flat_idx.numel()
        if not n_valid:
            return torch.zeros_like(x)
        if may_skip:
            perm, ids = perm[:n_valid], ids[:n_valid]
        hist_in = ids.float() if x.device.type in ("cpu", "mps") else ids.int()
        counts = torch.histc(hist_in, bins=k_total, min=0, max=k_total - 1)
        ranges = self.expert_ranges()
        # where each range's pairs start in the sorted order (one host sync for every range together)
        starts = [0] + torch.cumsum(counts, dim=0)[[hi - 1 for _, hi in ranges]].long().tolist()
        out_pairs = None
        for (lo, hi), a, b in zip(ranges, starts, starts[1:]):
            if b == a:
                continue
            w = self.fused_range(lo, hi)
            p, i = perm[a:b], ids[a:b] - lo
            xs = x[p // k]
            offsets = torch.cumsum(counts[lo:hi], dim=0, dtype=torch.int32)
            bias1 = w["gate_up_proj_bias"][i] if self.has_bias else None
            proj = _grouped_linear(
                xs, w["gate_up_proj"], offsets, bias=bias1, is_transposed=self.is_transposed
            )
            proj = self._round(self._apply_gate(proj))
            bias2 = w["down_proj_bias"][i] if self.has_bias else None
            proj = _grouped_linear(
                proj, w["down_proj"], offsets, bias=bias2, is_transposed=self.is_transposed
            )
            weighted = proj * flat_w[p].unsqueeze(-1)
            if out_pairs is None:
                out_pairs = weighted.new_zeros(n * k, x.shape[-1])
            out_pairs[p] = weighted
            del w, xs, proj, weighted
        return out_pairs.view(n, k, -1).sum(dim=1).to(x.dtype)
