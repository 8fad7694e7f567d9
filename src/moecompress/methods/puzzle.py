"""PuzzleMoE as a method: element-wise merged expert pairs (or groups), kept packed in the plan.

Per MoE layer with E experts (PuzzleMoE §3.2; merge/packing formulas in `moecompress.puzzle`):

1. group size G and group count n from the ratio: ratio ≤ 0.5 -> pairs, n = round(ratio·E) (0.5 pairs
   every expert, 0.25 pairs half of them); otherwise G = round(1/(1 − ratio)) (0.667 -> 3, 0.75 -> 4),
   n = min(round(ratio·E/(G − 1)), ⌊E/G⌋); experts in no group are kept as copies;
2. grouping: seeded random (default), or `evolve` — `puzzle.evolve_grouping` minimising the summed
   *channel-norm-weighted reconstruction error* of the groups (a cheap proxy of the calibration loss,
   see `weighted_error`);
3. each group is merged with the dual-mask rule (saliency |W| ⊙ ‖X_e‖₂ from the calibration stats
   `in_channel_norm` / `mid_channel_norm`) and stored packed: pairs as int16 bf16 words holding
   W_merged with both masks and signs (`pair-bf16`, exactly half a bf16 pair's bytes) or as 3/4-bit
   group-quantized codes (`pair-q3-g128`); groups of 3/4 with explicit bit masks (`group3-bf16`);
4. plan: the group is ONE stored expert (``elementwise_merge``, sources = its members in member order,
   ``packing`` = the layout code, tensors under ``layer{l}.merge{k}``); every member's router slot maps
   to it and computes its own member's reconstruction (the router is unchanged: gate ``replace``).

Integration API (used by the `auto` method): `pair_candidate` / `merge_candidate` build one candidate
merge with its packed tensors, bytes and estimated error; `layer_with_merges` turns candidates into a
layer's scope + slot map. See docs/puzzlemoe.md, "Integration API".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import MoECompressError
from ..models import ExpertWeights
from ..plan import CompressionPlan, LayerPlan, ModelInfo, Scope, StoredExpert
from ..puzzle import (
    ClampReport,
    InputNorms,
    PackedPairExperts,
    clamp_report,
    evolve_grouping,
    merge_expert_group,
    merge_expert_pair,
    packing_code,
    random_grouping,
)
from ..puzzle.group import GroupMergedExperts
from ..runtime.packed import run_members
from .context import MethodContext
from .needs import register_method_stats
from .registry import ViewUse, register_method

STATS = ["counts", "tokens", "in_channel_norm", "mid_channel_norm"]


class PuzzleConfig(BaseModel):
    """PuzzleMoE recipe."""

    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="fraction of routed experts removed: 0.25 / 0.5 (pairs), "
        "0.667 (groups of 3), 0.75 (groups of 4)",
    )
    group_size: int | None = Field(None, ge=2, le=8, description="experts per merge (None: from the ratio)")
    tau: float = Field(0.4, ge=0.0, le=1.0, description="similarity threshold of the dual mask")
    pairing: Literal["random", "evolve"] = Field(
        "random", description="seeded random grouping or genetic search"
    )
    population: int = Field(16, ge=1, description="evolve: population size")
    generations: int = Field(20, ge=0, description="evolve: generations")
    quant_bits: Literal[3, 4] | None = Field(
        None, description="group-quantize W_merged of pairs to 3 or 4 bits"
    )
    quant_group: int = Field(128, ge=1, description="input channels per quantization scale")
    underflow: Literal["nearest", "clamp", "flush"] = Field(
        "nearest",
        description="bf16 exponent clamp at 112: values below 2^-15 go to the nearer of 0 / 2^-15, "
        "up to 2^-15, or to 0",
    )
    saliency: Literal["activation", "weight"] = Field(
        "activation", description="|W|·‖X‖₂ from calibration (paper), or |W| alone (no statistics needed)"
    )
    seed: int = 0


def needs_stats(config: PuzzleConfig) -> list[str]:
    return list(STATS) if config.saliency == "activation" else []


def group_layout(num_experts: int, ratio: float, group_size: int | None = None) -> tuple[int, int]:
    """(experts per group G, number of groups n) that remove about `ratio` of `num_experts` experts."""
    if not 0.0 <= ratio < 1.0:
        raise MoECompressError(
            f"The compression ratio {ratio} is outside [0, 1); use 0.25, 0.5, 0.667 or 0.75."
        )
    g = group_size or (2 if ratio <= 0.5 + 1e-9 else max(3, round(1.0 / (1.0 - ratio))))
    n = min(round(ratio * num_experts / (g - 1)), num_experts // g)
    if ratio > 0 and n == 0:
        raise MoECompressError(
            f"Ratio {ratio} merges no experts of a layer with {num_experts} experts in groups of "
            f"{g}; use a larger ratio."
        )
    return g, n


def layer_norms(stats, layer: int, num_experts: int) -> list[InputNorms] | None:
    """Per-expert ‖X_e‖₂ (hidden, intermediate) from a stats store; None without stats (saliency |W|)."""
    if stats is None:
        return None
    stats.require("in_channel_norm", "mid_channel_norm", method="puzzlemoe")
    hid, mid = stats.get(layer, "in_channel_norm").float(), stats.get(layer, "mid_channel_norm").float()
    return [InputNorms(hidden=hid[e], intermediate=mid[e]) for e in range(num_experts)]


def weighted_error(orig: ExpertWeights, rec: ExpertWeights, norms: InputNorms | None) -> tuple[float, float]:
    """(Σ ‖(W − Ŵ) diag(‖X‖₂)‖²_F, Σ ‖W diag(‖X‖₂)‖²_F) over gate, up (hidden norms) and down (intermediate norms).

    With ‖X_j‖₂² = Σ_t x_tj² this is Σ_t ‖(W − Ŵ) x_t‖² when input channels are uncorrelated — the
    calibration-token output error of each projection (Wanda's proxy), cheap and additive over groups.
    """
    err = ref = 0.0
    for part, key in (("gate", "hidden"), ("up", "hidden"), ("down", "intermediate")):
        w, r = getattr(orig, part).float(), getattr(rec, part).float().to(getattr(orig, part).device)
        n = None if norms is None else getattr(norms, key)
        scale = torch.ones(w.shape[1], device=w.device) if n is None else n.float().to(w.device)
        err += float(((w - r) * scale).square().sum())
        ref += float((w * scale).square().sum())
    return err, ref


@dataclass
class MergeCandidate:
    """One merged group of a layer, packed: what the plan stores for it and what it costs.

    members: original expert ids in member order (= the stored expert's sources' order);
    module: `PackedPairExperts` / `GroupMergedExperts` (run it with ``run_members(module, [x_0, ...])``);
    est_error: Σ over members of `weighted_error` (channel-norm-weighted squared reconstruction error);
    rel_error: est_error / Σ ‖W diag(‖X‖₂)‖² of the members; member_errors: per member;
    clamp: what the bf16 exponent clamp changed in W_merged (bf16 pairs; zeros otherwise).
    """

    layer: int
    members: tuple[int, ...]
    packing: str
    module: torch.nn.Module
    est_error: float
    rel_error: float
    member_errors: list[float]
    stats: dict[str, float] = field(default_factory=dict)
    clamp: ClampReport = field(default_factory=ClampReport)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the plan stores for this merge (packed weights + per-member biases)."""
        return sum(t.numel() * t.element_size() for t in self.module.state_dict().values())

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """PlanTensors of this merge under `prefix` (keys as in runtime/packed.py)."""
        return {f"{prefix}.{k}": v for k, v in self.module.state_dict().items()}

    def stored_expert(self, id: int, prefix: str) -> StoredExpert:
        return StoredExpert(
            id=id,
            sources=[(self.layer, e) for e in self.members],
            construction="elementwise_merge",
            tensor=prefix,
            packing=self.packing,
            nbytes=self.nbytes,
        )

    def decode(self, dtype: torch.dtype = torch.float32) -> list[ExpertWeights]:
        """Dense reconstruction of every member (documented orientation)."""
        return list(self.module.decode(dtype))

    def forward(self, xs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """[f̂_m(x_m)] for tokens routed to each member (no gate), from the packed tensors."""
        return run_members(self.module, list(xs))


class UpcastExperts(Mapping):
    """One layer's experts stacked at rest, each handed out in `dtype` when read: the values the method's
    float32 copies held (bf16 -> float32 is exact), at half their memory, and in one block per tensor
    rather than three small blocks per expert (which the C heap fragmented over a model's layers)."""

    def __init__(self, stacked: ExpertWeights, dtype: torch.dtype, num_experts: int):
        self.stacked, self.dtype, self.num_experts = stacked, dtype, num_experts

    def __getitem__(self, e: int) -> ExpertWeights:
        if not 0 <= e < self.num_experts:
            raise KeyError(e)
        return self.stacked.map(lambda t: t[e].to(self.dtype, copy=True))  # never a view into the stack

    def __iter__(self):
        return iter(range(self.num_experts))

    def __len__(self) -> int:
        return self.num_experts


def merge_candidate(
    adapter,
    layer: int,
    members: Sequence[int],
    *,
    norms: Sequence[InputNorms] | None = None,
    stats=None,
    tau: float = 0.4,
    quant_bits: int | None = None,
    quant_group: int = 128,
    underflow: str = "nearest",
    experts: Mapping[int, ExpertWeights] | None = None,
) -> MergeCandidate:
    """Merge experts `members` of `layer` (2 -> packed pair, ≥ 3 -> explicit group) and estimate its error.

    Norms come from `norms` (per expert of the layer), else from `stats` (in/mid_channel_norm), else
    saliency is |W| alone. `experts` may pass already-read expert weights (avoids re-reading).
    """
    members = tuple(int(e) for e in members)
    if len(members) < 2 or len(set(members)) != len(members):
        raise MoECompressError(f"A merge needs two or more distinct experts, got {list(members)}.")
    if norms is None and stats is not None:
        norms = layer_norms(stats, layer, adapter.num_experts(layer))
    get = (lambda e: experts[e]) if experts is not None else (lambda e: adapter.get_expert(layer, e))
    ws = [get(e) for e in members]
    ns = [None if norms is None else norms[e] for e in members]
    act = adapter.layer(layer).act
    code = packing_code(len(members), quant_bits, quant_group)
    clamp = ClampReport()
    with torch.no_grad():
        if len(members) == 2:
            merge = merge_expert_pair(ws[0], ws[1], ns[0], ns[1], tau)
            module = PackedPairExperts.from_merge(
                merge, act, quant_bits=quant_bits, group_size=quant_group, underflow=underflow
            )
            stats_ = {k: v for k, v in merge.gate_up.stats().items()}
            if quant_bits is None:
                clamp = clamp_report([merge.gate_up.w_merged, merge.down.w_merged], underflow)
        else:
            merged = merge_expert_group(ws, ns, tau)
            biases = [
                None if not w.has_bias else ExpertWeights(gate=w.gate_bias, up=w.up_bias, down=w.down_bias)
                for w in ws
            ]
            module = GroupMergedExperts.from_merge(merged, act, biases)
            stats_ = {"merged_fraction": float(merged["gate_up"].masks.all(0).float().mean())}
        recs = module.decode(torch.float32)
        errs = [weighted_error(w, r, n) for w, r, n in zip(ws, recs, ns)]
    total, ref = sum(e for e, _ in errs), sum(r for _, r in errs)
    return MergeCandidate(
        layer, members, code, module, total, total / ref if ref else 0.0, [e for e, _ in errs], stats_, clamp
    )


def pair_candidate(adapter, layer: int, i: int, j: int, **kwargs) -> MergeCandidate:
    """The packed pair (i, j) of `layer`: tensors, bytes, estimated error (see `merge_candidate`)."""
    return merge_candidate(adapter, layer, (i, j), **kwargs)


def merge_prefix(layer: int, k: int) -> str:
    return f"layer{layer}.merge{k}"


def layer_with_merges(
    layer: int,
    num_experts: int,
    merges: Sequence[MergeCandidate],
    gate: str = "replace",
    scope_id: str | None = None,
    prefix: Callable[[int, int], str] = merge_prefix,
) -> tuple[Scope, LayerPlan, dict]:
    """A layer's scope + slot map: every merge one packed stored expert, every other expert a copy.

    Stored ids follow the smallest original expert of each entry; a member's slot maps to its merge.
    Returns (Scope, LayerPlan, PlanTensors of the merges).
    """
    owner: dict[int, int] = {}
    for k, c in enumerate(merges):
        if c.layer != layer:
            raise MoECompressError(f"Merge {list(c.members)} belongs to layer {c.layer}, not {layer}.")
        for e in c.members:
            if e in owner:
                raise MoECompressError(
                    f"Expert {e} of layer {layer} is in two merges; merges must be disjoint."
                )
            owner[e] = k
    stored, slots, tensors, seen = [], [0] * num_experts, {}, {}
    for e in range(num_experts):
        if e not in owner:
            slots[e] = len(stored)
            stored.append(StoredExpert(id=len(stored), sources=[(layer, e)]))
            continue
        k = owner[e]
        if k not in seen:
            seen[k] = len(stored)
            p = prefix(layer, k)
            stored.append(merges[k].stored_expert(len(stored), p))
            tensors.update(merges[k].tensors(p))
        slots[e] = seen[k]
    sid = scope_id or f"layer{layer}"
    return (
        Scope(id=sid, layers=[layer], stored=stored),
        LayerPlan(layer=layer, scope=sid, gate=gate, slots=slots),
        tensors,
    )


def _layer_seed(seed: int, layer: int) -> int:
    return seed * 1_000_003 + layer  # a different random grouping in every layer, reproducible


def choose_groups(
    config: PuzzleConfig, adapter, layer: int, norms, experts
) -> tuple[list[tuple[int, ...]], dict]:
    """The layer's groups (random or evolved on the weighted-error proxy) and search info."""
    e_count = adapter.num_experts(layer)
    g, n = group_layout(e_count, config.ratio, config.group_size)
    seed = _layer_seed(config.seed, layer)
    if n == 0:
        return [], {}
    if config.pairing == "random":
        return random_grouping(e_count, g, n, seed), {}
    cache: dict[tuple[int, ...], float] = {}

    def cost(group: tuple[int, ...]) -> float:
        if group not in cache:
            cache[group] = _merge_candidates(config, adapter, layer, [group], norms, experts)[0].est_error
        return cache[group]

    res = evolve_grouping(
        e_count,
        lambda groups: sum(cost(tuple(x)) for x in groups),
        group_size=g,
        num_groups=n,
        population=config.population,
        generations=config.generations,
        seed=seed,
    )
    random_loss = sum(cost(tuple(x)) for x in random_grouping(e_count, g, n, seed))
    return [tuple(x) for x in res.groups], {
        "proxy_loss": res.loss,
        "random_proxy_loss": random_loss,
        "evaluations": res.evaluations,
    }


def build_puzzle(config: PuzzleConfig, context: MethodContext):
    """CompressionPlan (+ packed tensors) of PuzzleMoE on the context's model; see the module doc."""
    adapter, stats = context.adapter, context.stats
    if config.saliency == "activation":
        if stats is None:
            raise MoECompressError(
                "PuzzleMoE weighs saliency by calibration activations; run moecompress calibrate "
                "--for-method puzzlemoe first (or pass --calib SPEC, or saliency=weight)."
            )
        stats.require(*STATS, method="puzzlemoe")
    info = ModelInfo.from_model(adapter)
    layers_iter = adapter.moe_layers
    if context.progress:
        from rich.progress import track

        layers_iter = track(layers_iter, description="PuzzleMoE merging", transient=True)
    from ..checkpoint.view import plan_tensor_store

    scopes, layer_plans = [], []
    tensors = plan_tensor_store(
        adapter
    )  # streamed view: on disk layer by layer, not every layer's merges in memory
    summary: dict = {"layers": [], "clamp": ClampReport()}
    removed = total = 0
    for i in layers_iter:
        e_count = adapter.num_experts(i)
        norms = layer_norms(stats, i, e_count) if config.saliency == "activation" else None
        # held at rest (a streamed view: the checkpoint's bf16, and the layer evicted), upcast per read
        experts = UpcastExperts(adapter.experts_at_rest(i), adapter.expert_dtype(i), e_count)
        groups, search = choose_groups(config, adapter, i, norms, experts)
        cands = _merge_candidates(config, adapter, i, groups, norms, experts)
        sc, lp, t = layer_with_merges(i, e_count, cands)
        scopes.append(sc)
        layer_plans.append(lp)
        tensors.update(t)
        removed += sum(len(c.members) - 1 for c in cands)
        total += e_count
        for c in cands:
            summary["clamp"] = summary["clamp"] + c.clamp
        summary["layers"].append(_layer_row(i, cands, search))
        del experts
    clamp = summary["clamp"].to_dict()
    summary["clamp"] = {k: _r(v) if isinstance(v, float) else v for k, v in clamp.items()}
    summary["removed_fraction"] = _r(removed / total if total else 0.0)
    params = config.model_dump()
    params["puzzle"] = summary
    plan = CompressionPlan(model=info, scopes=scopes, layers=layer_plans, method="puzzlemoe", params=params)
    return plan, tensors


def _merge_candidates(config: PuzzleConfig, adapter, i: int, groups, norms, experts) -> list:
    """Layer `i`'s merge of every group of `groups` (`merge_candidate`, with the config's tau and quantization)."""
    return [
        merge_candidate(
            adapter,
            i,
            grp,
            norms=norms,
            tau=config.tau,
            quant_bits=config.quant_bits,
            quant_group=config.quant_group,
            underflow=config.underflow,
            experts=experts,
        )
        for grp in groups
    ]


def _layer_row(i: int, cands: list, search: dict) -> dict:
    """Layer `i`'s row of the plan's puzzle summary: its groups, their errors and merged fractions, and the
    grouping search's figures."""
    row = dict(
        layer=i,
        groups=[list(c.members) for c in cands],
        est_error=_r(sum(c.est_error for c in cands)),
        rel_error=[_r(c.rel_error) for c in cands],
        merged_fraction=[_r(c.stats.get("merged_fraction", float("nan"))) for c in cands],
    )
    row.update({k: _r(v) if isinstance(v, float) else v for k, v in search.items()})
    return row


def _r(x: float, digits: int = 6) -> float:
    """Round for the plan's JSON (stable bytes, readable reports)."""
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x


# the view: the layer as stored, plus every pair's merge of the layer (float32 members, merged weights, masks
# and codes) at once; the default's two float32 layers came out below the measured peak (BENCHMARKS.md,
# "Streaming compress")
register_method(
    "puzzlemoe",
    PuzzleConfig,
    build_puzzle,
    needs_stats,
    family="elementwise",
    view_use=lambda config: ViewUse(stored=1.0, compute=2.5),
)
register_method_stats("puzzlemoe", STATS)
