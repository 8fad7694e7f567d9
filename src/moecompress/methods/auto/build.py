"""`build_auto`: the method's entry point — the setup, the allocation of the budget across MoE layers (and, with
a whole-file budget, the non-expert tensors), the plan built layer by layer, its report and measurements."""

from __future__ import annotations

import contextlib

from ...errors import MoECompressError
from ...memory import large_blocks_mmapped
from ...plan import CompressionPlan, ModelInfo
from ..context import MethodContext
from ..tensor_quant import quantize_tensors
from . import report
from .config import AutoConfig, needs_stats, routed_budget, scope_bytes
from .divergence import SERVED_DTYPES, choose, prefix_allocations, stages
from .files import file_overhead, files_budget
from .materialise import plan_layer_by_layer
from .measure import calibration_ids, kl_to, logprobs, plan_installed, sample_layer_error, sig
from .sensitivity import noise_installed
from .setup import AutoSetup, prepare
from .solver import allocate, uniform_bits_check
from .target import allocate_for_target, check_groups, constrained, unquantized_classes
from .tensors import WholeFile, chosen_classes, dequantized_weights, hessians, weights_installed


def whole_file(config: AutoConfig, adapter, stats, setup: AutoSetup) -> WholeFile | None:
    """The non-expert part of a whole-file budget (`tensors.WholeFile`), or None with a routed budget."""
    if config.budget_scope != "whole":
        return None
    ids, ref = setup.ids, setup.ref
    if ids is None:  # sensitivity uniform, measure off: the Hessians and class probes still need tokens
        ids, _ = calibration_ids(
            stats, adapter, config.sensitivity_sequences, config.sensitivity_seq_len, config.seed
        )
        ref = logprobs(adapter.model, ids)
    classes = [
        c
        for c in chosen_classes(adapter, config.tensor_classes)
        if c not in unquantized_classes(config.target)
    ]
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
        proxy=config.proxy_pricing,
        extra=None
        if setup.noise_eps is None
        else lambda rows: noise_installed(adapter, setup.noise_eps, rows),
    )


def exact_stages(config: AutoConfig, adapter, stats, setup: AutoSetup, whole, fronts, chosen):
    """(allocation, report or None): `chosen`, or the allocation keeping the first stages exact when their
    served-precision divergence outweighs what it costs (`divergence.choose`), for a whole-file budget on a 16-bit
    checkpoint served by our runtime (`divergence_stages` > 0)."""
    dtype = SERVED_DTYPES.get(setup.info.dtype)
    if whole is None or dtype is None or config.divergence_stages == 0 or constrained(config.target):
        return chosen, None
    found = stages(adapter, whole, config.divergence_stages)
    if not found:
        return chosen, None
    scale = item_scales(setup, whole)
    run = lambda f, b: allocate(f, scale, b)  # noqa: E731
    options = prefix_allocations(fronts, scale, setup.budget - whole.fixed, chosen, found, run)
    ref = setup.ref if setup.ids is whole.ids else logprobs(adapter.model, whole.ids)
    more, _ = calibration_ids(
        stats, adapter, config.divergence_sequences, config.sensitivity_seq_len, config.seed
    )
    return choose(adapter, found, fronts, scale, options, (whole.ids, ref, more, dtype))


def item_scales(setup: AutoSetup, whole) -> dict[int, float]:
    """The allocation's scale of every item: s_l for MoE layers, 1 for tensors (their losses are KL already)."""
    return {**setup.sens, **dict.fromkeys(whole.fronts() if whole is not None else {}, 1.0)}


def allocate_all(config: AutoConfig, setup: AutoSetup, whole) -> tuple[dict, dict[int, int]]:
    """(fronts of every item, the chosen index of each): MoE layers and, for a whole-file budget, tensors."""
    fronts, scale, uniform = (
        dict(setup.fronts),
        dict(setup.sens),
        {b: dict(v) for b, v in setup.uniform.items()},
    )
    budget = setup.budget
    if constrained(config.target):
        extra = whole.fronts() if whole is not None else {}
        fixed = whole.fixed if whole else 0
        # `fixed` (as the target's refusal counts the file) includes the bytes reserved for the headers
        fronts, chosen, _ = allocate_for_target(config, setup, extra, budget - fixed, fixed + setup.reserved)
        return fronts, chosen
    if whole is not None:
        tf = whole.fronts()
        fronts.update(tf)
        scale = item_scales(setup, whole)
        for b in uniform:
            uniform[b].update(whole.uniform(b))
        budget -= whole.fixed
        minimum = sum(f[0].bytes for f in fronts.values())
        if minimum > budget:
            raise MoECompressError(
                f"The budget of {setup.budget + setup.reserved} bytes ({setup.reserved} of them reserved for "
                f"the files' headers) is below the smallest whole file auto can reach ({minimum + whole.fixed} "
                "bytes of tensors: every expert layer keeps what its router needs, every weight at the lowest "
                "width tried, norms and routers as they are); raise the budget or add lower widths to bits."
            )
    elif (minimum := sum(f[0].bytes for f in fronts.values())) > budget:
        raise MoECompressError(
            f"The budget of {setup.budget + setup.reserved} routed-expert bytes is below the smallest reachable "
            f"({minimum + setup.reserved}: every layer keeps what its router needs, and {setup.reserved} bytes are "
            "reserved for the files' headers); raise the budget."
        )
    chosen = allocate(fronts, scale, budget)
    return fronts, uniform_bits_check(fronts, scale, budget, chosen, uniform)


def build_auto(config: AutoConfig, context: MethodContext):
    """CompressionPlan (+ tensors) of the budget-optimal mixed representation; see the package doc."""
    # the operator fits' H × H float64 temporaries fragment the heap (memory.py); without them a fixed mmap
    # threshold only costs page faults (docs/auto.md, "Fast search")
    fits = {"constant", "tilt", "partial"} & set(config.candidates)
    with large_blocks_mmapped() if fits else contextlib.nullcontext():
        return _build_auto(config, context)


def _build_auto(config: AutoConfig, context: MethodContext):
    adapter, stats = context.adapter, context.stats
    if stats is None:
        raise MoECompressError(
            "The auto method needs calibration statistics; run moecompress calibrate "
            "--for-method auto first (or pass --calib SPEC)."
        )
    stats.require(*needs_stats(config), method="auto")
    info = ModelInfo.from_model(adapter)
    check_groups(config, info)
    budget = routed_budget(config, info)
    if config.budget is not None and config.budget >= 1:
        # the whole original asked for: nothing is compressed, so no file bound (its header is not the original's)
        return report.identity(config, adapter, info, budget, None, 0)
    # the budget bounds the weight files written, headers included: what no choice makes is reserved first
    files = files_budget(config, info, budget)
    reserved = file_overhead(config, adapter, info, files)
    if scope_bytes(config, info) + reserved <= budget:
        return report.identity(config, adapter, info, budget, files, reserved)

    setup = prepare(config, adapter, stats, context.progress, reserved=reserved)
    whole = whole_file(config, adapter, stats, setup)
    setup.finish_global(adapter, whole.extra_kl if whole is not None else None)
    fronts, chosen_idx = allocate_all(config, setup, whole)
    chosen_idx, divergence = exact_stages(config, adapter, stats, setup, whole, fronts, chosen_idx)
    chosen = {i: fronts[i][chosen_idx[i]] for i in adapter.moe_layers}
    sample_error: dict[int, float] = {}

    def measure_sample(i: int, part: CompressionPlan, part_tensors) -> None:
        # here, not after the plan: the layer is still lent and its tensors in memory (read back from the
        # store, every layer's were mapped in again on the streamed view)
        if any(c.kind != "keep" for c in chosen[i].choice) and setup.moments[i].sample is not None:
            sample_error[i] = sig(sample_layer_error(adapter, part, part_tensors, i, setup.moments[i].sample))

    plan, tensors = plan_layer_by_layer(config, adapter, stats, info, chosen, on_layer=measure_sample)
    if whole is not None and (specs := whole.specs(fronts, chosen_idx)):
        plan, tensors = quantize_tensors(plan, tensors, adapter, specs, hessians(adapter, stats, whole.ids))
    summary = report.summary(config, adapter, setup, plan, tensors, chosen, sample_error, budget, files)
    if whole is not None:
        report.whole_summary(summary, whole, fronts, chosen_idx, plan, tensors, setup.budget)
    if divergence is not None:
        summary["divergence"] = divergence
    if config.measure:
        with installed(adapter, plan, tensors, adapter.moe_layers):
            summary["measured_kl"] = sig(kl_to(setup.ref, adapter.model, setup.ids))
    params = config.model_dump()
    params["auto"] = summary
    return plan.model_copy(update={"params": params}), tensors


@contextlib.contextmanager
def installed(adapter, plan: CompressionPlan, tensors, layers):
    """The plan's MoE `layers` and its quantized non-expert weights in the model, for a measurement."""
    with (
        plan_installed(adapter, plan, tensors, layers),
        weights_installed(adapter, dequantized_weights(plan, tensors)),
    ):
        yield
