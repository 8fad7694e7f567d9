"""A layer's problem and its frontier (docs/auto.md, "Layer modes"): the per-slot candidates of one MoE layer and
its byte rules (`LayerProblem`), the greedy walk from "keep everything" giving a frontier of layer states per
mode (`layer_frontier`), the Pareto front of a layer over its modes (`layer_front`) and the restricted problems
the sensitivity probes and uniform quantization use. Pure: (bytes, loss) of `Candidate`s, no model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .solver import Candidate, LayerPoint, pareto

if TYPE_CHECKING:
    import torch

    from .config import AutoConfig

REPLACE_KINDS = frozenset({"keep", "quant", "drop", "constant", "tilt", "partial", "remap", "pair"})
REROUTE_KINDS = frozenset({"keep", "quant", "reroute", "remap", "pair"})
STORED_KINDS = ("keep", "quant")  # a stored copy of the slot's own expert: at 16 bits, or quantized


@dataclass
class LayerProblem:
    """Everything the solver knows about one MoE layer: per-slot candidates and the byte rules."""

    layer: int
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    group_score: str
    expert_bytes: int  # bytes of one kept expert
    h: int
    el: int
    options: list[list[Candidate]]  # per slot, non-remap candidates (keep first)
    remap: torch.Tensor | None  # [E, E] remap losses (slot, prototype) or None
    stored: bool  # padded (compact) accounting
    pairs: list = field(default_factory=list)  # PuzzleMoE packed-pair candidates (pairs.PairRef)
    remap_scale: float | None = (
        None  # per-kind sensitivity applied to remap losses (raw errors stay in `remap`)
    )

    def routable_ok(self, routable: list[bool]) -> bool:
        """The plan's own routing check for keep/renorm layers (plan.checks.check_routing)."""
        if sum(routable) < self.top_k:
            return False
        if self.n_group > 1:
            size = self.num_experts // self.n_group
            counts = sorted(sum(routable[g * size : (g + 1) * size]) for g in range(self.n_group))
            live = [c for c in counts if c >= (2 if self.group_score == "top2_sum" else 1)]
            if sum(live[: self.topk_group]) < self.top_k:
                return False
            if self.group_score == "top2_sum" and 1 in counts:
                return False
        return True

    def slot_bytes(self, c: Candidate) -> int:
        """One slot's own bytes (a stored tilt or partial copy: 0, `bytes_of` pads them per layer); quantized keeps
        at their own width, unpadded (QuantizedStoredExperts)."""
        if c.kind == "keep":
            return self.expert_bytes
        return c.bytes if not self.stored or c.kind in ("constant", "pair", "quant") else 0

    def bytes_of(self, choice: list[Candidate]) -> int:
        """The layer's bytes in state `choice`: every slot's own (`slot_bytes`), plus the stored tilts and partial
        copies, padded to the layer's largest rank."""
        total = sum(self.slot_bytes(c) for c in choice)
        if not self.stored:
            return total
        tilts = [c.param for c in choice if c.kind == "tilt"]
        if tilts:
            total += len(tilts) * (2 * self.h * max(tilts) + self.h) * self.el
        parts = [c.param for c in choice if c.kind == "partial"]
        if parts:
            total += len(parts) * (3 * max(parts) * self.h + self.h) * self.el
        return total


def remap_to(prob: LayerProblem, e: int, kept: list[int], exclude: int = -1) -> Candidate | None:
    """Slot e's best remap among the kept experts (lower index on ties), or None."""
    if prob.remap is None:
        return None
    best = None
    scale = prob.remap_scale
    for p in kept:
        if p == e or p == exclude:
            continue
        err = float(prob.remap[e, p])
        loss = err if scale is None else err * scale
        if best is None or loss < best.loss:
            best = Candidate("remap", loss, p, raw=None if scale is None else err)
    return best


class _Walk:
    """The greedy walk of one layer in one mode (`layer_frontier`): its candidates, moves and feasibility."""

    def __init__(self, prob: LayerProblem, mode: str):
        self.prob, self.mode = prob, mode
        kinds = REROUTE_KINDS if mode.startswith("reroute") else REPLACE_KINDS
        self.kinds = kinds
        self.opts = [[c for c in slot if c.kind in kinds] for slot in prob.options]
        self.zero_kinds = [k for k in ("reroute", "drop") if k in kinds]
        self.reroute_mode = mode.startswith("reroute")
        kinds_here = {c.kind for slot in self.opts for c in slot}
        self.remaps = "remap" in kinds_here  # else no fallback to look for
        self.additive = not kinds_here & {"tilt", "partial"}  # every slot's bytes its own (`_bytes`)
        self.group = prob.num_experts // prob.n_group if prob.n_group > 1 else prob.num_experts
        self.pair_moves = self._pair_moves() if "pair" in kinds else []

    def fallback(self, s: int, kept: list[int]) -> Candidate | None:
        """Slot s's best zero-byte alternative once its remap prototype is gone: another kept prototype, drop or
        reroute."""
        opts = self.opts
        best = remap_to(self.prob, s, kept) if any(c.kind == "remap" for c in opts[s]) else None
        for c in opts[s]:
            if c.kind in self.zero_kinds and (best is None or c.loss < best.loss):
                best = c
        return best

    def change(self, state: list[Candidate], moves: dict[int, Candidate]) -> list[Candidate] | None:
        """`state` with `moves` applied; slots remapped to an expert no longer kept fall back; None if infeasible."""
        e_all = self.prob.num_experts
        new = list(state)
        for s, c in moves.items():
            new[s] = c
        if not any(c.kind in STORED_KINDS or c.kind == "pair" for c in new):
            return None  # the runtime needs one stored expert per layer
        kept = [i for i in range(e_all) if new[i].kind in STORED_KINDS] if self.remaps else []
        for s in range(e_all) if self.remaps else ():
            if new[s].kind == "remap" and new[s].param not in kept:
                fb = self.fallback(s, kept)
                if fb is None:
                    return None
                new[s] = fb
        if self.reroute_mode and not self.prob.routable_ok([c.kind != "reroute" for c in new]):
            return None
        return new

    def _pair_moves(self) -> list[tuple[int, int, Candidate, Candidate]]:
        """(i, j, Candidate for i, Candidate for j) per packed pair: both slots decided jointly."""
        out = []
        for ref in self.prob.pairs:
            i, j = ref.members
            sc = 1.0 if ref.scale is None else ref.scale
            raw = (None, None) if ref.scale is None else ref.losses
            half = ref.nbytes // 2
            out.append(
                (
                    i,
                    j,
                    Candidate("pair", ref.losses[0] * sc, j, half, op=ref, raw=raw[0]),
                    Candidate("pair", ref.losses[1] * sc, i, ref.nbytes - half, op=ref, raw=raw[1]),
                )
            )
        return out

    def moves(self, state: list[Candidate], pairs_first: bool) -> list[tuple[tuple, dict[int, Candidate]]]:
        """Every change of one slot (or one pair) from `state`, each with its tie-break key."""
        opts, e_all = self.opts, self.prob.num_experts
        kept = [i for i in range(e_all) if state[i].kind in STORED_KINDS]
        moves: list[tuple[tuple, dict[int, Candidate]]] = []
        for e in range(e_all):
            if state[e].kind == "pair":
                continue  # a packed pair is final for both of its slots
            alts = [
                c for c in opts[e] if c.kind not in ("keep", "remap", "pair")
            ]  # upgrades never save bytes
            if any(c.kind == "remap" for c in opts[e]):
                r = remap_to(self.prob, e, kept)
                if r is not None:
                    alts.append(r)
            for j, alt in enumerate(alts):
                if alt.kind == state[e].kind and alt.param == state[e].param:
                    continue
                moves.append(((e, j), {e: alt}))
        pm = [
            ((i, len(opts[i]) + k), {i: ci, j: cj})
            for k, (i, j, ci, cj) in enumerate(self.pair_moves)
            if state[i].kind in STORED_KINDS and state[j].kind in STORED_KINDS
        ]
        return pm if pairs_first and pm else moves + pm

    def apply(self, state: list[Candidate], move: dict[int, Candidate]) -> list[Candidate] | None:
        """`change`, and for group-limited routers a reroute that alone is infeasible applied to e's whole router
        group at once."""
        new = self.change(state, move)
        (e, alt) = next(iter(move.items()))
        if new is None and self.reroute_mode and alt.kind == "reroute" and self.prob.n_group > 1:
            g0 = (e // self.group) * self.group
            grp = {
                s: next(c for c in self.opts[s] if c.kind == "reroute")
                for s in range(g0, g0 + self.group)
                if state[s].kind not in ("reroute", "pair")
            }
            new = self.change(state, grp)
        return new

    def _bytes(self, state: list[Candidate], new: list[Candidate], cur_bytes: int) -> int:
        """`bytes_of(new)`: from the slots that changed where every slot's bytes are its own (no padded tilt or
        partial copy in the layer's options); integers, so the same number either way."""
        if not self.additive:
            return self.prob.bytes_of(new)
        own = self.prob.slot_bytes
        return cur_bytes + sum(own(b) - own(a) for a, b in zip(state, new) if a is not b)

    def step(self, state: list[Candidate], cur_bytes: int, cur_loss: float, pairs_first: bool):
        """(best loss-lowering change that saves nothing, best change by added loss per byte saved), each as
        (key, state, bytes, loss) or None."""
        best_improve, best_save = None, None
        for key_tail, move in self.moves(state, pairs_first):
            new = self.apply(state, move)
            if new is None:
                continue
            nb = self._bytes(state, new, cur_bytes)
            nl = sum(c.loss for c in new)
            db, dl = nb - cur_bytes, nl - cur_loss
            if db <= 0 and dl < -1e-15 * (1 + abs(cur_loss)):
                cand = ((dl, db) + key_tail, new, nb, nl)
                if best_improve is None or cand[0] < best_improve[0]:
                    best_improve = cand
            elif db < 0:
                cand = ((dl / -db, dl) + key_tail, new, nb, nl)
                if best_save is None or cand[0] < best_save[0]:
                    best_save = cand
        return best_improve, best_save


def layer_frontier(prob: LayerProblem, mode: str, pairs_first: bool = False) -> list[LayerPoint]:
    """Greedy walk from all-keep: each step applies the change with the least added loss per byte saved.

    A change of slot e to another candidate; if e stops being kept, the slots remapped to e move to
    their best zero-byte alternative (another kept prototype, drop or reroute) within the same change.
    Changes that save no bytes but lower the loss are applied first. Reroute-style layers keep the
    router able to fill its top-k (and its group-limited selection). With `pairs_first`, pair changes are
    taken before any other while one is possible (used with the pairs of a least-loss matching).
    """
    walk = _Walk(prob, mode)
    state = [slot[0] for slot in walk.opts]  # keep
    cur_bytes, cur_loss = prob.bytes_of(state), 0.0
    points = [LayerPoint(mode, list(state), cur_bytes, 0.0)]
    while True:
        best_improve, best_save = walk.step(state, cur_bytes, cur_loss, pairs_first)
        chosen = best_improve or best_save
        if chosen is None:
            break
        _, state, cur_bytes, cur_loss = chosen
        if best_improve is None or cur_bytes < points[-1].bytes:
            points.append(LayerPoint(mode, list(state), cur_bytes, cur_loss))
        else:
            points[-1] = LayerPoint(mode, list(state), cur_bytes, cur_loss)
    return points


def _mode_options(prob: LayerProblem, gate: str) -> LayerProblem:
    """The problem restricted to one reroute gate (reroute candidates of other gates removed)."""
    opts = [[c for c in slot if c.kind != "reroute" or c.gate == gate] for slot in prob.options]
    return LayerProblem(**{**prob.__dict__, "options": opts})


def layer_modes(config: AutoConfig, li) -> list[str]:
    modes = []
    if (
        set(config.candidates) & {"drop", "constant", "tilt", "partial", "pair"}
        or "reroute" not in config.candidates
    ):
        modes.append("replace")
    if "reroute" in config.candidates:
        gates = list(dict.fromkeys(config.gates))
        if li.keep_equals_renorm:
            gates = gates[:1]  # both gates compute the same on this router
        modes += [f"reroute:{g}" for g in gates]
    return modes


def keep_point_of(li) -> LayerPoint:
    """The untouched layer from its `ModelInfo` entry alone (no candidates needed)."""
    keep = Candidate("keep", 0.0, 0, li.bytes_per_expert)
    return LayerPoint("replace", [keep] * li.num_experts, li.bytes_per_expert * li.num_experts, 0.0)


def probe_point(front: list[LayerPoint], target_bytes: float) -> LayerPoint | None:
    """The frontier state used to probe a layer's sensitivity: the largest one within `target_bytes`
    that loses something (else the cheapest that does); None when no state loses anything."""
    lossy = [p for p in front if p.loss > 0]
    if not lossy:
        return None
    within = [p for p in lossy if p.bytes <= target_bytes]
    return within[-1] if within else lossy[0]


def min_loss_matching(pairs: list) -> list:
    """Disjoint pairs of maximum cardinality with the least total estimated loss (Edmonds' blossom algorithm,
    networkx). Pairing greedily by loss leaves the last experts with bad partners; a matching does not."""
    if not pairs:
        return []
    try:
        import networkx as nx
    except ImportError:  # pragma: no cover - networkx comes with torch
        return pairs
    g = nx.Graph()
    for ref in sorted(pairs, key=lambda r: r.members):
        g.add_edge(*ref.members, weight=-(ref.losses[0] + ref.losses[1]))
    chosen = {tuple(sorted(e)) for e in nx.max_weight_matching(g, maxcardinality=True)}
    return [r for r in pairs if r.members in chosen]


def layer_front(prob: LayerProblem, config: AutoConfig, li) -> list[LayerPoint]:
    """The Pareto front of a layer's states over every mode it may take. With pair candidates the greedy walk
    runs twice — over every candidate pair and over the pairs of a least-loss matching only — and the
    states of both walks compete on the front."""
    points = uniform_points(prob)
    matched = min_loss_matching(prob.pairs)
    for mode in layer_modes(config, li):
        p = _mode_options(prob, mode.split(":")[1]) if mode.startswith("reroute") else prob
        points += layer_frontier(p, mode)
        if matched:
            points += layer_frontier(LayerProblem(**{**p.__dict__, "pairs": matched}), mode, pairs_first=True)
    return pareto(points)


def uniform_state(prob: LayerProblem, bits: int) -> list[Candidate] | None:
    """Every expert of the layer kept at `bits` (pure quantization, no structural change), or None."""
    state = []
    for slot in prob.options:
        c = next((c for c in slot if c.kind == "quant" and c.param == bits), None)
        if c is None:
            return None
        state.append(c)
    return state


def uniform_points(prob: LayerProblem) -> list[LayerPoint]:
    """The pure-quantization states of a layer (one per bit width), put on its frontier explicitly so that
    uniform GPTQ is always a choice of the allocation, whatever path the greedy walks take."""
    out = []
    for b in sorted({c.param for slot in prob.options for c in slot if c.kind == "quant"}, reverse=True):
        state = uniform_state(prob, b)
        if state is not None:
            out.append(LayerPoint("replace", state, prob.bytes_of(state), sum(c.loss for c in state)))
    return out


def kinds_of(prob: LayerProblem) -> list[str]:
    keys = {c.kind_key for slot in prob.options for c in slot[1:]}
    keys |= {"remap"} if prob.remap is not None else set()
    keys |= {"pair"} if prob.pairs else set()
    return sorted(keys)


def restrict(prob: LayerProblem, kind: str) -> tuple[LayerProblem, str]:
    """The layer's problem with only `kind` besides keep, and the mode it runs in."""
    opts = [[slot[0]] + [c for c in slot[1:] if c.kind_key == kind] for slot in prob.options]
    sub = LayerProblem(
        **{
            **prob.__dict__,
            "options": opts,
            "remap": prob.remap if kind == "remap" else None,
            "pairs": min_loss_matching(prob.pairs) if kind == "pair" else [],
        }
    )
    return sub, (kind if kind.startswith("reroute") else "replace")
