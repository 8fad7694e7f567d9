"""Pre-distillation sweep: held-out perplexity of the dense conversion over criterion × grouping × K × scaling.

Each configuration runs in place (`methods.dense_convert.dense_view`: the teacher with its MoE blocks
replaced by the converted dense FFNs — the function the exported student computes, tested), so
no checkpoint is written per configuration. With K = top-k every grouping is the identity (one
expert per group), so those cells are computed once per criterion × scaling and shared.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch

from ..errors import MoECompressError
from ..methods.dense_convert import convert, dense_view
from ..methods.dense_fit import CRITERIA, GROUPINGS, SCALINGS, DenseConfig, canonical
from ..models import MoEAdapter
from .dense_export import load_stats
from .student_config import student_target


def dense_sweep(
    model,
    calib,
    heldout,
    *,
    criteria=CRITERIA,
    groupings=GROUPINGS,
    Ks=None,
    scalings=("uniform", "proportional"),
    mass_scale: bool = False,
    seq_len: int = 256,
    heldout_tokens: int | None = 16384,
    window: int = 256,
    progress: bool = True,
) -> dict:
    """Perplexity of every configuration; returns {"rows": [...], "teacher_ppl", "top_k", "Ks", ...}.

    A scaling may carry "+mass" ("uniform+mass"): α_g scaled by the measured mean top-k routing mass
    instead of the routed scaling factor (the option for routers that do not renormalise).
    """
    from ..eval.metrics import evaluate_stream

    model, source = _sweep_model(model)
    adapter = MoEAdapter(model)
    tokenizer = _tokenizer_at(source)
    criteria = [canonical(c, CRITERIA, "criterion") for c in criteria]
    groupings = [canonical(g, GROUPINGS, "grouping") for g in groupings]
    _check_scalings(scalings)
    k = min(adapter.top_k(i) for i in adapter.moe_layers)
    E = min(adapter.num_experts(i) for i in adapter.moe_layers)
    Ks = sorted(set(Ks or [k * m for m in (1, 2, 4, 8) if k * m <= E]))
    if any(K < k or K > E for K in Ks):
        raise MoECompressError(f"Every K must lie in {k}..{E} (top-k..experts); got {Ks}.")
    stats, calib_info = load_stats(calib, model, tokenizer, seq_len=seq_len, gram=True, progress=progress)
    ids = _heldout_ids(heldout, tokenizer, heldout_tokens)

    def ppl() -> float:
        return evaluate_stream(model, ids, window=window, progress=False)["aggregate"]["ppl"]

    t0 = time.time()
    teacher_ppl = ppl()
    combos = list(itertools.product(criteria, groupings, scalings, Ks))
    rows, cache = _sweep_rows(adapter, stats, combos, k, mass_scale, ppl, progress)
    return {
        "model": source or getattr(model, "name_or_path", None),
        "model_type": adapter.model_type,
        "top_k": k,
        "num_experts": E,
        "Ks": Ks,
        "teacher_ppl": teacher_ppl,
        "rows": rows,
        "calibration": calib_info,
        "heldout_tokens": int(ids.numel()),
        "window": window,
        "mass_scale": mass_scale,
        "evaluations": len(cache) + 1,
        "wall_s": round(time.time() - t0, 1),
    }


def _sweep_model(model):
    """(model, source): a directory or hub id loaded in float32 (source its string), a loaded model as is."""
    from ..models import load_model

    if isinstance(model, (str, Path)):
        source = str(model)
        return load_model(source, dtype="float32"), source
    return model, None


def _tokenizer_at(source):
    """The tokenizer of model directory `source` (refused in one sentence when it has none); None otherwise."""
    if source is not None and Path(source).is_dir():
        from ..data import load_tokenizer

        return load_tokenizer(source)
    return None


def _check_scalings(scalings) -> None:
    """Refuse a scaling that is not a known one, optionally with ``+mass``."""
    for scl in scalings:
        base, _, extra = scl.partition("+")
        canonical(base, SCALINGS, "scaling")
        if extra not in ("", "mass"):
            raise MoECompressError(
                f"Unknown scaling '{scl}'; use uniform, proportional or gate, optionally with "
                "'+mass' (e.g. uniform+mass)."
            )


def _heldout_ids(heldout, tokenizer, heldout_tokens: int | None) -> torch.Tensor:
    """The held-out token ids (token ids as given, or a data spec's stream), cut to `heldout_tokens`."""
    if isinstance(heldout, torch.Tensor):
        ids = heldout.reshape(-1).long()
    else:
        if tokenizer is None:
            raise MoECompressError(
                "The held-out text needs the model's tokenizer; pass a model directory with one."
            )
        from ..data import token_stream

        ids = token_stream(str(heldout), tokenizer).ids
    if heldout_tokens is not None:
        ids = ids[:heldout_tokens]
    return ids


def _sweep_rows(adapter, stats, combos, k: int, mass_scale: bool, ppl, progress: bool) -> tuple[list, dict]:
    """(rows, cache): the perplexity of each (criterion, grouping, scaling, K) in `combos`, computed in place on
    the dense view; a cell with K = top-k ignores the grouping, so it is computed once per criterion × scaling."""
    rows, cache = [], {}
    from rich.progress import Progress

    with Progress(transient=True, disable=not progress) as bar:
        job = bar.add_task("dense sweep", total=len(combos))
        for crit, grp, scl, K in combos:
            key = (crit, "-" if K == k else grp, scl, K)
            if key not in cache:
                base, _, extra = scl.partition("+")  # "uniform+mass": α scaled by the measured top-k mass
                cfg = DenseConfig(
                    criterion=crit,
                    K=K,
                    grouping=grp,
                    scaling=canonical(base, SCALINGS, "scaling"),
                    mass_scale=mass_scale or extra == "mass",
                )
                target = student_target(adapter, cfg)
                conv = convert(adapter, stats, cfg, fold_shared=target.fold_shared, progress=False)
                with torch.no_grad(), dense_view(adapter, conv):
                    cache[key] = ppl()
            rows.append({"criterion": crit, "grouping": grp, "scaling": scl, "K": K, "ppl": cache[key]})
            bar.advance(job)
    return rows, cache


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}"


def sweep_markdown(result: dict) -> str:
    """The paper's table layout: one row per criterion × grouping × scaling, one column per K, best K bold."""
    Ks = result["Ks"]
    by = {}
    for r in result["rows"]:
        by.setdefault((r["criterion"], r["grouping"], r["scaling"]), {})[r["K"]] = r["ppl"]
    best = min(result["rows"], key=lambda r: r["ppl"])
    lines = [
        f"Pre-distillation held-out perplexity, `{Path(str(result['model'])).name}` ({result['model_type']}, "
        f"{result['num_experts']} experts, top-{result['top_k']}); MoE teacher: **{_fmt(result['teacher_ppl'])}**; "
        f"{result['heldout_tokens']:,} held-out tokens, windows of {result['window']}. "
        f"K = {result['top_k']} is pure pruning (every grouping identical). Bold: best K per row.",
        "",
        "Best configuration per criterion:",
        "",
        "| criterion | best grouping / scaling / K | ppl | pure pruning (K = k), best scaling |",
        "| --- | --- | ---: | ---: |",
    ]
    for c in dict.fromkeys(r["criterion"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["criterion"] == c]
        b = min(rows, key=lambda r: r["ppl"])
        pure = [r["ppl"] for r in rows if r["K"] == result["top_k"]]
        lines.append(
            f"| {c} | {b['grouping']} / {b['scaling']} / {b['K']} | {_fmt(b['ppl'])} | "
            f"{_fmt(min(pure)) if pure else '–'} |"
        )
    lines += [
        "",
        f"Best overall: {best['criterion']} / {best['grouping']} / {best['scaling']} / K={best['K']}: "
        f"{_fmt(best['ppl'])} ({result['evaluations']} evaluations, {result['wall_s']} s).",
        "",
        "<details><summary>All configurations</summary>",
        "",
        "| criterion | grouping | scaling | " + " | ".join(f"K={K}" for K in Ks) + " |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in Ks) + " |",
    ]
    for (c, g, s), vals in by.items():
        kbest = min(vals, key=vals.get)
        cells = [(f"**{_fmt(vals[K])}**" if K == kbest else _fmt(vals[K])) if K in vals else "–" for K in Ks]
        lines.append(f"| {c} | {g} | {s} | " + " | ".join(cells) + " |")
    lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def check_sweep_out(out: str | Path, overwrite: bool = False, protect=()) -> Path:
    """Refuse, before any compute, a `dense-sweep --out` it may not write (docs/architecture.md, "Outputs").

    The table and its raw rows (`out` with a .json suffix) may not be, contain or sit inside what the sweep
    reads (`protect`: the model, a stats store, text files); an existing one is replaced only with
    `overwrite`, and only when its .json is an earlier sweep's rows, so a notes.md or a config.json of
    one's own is never written over."""
    from ..atomic import check_apart, check_path

    out = Path(out)
    rows = out.with_suffix(".json")
    check_path(out)
    if out.is_dir():
        raise MoECompressError(
            f"--out {out} is a directory; pass a markdown file path such as dense_sweep.md."
        )
    if rows == out:
        raise MoECompressError(
            f"--out {out} would be overwritten by the raw rows written beside it as .json; pass a "
            "markdown file path such as dense_sweep.md."
        )
    for path in (out, rows):
        check_apart(path, protect)
    existing = [p for p in (out, rows) if p.exists() or p.is_symlink()]
    if existing and not overwrite:
        raise MoECompressError(f"{existing[0]} already exists; choose another --out or pass --overwrite.")
    if existing and not _is_sweep(rows):
        raise MoECompressError(
            f"{existing[0]} is not an earlier dense-sweep's output ({rows} holds no sweep rows), "
            "so --overwrite will not replace it; pass another --out."
        )
    return out


def _is_sweep(rows: Path) -> bool:
    from ..safejson import try_load_json

    data = try_load_json(rows) if rows.is_file() and not rows.is_symlink() else None
    return isinstance(data, dict) and {"rows", "top_k"} <= data.keys()


def write_sweep(result: dict, out: str | Path, inputs=None) -> Path:
    """Write the markdown table to `out` and the raw rows to `out` with a .json suffix, each complete or not at
    all (`atomic.write_file`); `inputs` (fingerprints from when the sweep started) are checked first."""
    from ..atomic import write_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if inputs is not None:
        inputs.check()
    write_file(out.with_suffix(".json"), json.dumps(result, indent=2, default=str) + "\n")
    write_file(out, sweep_markdown(result))
    return out
