"""The five-item reporting checklist every report prints: an item the results do not support is listed as
MISSING with what would satisfy it, never left out."""

from __future__ import annotations

from .report_tables import human
from .schema import Results, arm_bytes, validate_results

CHECKLIST_TITLES = (
    "Router convention of the model and the gate semantics each arm used",
    "Replacement operators compared on a fixed mask",
    "At least one generative task",
    "Calibration domain, source and token count",
    "Matched-storage quantization baseline (RTN, group-wise, symmetric, 4/3-bit on routed experts)",
)


def _router_item(res: Results) -> tuple[bool, str]:
    """Item 1: the model's router convention and the gate semantics of every compressed arm."""
    conv = res.model.router_convention
    needs = [a for a in res.arms if a.kind != "original"]
    lacking = [a.name for a in needs if not a.gate_semantics]
    sem = "; ".join(f"{a.name}: {a.gate_semantics or 'not recorded'}" for a in needs) or "no compressed arms"
    if conv and not lacking:
        return (True, f"router: {conv}. Gate semantics — {sem}.")
    miss = ([] if conv else ["the model's router convention"]) + (
        [f"gate semantics of {', '.join(lacking)}"] if lacking else []
    )
    return (False, f"not recorded: {' and '.join(miss)}.")


def _fixed_mask_item(res: Results) -> tuple[bool, str]:
    """Item 2: two or more arms sharing a retained-expert mask with different replacement operators."""
    by_mask: dict[str, set] = {}
    for a in res.arms:
        if a.mask_id:
            by_mask.setdefault(a.mask_id, set()).add(a.operator or "none")
    fixed = {m: ops for m, ops in by_mask.items() if len(ops) >= 2}
    if fixed:
        return (
            True,
            "; ".join(f"mask {m[:12]}: operators {', '.join(sorted(ops))}" for m, ops in fixed.items()) + ".",
        )
    return (
        False,
        "no two arms share a retained-expert mask (mask_id) with different replacement "
        "operators, so operator effects are confounded with mask effects.",
    )


def _generative_item(res: Results) -> tuple[bool, str]:
    """Item 3: at least one generate_until task evaluated."""
    gen = sorted({t for a in res.arms for t, e in a.metrics.items() if e.output_type == "generate_until"})
    return (
        (True, f"generative task(s): {', '.join(gen)}.")
        if gen
        else (
            False,
            "no generate_until task was evaluated (e.g. fixture_gen, gsm8k); multiple-choice accuracy "
            "alone can hide generation collapse.",
        )
    )


def _calibration_item(res: Results) -> tuple[bool, str]:
    """Item 4: the shared calibration's domain, source and token count, and each arm's own calibration."""
    cal = res.calibration
    fields = {
        "domain": cal.domain if cal else None,
        "source": cal.source if cal else None,
        "tokens": cal.tokens if cal else None,
    }
    missing = [k for k, v in fields.items() if v in (None, "")]
    own = [(a.name, c) for a in res.arms if (c := (a.model_extra or {}).get("calibration"))]
    each = "".join(
        f"; arm {n}: domain {c.get('domain')}, source {c.get('source')} ({c.get('origin')}), "
        f"{c.get('tokens') or 0:,} tokens"
        for n, c in own
    )
    if not missing:
        return (True, f"domain: {cal.domain}; source: {cal.source}; tokens: {cal.tokens:,}{each}.")
    if own and cal is None:  # every arm calibrated on its own spec
        return (True, each.lstrip("; ") + ".")
    return (False, f"calibration {', '.join(missing)} not recorded{each}.")


def _quant_baseline_item(res: Results) -> tuple[bool, str]:
    """Item 5: an evaluated matched-storage pure-quantization arm, with its bits per weight and size."""
    quant = [a for a in res.arms if a.kind == "quant_baseline" and a.metrics]
    if not quant:
        return (
            False,
            "no evaluated pure-quantization arm (method 'quant', kind 'quant_baseline'); add "
            "eval.quant_baselines or an arm with method quant.",
        )
    desc = []
    for a in quant:
        bpw = (a.model_extra or {}).get("bits_per_weight")
        size = arm_bytes(a)
        desc.append(f"{a.name} ({bpw:.3f} bits/weight incl. scales, " if bpw else f"{a.name} (")
        desc[-1] += f"{human(size)})" if size is not None else "size not recorded)"
    return (True, "; ".join(desc) + ".")


def checklist(results: dict | Results) -> list[dict]:
    """The five reporting items: {"item", "title", "done", "detail"} (detail says what is missing)."""
    res = results if isinstance(results, Results) else validate_results(results)
    items = [
        _router_item(res),
        _fixed_mask_item(res),
        _generative_item(res),
        _calibration_item(res),
        _quant_baseline_item(res),
    ]
    return [
        dict(item=i + 1, title=CHECKLIST_TITLES[i], done=d, detail=det) for i, (d, det) in enumerate(items)
    ]


def checklist_markdown(items: list[dict]) -> str:
    """The checklist as a numbered markdown list, each item marked done or MISSING."""
    lines = []
    for it in items:
        mark = "done" if it["done"] else "MISSING"
        lines.append(f"{it['item']}. **{mark}** — {it['title']}: {it['detail']}")
    return "\n".join(lines)
