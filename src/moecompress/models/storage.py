"""Reading and writing routed experts whatever the storage, in one orientation.

Documented orientation (nn.Linear's out x in), for E experts, hidden H, expert width I:
    gate [E, I, H], up [E, I, H], down [E, H, I]; optional biases gate_bias/up_bias [E, I],
    down_bias [E, H].
An expert computes  down @ act(gate @ x + b_g) * (up @ x + b_u) + b_d  (the activation is
the family's; GPT-OSS uses its clamped SwiGLU, see `ExpertActivation`).

Storages handled:
* ``fused``: transformers v5 ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``;
* ``gpt_oss``: ``gate_up_proj [E, H, 2I]`` with gate/up interleaved on the last dim, biases,
  ``down_proj [E, I, H]``;
* ``modulelist``: an ``nn.ModuleList`` of per-expert MLPs with gate_proj/up_proj/down_proj
  (or Mixtral-v4 style w1/w3/w2) Linear layers (remote-code and older checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

Layout = Literal["fused", "gpt_oss", "modulelist"]
"""How an experts module stores its experts (module doc): a family fact (`FamilySpec.layout`) or, for
undeclared families, detected from the module's shapes."""
FusedLayout = Literal["fused", "gpt_oss"]
"""The fused layouts the runtime holds a scope's stored experts in (`runtime.experts.StoredExperts`): a
``fused`` or ``gpt_oss`` storage keeps its own, per-expert ``modulelist`` storage runs ``fused``. The
values are layout names (``gpt_oss``: transposed, gate/up interleaved, biased), recorded in export markers."""


@dataclass
class ExpertWeights:
    """Weights of one expert (tensors [I, H], [I, H], [H, I]) or a stack of them ([E, ...])."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def map(self, fn) -> ExpertWeights:
        """Apply fn to every tensor present (e.g. indexing, dtype casts)."""
        return ExpertWeights(
            **{
                f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                for f in fields(self)
            }
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def has_bias(self) -> bool:
        return self.gate_bias is not None

    @staticmethod
    def stack(experts: list[ExpertWeights]) -> ExpertWeights:
        names = experts[0].tensors().keys()
        return ExpertWeights(**{n: torch.stack([getattr(e, n) for e in experts]) for n in names})


@dataclass(frozen=True)
class ExpertActivation:
    """The gated activation of a family's expert: act(gate) * up, or GPT-OSS's clamped SwiGLU."""

    kind: Literal["glu", "gpt_oss"] = "glu"
    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "gpt_oss":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        from transformers.activations import ACT2FN

        return ACT2FN[self.act](gate) * up


def expert_intermediate(w: ExpertWeights, x: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """The expert's intermediate activation act(gate x) * (up x), [N, I] for one expert's weights."""
    g = F.linear(x, w.gate, w.gate_bias)
    u = F.linear(x, w.up, w.up_bias)
    return act(g, u)


def expert_apply(w: ExpertWeights, x: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """f_e(x) for one expert's weights, x [N, H] -> [N, H]."""
    return F.linear(expert_intermediate(w, x, act), w.down, w.down_bias)


@dataclass
class ExpertStorage:
    """Read/write access to the routed experts of one MoE block's ``experts`` module."""

    module: nn.Module
    layout: Layout
    names: dict[str, str] = field(default_factory=dict)  # modulelist: gate/up/down attribute names

    @staticmethod
    def detect(module: nn.Module, fused: FusedLayout | None = None) -> ExpertStorage | None:
        """The storage of `module`, or None if it holds no experts we can read. fused: the layout of 3-D
        ``gate_up_proj`` storage when the family declares it; otherwise a biased one is ``gpt_oss``."""
        gu = getattr(module, "gate_up_proj", None)
        if isinstance(gu, torch.Tensor) and gu.dim() == 3:
            if fused is None:
                fused = "gpt_oss" if getattr(module, "gate_up_proj_bias", None) is not None else "fused"
            return ExpertStorage(module, fused)
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            first = module[0]
            for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
                if all(isinstance(getattr(first, n, None), nn.Linear) for n in names):
                    return ExpertStorage(module, "modulelist", dict(zip(("gate", "up", "down"), names)))
        return None

    @property
    def fused_layout(self) -> FusedLayout:
        """The runtime layout of these experts: ``gpt_oss`` keeps its own, every other storage runs fused."""
        return "gpt_oss" if self.layout == "gpt_oss" else "fused"

    @property
    def num_experts(self) -> int:
        if self.layout == "modulelist":
            return len(self.module)
        return self.module.gate_up_proj.shape[0]

    @property
    def intermediate_size(self) -> int:
        if self.layout == "fused":
            return self.module.down_proj.shape[-1]
        if self.layout == "gpt_oss":
            return self.module.down_proj.shape[1]
        return getattr(self.module[0], self.names["down"]).in_features

    @property
    def has_bias(self) -> bool:
        """Do the experts carry biases? (From the structure alone: reads no weights.)"""
        if self.layout == "gpt_oss":
            return True
        if self.layout == "modulelist":
            return getattr(self.module[0], self.names["gate"]).bias is not None
        return False

    def read_all(self) -> ExpertWeights:
        """All experts stacked: gate/up [E, I, H], down [E, H, I] (+ biases)."""
        m = self.module
        if self.layout == "fused":
            i = m.down_proj.shape[-1]
            return ExpertWeights(m.gate_up_proj[:, :i], m.gate_up_proj[:, i:], m.down_proj)
        if self.layout == "gpt_oss":
            gu = m.gate_up_proj.transpose(1, 2)  # [E, 2I, H], interleaved rows
            b = m.gate_up_proj_bias
            return ExpertWeights(
                gu[:, 0::2],
                gu[:, 1::2],
                m.down_proj.transpose(1, 2),
                b[:, 0::2],
                b[:, 1::2],
                m.down_proj_bias,
            )
        return ExpertWeights.stack([self.read(e) for e in range(len(m))])

    def read(self, e: int) -> ExpertWeights:
        """Expert e's weights (views where the storage allows; clone before mutating)."""
        if self.layout == "modulelist":
            mlp = self.module[e]
            lin = {k: getattr(mlp, n) for k, n in self.names.items()}
            return ExpertWeights(
                lin["gate"].weight,
                lin["up"].weight,
                lin["down"].weight,
                lin["gate"].bias,
                lin["up"].bias,
                lin["down"].bias,
            )
        return self.read_all().map(lambda t: t[e])

    @torch.no_grad()
    def write(self, e: int, w: ExpertWeights) -> None:
        """Overwrite expert e in place with w (same shapes as `read`)."""
        m = self.module
        if self.layout == "fused":
            i = m.down_proj.shape[-1]
            m.gate_up_proj[e, :i].copy_(w.gate)
            m.gate_up_proj[e, i:].copy_(w.up)
            m.down_proj[e].copy_(w.down)
        elif self.layout == "gpt_oss":
            m.gate_up_proj[e, :, 0::2].copy_(w.gate.T)
            m.gate_up_proj[e, :, 1::2].copy_(w.up.T)
            m.down_proj[e].copy_(w.down.T)
            m.gate_up_proj_bias[e, 0::2].copy_(w.gate_bias)
            m.gate_up_proj_bias[e, 1::2].copy_(w.up_bias)
            m.down_proj_bias[e].copy_(w.down_bias)
        else:
            cur = self.read(e)
            for name, t in cur.tensors().items():
                new = getattr(w, name)
                if new is not None:
                    t.copy_(new)

    def activation(self, config) -> ExpertActivation:
        if self.layout == "gpt_oss":
            return ExpertActivation("gpt_oss", alpha=float(self.module.alpha), limit=float(self.module.limit))
        act = getattr(config, "hidden_act", "silu")
        return ExpertActivation("glu", act=act)
