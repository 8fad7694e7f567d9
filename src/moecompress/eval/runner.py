"""One call that evaluates one in-memory model (an "arm") and fills its part of the results dict."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import MoECompressError, NonFiniteMetrics


def ppl_task_name(spec) -> str:
    """Metrics key of a perplexity stream: "ppl:<file name>" (or "ppl:tokens")."""
    return f"ppl:{Path(str(spec)).name}" if isinstance(spec, (str, os.PathLike)) else "ppl:tokens"


def model_info(model, path=None, name: str | None = None) -> dict[str, Any]:
    """results["model"]: type, router convention, MoE layers, experts, top-k, dtype and bytes."""
    from .bench import disk_bytes, resident_bytes

    info: dict[str, Any] = {
        "name": name or (Path(str(path)).name if path else type(model).__name__),
        "path": str(path) if path else None,
        "model_type": getattr(model.config, "model_type", None),
        "architecture": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "bytes": {"resident": resident_bytes(model)},
    }
    if path is not None and Path(str(path)).exists():
        info["bytes"]["disk"] = disk_bytes(path)
    try:
        from ..models import MoEAdapter

        ad = MoEAdapter(model)
        first = ad.moe_layers[0]
        info.update(
            router_convention=ad.router_spec(first).describe(),
            moe_layers=ad.moe_layers,
            num_experts=ad.num_experts(first),
            top_k=ad.top_k(first),
            router=ad.router_spec(first).to_dict(),
        )
    except MoECompressError:
        info["router_convention"] = "dense (no routed experts)"
    return info


def check_reference(model, reference, model_name: str, reference_name: str) -> None:
    """Refuse KL(reference || model) (None: no reference, nothing to check) between models whose logits do not correspond: another family (a dense
    student of the reference's family is the same family: `FamilySpec.dense_family`) or another vocabulary.
    The two fixtures share a tokenizer, so KL of one against the other used to be computed without a word."""
    from ..models.families import FAMILIES

    if reference is None:
        return

    def kind(m) -> tuple[str | None, int | None]:
        out = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        # logits per token: the output layer's width (the config's vocab_size when it has none)
        vocab = getattr(out, "out_features", None) or getattr(m.config, "vocab_size", None)
        return getattr(m.config, "model_type", None), vocab

    (mt, mv), (rt, rv) = kind(model), kind(reference)
    related = {mt, getattr(FAMILIES.get(mt), "dense_family", None)} & {
        rt,
        getattr(FAMILIES.get(rt), "dense_family", None),
    } - {None}
    if (mt != rt and not related) or (mv is not None and rv is not None and mv != rv):
        raise MoECompressError(
            f"--reference {reference_name} is a {rt} model with {rv} output tokens but {model_name} is a {mt} "
            f"model with {mv}: KL compares the same family's next-token distributions; pass the original "
            f"{model_name} was made from as --reference."
        )


def evaluate_model(
    model,
    tokenizer=None,
    *,
    tasks=None,
    ppl=None,
    reference=None,
    limit=None,
    num_fewshot: int | None = None,
    batch_size: int | str = 1,
    include_path=None,
    window: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    seed: int = 1234,
    progress: bool = True,
) -> dict[str, dict]:
    """{task: entry} for an arm: a perplexity stream ("ppl:<name>", with KL when `reference`) + lm-eval tasks.

    Every arm of a comparison must be evaluated with the same `ppl`, `window`, `stride`,
    `max_tokens`, `tasks`, `limit` and `num_fewshot` so its items pair with the others'.
    """
    from .lmeval import run_lm_eval
    from .metrics import evaluate_stream

    if reference is not None and ppl is None:
        raise MoECompressError(
            "KL to a reference model is measured on a text stream; pass a perplexity text "
            "(--ppl FILE) together with the reference."
        )
    metrics: dict[str, dict] = {}
    if ppl is not None:
        bs = batch_size if isinstance(batch_size, int) else 1
        metrics[ppl_task_name(ppl)] = evaluate_stream(
            model,
            ppl,
            tokenizer,
            reference=reference,
            window=window,
            stride=stride,
            max_tokens=max_tokens,
            batch_size=bs,
            progress=progress,
        )
    if tasks:
        metrics.update(
            run_lm_eval(
                model,
                tokenizer,
                tasks,
                num_fewshot=num_fewshot,
                limit=limit,
                batch_size=batch_size,
                include_path=include_path,
                seed=seed,
            )
        )
    return metrics


def non_finite(metrics: dict[str, dict]) -> list[str]:
    """'task metric=value' for every NaN or infinite aggregate of an arm's metrics (standard errors aside)."""
    import math

    return [
        f"{task} {k}={v}"
        for task, entry in metrics.items()
        for k, v in entry.get("aggregate", {}).items()
        if isinstance(v, float) and not k.endswith("_stderr") and not math.isfinite(v)
    ]


def check_finite(arm: str, metrics: dict[str, dict], allow_nan: bool = False) -> None:
    """Refuse (exit 1, one sentence naming the arm) metrics that are NaN or infinite, unless `allow_nan`.

    NaN weights, an infinite router row or tampered quantization scales make every logit NaN; the
    perplexity and KL are then NaN and the results JSON stores null, which read as a success before."""
    bad = non_finite(metrics)
    if bad and not allow_nan:
        raise NonFiniteMetrics(
            f"Arm '{arm}' evaluated to non-finite metrics ({', '.join(bad[:3])}): its weights, "
            "router or scales produce NaN or infinite values; check that checkpoint, or pass "
            "--allow-nan to keep these results."
        )


def plan_arm_fields(plan, tensors=None) -> dict[str, Any]:
    """An arm's gate_semantics, operator, mask_id and per_layer counts, read from a CompressionPlan.

    Per layer: ``retained`` = slots still served by a verbatim copy of their own expert;
    ``remapped`` = slots served by another stored expert (a prototype or a merged expert);
    ``operators`` = slots served by a replacement operator (constant, tilt, partial);
    ``dropped`` = slots with no expert (rerouted under keep/renorm, zero under replace).
    ``mask_id`` hashes the set of retained (layer, expert) pairs: arms with the same mask share it.
    """
    import hashlib
    import json

    rows, retained_all, ops_used, gates = [], [], set(), []
    for lp in sorted(plan.layers, key=lambda x: x.layer):
        sc = plan.scope(lp.scope)
        row = _layer_counts(lp, sc, retained_all, ops_used)
        if row["dropped"]:
            ops_used.add(f"reroute ({lp.gate})" if lp.gate in ("keep", "renorm") else "drop")
        if row["remapped"]:
            ops_used.add("remap")
        gates.append(lp.gate)
        rows.append(row)
    mask = hashlib.sha256(json.dumps(sorted(retained_all)).encode()).hexdigest()[:16]
    specs = sorted(
        {
            "16-bit" if s.quant is None else s.quant.name()
            for sc in plan.scopes
            for s in sc.stored
            if s.packing is None
        }
        | {s.packing for sc in plan.scopes for s in sc.stored if s.packing}
    )
    return {
        "gate_semantics": "/".join(sorted(set(gates))) or None,
        "operator": " + ".join(sorted(ops_used)) or None,
        "mask_id": mask,
        "per_layer": rows,
        "method": plan.method,
        "params": dict(plan.params),
        "precision": " + ".join(specs) + _tensor_precisions(plan),
        "bits_per_weight": routed_bits_per_weight(plan, tensors),
    }


def _layer_counts(lp, sc, retained_all: list, ops_used: set) -> dict:
    """`plan_arm_fields`'s row for layer `lp` (scope `sc`): its slots retained, remapped, served by an operator
    and dropped; appends its retained (layer, expert) pairs to `retained_all` and its operators to `ops_used`."""
    stored = {s.id: s for s in sc.stored}
    ret = rem = ops = drop = 0
    for e, slot in enumerate(lp.slots):
        if isinstance(slot, int):
            s = stored.get(slot)
            own = (
                s is not None
                and s.construction == "copy"
                and [tuple(x) for x in s.sources] == [(lp.layer, e)]
            )
            if own:
                ret += 1
                retained_all.append((lp.layer, e))
            else:
                rem += 1
        elif slot == "drop":
            drop += 1
        else:
            ops += 1
            ops_used.add(slot.op)
    return dict(
        layer=lp.layer,
        experts=len(lp.slots),
        stored=len(sc.stored),
        retained=ret,
        remapped=rem,
        operators=ops,
        dropped=drop,
        gate=lp.gate,
    )


def _tensor_precisions(plan) -> str:
    """ "; attention w4g32, embeddings w8c" for the non-expert classes the plan quantizes (issue 30), else ""."""
    found = sorted({(tq.kind, tq.quant.name()) for tq in plan.tensor_quant.values()})
    return "; " + ", ".join(f"{kind} {spec}" for kind, spec in found) if found else ""


def routed_bits_per_weight(plan, tensors=None) -> float:
    """Stored routed-expert bits (experts, operators, packed codes, scales) per ORIGINAL routed-expert weight
    (None when the plan's packed tensors are not at hand to count)."""
    from ..errors import MoECompressError

    try:
        b = plan.logical_bytes(tensors)
    except MoECompressError:
        return None
    params = plan.model.expert_bytes / plan.model.element_size
    return round(8 * (b.stored_experts + b.operators) / params, 4)
