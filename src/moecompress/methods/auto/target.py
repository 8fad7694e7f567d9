"""`auto` within what a runtime runs (issue 31, item 3): ``target: llama.cpp``.

A GGUF holds, per MoE layer, the kept experts of every layer stacked into one tensor per projection, with one
type for the whole tensor, the same expert count in every layer, and a router with the kept rows only; no
operators, merges or cross-layer scopes (`export.gguf.reason`). So with ``target: llama.cpp`` the search space
is:

* per layer, the k experts kept (the same k in every layer; the rest rerouted with the renormalised gate, as
  deleting router rows computes), all at one width b_l — 16 (the checkpoint's dtype), 8, 5 or 4 bits, symmetric
  group 32: exactly ``Q8_0`` / ``Q5_0`` / ``Q4_0``, which the GGUF writer stores from our codes (5 bits fills the
  step from 8.5 to 4.5 bits per weight where llama.cpp's own mixes use Q5_0 / Q5_K);
* every non-expert weight at 16, 8, 5 or 4 bits, group 32 (`auto.tensors`, with a whole-file budget).

Which experts a layer keeps for a given k: those with the largest estimated loss when rerouted (the `reroute`
candidates' per-slot losses, as the unconstrained solver scores them). For each k the layers' states
(k, b_l) form fronts and the ordinary allocation (`solver.allocate`) picks one per layer within the budget; the k
with the least total estimated loss wins. Estimates, sensitivities and the plan's construction are the
unconstrained solver's (`setup.prepare`, `materialise.restore`).
"""

from __future__ import annotations

from ...errors import MoECompressError
from .solver import LayerPoint, allocate, pareto

TARGETS = ("moecompress", "llama.cpp", "vllm", "transformers")
# what llama.cpp's GGUF types hold exactly (export.gguf.exact_type), and how auto's search is set for it
LLAMA_CPP = dict(candidates=["reroute"], gates=["renorm"], bits=[16, 8, 5, 4], quant_group=32)


def target_defaults(data: dict) -> dict:
    """An AutoConfig's input with the target's search space filled in where not given, or one sentence when a
    given field asks for what the target cannot run."""
    if not isinstance(data, dict) or data.get("target", "moecompress") == "moecompress":
        return data
    target = data["target"]
    if target not in TARGETS:
        raise MoECompressError(f"Target '{target}' is not known; use {', '.join(TARGETS)}.")
    if target != "llama.cpp":
        raise MoECompressError(
            f"auto --target {target} is not implemented yet (issue 31): use --target llama.cpp "
            "or moecompress, and check the plan with --format hf."
        )
    out = dict(data)
    for key, allowed in LLAMA_CPP.items():
        given = out.get(key)
        if given is None:
            out[key] = allowed
            continue
        ok = set(given) <= set(allowed) if isinstance(allowed, list) else given == allowed
        if not ok:
            raise MoECompressError(
                f"auto --target llama.cpp cannot use {key}={given}: llama.cpp runs {key} "
                f"{allowed} only (one GGUF type per layer tensor: Q8_0 / Q5_0 / Q4_0 from group-32 "
                "codes); leave it out."
            )
    return out


def kept_counts(setup) -> list[int]:
    """The expert counts every layer can keep: from the largest top-k to the smallest layer's experts."""
    probs = setup.problems.values()
    lo = max(p.top_k for p in probs)
    hi = min(p.num_experts for p in probs)
    return list(range(hi, lo - 1, -1))


def layer_states(prob, k: int, widths: list[int]):
    """The states (k experts kept, all at width b) of one layer, for each b of `widths` that every kept slot
    has a candidate for: LayerPoints of `auto`'s own type."""
    e = prob.num_experts
    reroute = [
        next((c for c in slot if c.kind == "reroute" and c.gate == "renorm"), None) for slot in prob.options
    ]
    if k < e and any(c is None for c in reroute):
        raise MoECompressError(
            f"auto --target llama.cpp found no reroute estimate in layer {prob.layer}; calibrate "
            "with --for-method auto."
        )
    order = sorted(range(e), key=lambda s: (reroute[s].loss if reroute[s] is not None else 0.0, s))
    dropped = set(order[: e - k])
    points = []
    for b in widths:
        choice = []
        for s, slot in enumerate(prob.options):
            if s in dropped:
                choice.append(reroute[s])
                continue
            c = slot[0] if b == 16 else next((c for c in slot if c.kind == "quant" and c.param == b), None)
            if c is None:
                break
            choice.append(c)
        else:
            mode = "reroute:renorm" if dropped else "replace"
            points.append(LayerPoint(mode, choice, prob.bytes_of(choice), sum(c.loss for c in choice)))
    return pareto(points)


def allocate_for_target(config, setup, extra_fronts: dict, budget: int):
    """(fronts, chosen index per item, k) minimising the scaled estimated loss over every common expert count k;
    `extra_fronts` are the non-expert items (their losses already in KL units)."""
    widths = sorted({16, *config.quant_bits}, reverse=True)
    best = None
    for k in kept_counts(setup):
        fronts = {i: layer_states(p, k, widths) for i, p in setup.problems.items()}
        fronts.update(extra_fronts)
        scale = {i: setup.sens.get(i, 1.0) for i in fronts}
        if sum(f[0].bytes for f in fronts.values()) > budget:
            continue
        chosen = allocate(fronts, scale, budget)
        cost = sum(fronts[i][j].loss * scale[i] for i, j in chosen.items())
        if best is None or cost < best[0] * (1 - 1e-12):
            best = (cost, fronts, chosen, k)
    if best is None:
        raise MoECompressError(
            f"The budget of {budget} bytes is below the smallest plan llama.cpp can run (every "
            "layer at the largest top-k, 4 bits); raise the budget."
        )
    return best[1], best[2], best[3]
