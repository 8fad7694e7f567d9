"""Attaching collectors to one MoE layer, through the adapter only.

Routing-only collectors use a forward pre-hook on the MoE block: the HF block runs unchanged and
``adapter.route`` is evaluated on its input. Collectors that need expert outputs (or intermediate
activations) swap in `ObservedBlock` with ``adapter.set_block`` for the layer's pass: it computes
the block output from ``adapter.route`` / ``adapter.expert_forward`` / ``adapter.shared_forward``
(equal to the HF block, see tests/test_adapters.py) and hands the very same expert outputs to the
collectors, so no expert runs twice. Statistics only ever see real (unpadded) tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models import MoEAdapter, Routing, expert_intermediate
from .collectors import Collector
from .observe import Observation


def _restrict(r: Routing, rows: torch.Tensor) -> Routing:
    return Routing(r.logits[rows], r.probs[rows], r.index[rows], r.weight[rows])


class LayerObserver:
    """Feeds one MoE layer's collectors for every batch of a pass; call `attach` / `detach` around it."""

    def __init__(self, adapter: MoEAdapter, layer: int, collectors: list[Collector], mute: bool = False):
        self.adapter, self.layer = adapter, layer
        self.mute = mute  # same computation path (bit-identical outputs), no statistics: resume replays
        needs = set().union(*(c.needs for c in collectors)) if collectors else set()
        self.need_outputs = bool(needs & {"outputs", "intermediate"})
        self.need_mid = "intermediate" in needs
        self.use(collectors)
        self.valid: torch.Tensor | None = None
        self._handle = None
        self._original = None
        e, h = adapter.num_experts(layer), adapter.hidden_size
        self.chunk_tokens = max(16, (1 << 24) // max(1, e * h))  # E x c x H floats per all-experts chunk

    def use(self, collectors: list[Collector]) -> None:
        """Feed these collectors from the next batch on (same classes as at construction; `groups.py`)."""
        self.collectors = collectors
        self.all_collectors = [c for c in collectors if "all_outputs" in c.needs]

    def set_valid(self, mask: torch.Tensor) -> None:
        """Real-token mask [B, T] of the next batch (1 = real, 0 = padding)."""
        self.valid = mask.reshape(-1).to(torch.bool)

    def attach(self) -> None:
        block = self.adapter.layer(self.layer).block
        if self.need_outputs:
            self._original = block
            self.adapter.set_block(self.layer, ObservedBlock(self, block))
        else:
            self._handle = block.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._original is not None:
            self.adapter.set_block(self.layer, self._original)
            self._original = None

    def _pre_hook(self, module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        x = h.reshape(-1, h.shape[-1])
        rows = self._rows(x)
        xv = x[rows]
        self.observe(
            Observation(
                self.adapter,
                self.layer,
                xv,
                self.adapter.route(self.layer, xv),
                chunk_tokens=self.chunk_tokens,
            )
        )

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.valid is None or self.valid.numel() != x.shape[0]:
            return torch.arange(x.shape[0], device=x.device)
        return torch.nonzero(self.valid.to(x.device)).squeeze(-1)

    def observe(self, obs: Observation) -> None:
        if self.mute:
            return
        for c in self.collectors:
            c.update(obs)
        if self.all_collectors and obs.num_tokens:
            for rows, outputs in obs.all_output_chunks():
                for c in self.all_collectors:
                    c.update_all(obs, rows, outputs)


class ObservedBlock(nn.Module):
    """Stand-in for a MoE block during a calibration pass: same output, expert outputs shared with collectors."""

    def __init__(self, observer: LayerObserver, original: nn.Module):
        super().__init__()
        self.observer = observer
        object.__setattr__(self, "_original_block", original)  # not a submodule: no double registration

    def forward(self, hidden_states, *args, **kwargs):
        ob = self.observer
        adapter, i = ob.adapter, ob.layer
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        r = adapter.route(i, x)
        rows = ob._rows(x)
        valid = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        valid[rows] = True
        out = torch.zeros_like(x)
        weights = adapter.experts(i) if ob.need_mid else None
        act = adapter.layer(i).act
        outputs, mids = {}, {}
        for e in r.index.unique().tolist():
            tok, slot = torch.where(r.index == e)
            if weights is not None:
                w = weights.map(lambda t, e=e: t[e])
                a = expert_intermediate(w, x[tok], act)
                y = F.linear(a, w.down, w.down_bias)
            else:
                a, y = None, adapter.expert_forward(i, e, x[tok])
            out.index_add_(0, tok, (y * r.weight[tok, slot, None]).to(out.dtype))
            keep = valid[tok]
            outputs[e] = y[keep]
            if a is not None:
                mids[e] = a[keep]
        shared = adapter.shared_forward(i, x)
        if shared is not None:
            out = out + shared
        obs = Observation(
            adapter, i, x[rows], _restrict(r, rows), outputs=outputs, chunk_tokens=ob.chunk_tokens
        )
        obs._mid.update(mids)
        ob.observe(obs)
        out = out.reshape(shape)
        return (out, None) if adapter.returns_tuple else out
