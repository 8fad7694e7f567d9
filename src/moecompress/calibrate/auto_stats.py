r"""Gate²-weighted statistics for the budget-optimal ``auto`` method (docs/auto.md).

Notation as in collectors.py: N real tokens, T_e the tokens routed to expert e, g_e(t) the gate
weight applied to e's output (routed scaling included), y = f_e(h_t), a = a_e(h_t) the intermediate
activation, x = h_t the block input. Every statistic is a sum over tokens divided by N, so a
candidate's loss computed from them is "per calibration token of the layer" and losses of all
slots and layers add up on one scale.

auto_output (routing + outputs):
    auto_g2_e  = (1/N) Σ_{T_e} g²                        [E]
    auto_g2_y_e  = (1/N) Σ_{T_e} g² y                    [E, H]
    auto_g2_yy_e = (1/N) Σ_{T_e} g² ‖y‖²                 [E]
auto_affine (routing + outputs): sufficient statistics of a gate²-weighted affine fit y ≈ b + M x
    auto_g2_x_e  = (1/N) Σ_{T_e} g² x                    [E, H]
    auto_g2_xx_e = (1/N) Σ_{T_e} g² x xᵀ                 [E, H, H]
    auto_g2_xy_e = (1/N) Σ_{T_e} g² x yᵀ                 [E, H, H]  (rows: input dims)
auto_mid (routing + intermediate): the same for the down projection's input (partial copies)
    auto_g2_a_e  = (1/N) Σ_{T_e} g² a                    [E, I]
    auto_g2_aa_e = (1/N) Σ_{T_e} g² a aᵀ                 [E, I, I]
auto_substitute (all experts on every token):
    auto_remap_{e,p} = (1/N) Σ_{T_e} g_e² ‖f_e − f_p‖²   [E, E]   (slot e served by expert p)
auto_reroute (routing; each expert run only on the tokens a removal sends to it):
    auto_reroute_keep_e / auto_reroute_renorm_e = (1/N) Σ_{t: e∈K(t)} ‖ŷ_t − y_t‖²   [E]
        where y_t = Σ_{j∈K(t)} g_j(t) f_j(h_t) is the routed output and ŷ_t the routed output when
        only e is removed from the router (``allowed`` mask = keep gate, ``present`` = renorm): the
        exact error of the substituted experts' contribution for a single removal.
Every auto_output / auto_affine / auto_mid statistic X also comes as X_f1: the same sum over the
tokens of every second calibration batch (fold 1; fold 0 = X − X_f1), still divided by the total N,
so an operator fitted on one fold can be scored on the other (cross-fitted losses, docs/auto.md).
auto_sample (routing): a uniform sample of S block inputs (priority sampling with a seeded generator,
    deterministic for a given batch order), float32, rows ordered by their sampling key
    auto_sample [S, H]   (S = min(N, 512) by default; collector parameter ``auto_sample``)
In multi-process calibration the sample is rank 0's (samples are not summable); sums are exact.
"""

from __future__ import annotations

import torch

from .collectors import Collector
from .observe import Observation

SAMPLE_SIZE = 512


def _per_token(collector: Collector, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    n = collector.sums["tokens"].to(torch.float64).clamp(min=1)
    return {
        name: collector.sums[name].div_(n) for name in names
    }  # in place: a copy held the layer's sums twice


class _GateWeighted(Collector):
    """Shared bookkeeping: the token count N, each expert's routed tokens with g², and the fold-1 copies."""

    base: tuple[str, ...] = ()
    square_base: tuple[str, ...] = ()  # the [E, D, D] ones among `base`

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.base:
            cls.provides = cls.base + tuple(f"{n}_f1" for n in cls.base)
            cls.square = cls.square_base + tuple(f"{n}_f1" for n in cls.square_base)

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("tokens", 1, dtype=torch.int64)
        self.batches = 0
        self.rows = {e: k for k, e in enumerate(self.square_experts())}  # expert -> row of its square sums

    def zeros(self, name, *shape, dtype=torch.float64):
        if name in self.square_base:
            shape = (len(self.rows), *shape[1:])
        t = super().zeros(name, *shape, dtype=dtype)
        if name in self.base:
            super().zeros(f"{name}_f1", *shape, dtype=dtype)
        return t

    def update(self, obs: Observation) -> None:
        self.sums["tokens"] += obs.num_tokens
        fold = self.batches % 2
        self.batches += 1
        for e in range(self.E):
            tok, _ = obs.routed(e)
            if tok.numel():
                g2 = obs.gate(e).to(torch.float64).square()
                row = self.rows.get(e)
                for name, value in self.add(obs, e, tok, g2, square=row is not None).items():
                    k = row if name in self.square_base else e
                    self.sums[name][k] += value
                    if fold:
                        self.sums[f"{name}_f1"][k] += value

    def add(
        self, obs: Observation, e: int, tok: torch.Tensor, g2: torch.Tensor, square: bool
    ) -> dict:  # pragma: no cover
        """Expert e's terms of this batch; the square ones only when `square` (e's square sums are gathered)."""
        raise NotImplementedError

    def counts(self):
        return None


class AutoOutputCollector(_GateWeighted):
    name = "auto_output"
    base = ("auto_g2", "auto_g2_y", "auto_g2_yy")
    needs = frozenset({"routing", "outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("auto_g2", self.E)
        self.zeros("auto_g2_y", self.E, self.H)
        self.zeros("auto_g2_yy", self.E)

    def add(self, obs, e, tok, g2, square):
        y = obs.output(e).to(torch.float64)
        return {"auto_g2": g2.sum(), "auto_g2_y": g2 @ y, "auto_g2_yy": g2 @ y.square().sum(-1)}

    def finalize(self):
        return _per_token(self, self.provides)


class AutoAffineCollector(_GateWeighted):
    name = "auto_affine"
    base = ("auto_g2_x", "auto_g2_xx", "auto_g2_xy")
    square_base = ("auto_g2_xx", "auto_g2_xy")
    needs = frozenset({"routing", "outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("auto_g2_x", self.E, self.H)
        self.zeros("auto_g2_xx", self.E, self.H, self.H)
        self.zeros("auto_g2_xy", self.E, self.H, self.H)

    def add(self, obs, e, tok, g2, square):
        x = obs.x[tok].to(torch.float64)
        xw = x * g2[:, None]
        if not square:
            return {"auto_g2_x": xw.sum(0)}
        y = obs.output(e).to(torch.float64)
        return {"auto_g2_x": xw.sum(0), "auto_g2_xx": xw.T @ x, "auto_g2_xy": xw.T @ y}

    def finalize(self):
        return _per_token(self, self.provides)


class AutoMidCollector(_GateWeighted):
    name = "auto_mid"
    base = ("auto_g2_a", "auto_g2_aa")
    square_base = ("auto_g2_aa",)
    needs = frozenset({"routing", "intermediate"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        i = self.adapter.intermediate_size(self.layer)
        self.zeros("auto_g2_a", self.E, i)
        self.zeros("auto_g2_aa", self.E, i, i)

    def add(self, obs, e, tok, g2, square):
        a = obs.intermediate(e).to(torch.float64)
        aw = a * g2[:, None]
        return {"auto_g2_a": aw.sum(0), "auto_g2_aa": aw.T @ a} if square else {"auto_g2_a": aw.sum(0)}

    def finalize(self):
        return _per_token(self, self.provides)


_SUBSTITUTE_ROWS = 32  # tokens per block of the remap distances


class AutoSubstituteCollector(Collector):
    name = "auto_substitute"
    provides = ("auto_remap",)
    needs = frozenset({"routing", "all_outputs"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("tokens", 1, dtype=torch.int64)
        self.zeros("auto_remap", self.E, self.E)

    def update(self, obs: Observation) -> None:
        self.sums["tokens"] += obs.num_tokens

    def update_all(self, obs: Observation, rows: slice, outputs: torch.Tensor) -> None:
        idx, wt = obs.routing.index[rows], obs.routing.weight[rows].to(torch.float64)
        f = outputs.permute(1, 0, 2).to(torch.float64)  # [c, E, H]
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            g2 = wt[tok, slot].square()
            # [n, E] ‖f_p − f_e‖², a few tokens at a time: [n, E, H] float64 copies were most of the layer's peak
            d2 = torch.cat(
                [(f[t] - f[t, e][:, None, :]).square().sum(-1) for t in tok.split(_SUBSTITUTE_ROWS)]
            )
            self.sums["auto_remap"][e] += g2 @ d2

    def finalize(self):
        return _per_token(self, self.provides)

    def counts(self):
        return None


class AutoRerouteCollector(Collector):
    """auto_reroute_keep / auto_reroute_renorm (module doc). Removing e from a token's router brings in one
    substitute, so each expert runs on its routed tokens and on those a removal sends it, about k + 1 expert
    evaluations per token instead of every expert's (``all_outputs``: E on every token, most of an `auto` pass's
    time on the 64-expert wide model)."""

    name = "auto_reroute"
    provides = ("auto_reroute_keep", "auto_reroute_renorm")
    needs = frozenset({"routing"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.zeros("tokens", 1, dtype=torch.int64)
        for name in self.provides:
            self.zeros(name, self.E)

    def update(self, obs: Observation) -> None:
        self.sums["tokens"] += obs.num_tokens
        idx, x = obs.routing.index, obs.x
        if not obs.num_tokens:
            return
        routes = []  # (e, gate, tokens routed to e, their routing with e removed)
        for e in idx.unique().tolist():
            tok, _ = torch.where(idx == e)
            mask = torch.ones(self.E, dtype=torch.bool, device=idx.device)
            mask[e] = False
            for gate, kw in (("keep", "allowed"), ("renorm", "present")):
                routes.append((e, gate, tok, self.adapter.route(self.layer, x[tok], **{kw: mask})))
        need = torch.zeros(self.E, obs.num_tokens, dtype=torch.bool, device=idx.device)  # [E, N]
        need[idx, torch.arange(obs.num_tokens, device=idx.device)[:, None].expand_as(idx)] = True
        for _, _, tok, r in routes:
            need[r.index, tok[:, None].expand_as(r.index)] = True
        outputs = _Outputs(self.adapter, self.layer, x, need)
        y = outputs.mix(torch.arange(obs.num_tokens, device=idx.device), idx, obs.routing.weight)
        for e, gate, tok, r in routes:
            new = outputs.mix(tok, r.index, r.weight)
            self.sums[f"auto_reroute_{gate}"][e] += (new - y[tok]).square().sum()

    def finalize(self):
        return _per_token(self, self.provides)

    def counts(self):
        return None


class _Outputs:
    """f_p(h_t) in float64 for the (expert p, token t) pairs of `need` [E, N], each expert run once."""

    def __init__(self, adapter, layer: int, x: torch.Tensor, need: torch.Tensor):
        self.row = torch.full(need.shape, -1, dtype=torch.long, device=need.device)  # [E, N] -> row of f
        parts, start = [], 0
        for p in torch.where(need.any(1))[0].tolist():
            tok = torch.where(need[p])[0]
            parts.append(adapter.expert_forward(layer, p, x[tok]).to(torch.float64))
            self.row[p, tok] = torch.arange(start, start + len(tok), device=need.device)
            start += len(tok)
        self.f = torch.cat(parts)  # [rows, H]

    def mix(self, tok: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Σ_j weight[:, j] f_{index[:, j]}(h_tok) [n, H]: the block's routed output for that routing."""
        picked = self.f[self.row[index, tok[:, None].expand_as(index)]]  # [n, k, H]
        return (picked * weight.to(torch.float64)[..., None]).sum(1)


class AutoSampleCollector(Collector):
    name = "auto_sample"
    provides = ("auto_sample",)
    needs = frozenset({"routing"})

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.size = int(self.params.get("auto_sample", SAMPLE_SIZE))
        self.gen = torch.Generator().manual_seed(7919 + self.layer)
        self.keys = torch.empty(0, dtype=torch.float64)
        self.x = torch.empty(0, self.H, dtype=torch.float32)

    def update(self, obs: Observation) -> None:
        n = obs.num_tokens
        if not n:
            return
        keys = torch.cat([self.keys, torch.rand(n, generator=self.gen, dtype=torch.float64)])
        x = torch.cat([self.x, obs.x.detach().to("cpu", torch.float32)])
        order = torch.argsort(keys)[: self.size]
        self.keys, self.x = keys[order], x[order]

    def finalize(self):
        return {"auto_sample": self.x.clone()}

    def counts(self):
        return None
