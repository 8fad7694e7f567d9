"""What collectors see of one batch at one MoE layer, computed only through the adapter.

`Observation` holds the block input of the batch's real (unpadded) tokens, their routing from
``adapter.route`` and, lazily and cached, each expert's output ``adapter.expert_forward`` on the
tokens routed to it (or its intermediate activation, from which the output is then derived so the
expert is not run twice). When the observed block computes expert outputs anyway (the runner's
wrapper), it hands them in, so they are never computed twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models import MoEAdapter, Routing, expert_intermediate


class Observation:
    """One batch at one MoE layer: x [N, H] (real tokens only) and their routing."""

    def __init__(
        self,
        adapter: MoEAdapter,
        layer: int,
        x: torch.Tensor,
        routing: Routing,
        outputs: dict[int, torch.Tensor] | None = None,
        chunk_tokens: int = 1024,
    ):
        self.adapter, self.layer, self.x, self.routing = adapter, layer, x, routing
        self.num_experts = adapter.num_experts(layer)
        self._outputs: dict[int, torch.Tensor] = dict(outputs or {})
        self._mid: dict[int, torch.Tensor] = {}
        self._routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._weights = None
        self.chunk_tokens = chunk_tokens

    @property
    def num_tokens(self) -> int:
        return int(self.x.shape[0])

    def routed(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token rows, top-k slot) of the tokens that selected expert e."""
        if e not in self._routed:
            self._routed[e] = torch.where(self.routing.index == e)
        return self._routed[e]

    def gate(self, e: int) -> torch.Tensor:
        """Gate weight g_e(t) applied to expert e's output on its routed tokens [n_e]."""
        tok, slot = self.routed(e)
        return self.routing.weight[tok, slot]

    def _expert(self, e: int):
        if self._weights is None:
            self._weights = self.adapter.experts(self.layer)
        return self._weights.map(lambda t: t[e])

    def intermediate(self, e: int) -> torch.Tensor:
        """act(gate x) * (up x) of expert e on its routed tokens [n_e, I] (the input of its down projection)."""
        if e not in self._mid:
            tok, _ = self.routed(e)
            self._mid[e] = expert_intermediate(
                self._expert(e), self.x[tok], self.adapter.layer(self.layer).act
            )
        return self._mid[e]

    def output(self, e: int) -> torch.Tensor:
        """f_e(x_t) on expert e's routed tokens [n_e, H] (no gate weight)."""
        if e not in self._outputs:
            if e in self._mid:
                w = self._expert(e)
                self._outputs[e] = F.linear(self._mid[e], w.down, w.down_bias)
            else:
                tok, _ = self.routed(e)
                self._outputs[e] = self.adapter.expert_forward(self.layer, e, self.x[tok])
        return self._outputs[e]

    def all_output_chunks(self):
        """Yield (token slice, F [E, c, H]): every expert's output on every real token, in token chunks."""
        n = self.num_tokens
        for s in range(0, n, self.chunk_tokens):
            sl = slice(s, min(s + self.chunk_tokens, n))
            xs = self.x[sl]
            yield (
                sl,
                torch.stack(
                    [self.adapter.expert_forward(self.layer, e, xs) for e in range(self.num_experts)]
                ),
            )
