"""What `auto` estimates once per model and calibration (`prepare` -> `AutoSetup`): every layer's candidates and
frontier, the sensitivities, and the calibration tokens and reference log-probs of the measurements."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...calibrate.streamed import each_layer
from ...plan import ModelInfo
from .candidates import layer_problem
from .config import AutoConfig, routed_budget, scope_bytes
from .frontier import LayerProblem, layer_front, uniform_state
from .materialise import restore, shed
from .measure import calibration_ids, kl_to, logprobs, sig
from .moments import LayerMoments
from .sensitivity import (
    apply_kind_scale,
    global_from,
    global_sensitivity,
    kind_sensitivity,
    layer_sensitivity,
    measure_states,
    noise_energies,
    noise_installed,
    output_energy,
    probe_sensitivity,
)
from .solver import LayerPoint


@dataclass
class AutoSetup:
    """Everything estimated once per model and calibration: candidates, frontiers, sensitivities."""

    info: ModelInfo
    budget: int  # tensor bytes the allocation may use in the budget's scope: the budget less `reserved`
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
    # the global noise probe's ε_l while it has not run (`finish_global`)
    noise_eps: dict[int, float] | None = None
    # bytes of the budget reserved for the weight files' headers and other non-tensor bytes (`export.auto_reserve`)
    reserved: int = 0

    def finish_global(self, adapter, kl: float | None) -> None:
        """The global noise sensitivity from `kl`, its probe's KL measured beside the class probes (`build`), or
        measured now when that forward did not run; nothing to do unless `prepare` left the probe to run."""
        if self.noise_eps is None:
            return
        if kl is None and self.noise_eps:
            with noise_installed(adapter, self.noise_eps):
                kl = kl_to(self.ref, adapter.model, self.ids)
        s = {i: sig(v, 4) for i, v in global_from(adapter, self.noise_eps, kl).items()}
        self.sens, self.noise_sens, self.noise_eps = s, dict(s), None


def prepare(
    config: AutoConfig, adapter, stats, progress: bool = False, keep_tensors: bool = False, reserved: int = 0
) -> AutoSetup:
    """Candidates and frontiers of every layer, and the sensitivities (a few forward passes).

    One layer at a time: its candidates, its sensitivity probes (the layer compressed alone), its front; then
    the layer sheds what its candidates hold beyond (bytes, loss) (`materialise.shed`), so the setup keeps
    numbers for every layer but tensors, codes and moments for none (`materialise.restore` rebuilds a chosen
    state's tensors). keep_tensors: keep every candidate's tensors and the full layer moments (benchmarks that
    measure single candidates in memory). reserved: bytes of the budget kept for the weight files' non-tensor bytes
    (`export.auto_reserve`), which the allocation may not use."""
    from rich.progress import track

    info = ModelInfo.from_model(adapter)
    budget = routed_budget(config, info) - reserved
    layers = adapter.moe_layers
    ids, ids_note, ref = None, None, None
    if config.sensitivity != "uniform" or config.measure:
        ids, ids_note = calibration_ids(
            stats, adapter, config.sensitivity_sequences, config.sensitivity_seq_len, config.seed
        )
    noise, pending = {i: 1.0 for i in layers}, None
    if config.sensitivity == "global":  # the reference log-probs from the forward that measures the energies
        energy, ref = output_energy(adapter, ids)
        if config.budget_scope == "whole":  # its probe runs in the class probes' forward (`finish_global`)
            pending = noise_energies(adapter, energy, config.noise)
        else:
            noise = global_sensitivity(adapter, ids, rel=config.noise, ref=ref, energy=energy)
    elif ids is not None:
        ref = logprobs(adapter.model, ids)
    if config.sensitivity not in ("global", "uniform"):
        noise = layer_sensitivity(adapter, ids, rel=config.noise, ref=ref)
    raw = dict(noise)
    noise_sens = {i: sig(v, 4) for i, v in noise.items()}
    setup = AutoSetup(
        info, budget, {}, {}, {}, {}, noise_sens, {}, ids, ids_note, ref, noise_eps=pending, reserved=reserved
    )
    ratio = min(1.0, budget / scope_bytes(config, info))
    for i, layer_stats in track(
        each_layer(stats, layers, adapter),
        total=len(layers),
        description="auto: candidates",
        disable=not progress,
        transient=True,
    ):
        raw[i] = _layer_setup(config, adapter, layer_stats, setup, i, ratio, raw[i], keep_tensors)
        del layer_stats
    setup.sens = {i: sig(raw[i], 4) for i in layers}  # global and pending: 1 until `finish_global`
    setup.uniform = _uniform_bytes(config, setup.problems, layers)
    return setup


def _layer_setup(
    config: AutoConfig, adapter, stats, setup: AutoSetup, i: int, ratio: float, raw: float, keep_tensors: bool
) -> float:
    """Layer i's candidates, kind sensitivities, front and probe into `setup`; returns its raw sensitivity (`raw`,
    the noise sensitivity, unless a probe replaces it; 1 with per-kind sensitivities, its losses in KL units)."""
    info, ids, ref = setup.info, setup.ids, setup.ref
    stored = config.accounting == "stored"
    # the codes stay until the probes below have run: rebuilding each probe's codes (`restore`) was a GPTQ of
    # the layer per quantized kind; one layer's int8 codes at every width are held at a time
    probing = config.sensitivity in ("kind", "probe")
    prob, m = layer_problem(config, adapter, stats, info, i, stored, keep_codes=keep_tensors or probing)
    target = ratio * prob.expert_bytes * prob.num_experts

    def measure(pt: LayerPoint) -> float:  # the layer alone compressed to `pt`
        return measure_states(adapter, info, {i: restore(config, adapter, stats, info, i, pt)}, ids, ref)

    if config.sensitivity == "kind":
        # every candidate's loss becomes s_{l,k}·L_e (KL units)
        setup.kind_sens[i] = kind_sensitivity(prob, target, measure, raw)
        apply_kind_scale(prob, setup.kind_sens[i])
        raw = 1.0
    setup.fronts[i] = layer_front(prob, config, info.layer(i))
    if config.sensitivity == "probe":
        found = probe_sensitivity(setup.fronts[i], target, measure)
        if found is not None:  # else nothing to probe with: keep the noise sensitivity
            setup.probes[i], raw = found
    if not keep_tensors:
        shed(prob)
        m = LayerMoments(i, m.w, m.s_y, m.s_yy, sample=m.sample)  # the token sample is read again at the end
    setup.moments[i], setup.problems[i] = m, prob
    return raw


def _uniform_bytes(
    config: AutoConfig, problems: dict[int, LayerProblem], layers
) -> dict[int, dict[int, int]]:
    """bits -> layer -> bytes of the layer's pure quantization at that width (where every slot has it)."""
    uniform: dict[int, dict[int, int]] = {}
    for b in config.quant_bits:
        for i in layers:
            state = uniform_state(problems[i], b)
            if state is not None:
                uniform.setdefault(b, {})[i] = problems[i].bytes_of(state)
    return uniform
