"""`auto`'s sensitivities (docs/auto.md, "Sensitivity"): the factors that turn a layer's estimated errors into KL.

* noise (`layer_sensitivity`): KL per unit of Gaussian noise energy added to the layer's MoE output;
* global (`global_sensitivity`): one such factor for every layer, the noise added to all of them at once;
* kind (`kind_sensitivity`): per layer and representation, the layer compressed with that representation alone
  at the budget ratio, its measured KL over its estimated error; `apply_kind_scale` puts every candidate's loss
  in KL units;
* probe: per layer, the layer's own frontier state at the budget ratio (`measure_states` of that state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ...plan import ModelInfo
from .frontier import LayerProblem, keep_point_of, kinds_of, layer_frontier, probe_point, restrict
from .materialise import plan_from_points
from .measure import kl_to, logprobs, perturbed, plan_installed, sig
from .solver import LayerPoint, pareto


def output_energy(adapter, ids: torch.Tensor) -> tuple[dict[int, float], torch.Tensor]:
    """Mean per-token ‖MoE block output‖² of every MoE layer on `ids`, and the original's log-probs on `ids` (the
    forward that measured them, unperturbed)."""
    acc: dict[int, list[float]] = {i: [0.0, 0] for i in adapter.moe_layers}

    def make(i):
        def fn(o):
            acc[i][0] += float(o.double().square().sum())
            acc[i][1] += o.numel() // o.shape[-1]
            return o

        return fn

    with contextlib.ExitStack() as stack:
        for i in adapter.moe_layers:
            stack.enter_context(perturbed(adapter, i, make(i)))
        ref = logprobs(adapter.model, ids)
    return {i: a / max(n, 1) for i, (a, n) in acc.items()}, ref


def layer_sensitivity(
    adapter, ids: torch.Tensor, rel: float = 0.05, seeds: int = 2, ref: torch.Tensor | None = None
) -> dict[int, float]:
    """s_l = KL(original ‖ noisy) / ε_l for isotropic Gaussian noise of mean per-token energy ε_l added to
    layer l's MoE output (ε_l = rel × mean ‖output‖²), averaged over `seeds` noise draws.

    KL is quadratic in a small perturbation, so s_l is the KL cost per unit of squared output error:
    the factor that turns the per-token errors L_e of layer l into a KL estimate.
    """
    model = adapter.model
    energy, own = output_energy(adapter, ids)
    ref = own if ref is None else ref
    out = {}
    for i in adapter.moe_layers:
        eps = rel * energy[i]
        if eps <= 0:
            out[i] = 0.0
            continue
        total = 0.0
        for s in range(seeds):
            with perturbed(adapter, i, _noisy(1000 * i + s, eps)):
                total += kl_to(ref, model, ids)
        out[i] = total / seeds / eps
    return out


def global_sensitivity(
    adapter, ids: torch.Tensor, rel: float = 0.05, ref: torch.Tensor | None = None, energy=None
) -> dict[int, float]:
    """One s for every layer: s = KL(original ‖ noisy) / Σ_l ε_l with the noise of `layer_sensitivity` added to
    every MoE layer's output at once (``search: fast``). Two forwards whatever the depth, where per-layer noise
    takes one per layer, each through every layer; the allocation then trades layers by their estimated errors
    alone. `ref`, `energy`: `output_energy`'s, if measured already."""
    model = adapter.model
    if energy is None:
        energy, own = output_energy(adapter, ids)
        ref = own if ref is None else ref
    eps = noise_energies(adapter, energy, rel)
    if not eps:
        return dict.fromkeys(adapter.moe_layers, 0.0)
    with noise_installed(adapter, eps):
        kl = kl_to(ref, model, ids)
    return global_from(adapter, eps, kl)


def noise_energies(adapter, energy: dict[int, float], rel: float) -> dict[int, float]:
    """ε_l = rel × layer l's mean output energy, for the layers whose output is not 0."""
    return {i: rel * energy[i] for i in adapter.moe_layers if rel * energy[i] > 0}


def global_from(adapter, eps: dict[int, float], kl: float) -> dict[int, float]:
    """`global_sensitivity` from the KL its probe measured (0 when no layer has noise)."""
    return dict.fromkeys(adapter.moe_layers, kl / sum(eps.values()) if eps else 0.0)


@contextlib.contextmanager
def noise_installed(adapter, eps: dict[int, float], rows: slice | None = None):
    """`global_sensitivity`'s probe: noise of energy ε_l on every layer l's MoE output (batch rows `rows` only, to
    run beside other probes in one forward, `tensors.class_sensitivity`)."""
    with contextlib.ExitStack() as stack:
        for i, e in eps.items():
            stack.enter_context(perturbed(adapter, i, _noisy(1000 * i, e, rows)))
        yield


def _noisy(seed: int, eps: float, rows: slice | None = None):
    """o + isotropic Gaussian noise of mean per-token energy `eps` (a fixed draw per seed), on `rows` only if given
    (the draw of those rows alone: a probe in its own rows draws what it draws alone)."""
    gen = torch.Generator().manual_seed(seed)

    def fn(o):
        part = o if rows is None else o[rows]
        noise = torch.randn(part.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype)
        noisy = part + noise * (eps / o.shape[-1]) ** 0.5
        if rows is None:
            return noisy
        out = o.clone()
        out[rows] = noisy
        return out

    return fn


def measure_states(
    adapter, info: ModelInfo, states: dict[int, LayerPoint], ids: torch.Tensor, ref: torch.Tensor
) -> float:
    """KL(original ‖ model with `states` in their layers, every other layer untouched) on `ids`."""
    chosen = {li.layer: states.get(li.layer) or keep_point_of(li) for li in info.layers}
    plan, tensors = plan_from_points(info, chosen, source=lambda l, e: adapter.layer(l).storage.read(e))
    with plan_installed(adapter, plan, tensors, sorted(states)):
        return kl_to(ref, adapter.model, ids)


def kind_sensitivity(
    prob: LayerProblem, target: float, measure: Callable[[LayerPoint], float], noise: float
) -> dict[str, float]:
    """s_{l,k}: KL per unit of estimated error of representation k in layer l, probed with the layer compressed by
    k alone at `target` bytes (`measure` gives the KL of a layer state); a kind whose probe measures nothing takes
    the median of the others (the noise sensitivity when none measures anything)."""
    found = {}
    for kind in kinds_of(prob):
        sub, mode = restrict(prob, kind)
        pt = probe_point(pareto(layer_frontier(sub, mode)), target)
        if pt is None:
            continue
        kl = measure(pt)
        if kl > 0:
            found[kind] = sig(kl / pt.loss, 4)
    fallback = sorted(found.values())[len(found) // 2] if found else sig(noise, 4)
    return {k: found.get(k, fallback) for k in kinds_of(prob)}


def probe_sensitivity(
    front: list[LayerPoint], target: float, measure: Callable[[LayerPoint], float]
) -> tuple[tuple[int, float, float], float] | None:
    """probe: the layer's own frontier state at `target` bytes (`probe_point`) measured, as ((bytes, estimated
    error, measured KL), KL per unit of estimated error); None when no state loses anything."""
    pt = probe_point(front, target)
    if pt is None:
        return None
    kl = measure(pt)
    return (pt.bytes, pt.loss, kl), max(kl, 0.0) / pt.loss


def apply_kind_scale(prob: LayerProblem, scale: dict[str, float]) -> None:
    """Losses in KL units: every candidate's loss becomes s_{l,kind}·L_e (its raw error kept in `raw`)."""
    for slot in prob.options:
        for c in slot[1:]:
            c.raw = c.error
            c.loss = c.raw * scale[c.kind_key]
    if prob.remap is not None:
        prob.remap_scale = scale["remap"]
    for ref in prob.pairs:
        ref.scale = scale["pair"]
