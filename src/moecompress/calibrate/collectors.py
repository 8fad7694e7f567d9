r"""Per-expert statistics, accumulated in float64 over routed, unpadded calibration tokens.

Notation for one MoE layer: T the real calibration tokens (N = |T|), h_t the block input of token t,
p_e(t) the router probability of expert e (softmax, or sigmoid score, over all E experts), K(t) the
top-k selected experts, g_e(t) the gate weight applied to expert e's output, f_e(h) expert e's
output (no gate), a_e(h) its intermediate activation (the input of its down projection), and
T_e = {t : e in K(t)} the tokens routed to e.

A collector is a small class: it declares the statistics it ``provides`` and what it ``needs``
(``routing``, ``outputs`` of routed tokens, ``intermediate`` activations, or ``all_outputs`` — every
expert on every token), keeps float64 sums in ``self.sums`` (all-reduced across processes), and
turns them into statistics in ``finalize``. Experts no token reached get 0, never NaN. This module holds
the statistics several methods share; a statistic one method needs has a module of its own
(intermediate, remap, auto_stats, hessian). Every built-in collector is registered by name in one
explicit list, `calibrate.registry.BUILTIN_COLLECTORS`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import MoECompressError
from ..models import MoEAdapter
from ..scoring.criteria import safe_div
from .observe import Observation

NEEDS = ("routing", "outputs", "intermediate", "all_outputs")


class Collector:
    """Base class: float64 sums keyed by name, reduced across ranks, finalized into statistics."""

    name: ClassVar[str] = ""
    provides: ClassVar[tuple[str, ...]] = ()
    needs: ClassVar[frozenset[str]] = frozenset({"routing"})

    def __init__(self, adapter: MoEAdapter, layer: int, device: torch.device | str = "cpu", **params):
        self.adapter, self.layer, self.device = adapter, layer, torch.device(device)
        self.E = adapter.num_experts(layer)
        self.H = adapter.hidden_size
        self.params = params
        self.sums: dict[str, torch.Tensor] = {}

    def zeros(self, name: str, *shape: int, dtype=torch.float64) -> torch.Tensor:
        self.sums[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self.sums[name]

    def update(self, obs: Observation) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def update_all(self, obs: Observation, rows: slice, outputs: torch.Tensor) -> None:
        """All-experts mode: outputs [E, c, H] of every expert on the real tokens `rows` of the batch."""

    def finalize(self) -> dict[str, torch.Tensor]:  # pragma: no cover - interface
        """The layer's statistics from the (reduced) sums; called once, so it may divide the sums in place."""
        raise NotImplementedError

    def stat_bytes(self, packed: bool = True) -> int:
        """Bytes of this layer's finalized statistics in a store (default: the accumulators' shapes and dtypes).
        `packed`: the `symmetric` ones as the store keeps them (upper triangles); False: as full matrices (stats
        store format 1)."""
        return sum(t.numel() * t.element_size() for t in self.sums.values())

    def counts(self) -> torch.Tensor | None:
        """Tokens routed to each expert, when this collector tracks them (for the unreached-experts warning)."""
        return self.sums.get("count")

    # statistics of shape [E, D, D] (one D x D matrix per expert), which parameter ``square_experts`` restricts
    square: ClassVar[tuple[str, ...]] = ()
    # statistics of shape [..., D, D] that `finalize` leaves exactly symmetric: a store keeps their upper triangle
    # only (`calibrate.symmetric`, docs/calibration.md "Stats store")
    symmetric: ClassVar[tuple[str, ...]] = ()

    def square_experts(self) -> list[int]:
        """The experts whose [D, D] statistics this collector gathers, in row order: parameter
        ``square_experts`` (None: every expert). A layer's square statistics can then be gathered a few experts
        at a time (`calibrate.streamed`), the other statistics staying whole."""
        sel = self.params.get("square_experts")
        return list(range(self.E)) if sel is None else [int(e) for e in sel]


class RoutingCollector(Collector):
    r"""Routing only.

    counts_e = |T_e|;  tokens = N;  routing_mass_e = \sum_{t\in T_e} g_e(t);
    pp_e = (1/N) \sum_{t\in T} p_e(t);  cp_e = (1/|T_e|) \sum_{t\in T_e} p_e(t).
    """

    name = "routing"
    provides = ("counts", "tokens", "routing_mass", "pp", "cp")

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("count", self.E, dtype=torch.int64)
        self.zeros("tokens", 1, dtype=torch.int64)
        self.zeros("mass", self.E)
        self.zeros("prob", self.E)
        self.zeros("prob_sel", self.E)

    def update(self, obs: Observation) -> None:
        r = obs.routing
        idx = r.index.reshape(-1)
        s = self.sums
        s["count"] += torch.bincount(idx, minlength=self.E)
        s["tokens"] += obs.num_tokens
        s["mass"].index_add_(0, idx, r.weight.reshape(-1).to(torch.float64))
        probs = r.probs.to(torch.float64)
        s["prob"] += probs.sum(0)
        s["prob_sel"].index_add_(0, idx, probs.gather(1, r.index).reshape(-1))

    def finalize(self) -> dict[str, torch.Tensor]:
        s = self.sums
        n = s["tokens"].to(torch.float64)
        return {
            "counts": s["count"].clone(),
            "tokens": s["tokens"].reshape(()).clone(),
            "routing_mass": s["mass"].clone(),
            "pp": s["prob"] / n.clamp(min=1),
            "cp": safe_div(s["prob_sel"], s["count"]),
        }


class ReapCollector(Collector):
    r"""Gate-weighted and plain output norms on routed tokens.

    reap_e = (1/|T_e|) \sum_{t\in T_e} g_e(t) ||f_e(h_t)||_2    (REAP; ConMoE's a_e);
    ean_e = \sum_{t\in T_e} ||f_e(h_t)||_2                      (EAN);
    out_norm_mean_e = (1/|T_e|) \sum ||f_e(h_t)||_2;  out_norm_sq_mean_e = (1/|T_e|) \sum ||f_e(h_t)||_2^2.
    """

    name = "reap"
    provides = ("reap", "ean", "out_norm_mean", "out_norm_sq_mean")
    needs = frozenset({"routing", "outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("count", self.E, dtype=torch.int64)
        for n in ("gnorm", "norm", "sq"):
            self.zeros(n, self.E)

    def update(self, obs: Observation) -> None:
        s = self.sums
        for e in range(self.E):
            tok, _ = obs.routed(e)
            if tok.numel() == 0:
                continue
            norm = obs.output(e).to(torch.float64).norm(dim=-1)
            s["count"][e] += tok.numel()
            s["gnorm"][e] += (obs.gate(e).to(torch.float64) * norm).sum()
            s["norm"][e] += norm.sum()
            s["sq"][e] += (norm * norm).sum()

    def finalize(self) -> dict[str, torch.Tensor]:
        s = self.sums
        return {
            "reap": safe_div(s["gnorm"], s["count"]),
            "ean": s["norm"].clone(),
            "out_norm_mean": safe_div(s["norm"], s["count"]),
            "out_norm_sq_mean": safe_div(s["sq"], s["count"]),
        }


class OutputMomentsCollector(Collector):
    r"""Mean and per-dimension variance of each expert's output over its routed tokens.

    out_mean_e = (1/|T_e|) \sum_{t\in T_e} f_e(h_t)              [E, H]  (MoNE's constant replacement);
    out_var_e = (1/|T_e|) \sum_{t\in T_e} f_e(h_t)^2 - out_mean_e^2  [E, H]  (population variance; MoNE std = sqrt).
    """

    name = "output_moments"
    provides = ("out_mean", "out_var")
    needs = frozenset({"routing", "outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("count", self.E, dtype=torch.int64)
        self.zeros("sum", self.E, self.H)
        self.zeros("sumsq", self.E, self.H)

    def update(self, obs: Observation) -> None:
        s = self.sums
        for e in range(self.E):
            tok, _ = obs.routed(e)
            if tok.numel() == 0:
                continue
            y = obs.output(e).to(torch.float64)
            s["count"][e] += tok.numel()
            s["sum"][e] += y.sum(0)
            s["sumsq"][e] += (y * y).sum(0)

    def finalize(self) -> dict[str, torch.Tensor]:
        s = self.sums
        mean = safe_div(s["sum"], s["count"])
        var = (safe_div(s["sumsq"], s["count"]) - mean * mean).clamp(min=0)
        return {"out_mean": mean, "out_var": var}


class ChannelNormCollector(Collector):
    r"""Per-channel L2 norms of each expert's inputs over its routed tokens (Wanda/PuzzleMoE saliency).

    in_channel_norm_{e,j} = sqrt(\sum_{t\in T_e} h_{t,j}^2)       [E, H]  (input of gate/up projections);
    mid_channel_norm_{e,j} = sqrt(\sum_{t\in T_e} a_e(h_t)_j^2)   [E, I]  (input of the down projection).
    """

    name = "channel_norms"
    provides = ("in_channel_norm", "mid_channel_norm")
    needs = frozenset({"routing", "intermediate"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.I = self.adapter.intermediate_size(self.layer)
        self.zeros("count", self.E, dtype=torch.int64)
        self.zeros("in_sq", self.E, self.H)
        self.zeros("mid_sq", self.E, self.I)

    def update(self, obs: Observation) -> None:
        s = self.sums
        for e in range(self.E):
            tok, _ = obs.routed(e)
            if tok.numel() == 0:
                continue
            x = obs.x[tok].to(torch.float64)
            a = obs.intermediate(e).to(torch.float64)
            s["count"][e] += tok.numel()
            s["in_sq"][e] += (x * x).sum(0)
            s["mid_sq"][e] += (a * a).sum(0)

    def finalize(self) -> dict[str, torch.Tensor]:
        return {"in_channel_norm": self.sums["in_sq"].sqrt(), "mid_channel_norm": self.sums["mid_sq"].sqrt()}


class AllExpertsCollector(Collector):
    r"""Every expert run on every real token (explicit all-experts mode; E/k times the MoE compute).

    gram_{ab} = (1/N) \sum_{t\in T} <f_a(h_t), f_b(h_t)>   [E, E]  (output similarity; cos = G_ab/sqrt(G_aa G_bb));
    out_mean_all_e = (1/N) \sum_{t\in T} f_e(h_t)          [E, H]  (HC-SMoE's expert output features).
    """

    name = "all_experts"
    provides = ("gram", "out_mean_all")
    needs = frozenset({"all_outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("tokens", 1, dtype=torch.int64)
        self.zeros("gram", self.E, self.E)
        self.zeros("sum", self.E, self.H)

    def update(self, obs: Observation) -> None:
        self.sums["tokens"] += obs.num_tokens

    def update_all(self, obs: Observation, rows: slice, outputs: torch.Tensor) -> None:
        f = outputs.to(torch.float64)
        flat = f.reshape(self.E, -1)
        self.sums["gram"] += flat @ flat.T
        self.sums["sum"] += f.sum(1)

    def finalize(self) -> dict[str, torch.Tensor]:
        n = self.sums["tokens"].to(torch.float64).clamp(min=1)
        return {"gram": self.sums["gram"] / n, "out_mean_all": self.sums["sum"] / n}

    def counts(self):
        return None


class MomentCollector(Collector):
    r"""Input second moment and input/output cross moment of a subset S of experts, over routed tokens
    (the sufficient statistics of a least-squares fit f_e(h) ~ A h + b, e.g. the "tilted novice").

    moment_experts = S (int64 [S]);  moment_count_s = |T_s|;
    moment_in_mean_s = (1/|T_s|) \sum_{t\in T_s} h_t                    [S, H];
    moment_out_mean_s = (1/|T_s|) \sum_{t\in T_s} f_s(h_t)              [S, H];
    input_moment_s = (1/|T_s|) \sum_{t\in T_s} h_t h_t^T                [S, H, H] float32;
    cross_moment_s = (1/|T_s|) \sum_{t\in T_s} h_t f_s(h_t)^T           [S, H, H] float32 (rows: input dims).

    Parameter ``moment_experts``: None (all experts), a list of expert ids, or {layer: [ids]}.
    """

    name = "moments"
    provides = (
        "input_moment",
        "cross_moment",
        "moment_experts",
        "moment_count",
        "moment_in_mean",
        "moment_out_mean",
    )
    symmetric = ("input_moment",)
    needs = frozenset({"routing", "outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        sel = self.params.get("moment_experts")
        if isinstance(sel, dict):
            sel = sel.get(self.layer, sel.get(str(self.layer), []))
        experts = list(range(self.E)) if sel is None else sorted({int(e) for e in sel})
        bad = [e for e in experts if not 0 <= e < self.E]
        if bad:
            raise MoECompressError(
                f"moment_experts names expert {bad[0]} but layer {self.layer} has {self.E} "
                "experts; pass ids in [0, E)."
            )
        self.experts = experts
        S = len(experts)
        self.zeros("count", S, dtype=torch.int64)
        self.zeros("in_sum", S, self.H)
        self.zeros("out_sum", S, self.H)
        # the [S, H, H] sums are the largest statistics there are: each batch's products are formed in float64 and
        # added into float32 sums (as GPTQ keeps its Hessians), which halves them in memory and on disk
        self.zeros("xx", S, self.H, self.H, dtype=torch.float32)
        self.zeros("xy", S, self.H, self.H, dtype=torch.float32)

    def update(self, obs: Observation) -> None:
        s = self.sums
        for k, e in enumerate(self.experts):
            tok, _ = obs.routed(e)
            if tok.numel() == 0:
                continue
            x = obs.x[tok].to(torch.float64)
            y = obs.output(e).to(torch.float64)
            s["count"][k] += tok.numel()
            s["in_sum"][k] += x.sum(0)
            s["out_sum"][k] += y.sum(0)
            s["xx"][k] += x.T @ x
            s["xy"][k] += x.T @ y

    def finalize(self) -> dict[str, torch.Tensor]:
        from .symmetric import mirror_

        s, c = self.sums, self.sums["count"]
        return {
            "moment_experts": torch.tensor(self.experts, dtype=torch.int64),
            "moment_count": c.clone(),
            "moment_in_mean": safe_div(s["in_sum"], c),
            "moment_out_mean": safe_div(s["out_sum"], c),
            "input_moment": mirror_(safe_div(s["xx"], c, out=s["xx"])),
            "cross_moment": safe_div(s["xy"], c, out=s["xy"]),
        }

    def stat_bytes(self, packed: bool = True) -> int:
        from .symmetric import packed_size

        full = super().stat_bytes()
        xx = self.sums["xx"]
        return full - (xx.numel() - xx.shape[0] * packed_size(self.H)) * xx.element_size() if packed else full

    def counts(self):
        return None  # a subset only


class RouterCorrelationCollector(Collector):
    r"""Correlation of router logits across experts over all real tokens (M-SMoE's router similarity).

    With l_t the logit vector of token t: mu = (1/N) \sum_t l_t, C = (1/N) \sum_t l_t l_t^T - mu mu^T,
    router_logit_corr_{ab} = C_ab / sqrt(C_aa C_bb)  [E, E] (0 where a variance is 0, 1 on the diagonal);
    router_logit_mean = mu [E].
    """

    name = "router_corr"
    provides = ("router_logit_corr", "router_logit_mean")

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("tokens", 1, dtype=torch.int64)
        self.zeros("sum", self.E)
        self.zeros("outer", self.E, self.E)

    def update(self, obs: Observation) -> None:
        logit = obs.routing.logits.to(torch.float64)
        self.sums["tokens"] += obs.num_tokens
        self.sums["sum"] += logit.sum(0)
        self.sums["outer"] += logit.T @ logit

    def finalize(self) -> dict[str, torch.Tensor]:
        n = self.sums["tokens"].to(torch.float64).clamp(min=1)
        mu = self.sums["sum"] / n
        cov = self.sums["outer"] / n - torch.outer(mu, mu)
        sd = cov.diagonal().clamp(min=0).sqrt()
        den = torch.outer(sd, sd)
        corr = torch.where(den > 0, cov / den.clamp(min=1e-300), torch.zeros_like(cov))
        corr.fill_diagonal_(1.0)
        return {"router_logit_corr": corr.clamp(-1, 1), "router_logit_mean": mu}

    def counts(self):
        return None
