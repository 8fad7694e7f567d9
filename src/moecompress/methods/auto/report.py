"""`auto`'s report, ``params["auto"]`` of the plan (docs/auto.md, "Output"): per layer what was chosen, its bytes,
estimated error and KL, the error measured on a token sample and the measured KL; with a whole-file budget, the
non-expert classes' precisions. The byte counts are checked against the plan's own (`CompressionPlan.logical_bytes`)."""

from __future__ import annotations

from ...plan import CompressionPlan, ModelInfo
from .config import AutoConfig
from .frontier import STORED_KINDS
from .measure import kl_to, plan_installed, sig
from .setup import AutoSetup
from .tensors import KEY_OFFSET


def budget_fields(budget: int, files: int | None, reserved: int) -> dict:
    """The budget as params["auto"] records it: ``budget_bytes`` (the user's, in the budget's scope),
    ``files_budget_bytes`` (what the weight files written may hold, headers included: the export refuses more,
    `export.budget.check_weight_budget`), ``reserved_bytes`` (kept for the files' non-tensor bytes, `export.auto_reserve`)
    and ``tensor_budget_bytes`` (what the allocation could use: the budget less the reserve)."""
    return dict(
        budget_bytes=budget,
        files_budget_bytes=files,
        reserved_bytes=reserved,
        tensor_budget_bytes=budget - reserved,
    )


def identity(config: AutoConfig, adapter, info: ModelInfo, budget: int, files: int | None, reserved: int):
    """Everything fits: keep every expert (a zero-loss removal is still a change to the model)."""
    plan = CompressionPlan.identity(adapter.model, method="auto")
    params = config.model_dump()
    params["auto"] = dict(
        budget_scope=config.budget_scope,
        **budget_fields(budget, files, reserved),
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


def summary(
    config: AutoConfig,
    adapter,
    setup: AutoSetup,
    plan,
    tensors,
    chosen,
    sample_error,
    budget: int,
    files: int,
) -> dict:
    """params["auto"]: the per-layer table (what was chosen, estimated and measured), the routed bytes and the
    budget (`budget_fields`; `budget` the user's, `files` the weight files')."""
    sens, info = setup.sens, setup.info
    table = [
        _layer_row(config, adapter, setup, plan, tensors, i, chosen[i], sample_error)
        for i in adapter.moe_layers
    ]
    routed = plan.logical_bytes(tensors, accounting=config.accounting).routed
    solver = sum(chosen[i].bytes for i in adapter.moe_layers)
    if routed != solver or (config.budget_scope == "routed" and routed > setup.budget):
        raise RuntimeError(
            f"auto: the solver counted {solver} routed bytes, the plan holds {routed} (budget "
            f"{setup.budget}); this is a bug, please report it."
        )
    return dict(
        budget_scope=config.budget_scope,
        **budget_fields(budget, files, setup.reserved),
        routed_bytes=routed,
        dtype=info.dtype,
        original_routed_bytes=info.expert_bytes,
        accounting=config.accounting,
        est_kl=sig(sum(chosen[i].loss * sens[i] for i in adapter.moe_layers)),
        sensitivity_data=setup.ids_note,
        layers=table,
    )


def _layer_row(
    config: AutoConfig, adapter, setup: AutoSetup, plan, tensors, i: int, pt, sample_error
) -> dict:
    """Layer i's row of the table: its choices and precisions, bytes, estimates, sensitivities and measurements."""
    sens = setup.sens
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
        est_error=sig(sum(c.error for c in pt.choice)),
        sensitivity=sens[i],
        noise_sensitivity=setup.noise_sens[i],
        est_kl=sig(pt.loss * sens[i]),
    )
    if i in setup.kind_sens:
        row["kind_sensitivity"] = setup.kind_sens[i]
    if i in setup.probes:
        b, err, kl = setup.probes[i]
        row["probe"] = dict(bytes=b, est_error=sig(err), measured_kl=sig(kl))
    if i in sample_error:
        row["sample_error"] = sample_error[i]
    # one forward per layer, each through every layer: the fast search measures the whole plan only
    if any(c.kind != "keep" for c in pt.choice) and config.measure and config.search == "full":
        with plan_installed(adapter, plan, tensors, [i]):
            row["measured_kl"] = sig(kl_to(setup.ref, adapter.model, setup.ids))
    return row


def whole_summary(summary: dict, whole, fronts, chosen_idx, plan, tensors, budget: int) -> None:
    """The whole-file part of params["auto"]: per-class precisions and the whole file's bytes (checked)."""
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
        est_kl=sig(summary["est_kl"] + tensor_kl),
        tensors=whole.table(fronts, chosen_idx),
    )
