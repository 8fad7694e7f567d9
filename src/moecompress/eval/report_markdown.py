"""report.md's text: the model's facts and the checklist, then one section per kind of result (arms,
paired comparisons, memory and latency, the quantization reference, per-layer experts, calibration, plots,
notes), each left out when the results hold nothing for it."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from .report_checklist import checklist_markdown
from .report_comparisons import min_replicates
from .report_tables import fmt, human, md_table, task_columns
from .schema import Results, arm_bytes


def _header(res: Results, items: list[dict]) -> list[str]:
    """The title, when and where the machine-readable results are, the model's facts and the checklist."""
    m = res.model
    out = [f"# moecompress report — {m.name or m.path or m.model_type or 'model'}", ""]
    out.append(
        f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; machine-readable "
        "results (incl. per-item scores) in `results.json`."
    )
    out.append("")
    facts = [
        ("model", m.name or m.path),
        ("model type", m.model_type),
        ("router convention", m.router_convention),
    ]
    for key in ("num_experts", "top_k", "moe_layers", "dtype"):
        if (m.model_extra or {}).get(key) is not None:
            facts.append((key.replace("_", " "), m.model_extra[key]))
    out.append(md_table(["", ""], [(k, v if v is not None else "—") for k, v in facts]))
    out += ["", "## Reporting checklist", "", checklist_markdown(items), ""]
    return out


def _arms_section(res: Results) -> list[str]:
    """One row per arm: method, parameters, gate semantics, operator, precision, size and every task metric."""
    base = next(a for a in res.arms if a.name == res.baseline)
    base_bytes = arm_bytes(base)
    cols = task_columns(res)
    out = ["## Arms", ""]
    header = [
        "arm",
        "method",
        "params",
        "gate semantics",
        "operator",
        "precision",
        "bits/weight",
        "size",
        "size vs baseline",
    ]
    header += [f"{t} {mm}" for t, mm in cols]
    rows = []
    for a in res.arms:
        b = arm_bytes(a)
        rel = f"{100 * b / base_bytes:.1f}%" if b is not None and base_bytes else "—"
        params = ", ".join(f"{k}={v}" for k, v in a.params.items()) or "—"
        extra = a.model_extra or {}
        row = [
            a.name + (" (baseline)" if a.name == res.baseline else ""),
            a.method,
            params,
            a.gate_semantics or "—",
            a.operator or "—",
            extra.get("precision") or "—",
            fmt(extra.get("bits_per_weight"), 3),
            human(b),
            rel,
        ]
        for t, mm in cols:
            e = a.metrics.get(t)
            row.append(fmt(e.aggregate.get(mm)) if e else "—")
        rows.append(row)
    out += [md_table(header, rows), ""]
    out.append(
        "Size: `bytes.model` (the plan's bytes: packed codes and scales for quantized experts), else bytes "
        "on disk, else resident parameter bytes. Bits/weight: stored routed-expert bits (scales and operators "
        "included) per original routed-expert weight."
    )
    out.append("")
    return out


def _comparisons_table(comparisons: list[dict]) -> str:
    """The paired comparisons as one markdown table: arms, task, metric, means, Δ, interval, p and verdict."""
    rows = [
        [
            c["a"],
            c["b"],
            c["task"],
            c["metric"],
            c["n"],
            fmt(c["mean_a"]),
            fmt(c["mean_b"]),
            fmt(c["delta"]),
            f"[{fmt(c['ci_low'])}, {fmt(c['ci_high'])}]",
            fmt(c["p"]),
            fmt(c["p_adjusted"]),
            c["verdict"],
        ]
        for c in comparisons
    ]
    return md_table(
        [
            "A",
            "B",
            "task",
            "metric",
            "items",
            "A mean",
            "B mean",
            "Δ (A−B)",
            "interval",
            "p",
            "p (Holm)",
            "verdict",
        ],
        rows,
    )


def _comparisons_section(res: Results, comparisons: list[dict], settings: dict) -> list[str]:
    """How the comparisons were made, their table, and a warning when B is too small for any verdict."""
    out = ["## Paired comparisons", ""]
    if comparisons:
        out.append(
            f"A = arm, B = the other arm (default: the baseline `{res.baseline}`), on the same items; Δ = "
            f"mean(A − B) of the primary metric (perplexity streams: per-window mean NLL). Paired bootstrap, "
            f"B = {settings['B']} replicates, seed {settings['seed']}, {100 * (1 - settings['alpha']):.0f}% "
            f"percentile interval; p from the bootstrap; Holm correction over all {len(comparisons)} "
            "comparisons. A difference whose interval contains 0 or whose Holm-adjusted p exceeds α is "
            "*not detectably different* — not equal."
        )
        out.append("")
        out.append(_comparisons_table(comparisons))
        m, nb = len(comparisons), settings["B"]
        if nb is not None and 2 * m / (nb + 1) > settings["alpha"]:
            out.append("")
            out.append(
                f"**Warning:** with B = {nb} replicates the smallest bootstrap p is 2/(B+1) = "
                f"{2 / (nb + 1):.4f}, "
                f"so after Holm over {m} comparisons no difference can reach α = {settings['alpha']}; re-run "
                f"with B ≥ {min_replicates(m, settings['alpha'])}."
            )
    else:
        out.append("No comparisons: fewer than two arms share per-item results.")
    out.append("")
    return out


def _memory_section(res: Results) -> list[str]:
    """Bytes on disk and resident, peak memory and prefill / decode speed per arm, when measured."""
    out: list[str] = []
    if any(a.memory or a.latency or a.bytes.disk or a.bytes.resident for a in res.arms):
        out += ["## Memory and latency", ""]
        rows = []
        for a in res.arms:
            mem, lat = a.memory or {}, a.latency or {}
            rows.append(
                [
                    a.name,
                    human(a.bytes.disk),
                    human(a.bytes.resident),
                    human(mem.get("peak_bytes")),
                    human(mem.get("peak_delta_bytes")),
                    fmt(lat.get("prefill_tok_s"), 1),
                    fmt(lat.get("decode_tok_s"), 1),
                ]
            )
        out.append(
            md_table(
                [
                    "arm",
                    "on disk",
                    "resident params",
                    "peak memory",
                    "peak − before",
                    "prefill tok/s",
                    "decode tok/s",
                ],
                rows,
            )
        )
        lat0 = next((a.latency for a in res.arms if a.latency), None)
        if lat0:
            out.append("")
            out.append(
                f"Latency: greedy generation, batch {lat0.get('batch_size')}, prompt {lat0.get('prompt_len')} "
                f"tokens, {lat0.get('new_tokens')} new tokens, median of {lat0.get('repeats')} runs after "
                f"{lat0.get('warmup')} warm-up on {lat0.get('device')}. Peak memory: "
                f"{(next((a.memory for a in res.arms if a.memory), {}) or {}).get('kind', '—')}."
            )
        out.append("")
    return out


def _quant_section(res: Results) -> list[str]:
    """The pure-quantization reference arms: spec, algorithm, bits per weight and size."""
    out: list[str] = []
    quant = [a for a in res.arms if a.kind == "quant_baseline"]
    if quant:
        out += ["## Quantization reference", ""]
        rows = []
        for a in quant:
            extra = a.model_extra or {}
            rows.append(
                [
                    a.name,
                    a.params.get("quant"),
                    a.params.get("algo", "gptq"),
                    fmt(extra.get("bits_per_weight"), 3),
                    human(arm_bytes(a)),
                ]
            )
        out.append(md_table(["arm", "spec", "algorithm", "bits/weight", "size"], rows))
        out.append("")
        out.append(
            "Pure quantization of every routed expert (method `quant`: no structural change), exported and "
            "loaded back like every other arm; docs/quantization.md states the grid."
        )
        out.append("")
    return out


def _per_layer_section(res: Results) -> list[str]:
    """Per arm and layer: experts still served by themselves, remapped and replaced by operators."""
    out: list[str] = []
    per_layer = [a for a in res.arms if a.per_layer]
    if per_layer:
        out += ["## Per-layer experts", ""]
        layers = sorted({int(r.get("layer", k)) for a in per_layer for k, r in enumerate(a.per_layer)})
        rows = []
        for a in per_layer:
            by = {int(r.get("layer", k)): r for k, r in enumerate(a.per_layer)}
            rows.append(
                [a.name]
                + [
                    f"{by[i].get('retained', '—')}/{by[i].get('experts', '—')}"
                    + (f" (+{by[i]['remapped']} remapped)" if by[i].get("remapped") else "")
                    + (f" (+{by[i]['operators']} operators)" if by[i].get("operators") else "")
                    if i in by
                    else "—"
                    for i in layers
                ]
            )
        out.append(md_table(["arm"] + [f"layer {i}" for i in layers], rows))
        out.append("")
        out.append(
            "Cells: slots still served by their own expert / original routed experts (+ slots served by "
            "another stored expert or by a replacement operator)."
        )
        out.append("")
    return out


def _calibration_section(res: Results) -> list[str]:
    """The shared calibration's fields, and the arms calibrated on their own spec."""
    out: list[str] = []
    if res.calibration is not None:
        out += ["## Calibration", ""]
        cal = res.calibration.model_dump(exclude_none=True)
        out.append(md_table(["", ""], [(k, v) for k, v in cal.items()]))
        out.append("")
    own = [(a.name, c) for a in res.arms if (c := (a.model_extra or {}).get("calibration"))]
    if own:
        out += ["Arms with their own calibration (every arm is scored on the same items):", ""]
        out.append(
            md_table(
                ["arm", "domain", "source", "tokens"],
                [(n, c.get("domain"), c.get("source"), f"{c.get('tokens') or 0:,}") for n, c in own],
            )
        )
        out.append("")
    return out


def _plots_section(plots: dict[str, Path | None], comparisons: list[dict]) -> list[str]:
    """The plots drawn, embedded by file name; says so when no task was worth a per-task plot."""
    out: list[str] = []
    shown = [(k, p) for k, p in plots.items() if p is not None]
    if shown:
        out += ["## Plots", ""]
        titles = {
            "quality_vs_bytes": "Quality vs size",
            "task_deltas": "Per-task paired differences",
            "per_layer": "Routed experts per layer",
        }
        for k, p in shown:
            out += [f"![{titles.get(k, k)}]({p.name})", ""]
        if plots.get("task_deltas") is None and comparisons:
            out += [
                "No per-task plot: on no task does any paired interval exclude 0 (see the table above).",
                "",
            ]
    return out


def render_markdown(
    res: Results, comparisons: list[dict], items: list[dict], plots: dict[str, Path | None], settings: dict
) -> str:
    """report.md's text (without the final newline) from the validated results and what `write_report` computed."""
    out = _header(res, items)
    out += _arms_section(res)
    out += _comparisons_section(res, comparisons, settings)
    out += _memory_section(res)
    out += _quant_section(res)
    out += _per_layer_section(res)
    out += _calibration_section(res)
    out += _plots_section(plots, comparisons)
    if res.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in res.notes] + [""]
    return "\n".join(out)
