"""lm-evaluation-harness bridge: in-memory models, local tasks offline, per-document results for pairing.

`run_lm_eval` wraps `lm_eval.simple_evaluate` with an `HFLM(pretrained=model, tokenizer=tokenizer)`
built around the model object itself, so a model with runtime blocks installed (or any other
in-memory `PreTrainedModel`) is evaluated exactly as it sits in memory. `log_samples=True` keeps
every document's score, which is what the paired bootstrap in `stats.py` needs.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

from ..data.tasks import FIXTURE_TASKS, local_task_paths, parse_tasks, quiet_lm_eval, resolve_tasks  # noqa: F401
from ..errors import MoECompressError

# the metric used for the "task average" and the plots when a task reports several
_PRIMARY_ORDER = ("acc", "exact_match", "acc_norm", "f1", "mcc", "bleu", "word_perplexity")


@contextlib.contextmanager
def _offline_env(active: bool):
    """Keep local-only runs off the network (lm-eval and datasets look at these variables)."""
    if not active:
        yield
        return
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


def _split_key(key: str) -> tuple[str, str]:
    metric, _, flt = key.partition(",")
    return metric, flt or "none"


def _task_entry(
    name: str, results: dict, configs: dict, hib: dict, samples: list[dict] | None, n_shot
) -> dict[str, Any]:
    """One task's aggregate metrics and per-document scores in the results-dict layout (see report.py)."""
    # lm-eval writes "N/A" for a stderr it did not compute (bootstrap_iters=0): keep numbers only
    agg_raw = {k: (None if isinstance(v, str) else _clean(v)) for k, v in results.items() if "," in k}
    filters = sorted({_split_key(k)[1] for k in agg_raw if not _split_key(k)[0].endswith("_stderr")})
    plain = len(filters) <= 1

    def mname(key: str) -> str:
        metric, flt = _split_key(key)
        return metric if plain else f"{metric},{flt}"

    aggregate = {mname(k): v for k, v in agg_raw.items()}
    higher = {}
    for k in aggregate:
        base = _split_key(k)[0]
        if not base.endswith("_stderr") and base in hib:
            higher[k] = bool(hib[base])
    metric_names = [k for k in aggregate if not _split_key(k)[0].endswith("_stderr")]
    first_key = {}
    for k in metric_names:
        first_key.setdefault(_split_key(k)[0], k)
    primary = next(
        (first_key[p] for p in _PRIMARY_ORDER if p in first_key), metric_names[0] if metric_names else None
    )
    output_type = configs.get("output_type")
    items = _doc_items(samples, plain, output_type)
    _add_stderr(aggregate, metric_names, items)
    return {
        "output_type": output_type,
        "num_fewshot": n_shot,
        "n": len(items["ids"]),
        "aggregate": aggregate,
        "higher_is_better": higher,
        "primary": primary,
        "items": items,
    }


def _doc_items(samples: list[dict] | None, plain: bool, output_type) -> dict[str, list]:
    """The per-document items of one task's `samples`: doc ids and, per metric (``metric,filter`` unless
    `plain`), the values in doc order; generative tasks also keep ``response`` and ``target``."""
    items: dict[str, list] = {"ids": []}
    if samples:
        by_doc: dict[int, dict] = {}
        for s in samples:
            rec = by_doc.setdefault(int(s["doc_id"]), {})
            flt = s.get("filter", "none")
            for m in s.get("metrics", []):
                if m in s:
                    v = s[m]
                    rec[m if plain else f"{m},{flt}"] = _clean(
                        float(v) if isinstance(v, (int, float, bool)) else v
                    )
            if output_type == "generate_until":
                resp = s.get("filtered_resps")
                rec["response"] = resp[0] if isinstance(resp, list) and resp else resp
                rec["target"] = s.get("target")
        doc_ids = sorted(by_doc)
        items["ids"] = doc_ids
        keys = sorted({k for r in by_doc.values() for k in r})
        for k in keys:
            items[k] = [by_doc[d].get(k) for d in doc_ids]
    return items


def _add_stderr(aggregate: dict, metric_names: list[str], items: dict[str, list]) -> None:
    """Add to `aggregate` each metric's standard error of the mean from the per-document scores, where
    lm-eval gave none (it skips it here)."""
    for k in metric_names:
        vals = [v for v in items.get(k, []) if isinstance(v, (int, float))]
        if aggregate.get(f"{k}_stderr") is None and len(vals) > 1:
            mean = sum(vals) / len(vals)
            aggregate[f"{k}_stderr"] = math.sqrt(
                sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) / len(vals)
            )


def run_lm_eval(
    model,
    tokenizer,
    tasks,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 1,
    include_path=None,
    *,
    seed: int = 1234,
    gen_kwargs: dict | None = None,
    max_length: int | None = None,
    online: bool | None = None,
) -> dict[str, dict]:
    """Evaluate an in-memory model on lm-eval tasks; return {task: entry} with per-document items.

    Each entry: ``output_type`` (multiple_choice | generate_until | loglikelihood | ...),
    ``aggregate`` ({metric: value}, lm-eval's numbers incl. ``*_stderr``), ``higher_is_better``,
    ``primary`` (metric used for averages and plots), ``n``, ``num_fewshot`` and ``items``
    ({"ids": doc ids, metric: per-document values, ...}; generative tasks also keep ``response``
    and ``target``). A requested group (e.g. mmlu) becomes one entry whose item ids are
    "subtask/doc_id", with the subtasks' aggregates under ``subtasks``.
    """
    names, manager, local_only = resolve_tasks(tasks, include_path, online)
    if tokenizer is None:
        raise MoECompressError(
            "lm-eval needs the model's tokenizer; pass the tokenizer (a checkpoint directory "
            "without tokenizer files cannot be evaluated on tasks)."
        )
    lm = _hflm(model, tokenizer, batch_size, max_length)
    out = _simple_evaluate(lm, names, manager, local_only, num_fewshot, limit, seed, gen_kwargs)
    if out is None:  # non-zero ranks under accelerate
        return {}
    res, cfgs, hib = out["results"], out.get("configs", {}), out.get("higher_is_better", {})
    samples = out.get("samples", {})
    n_shot = out.get("n-shot", {})
    entries: dict[str, dict] = {}
    for name in names:
        if name in samples:
            entries[name] = _task_entry(
                name,
                res.get(name, {}),
                cfgs.get(name, {}),
                hib.get(name, {}),
                samples[name],
                n_shot.get(name, num_fewshot),
            )
            continue
        group = _group_entry(name, names, out)
        if group is not None:
            entries[name] = group
    return entries


def _hflm(model, tokenizer, batch_size, max_length):
    """lm-eval's `HFLM` over the in-memory model, its log-probabilities in float32."""
    import torch
    from lm_eval.models.huggingface import HFLM

    # log-probabilities in float32 whatever the model's dtype (a bf16 log_softmax costs ~3 significant digits)
    lm_kwargs = dict(
        pretrained=model, tokenizer=tokenizer, batch_size=batch_size, softmax_dtype=torch.float32
    )
    if max_length is not None:
        lm_kwargs["max_length"] = max_length
    with quiet_lm_eval():
        return HFLM(**lm_kwargs)


def _simple_evaluate(lm, names, manager, local_only: bool, num_fewshot, limit, seed, gen_kwargs):
    """lm-eval's `simple_evaluate` of `lm` on the tasks `names`, samples logged, every seed `seed`; off the
    network when `local_only`."""
    from lm_eval import simple_evaluate

    with _offline_env(local_only), quiet_lm_eval():
        return simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=True,
            task_manager=manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            gen_kwargs=gen_kwargs,
            bootstrap_iters=0,
            verbosity="ERROR",
        )


def _group_entry(name: str, names, out: dict) -> dict | None:
    """A group or tag: one entry over its leaf tasks, ids prefixed with the subtask name (None when lm-eval
    logged none of them)."""
    res, cfgs, hib = out["results"], out.get("configs", {}), out.get("higher_is_better", {})
    samples = out.get("samples", {})
    n_shot = out.get("n-shot", {})
    leaves = [t for t in out.get("group_subtasks", {}).get(name, []) if t in samples] or [
        t for t in samples if t not in names
    ]
    subs = {
        t: _task_entry(t, res.get(t, {}), cfgs.get(t, {}), hib.get(t, {}), samples[t], n_shot.get(t))
        for t in leaves
    }
    if not subs:
        return None
    first = next(iter(subs.values()))
    primary = first["primary"]
    items: dict[str, list] = {"ids": []}
    for t, e in subs.items():
        items["ids"] += [f"{t}/{i}" for i in e["items"]["ids"]]
        for k, v in e["items"].items():
            if k != "ids":
                items.setdefault(k, []).extend(v)
    agg = {k: _clean(v) for k, v in res.get(name, {}).items() if "," in k}
    agg = {_split_key(k)[0]: v for k, v in agg.items()} or {
        primary: sum(x for x in items.get(primary, []) if x is not None) / max(1, len(items["ids"]))
    }
    return {
        "output_type": first["output_type"],
        "num_fewshot": first["num_fewshot"],
        "n": len(items["ids"]),
        "aggregate": agg,
        "higher_is_better": first["higher_is_better"],
        "primary": primary,
        "items": items,
        "subtasks": {t: e["aggregate"] for t, e in subs.items()},
    }
