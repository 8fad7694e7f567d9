"""`auto`: budget-optimal compression — per slot and per layer, the representation that loses least for
the bytes it saves (issue 9; docs/auto.md).

1. **Candidates** per slot (auto_estimate.py): keep (the expert's bytes), reroute (0 bytes; gate keep or
   renorm), drop (0), constant (H values), tilt of rank r (2Hr + H), partial copy at a rank-r tilt's
   parameter budget, remap to a kept prototype of the same layer (0 extra bytes), and PuzzleMoE packed
   pairs (both slots decided jointly); and the slot's own expert kept at 8, 4, 3 or 2 bits (``bits``;
   auto_quant.py, issue 14). Each has an estimated loss L_e: closed forms from gate²-weighted moments, exact
   substitution errors, for pairs a token-sample estimate, for quantized keeps the GPTQ residual
   tr(ΔW_d H_mid_g2 ΔW_dᵀ)/N plus a token-sample estimate of the gate/up part.
2. **Layer modes**: a layer is either *reroute-style* (gate keep or renorm: removed slots are deleted
   from / masked in the router; slots may be kept or remapped) or *replace-style* (gate replace: the
   original top-k is unchanged and a removed slot computes its operator at its gate, or zero). Per
   layer and mode a greedy walk from "keep everything" applies, step by step, the single-slot change
   with the least added loss per byte saved (changes that save nothing but lower the loss first),
   giving a frontier of layer states (bytes, loss).
3. **Allocation** across layers (a multiple-choice knapsack): layer losses are scaled by the layer's
   measured sensitivity s_l; a Lagrangian walk takes, over all layers, the frontier step with the
   least loss per byte saved until the routed bytes fit the budget, then single-layer and two-layer
   exchanges that lower the total loss within the budget are applied until none is left; uniform
   quantization of every layer at one width is always compared (``uniform_bits_check``). Ties break
   toward the lower layer / slot / candidate order, so the plan is deterministic.
4. **Output**: an ordinary CompressionPlan (mixed per-slot representations + tensors) whose
   ``params["auto"]`` holds the per-layer table: choices, bytes, estimated error and KL, the error
   measured on a token sample, and the measured KL.

Byte accounting: every byte is counted at the checkpoint's on-disk dtype (``ModelInfo``), whatever
dtype the model is computed in, and the budget is a fraction of the original routed-expert bytes as
stored, or an absolute size of the routed experts (``budget: 4GB``; ``parse_budget``). ``accounting``:
``stored`` (default) counts what the compact checkpoint stores — the runtime pads a layer's tilts to
its largest rank and partial copies to their largest width — so the budget holds for the plan's
logical bytes and for the checkpoint's tensors; ``logical`` counts unpadded bytes. The plan's final
bytes come from ``CompressionPlan.logical_bytes`` (the one byte count) and must equal the solver's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..calibrate.streamed import each_layer
from ..errors import MoECompressError
from ..memory import large_blocks_mmapped
from ..plan import CompressionPlan, LayerPlan, ModelInfo, Scope, StoredExpert
from ..validate import parse_size
from . import auto_estimate as est
from . import auto_quant as aq
from .auto_estimate import Candidate, LayerMoments
from .auto_solver import LayerPoint, allocate, pareto
from .context import MethodContext
from .registry import ViewUse, register_method

CandidateName = Literal["reroute", "drop", "constant", "tilt", "partial", "remap", "pair"]
ALL_CANDIDATES = ("reroute", "drop", "constant", "tilt", "partial", "remap", "pair")
REPLACE_KINDS = frozenset({"keep", "quant", "drop", "constant", "tilt", "partial", "remap", "pair"})
REROUTE_KINDS = frozenset({"keep", "quant", "reroute", "remap", "pair"})
STORED_KINDS = ("keep", "quant")  # a stored copy of the slot's own expert: at 16 bits, or quantized
ALL_BITS = (16, 8, 4, 3, 2)


def parse_budget(value) -> tuple[float | None, int | None]:
    """A budget as (fraction, None) or (None, routed-expert bytes).

    A plain number in (0, 1] is a fraction of the original routed-expert bytes as stored on disk;
    ``"50%"`` is the same as 0.5; a size with a unit is the absolute routed-expert bytes: decimal
    ``B``, ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000) or binary ``KiB``, ``MiB``, ``GiB``, ``TiB``
    (powers of 1024), case-insensitive, e.g. ``"4GB"``, ``"500MB"``, ``"1.5GiB"``.
    """
    bad = (
        f"Budget '{value}' is not a fraction in (0, 1] or a size such as 4GB, 500MB or 1.5GiB; "
        "pass e.g. --budget 0.5 or --budget 500MB."
    )
    if isinstance(value, bool):
        raise MoECompressError(bad)
    if isinstance(value, (int, float)):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise MoECompressError(bad)
        return float(value), None
    text = str(value).strip()
    if text.endswith("%"):
        try:
            return parse_budget(float(text[:-1]) / 100)
        except ValueError:
            raise MoECompressError(bad) from None
    try:
        number = float(text)  # a bare number is a fraction here, not bytes
    except ValueError:
        number = None
    if number is not None:
        return parse_budget(number)
    try:
        nbytes = parse_size(text)
    except ValueError:
        raise MoECompressError(bad) from None
    if nbytes <= 0:
        raise MoECompressError(bad)
    return None, nbytes


class AutoConfig(BaseModel):
    """Budget-optimal mixed compression recipe."""

    model_config = ConfigDict(extra="forbid")

    budget: float | None = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="bytes kept, as a fraction of the original's "
        "as stored on disk (of the whole file's weights, or of the routed experts': "
        "budget_scope); a size string ('4GB', '500MiB') sets budget_bytes",
    )
    budget_bytes: int | None = Field(
        None,
        gt=0,
        description="absolute budget at the checkpoint's dtypes: the whole "
        "file's weights, or the routed experts' (stored experts + operators) with "
        "budget_scope routed; overrides budget",
    )
    budget_scope: Literal["whole", "routed"] = Field(
        "whole",
        description="whole: the budget counts every weight of the file, and auto also chooses a precision "
        "for the non-expert weights (tensor_classes); routed: it counts the routed experts only, every other "
        "tensor stays as it is",
    )
    target: Literal["moecompress", "llama.cpp", "vllm", "transformers"] = Field(
        "moecompress",
        description="the runtime the plan must run in: moecompress (everything); llama.cpp (one "
        "expert count in every layer, one Q8_0 / Q4_0 / 16-bit type per layer tensor: auto_target.py)",
    )
    tensor_classes: list[str] | None = Field(
        None,
        description="non-expert classes auto may quantize with budget_scope whole (attention, shared, "
        "dense_mlp, embeddings, lm_head; never the router); None: every one the model has, []: none",
    )
    candidates: list[CandidateName] = Field(
        default_factory=lambda: list(ALL_CANDIDATES),
        description="representations a removed slot may take (keep is implicit)",
    )
    ranks: list[int] = Field(
        default_factory=lambda: [8, 32], description="tilt ranks (and partial-copy budgets)"
    )
    gates: list[Literal["renorm", "keep"]] = Field(
        default_factory=lambda: ["renorm", "keep"], description="gate scales a reroute-style layer may use"
    )
    fit: Literal["weighted", "unweighted"] = Field(
        "weighted", description="gate²-weighted operator fits, or exactly the prune method's operators"
    )
    ridge: float = Field(1e-3, ge=0.0, description="scale-free ridge of the tilt fits")
    cross_fit: bool = Field(
        True,
        description="score fitted operators out of sample: fit on one half of the "
        "calibration batches, score on the other (weighted fits)",
    )
    accounting: Literal["stored", "logical"] = Field(
        "stored",
        description="bytes as the compact checkpoint "
        "stores them (padding included) or the plan's logical bytes",
    )
    sensitivity: Literal["kind", "probe", "noise", "uniform"] = Field(
        "kind",
        description="KL per unit of estimated error: kind = per layer and representation (probe of the "
        "layer compressed with that representation alone at the budget ratio); probe = per layer (the layer's own "
        "frontier state at the budget ratio); noise = per layer, Gaussian noise of known energy; uniform = 1",
    )
    sensitivity_sequences: int = Field(
        8, ge=1, description="calibration sequences for sensitivity/measurement"
    )
    sensitivity_seq_len: int = Field(128, ge=8)
    noise: float = Field(
        0.05, gt=0.0, description="sensitivity noise energy relative to the layer's output energy"
    )
    measure: bool = Field(True, description="measure each layer's KL and the whole plan's (a few forwards)")
    pair_partners: int | None = Field(
        None,
        ge=1,
        description="nearest experts tried as PuzzleMoE partners "
        "(None: every other expert up to 32 experts, else 8)",
    )
    bits: list[Literal[16, 8, 4, 3, 2]] = Field(
        default_factory=lambda: list(ALL_BITS),
        description="bit widths a kept expert may take (16 = unquantized, "
        "the checkpoint's dtype); [16] is structure only",
    )
    quant_group: Literal[32, 64, 128] | None = Field(
        128, description="quantization group along the input dimension (None: per output channel)"
    )
    quant_algo: Literal["gptq", "rtn"] = Field("gptq", description="how quantized keeps choose their codes")
    quant_weighting: Literal["gate2", "uniform"] = Field(
        "gate2",
        description="GPTQ Hessians: gate²-weighted "
        "(the objective the estimator scores) or every routed token",
    )
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _budget(cls, data):
        """``budget`` may be a size: it then becomes ``budget_bytes`` (one sentence if it is neither); a target
        fills in its search space (`auto_target.target_defaults`)."""
        from .auto_target import target_defaults

        data = target_defaults(data)
        if isinstance(data, dict) and data.get("budget") is not None:
            fraction, nbytes = parse_budget(data["budget"])
            if nbytes is not None:
                if data.get("budget_bytes") is not None:
                    raise MoECompressError(
                        "Give the auto budget once: a size in budget or budget_bytes, not both."
                    )
                data = {**data, "budget": None, "budget_bytes": nbytes}
            else:
                data = {**data, "budget": fraction}
        return data

    @model_validator(mode="after")
    def _check(self):
        if any(r < 1 for r in self.ranks):
            raise ValueError("ranks must be positive (the constant is candidate 'constant')")
        if "reroute" in self.candidates and not self.gates:
            raise ValueError("reroute needs at least one gate")
        if self.budget_scope == "routed" and self.tensor_classes:
            raise ValueError(
                "tensor_classes need budget_scope whole: a routed budget counts the routed experts only, "
                "so it has no bytes to give other tensors"
            )
        if 16 not in self.bits:
            raise ValueError(
                "bits must include 16 (every layer starts from its unquantized experts); "
                "e.g. bits: [16, 4, 2]"
            )
        return self

    @property
    def quant_bits(self) -> list[int]:
        """The bit widths below 16, decreasing."""
        return sorted({b for b in self.bits if b < 16}, reverse=True)


def needs_stats(config: AutoConfig) -> list[str]:
    c = set(config.candidates)
    names = {"counts", "tokens", "auto_g2", "auto_g2_y", "auto_g2_yy", "auto_sample"}
    if "tilt" in c:
        names |= {"auto_g2_x", "auto_g2_xx", "auto_g2_xy"}
        if config.fit == "unweighted":
            names |= {
                "moment_experts",
                "moment_count",
                "moment_in_mean",
                "moment_out_mean",
                "input_moment",
                "cross_moment",
            }
    if "constant" in c and config.fit == "unweighted":
        names.add("out_mean")
    if "partial" in c:
        names |= {"auto_g2_a", "auto_g2_aa"}
        if config.fit == "unweighted":
            names |= {"mid_channel_norm", "mid_mean"}
    if c & {"remap", "reroute"}:
        names |= {"auto_remap", "auto_reroute_keep", "auto_reroute_renorm"}
    if "pair" in c:
        names |= {"in_channel_norm", "mid_channel_norm"}  # PuzzleMoE saliency
    if config.cross_fit and config.fit == "weighted" and c & {"constant", "tilt", "partial"}:
        names |= {f"{n}_f1" for n in names if n.startswith("auto_g2")}
    names |= aq.quant_stats(config.bits, config.quant_algo, config.quant_weighting)
    return sorted(names)


# ----------------------------------------------------------------------------- layer problem
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
    pairs: list = field(default_factory=list)  # PuzzleMoE packed-pair candidates (auto_estimate.PairRef)
    remap_scale: float | None = (
        None  # per-kind sensitivity applied to remap losses (raw errors stay in `remap`)
    )

    def routable_ok(self, routable: list[bool]) -> bool:
        """The plan's own routing check for keep/renorm layers (plan._check_routing)."""
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

    def bytes_of(self, choice: list[Candidate]) -> int:
        keep = sum(1 for c in choice if c.kind == "keep")
        if not self.stored:
            return keep * self.expert_bytes + sum(c.bytes for c in choice if c.kind != "keep")
        # quantized keeps are stored at their own width, unpadded (QuantizedStoredExperts)
        total = keep * self.expert_bytes + sum(
            c.bytes for c in choice if c.kind in ("constant", "pair", "quant")
        )
        tilts = [c.param for c in choice if c.kind == "tilt"]
        if tilts:
            total += len(tilts) * (2 * self.h * max(tilts) + self.h) * self.el
        parts = [c.param for c in choice if c.kind == "partial"]
        if parts:
            total += len(parts) * (3 * max(parts) * self.h + self.h) * self.el
        return total


def _remap_to(prob: LayerProblem, e: int, kept: list[int], exclude: int = -1) -> Candidate | None:
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


def layer_frontier(prob: LayerProblem, mode: str, pairs_first: bool = False) -> list[LayerPoint]:
    """Greedy walk from all-keep: each step applies the change with the least added loss per byte saved.

    A change of slot e to another candidate; if e stops being kept, the slots remapped to e move to
    their best zero-byte alternative (another kept prototype, drop or reroute) within the same change.
    Changes that save no bytes but lower the loss are applied first. Reroute-style layers keep the
    router able to fill its top-k (and its group-limited selection). With `pairs_first`, pair changes are
    taken before any other while one is possible (used with the pairs of a least-loss matching).
    """
    kinds = REROUTE_KINDS if mode.startswith("reroute") else REPLACE_KINDS
    opts = [[c for c in slot if c.kind in kinds] for slot in prob.options]
    state = [slot[0] for slot in opts]  # keep
    e_all = prob.num_experts
    cur_bytes, cur_loss = prob.bytes_of(state), 0.0
    points = [LayerPoint(mode, list(state), cur_bytes, 0.0)]
    zero_kinds = [k for k in ("reroute", "drop") if k in kinds]
    reroute_mode = mode.startswith("reroute")
    group = prob.num_experts // prob.n_group if prob.n_group > 1 else prob.num_experts

    def fallback(s: int, kept: list[int]) -> Candidate | None:
        best = _remap_to(prob, s, kept) if any(c.kind == "remap" for c in opts[s]) else None
        for c in opts[s]:
            if c.kind in zero_kinds and (best is None or c.loss < best.loss):
                best = c
        return best

    def change(state: list[Candidate], moves: dict[int, Candidate]) -> list[Candidate] | None:
        """`state` with `moves` applied; slots remapped to an expert no longer kept fall back; None if infeasible."""
        new = list(state)
        for s, c in moves.items():
            new[s] = c
        kept = [i for i in range(e_all) if new[i].kind in STORED_KINDS]
        if not kept and not any(c.kind == "pair" for c in new):
            return None  # the runtime needs one stored expert per layer
        for s in range(e_all):
            if new[s].kind == "remap" and new[s].param not in kept:
                fb = fallback(s, kept)
                if fb is None:
                    return None
                new[s] = fb
        if reroute_mode and not prob.routable_ok([c.kind != "reroute" for c in new]):
            return None
        return new

    pair_moves = []  # (i, j, Candidate for i, Candidate for j): both slots decided jointly
    if "pair" in kinds:
        for ref in prob.pairs:
            i, j = ref.members
            sc = 1.0 if ref.scale is None else ref.scale
            pair_moves.append(
                (
                    i,
                    j,
                    Candidate(
                        "pair",
                        ref.losses[0] * sc,
                        j,
                        ref.nbytes // 2,
                        op=ref,
                        raw=None if ref.scale is None else ref.losses[0],
                    ),
                    Candidate(
                        "pair",
                        ref.losses[1] * sc,
                        i,
                        ref.nbytes - ref.nbytes // 2,
                        op=ref,
                        raw=None if ref.scale is None else ref.losses[1],
                    ),
                )
            )

    while True:
        kept = [i for i in range(e_all) if state[i].kind in STORED_KINDS]
        best_improve, best_save = None, None
        moves: list[tuple[tuple, dict[int, Candidate]]] = []
        for e in range(e_all):
            if state[e].kind == "pair":
                continue  # a packed pair is final for both of its slots
            alts = [
                c for c in opts[e] if c.kind not in ("keep", "remap", "pair")
            ]  # upgrades never save bytes
            if any(c.kind == "remap" for c in opts[e]):
                r = _remap_to(prob, e, kept)
                if r is not None:
                    alts.append(r)
            for j, alt in enumerate(alts):
                if alt.kind == state[e].kind and alt.param == state[e].param:
                    continue
                moves.append(((e, j), {e: alt}))
        pm = [
            ((i, len(opts[i]) + k), {i: ci, j: cj})
            for k, (i, j, ci, cj) in enumerate(pair_moves)
            if state[i].kind in STORED_KINDS and state[j].kind in STORED_KINDS
        ]
        moves = pm if pairs_first and pm else moves + pm
        for key_tail, move in moves:
            new = change(state, move)
            (e, alt) = next(iter(move.items()))
            if new is None and reroute_mode and alt.kind == "reroute" and prob.n_group > 1:
                # group-limited routers: reroute e's whole router group at once
                g0 = (e // group) * group
                grp = {
                    s: next(c for c in opts[s] if c.kind == "reroute")
                    for s in range(g0, g0 + group)
                    if state[s].kind not in ("reroute", "pair")
                }
                new = change(state, grp)
            if new is None:
                continue
            nb = prob.bytes_of(new)
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
        chosen = best_improve or best_save
        if chosen is None:
            break
        _, state, cur_bytes, cur_loss = chosen
        if best_improve is None or cur_bytes < points[-1].bytes:
            points.append(LayerPoint(mode, list(state), cur_bytes, cur_loss))
        else:
            points[-1] = LayerPoint(mode, list(state), cur_bytes, cur_loss)
    return points


# ----------------------------------------------------------------------------- candidates of a model
def _dtype_and_el(adapter, info: ModelInfo, layer: int):
    """(dtype operators are fitted in: the model's, in memory; bytes per element: the checkpoint's, on disk)."""
    return adapter.expert_dtype(layer), info.element_size


def layer_problem(
    config: AutoConfig,
    adapter,
    stats,
    info: ModelInfo,
    layer: int,
    stored: bool,
    keep_codes: bool = True,
    slots: set[int] | None = None,
) -> tuple[LayerProblem, LayerMoments]:
    """Per-slot candidates of one layer, fitted and scored from the statistics (keep_codes=False: quantized
    keeps carry their estimate, not their codes; see `restore`). slots: fit the operators of these slots only
    (the others keep only "keep"; `restore` rebuilds a few chosen slots)."""
    m = LayerMoments.load(stats, layer)
    li = info.layer(layer)
    h = adapter.hidden_size
    dtype, el = _dtype_and_el(adapter, info, layer)
    cands = set(config.candidates)
    quant = (
        aq.quant_candidates(
            adapter,
            stats,
            m,
            config.bits,
            config.quant_group,
            config.quant_algo,
            config.quant_weighting,
            el,
            keep_codes=keep_codes,
        )
        if config.quant_bits
        else None
    )
    options: list[list[Candidate]] = []
    for e in range(li.num_experts):
        slot = [Candidate("keep", 0.0, 0, li.bytes_per_expert)]
        if quant is not None:
            slot += quant[e]
        if slots is not None and e not in slots:
            options.append(slot)
            continue
        if "reroute" in cands:
            for gate in config.gates:
                slot.append(Candidate("reroute", float(m.reroute[gate][e]), 0, 0, gate=gate))
        if "drop" in cands:
            slot.append(Candidate("drop", est.drop_loss(m, e)))
        if "constant" in cands:
            slot.append(est.constant_candidate(m, stats, e, config.fit, el, h, dtype, config.cross_fit))
        for r in sorted(set(config.ranks)):
            if "tilt" in cands:
                c = est.tilt_candidate(
                    m, stats, e, r, config.fit, config.ridge, el, h, dtype, config.cross_fit
                )
                if c is not None:
                    slot.append(c)
            if "partial" in cands:
                c = est.partial_candidate(m, stats, adapter, e, r, config.fit, el, h, dtype, config.cross_fit)
                if c is not None and not any(o.kind == "partial" and o.param == c.param for o in slot):
                    slot.append(c)
        # an operator as large as the expert itself is never worth it
        options.append([c for c in slot if c.kind == "keep" or c.bytes < li.bytes_per_expert])
    if hasattr(stats, "drop_rows"):  # streamed statistics: the last chunk of square rows is not read again
        stats.drop_rows()
    remap = m.remap if "remap" in cands else None
    partners = config.pair_partners or (li.num_experts - 1 if li.num_experts <= 32 else 8)
    pairs = est.pair_options(adapter, stats, m, partners) if "pair" in cands else []
    pairs = [p for p in pairs if p.nbytes < 2 * li.bytes_per_expert]
    prob = LayerProblem(
        layer,
        li.num_experts,
        li.top_k,
        li.n_group,
        li.topk_group,
        li.group_score,
        li.bytes_per_expert,
        h,
        el,
        options,
        remap,
        stored,
        pairs,
    )
    return prob, m


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


# ----------------------------------------------------------------------------- plan
def plan_from_points(
    info: ModelInfo,
    chosen: dict[int, LayerPoint],
    method: str = "auto",
    params: dict | None = None,
    source=None,
) -> tuple[CompressionPlan, dict[str, torch.Tensor]]:
    """The plan of one state per layer. Quantized keeps are written by `quantize_plan` from the codes the
    estimator computed; source(layer, expert) -> ExpertWeights (their biases) is needed only for them."""
    scopes, layers, tensors = [], [], {}
    specs, done = {}, {}
    for li in info.layers:
        pt = chosen[li.layer]
        sid = f"layer{li.layer}"
        # stored experts in order of their smallest original expert: kept copies and packed pairs
        entries = sorted(
            {
                (e,) if c.kind in STORED_KINDS else tuple(sorted((e, c.param)))
                for e, c in enumerate(pt.choice)
                if c.kind in (*STORED_KINDS, "pair")
            }
        )
        kept = [e for e, c in enumerate(pt.choice) if c.kind in STORED_KINDS]
        pos = {}
        stored = []
        for j, entry in enumerate(entries):
            if len(entry) == 1:
                stored.append(StoredExpert(id=j, sources=[(li.layer, entry[0])]))
                c = pt.choice[entry[0]]
                if c.kind == "quant":
                    specs[(sid, j)], done[(sid, j)] = c.op.spec, c.op.parts
            else:
                ref = pt.choice[entry[0]].op
                merge = ref.merge()
                prefix = f"layer{li.layer}.merge{entry[0]}"
                stored.append(merge.stored_expert(j, prefix))
                tensors.update(merge.tensors(prefix))
            for e in entry:
                pos[e] = j
        slots = []
        for e, c in enumerate(pt.choice):
            if c.kind in (*STORED_KINDS, "pair"):
                slots.append(pos[e])
            elif c.kind == "remap":
                slots.append(pos[c.param])
            elif c.kind in ("drop", "reroute"):
                slots.append("drop")
            else:
                slots.append(c.op)
                tensors.update(c.tensors)
        removed = len(kept) < li.num_experts
        gate = "renorm" if not removed else ("replace" if pt.mode == "replace" else pt.mode.split(":")[1])
        scopes.append(Scope(id=sid, layers=[li.layer], stored=stored))
        layers.append(LayerPlan(layer=li.layer, scope=sid, gate=gate, slots=slots))
    plan = CompressionPlan(model=info, scopes=scopes, layers=layers, method=method, params=params or {})
    if specs:
        from .quantize import QuantConfig, quantize_plan

        if source is None:
            raise RuntimeError(
                "plan_from_points: quantized keeps need the model's experts (source); this is a bug."
            )
        plan, tensors = quantize_plan(plan, tensors, source, QuantConfig(), None, specs=specs, done=done)
    return plan, tensors


def _sig(x: float, digits: int = 6) -> float:
    """x rounded to `digits` significant digits (stable JSON, decisions robust to last-bit noise)."""
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x


def routed_budget(config: AutoConfig, info: ModelInfo) -> int:
    """Bytes allowed in the budget's scope: budget_bytes, or the fraction of the original's bytes as stored (the
    whole file's weights, or the routed experts' with budget_scope routed)."""
    if config.budget_bytes is not None:
        return config.budget_bytes
    return math.floor((0.5 if config.budget is None else config.budget) * scope_bytes(config, info))


def scope_bytes(config: AutoConfig, info: ModelInfo) -> int:
    """The original's bytes the budget is a fraction of."""
    return info.expert_bytes + (info.other_bytes if config.budget_scope == "whole" else 0)


@dataclass
class AutoSetup:
    """Everything estimated once per model and calibration: candidates, frontiers, sensitivities."""

    info: ModelInfo
    budget: int  # bytes in the budget's scope
    problems: dict[int, LayerProblem]
    moments: dict[int, LayerMoments]
    fronts: dict[int, list[LayerPoint]]
    sens: dict[int, float]  # s_l used by the allocation
    noise_sens: dict[int, float]  # s_l from Gaussian noise (reported; the fallback of probe)
    probes: dict[int, tuple[int, float, float]]  # layer -> (bytes, estimated error, measured KL) of the probe
    ids: torch.Tensor | None  # calibration token ids of the sensitivity / measurement passes
    ids_note: str | None
    ref: torch.Tensor | None  # the original's log-probs on ids
    kind_sens: dict[int, dict[str, float]] = field(default_factory=dict)  # layer -> kind -> s_{l,k}
    uniform: dict[int, dict[int, int]] = field(
        default_factory=dict
    )  # bits -> layer -> bytes of pure quantization


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


def uniform_bits_check(
    fronts: dict[int, list[LayerPoint]],
    scale: dict[int, float],
    budget: int,
    chosen: dict[int, int],
    uniform: dict[int, dict[int, int]],
) -> dict[int, int]:
    """The allocation, or — when one is cheaper in scaled loss within the budget — for a bit width b whose
    uniform quantization fits, each layer's least-loss front state within its uniform-b bytes. The
    knapsack heuristic is near-optimal, this makes "never worse than uniform GPTQ" hold by construction
    (in estimated loss)."""

    def total(idx):
        return sum(fronts[l][k].loss * scale[l] for l, k in idx.items())

    best, best_cost = chosen, total(chosen)
    for b in sorted(uniform, reverse=True):
        per = uniform[b]
        if set(per) != set(fronts) or sum(per.values()) > budget:
            continue
        idx = {}
        for l, front in fronts.items():
            ok = [k for k, p in enumerate(front) if p.bytes <= per[l]]
            idx[l] = min(ok, key=lambda k: (front[k].loss, k))
        cost = total(idx)
        if cost < best_cost * (1 - 1e-12):
            best, best_cost = idx, cost
    return best


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


def prepare(
    config: AutoConfig, adapter, stats, progress: bool = False, keep_tensors: bool = False
) -> AutoSetup:
    """Candidates and frontiers of every layer, and the sensitivities (a few forward passes).

    One layer at a time: its candidates, its sensitivity probes (the layer compressed alone), its front; then
    the layer sheds what its candidates hold beyond (bytes, loss) (`shed`), so the setup keeps numbers for
    every layer but tensors, codes and moments for none (`restore` rebuilds a chosen state's tensors).
    keep_tensors: keep every candidate's tensors and the full layer moments (benchmarks that measure single
    candidates in memory)."""
    from rich.progress import track

    info = ModelInfo.from_model(adapter)
    budget = routed_budget(config, info)
    stored = config.accounting == "stored"
    layers = adapter.moe_layers
    ids, ids_note, ref = None, None, None
    if config.sensitivity != "uniform" or config.measure:
        ids, ids_note = est.calibration_ids(
            stats, adapter, config.sensitivity_sequences, config.sensitivity_seq_len, config.seed
        )
        ref = est._logprobs(adapter.model, ids)
    noise = {i: 1.0 for i in layers}
    if config.sensitivity != "uniform":
        noise = est.layer_sensitivity(adapter, ids, rel=config.noise, ref=ref)
    raw = dict(noise)
    ratio = min(1.0, budget / scope_bytes(config, info))
    fronts, moments, problems = {}, {}, {}
    probes: dict[int, tuple[int, float, float]] = {}
    kind_sens: dict[int, dict[str, float]] = {}
    for i, layer_stats in track(
        each_layer(stats, layers, adapter),
        total=len(layers),
        description="auto: candidates",
        disable=not progress,
        transient=True,
    ):
        prob, m = layer_problem(config, adapter, layer_stats, info, i, stored, keep_codes=keep_tensors)
        target = ratio * prob.expert_bytes * prob.num_experts

        def measure(pt: LayerPoint, i=i, s=layer_stats) -> float:  # the layer alone compressed to `pt`
            return measure_states(adapter, info, {i: restore(config, adapter, s, info, i, pt)}, ids, ref)

        if config.sensitivity == "kind":
            # s_{l,k}: KL per unit of estimated error of representation k in layer l, probed with the layer
            # compressed by k alone at the budget ratio; every candidate's loss becomes s_{l,k}·L_e (KL units)
            found = {}
            for kind in kinds_of(prob):
                sub, mode = restrict(prob, kind)
                pt = probe_point(pareto(layer_frontier(sub, mode)), target)
                if pt is None:
                    continue
                kl = measure(pt)
                if kl > 0:
                    found[kind] = _sig(kl / pt.loss, 4)
            fallback = sorted(found.values())[len(found) // 2] if found else _sig(noise[i], 4)
            kind_sens[i] = {k: found.get(k, fallback) for k in kinds_of(prob)}
            _apply_kind_scale(prob, kind_sens[i])
            raw[i] = 1.0
        fronts[i] = layer_front(prob, config, info.layer(i))
        if config.sensitivity == "probe":
            pt = probe_point(fronts[i], target)
            if pt is not None:  # else nothing to probe with: keep the noise sensitivity
                kl = measure(pt)
                probes[i] = (pt.bytes, pt.loss, kl)
                raw[i] = max(kl, 0.0) / pt.loss
        if not keep_tensors:
            shed(prob)
            m = LayerMoments(
                i, m.w, m.s_y, m.s_yy, sample=m.sample
            )  # the token sample is read again at the end
        moments[i], problems[i] = m, prob
        del m, layer_stats
    sens = {i: _sig(raw[i], 4) for i in layers}
    uniform: dict[int, dict[int, int]] = {}
    for b in config.quant_bits:
        for i in layers:
            state = uniform_state(problems[i], b)
            if state is not None:
                uniform.setdefault(b, {})[i] = problems[i].bytes_of(state)
    return AutoSetup(
        info,
        budget,
        problems,
        moments,
        fronts,
        sens,
        {i: _sig(v, 4) for i, v in noise.items()},
        probes,
        ids,
        ids_note,
        ref,
        kind_sens,
        uniform,
    )


REBUILT_KINDS = frozenset({"constant", "tilt", "partial", "quant"})  # candidates whose tensors `shed` drops


def shed(prob: LayerProblem) -> None:
    """Drop what a layer's candidates hold beyond their (bytes, loss): operator tensors, quantized codes and
    packed-pair merges. The fronts and the allocation read only those numbers; a layer's candidates would
    otherwise keep about its own size in memory (codes at every bit width), every layer's together more
    than the checkpoint. `restore` rebuilds the tensors of the one state chosen per layer."""
    for slot in prob.options:
        for c in slot:
            if c.kind in REBUILT_KINDS:
                c.tensors = {}
                if c.kind == "quant":
                    c.op = None  # with keep_codes=False there were none to begin with
    for ref in prob.pairs:
        ref._merge = None  # rebuilt from the weights by `PairRef.merge()` when the plan needs it


def _was_shed(c: Candidate) -> bool:
    """Has `c` no payload any more (see `shed`)?"""
    return (c.kind == "quant" and c.op is None) or (c.kind in REBUILT_KINDS - {"quant"} and not c.tensors)


def restore(config: AutoConfig, adapter, stats, info: ModelInfo, layer: int, point: LayerPoint) -> LayerPoint:
    """`point` with the tensors and codes its candidates shed, computed again for this layer from the same
    statistics and weights: the same deterministic fits, and GPTQ codes for the slots kept quantized only."""
    todo = [e for e, c in enumerate(point.choice) if _was_shed(c)]
    if not todo:
        return point
    rebuilt: dict[tuple[int, str, int], Candidate] = {}
    ops = {point.choice[e].kind for e in todo} - {"quant"}
    if ops:  # operator fits: the layer's problem with only those kinds and no quantized keeps
        sub = config.model_copy(
            update={"candidates": [k for k in config.candidates if k in ops], "bits": [16]}
        )
        prob, _ = layer_problem(
            sub, adapter, stats, info, layer, config.accounting == "stored", slots=set(todo)
        )
        rebuilt |= {(e, c.kind, c.param): c for e in todo for c in prob.options[e]}
    quant = [e for e in todo if point.choice[e].kind == "quant"]
    if quant:
        m = LayerMoments(layer, None, None, None, sample=stats.get(layer, "auto_sample"))
        widths = sorted({point.choice[e].param for e in quant}, reverse=True)
        for b in widths:
            ids = [e for e in quant if point.choice[e].param == b]
            got = aq.quant_candidates(
                adapter,
                stats,
                m,
                [b],
                config.quant_group,
                config.quant_algo,
                config.quant_weighting,
                info.element_size,
                experts=ids,
            )
            rebuilt |= {(e, "quant", b): got[e][0] for e in ids}
    choice = list(point.choice)
    for e in todo:
        c = point.choice[e]
        new = rebuilt.get((e, c.kind, c.param))
        if new is None or new.error != c.error:
            raise RuntimeError(
                f"auto: layer {layer} slot {e}'s {c.label} came out differently when rebuilt; "
                "this is a bug, please report it."
            )
        choice[e] = Candidate(
            c.kind, c.loss, c.param, c.bytes, op=new.op, gate=c.gate, tensors=new.tensors, raw=c.raw
        )
    return LayerPoint(point.mode, choice, point.bytes, point.loss)


def plan_layer_by_layer(
    config: AutoConfig, adapter, stats, info: ModelInfo, chosen: dict[int, LayerPoint], on_layer=None
) -> tuple[CompressionPlan, object]:
    """`plan_from_points` of the chosen states, built one layer at a time: each layer's state is restored, its
    part of the plan made and its tensors put in the method's tensor store (on disk for a streamed view).
    on_layer(i, part, part_tensors), if given, runs while layer i's part is still in memory (and a streamed
    view still lends the layer): a plan whose other layers are kept whole, and that layer's tensors."""
    from .streamed import plan_tensor_store

    keeps = {li.layer: keep_point_of(li) for li in info.layers}
    source = lambda l, e: adapter.layer(l).storage.read(e)
    tensors = plan_tensor_store(adapter)
    scopes, layers = [], []
    for i, layer_stats in each_layer(stats, [li.layer for li in info.layers], adapter):
        pt = restore(config, adapter, layer_stats, info, i, chosen[i])
        part, part_tensors = plan_from_points(info, {**keeps, i: pt}, source=source)
        if on_layer is not None:
            on_layer(i, part, part_tensors)
        scopes.append(part.scope(part.layer(i).scope))
        layers.append(part.layer(i))
        tensors.update(part_tensors)
        del pt, part_tensors
    return CompressionPlan(model=info, scopes=scopes, layers=layers, method="auto", params={}), tensors


def _apply_kind_scale(prob: LayerProblem, scale: dict[str, float]) -> None:
    """Losses in KL units: every candidate's loss becomes s_{l,kind}·L_e (its raw error kept in `raw`)."""
    for slot in prob.options:
        for c in slot[1:]:
            c.raw = c.error
            c.loss = c.raw * scale[c.kind_key]
    if prob.remap is not None:
        prob.remap_scale = scale["remap"]
    for ref in prob.pairs:
        ref.scale = scale["pair"]


def measure_states(
    adapter, info: ModelInfo, states: dict[int, LayerPoint], ids: torch.Tensor, ref: torch.Tensor
) -> float:
    """KL(original ‖ model with `states` in their layers, every other layer untouched) on `ids`."""
    chosen = {li.layer: states.get(li.layer) or keep_point_of(li) for li in info.layers}
    plan, tensors = plan_from_points(info, chosen, source=lambda l, e: adapter.layer(l).storage.read(e))
    with est.plan_installed(adapter, plan, tensors, sorted(states)):
        return est.kl_to(ref, adapter.model, ids)


def _identity(config: AutoConfig, adapter, info: ModelInfo, budget: int):
    """Everything fits: keep every expert (a zero-loss removal is still a change to the model)."""
    plan = CompressionPlan.identity(adapter.model, method="auto")
    params = config.model_dump()
    params["auto"] = dict(
        budget_scope=config.budget_scope,
        budget_bytes=budget,
        routed_bytes=info.expert_bytes,
        original_routed_bytes=info.expert_bytes,
        whole_bytes=info.expert_bytes + info.other_bytes,
        original_whole_bytes=info.expert_bytes + info.other_bytes,
        accounting=config.accounting,
        est_kl=0.0,
        layers=[
            dict(
                layer=i,
                gate="renorm",
                choices={"keep": adapter.num_experts(i)},
                routed_bytes=info.layer(i).bytes_per_expert * adapter.num_experts(i),
                est_error=0.0,
                est_kl=0.0,
            )
            for i in adapter.moe_layers
        ],
    )
    return plan.model_copy(update={"params": params}), {}


def _whole_file(config: AutoConfig, adapter, stats, setup: AutoSetup):
    """The non-expert part of a whole-file budget (`auto_tensors.WholeFile`), or None with a routed budget."""
    if config.budget_scope != "whole":
        return None
    from .auto_tensors import WholeFile, chosen_classes

    ids, ref = setup.ids, setup.ref
    if ids is None:  # sensitivity uniform, measure off: the Hessians and class probes still need tokens
        ids, _ = est.calibration_ids(
            stats, adapter, config.sensitivity_sequences, config.sensitivity_seq_len, config.seed
        )
        ref = est._logprobs(adapter.model, ids)
    classes = chosen_classes(adapter, config.tensor_classes)
    return WholeFile.price(
        adapter,
        stats,
        setup.info,
        classes,
        config.quant_bits,
        config.quant_group,
        config.quant_algo,
        ids,
        ref,
    )


def _allocate_all(config: AutoConfig, setup: AutoSetup, whole) -> tuple[dict, dict[int, int]]:
    """(fronts of every item, the chosen index of each): MoE layers and, for a whole-file budget, tensors."""
    fronts, scale, uniform = (
        dict(setup.fronts),
        dict(setup.sens),
        {b: dict(v) for b, v in setup.uniform.items()},
    )
    budget = setup.budget
    if config.target == "llama.cpp":
        from .auto_target import allocate_for_target

        extra = whole.fronts() if whole is not None else {}
        fronts, chosen, _ = allocate_for_target(config, setup, extra, budget - (whole.fixed if whole else 0))
        return fronts, chosen
    if whole is not None:
        tf = whole.fronts()
        fronts.update(tf)
        scale.update(dict.fromkeys(tf, 1.0))  # tensor losses are in KL units already
        for b in uniform:
            uniform[b].update(whole.uniform(b))
        budget -= whole.fixed
        minimum = sum(f[0].bytes for f in fronts.values())
        if minimum > budget:
            raise MoECompressError(
                f"The budget of {setup.budget} bytes is below the smallest whole file auto can "
                f"reach ({minimum + whole.fixed}: every expert layer keeps what its router "
                "needs, every weight at the lowest width tried, norms and routers as they "
                "are); raise the budget or add lower widths to bits."
            )
    chosen = allocate(fronts, scale, budget)
    return fronts, uniform_bits_check(fronts, scale, budget, chosen, uniform)


@large_blocks_mmapped()
def build_auto(config: AutoConfig, context: MethodContext):
    """CompressionPlan (+ tensors) of the budget-optimal mixed representation; see the module doc."""
    adapter, stats = context.adapter, context.stats
    if stats is None:
        raise MoECompressError(
            "The auto method needs calibration statistics; run moecompress calibrate "
            "--for-method auto first (or pass --calib SPEC)."
        )
    stats.require(*needs_stats(config), method="auto")
    info = ModelInfo.from_model(adapter)
    budget = routed_budget(config, info)
    if scope_bytes(config, info) <= budget:
        return _identity(config, adapter, info, budget)

    setup = prepare(config, adapter, stats, context.progress)
    whole = _whole_file(config, adapter, stats, setup)
    fronts, chosen_idx = _allocate_all(config, setup, whole)
    chosen = {i: fronts[i][chosen_idx[i]] for i in adapter.moe_layers}
    sample_error: dict[int, float] = {}

    def measure_sample(i: int, part: CompressionPlan, part_tensors) -> None:
        # here, not after the plan: the layer is still lent and its tensors in memory (read back from the
        # store, every layer's were mapped in again on the streamed view)
        if any(c.kind != "keep" for c in chosen[i].choice) and setup.moments[i].sample is not None:
            sample_error[i] = _sig(
                est.sample_layer_error(adapter, part, part_tensors, i, setup.moments[i].sample)
            )

    plan, tensors = plan_layer_by_layer(config, adapter, stats, info, chosen, on_layer=measure_sample)
    if whole is not None and (specs := whole.specs(fronts, chosen_idx)):
        from .auto_tensors import hessians
        from .tensor_quant import quantize_tensors

        plan, tensors = quantize_tensors(plan, tensors, adapter, specs, hessians(adapter, stats, whole.ids))
    summary = _summary(config, adapter, setup, plan, tensors, chosen, sample_error)
    if whole is not None:
        _whole_summary(summary, whole, fronts, chosen_idx, plan, tensors, budget)
    if config.measure:
        with _installed(adapter, plan, tensors, adapter.moe_layers):
            summary["measured_kl"] = _sig(est.kl_to(setup.ref, adapter.model, setup.ids))
    params = config.model_dump()
    params["auto"] = summary
    return plan.model_copy(update={"params": params}), tensors


@contextlib.contextmanager
def _installed(adapter, plan: CompressionPlan, tensors, layers):
    """The plan's MoE `layers` and its quantized non-expert weights in the model, for a measurement."""
    from .auto_tensors import dequantized_weights, weights_installed

    with (
        est.plan_installed(adapter, plan, tensors, layers),
        weights_installed(adapter, dequantized_weights(plan, tensors)),
    ):
        yield


def _summary(config: AutoConfig, adapter, setup: AutoSetup, plan, tensors, chosen, sample_error) -> dict:
    """params["auto"]: the per-layer table (what was chosen, estimated and measured) and the routed bytes."""
    sens, info = setup.sens, setup.info
    table = []
    for i in adapter.moe_layers:
        pt = chosen[i]
        hist: dict[str, int] = {}
        for c in pt.choice:
            hist[c.label] = hist.get(c.label, 0) + 1
        bits: dict[str, int] = {}  # stored copies of own experts by precision (representation x bits)
        for c in pt.choice:
            if c.kind in STORED_KINDS:
                key = str(c.param if c.kind == "quant" else 16)
                bits[key] = bits.get(key, 0) + 1
        row = dict(
            layer=i,
            gate=plan.layer(i).gate,
            choices=dict(sorted(hist.items())),
            bits=dict(sorted(bits.items(), key=lambda kv: -int(kv[0]))),
            routed_bytes=pt.bytes,
            est_error=_sig(sum(c.error for c in pt.choice)),
            sensitivity=sens[i],
            noise_sensitivity=setup.noise_sens[i],
            est_kl=_sig(pt.loss * sens[i]),
        )
        if i in setup.kind_sens:
            row["kind_sensitivity"] = setup.kind_sens[i]
        if i in setup.probes:
            b, err, kl = setup.probes[i]
            row["probe"] = dict(bytes=b, est_error=_sig(err), measured_kl=_sig(kl))
        if i in sample_error:
            row["sample_error"] = sample_error[i]
        if any(c.kind != "keep" for c in pt.choice) and config.measure:
            with est.plan_installed(adapter, plan, tensors, [i]):
                row["measured_kl"] = _sig(est.kl_to(setup.ref, adapter.model, setup.ids))
        table.append(row)
    routed = plan.logical_bytes(tensors, accounting=config.accounting).routed
    solver = sum(chosen[i].bytes for i in adapter.moe_layers)
    if routed != solver or (config.budget_scope == "routed" and routed > setup.budget):
        raise RuntimeError(
            f"auto: the solver counted {solver} routed bytes, the plan holds {routed} (budget "
            f"{setup.budget}); this is a bug, please report it."
        )
    return dict(
        budget_scope=config.budget_scope,
        budget_bytes=setup.budget,
        routed_bytes=routed,
        dtype=info.dtype,
        original_routed_bytes=info.expert_bytes,
        accounting=config.accounting,
        est_kl=_sig(sum(chosen[i].loss * sens[i] for i in adapter.moe_layers)),
        sensitivity_data=setup.ids_note,
        layers=table,
    )


def _whole_summary(summary: dict, whole, fronts, chosen_idx, plan, tensors, budget: int) -> None:
    """The whole-file part of params["auto"]: per-class precisions and the whole file's bytes (checked)."""
    from .auto_tensors import KEY_OFFSET

    total = plan.logical_bytes(tensors, accounting=summary["accounting"]).total
    solver = whole.fixed + sum(fronts[k][i].bytes for k, i in chosen_idx.items())
    if total != solver or total > budget:
        raise RuntimeError(
            f"auto: the solver counted {solver} bytes for the whole file, the plan holds {total} "
            f"(budget {budget}); this is a bug, please report it."
        )
    tensor_kl = sum(fronts[k][i].loss for k, i in chosen_idx.items() if k >= KEY_OFFSET)
    summary.update(
        whole_bytes=total,
        original_whole_bytes=plan.model.expert_bytes + plan.model.other_bytes,
        est_kl=_sig(summary["est_kl"] + tensor_kl),
        tensors=whole.table(fronts, chosen_idx),
    )


# the view: a layer as stored and one float32 layer, the embeddings and head (sensitivity probes and measured KL
# are full-model forwards). The statistics passes lend their own layer, and the sampled layer errors now run in
# the restore pass on it; measured KL (measure=True) still reads each layer again after the plan. The stored
# layer was set against the run before that change (counting the lent layer as free came out just below its
# peak, BENCHMARKS.md "Streaming compress"), and stays until a run after it is compared.
register_method(
    "auto",
    AutoConfig,
    build_auto,
    needs_stats,
    family="auto",
    streamed_stats=True,
    view_use=lambda config: ViewUse(stored=1.0, compute=1.0, forwards=True),
)


def _register_stats():
    from .needs import register_method_stats

    register_method_stats("auto", needs_stats(AutoConfig()))


_register_stats()
