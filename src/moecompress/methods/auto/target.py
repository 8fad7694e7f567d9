"""`auto` within what a runtime runs (issue 31, item 3): ``target: llama.cpp | transformers | vllm``.

A GGUF holds, per MoE layer, the kept experts of every layer stacked into one tensor per projection, with one
type for the whole tensor, the same expert count in every layer, and a router with the kept rows only; no
operators, merges or cross-layer scopes (`export.gguf.reason`). So with ``target: llama.cpp`` the search space
is:

* per layer, the k experts kept (the same k in every layer; the rest rerouted with the renormalised gate, as
  deleting router rows computes), all at one width b_l — 16 (the checkpoint's dtype), 8, 5 or 4 bits, symmetric
  group 32: exactly ``Q8_0`` / ``Q5_0`` / ``Q4_0``, which the GGUF writer stores from our codes (5 bits fills the
  step from 8.5 to 4.5 bits per weight where llama.cpp's own mixes use Q5_0 / Q5_K);
* every non-expert weight at 16, 8, 5 or 4 bits, group 32 (`auto.tensors`, with a whole-file budget).

An ``hf`` checkpoint (what transformers and vLLM load; `export.formats.HFFormat.reason`) holds the same structure
with ONE precision for every stored expert of the model (compressed-tensors), quantized non-expert weights only
beside quantized experts, and never quantized embeddings. So ``target: transformers`` searches the same k with one
expert width b for all layers (any of ``bits``), non-expert weights but the embeddings at any width when b < 16
and unquantized when b = 16; ``target: vllm`` narrows that to what vLLM's compressed-tensors loader runs
(`export.ct.vllm_reason`): WNA16 at 4 or 8 bits (its Marlin kernels), groups 32 / 64 / 128 or per channel, and
no quantized lm_head.

Which experts a layer keeps for a given k: those with the largest estimated loss when rerouted (the `reroute`
candidates' per-slot losses, as the unconstrained solver scores them). For each k (and, for hf targets, each
expert width) the layers' states form fronts and the ordinary allocation (`solver.allocate`) picks one per layer
within the budget; the choice with the least total estimated loss wins. Estimates, sensitivities and the plan's
construction are the unconstrained solver's (`setup.prepare`, `materialise.restore`).
"""

from __future__ import annotations

from ...errors import MoECompressError
from ...plan.targets import get_target
from .solver import LayerPoint, allocate, pareto


def target_defaults(data: dict) -> dict:
    """An AutoConfig's input with the target's search space filled in where not given, or one sentence when a
    given field asks for what the target cannot run."""
    if not isinstance(data, dict) or not isinstance(data.get("target"), str):
        return data
    target = data["target"]
    space = get_target(target).space
    if space is None:  # a runtime that runs every plan
        return data
    out = dict(data)
    for key, value in space.defaults.items():
        if out.get(key) is None:
            out[key] = value
    for key, allowed in space.allowed.items():
        given = out.get(key, "unset")
        if given == "unset":
            continue
        ok = set(given) <= set(allowed) if isinstance(given, list) else given in allowed
        if not ok:
            raise MoECompressError(
                f"auto --target {target} cannot use {key}={given}: {target} runs {key} {allowed} only "
                f"({space.why}); leave it out."
            )
    return out


def constrained(target: str) -> bool:
    """Whether `target`'s runtime runs only part of what `auto` searches (a search space of its own)."""
    return get_target(target).space is not None


def unquantized_classes(target: str) -> tuple[str, ...]:
    """The non-expert classes `target` loads only unquantized."""
    space = get_target(target).space
    return space.unquantized_classes if space is not None else ()


def check_groups(config, info) -> None:
    """Refuse, before any search, a quantization group that leaves a shorter last group on one of the model's
    input dimensions: compressed-tensors cannot load it, nor llama.cpp's 32-weight blocks hold it."""
    group = config.quant_group
    space = get_target(config.target).space
    if space is None or group is None:
        return
    dims = {info.hidden_size} | {li.intermediate_size for li in info.layers}
    if any(d % group for d in dims):
        allowed = space.allowed.get("quant_group", [128, 64, 32])
        fits = [g for g in (128, 64, 32) if g in allowed and all(d % g == 0 for d in dims)]
        hint = f"pass quant_group={fits[0]}" if fits else "no group it loads fits; use --target moecompress"
        raise MoECompressError(
            f"auto --target {config.target} with quant_group {group} leaves a shorter last group on input "
            f"dimensions {sorted(dims)}, which {config.target} cannot load; {hint}."
        )


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


def allocate_for_target(config, setup, extra_fronts: dict, budget: int, fixed: int = 0):
    """(fronts, chosen index per item, k) minimising the scaled estimated loss over every common expert count k
    (and, where the target holds one expert precision, every expert width); `extra_fronts` are the non-expert
    items (their losses already in KL units), `fixed` the bytes no choice changes (outside `budget`)."""
    widths = sorted({16, *config.quant_bits}, reverse=True)
    space = get_target(config.target).space
    best, smallest = None, None
    for k in kept_counts(setup):
        for ws in [[b] for b in widths] if space.one_expert_width else [widths]:
            fronts = {i: layer_states(p, k, ws) for i, p in setup.problems.items()}
            if not all(fronts.values()):  # a width some kept slot has no candidate for
                continue
            # an hf checkpoint quantizes other weights only beside quantized experts
            unquantized = space.one_expert_width and ws == [16]
            fronts.update(
                {
                    i: [p for p in f if p.option.spec is None] if unquantized else f
                    for i, f in extra_fronts.items()
                }
            )
            scale = {i: setup.sens.get(i, 1.0) for i in fronts}
            least = sum(f[0].bytes for f in fronts.values())
            smallest = least if smallest is None else min(smallest, least)
            if least > budget:
                continue
            chosen = allocate(fronts, scale, budget)
            cost = sum(fronts[i][j].loss * scale[i] for i, j in chosen.items())
            if best is None or cost < best[0] * (1 - 1e-12):
                best = (cost, fronts, chosen, k)
    if best is None:
        raise MoECompressError(
            f"The budget of {budget + fixed} bytes is below the smallest file {config.target} can run "
            f"({(smallest or 0) + fixed} bytes: every layer at the largest top-k and {min(widths)} bits, the weights "
            f"{config.target} loads unquantized as they are); raise the budget."
        )
    return best[1], best[2], best[3]
