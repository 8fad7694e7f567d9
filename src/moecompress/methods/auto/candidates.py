"""`auto`'s candidates of a model layer (docs/auto.md, "Candidates"): per slot, keep, the quantized keeps
(quant.py), reroute, drop and the fitted operators (estimate.py), the remap losses and the packed pairs
(pairs.py), gathered into the layer's `LayerProblem`."""

from __future__ import annotations

from ...plan import ModelInfo
from . import estimate as est
from .config import AutoConfig
from .frontier import LayerProblem
from .moments import LayerMoments
from .pairs import pair_options
from .quant import proxy_candidates, quant_candidates
from .solver import Candidate


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
    keeps carry their estimate, not their codes; see `materialise.restore`). slots: fit the operators of these
    slots only (the others keep only "keep"; `restore` rebuilds a few chosen slots)."""
    m = LayerMoments.load(stats, layer)
    li = info.layer(layer)
    h = adapter.hidden_size
    dtype, el = _dtype_and_el(adapter, info, layer)
    quant = _quant_options(config, adapter, stats, m, el, keep_codes)
    options: list[list[Candidate]] = []
    for e in range(li.num_experts):
        slot = [Candidate("keep", 0.0, 0, li.bytes_per_expert)]
        if quant is not None:
            slot += quant[e]
        if slots is not None and e not in slots:
            options.append(slot)
            continue
        slot += _slot_options(config, adapter, stats, m, e, h, dtype, el)
        # an operator as large as the expert itself is never worth it
        options.append([c for c in slot if c.kind == "keep" or c.bytes < li.bytes_per_expert])
    stats.drop_rows()  # streamed statistics: the last chunk of square rows is not read again
    cands = set(config.candidates)
    remap = m.remap if "remap" in cands else None
    pairs = _pairs(config, adapter, stats, m, li) if "pair" in cands else []
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


def _quant_options(config: AutoConfig, adapter, stats, m: LayerMoments, el: int, keep_codes: bool):
    """Per slot, the quantized keeps of every width of ``bits`` below 16 (priced by proxy in the fast search);
    None when there is none."""
    if not config.quant_bits:
        return None
    if config.proxy_pricing:
        return proxy_candidates(
            adapter, stats, m, config.bits, config.quant_group, config.quant_weighting, el, chunk=8
        )
    return quant_candidates(
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


def _slot_options(config: AutoConfig, adapter, stats, m: LayerMoments, e: int, h: int, dtype, el: int):
    """Slot e's reroutes, drop and fitted operators (constant, tilts, partial copies), as the config asks."""
    cands = set(config.candidates)
    slot: list[Candidate] = []
    if "reroute" in cands:
        for gate in config.gates:
            slot.append(Candidate("reroute", float(m.reroute[gate][e]), 0, 0, gate=gate))
    if "drop" in cands:
        slot.append(Candidate("drop", est.drop_loss(m, e)))
    if "constant" in cands:
        slot.append(est.constant_candidate(m, stats, e, config.fit, el, h, dtype, config.cross_fit))
    for r in sorted(set(config.ranks)):
        if "tilt" in cands:
            c = est.tilt_candidate(m, stats, e, r, config.fit, config.ridge, el, h, dtype, config.cross_fit)
            if c is not None:
                slot.append(c)
        if "partial" in cands:
            c = est.partial_candidate(m, stats, adapter, e, r, config.fit, el, h, dtype, config.cross_fit)
            if c is not None and not any(o.kind == "partial" and o.param == c.param for o in slot):
                slot.append(c)
    return slot


def _pairs(config: AutoConfig, adapter, stats, m: LayerMoments, li) -> list:
    """The layer's packed-pair candidates smaller than their two experts kept."""
    partners = config.pair_partners or (li.num_experts - 1 if li.num_experts <= 32 else 8)
    pairs = pair_options(adapter, stats, m, partners)
    return [p for p in pairs if p.nbytes < 2 * li.bytes_per_expert]
