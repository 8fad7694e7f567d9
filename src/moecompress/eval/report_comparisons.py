"""The report's paired comparisons: which (arm, reference, task) pairs are bootstrapped, with how many
replicates, Holm-corrected as one family; and which tasks discriminate between arms at all."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import MoECompressError
from .schema import Arm, Results, validate_results
from .stats import apply_holm, paired_bootstrap_tasks

AVERAGE = "task average"


def min_replicates(m: int, alpha: float = 0.05) -> int:
    """Default B: at least 1000 and enough that Holm over m comparisons can reach significance.

    The smallest bootstrap p is 2/(B+1), and Holm multiplies the smallest p by m, so B must exceed
    2m/alpha - 1 for any verdict to be possible; we take 4x that margin.
    """
    return max(1000, math.ceil(8 * m / alpha))


def _pair_jobs(a: Arm, b: Arm) -> list[tuple]:
    """The comparisons of arm `a` against arm `b`: (task label, {task: (ids, vals)} for A, same for B, metric,
    higher_is_better) per shared task with per-item results, plus the task average over the lm-eval tasks when
    there are two or more with the same direction."""
    jobs: list[tuple] = []
    lm_tasks = {}
    for t in [t for t in a.metrics if t in b.metrics]:
        ea, eb = a.metrics[t], b.metrics[t]
        metric = ea.primary
        if metric not in ea.items or metric not in eb.items:
            continue
        hib = ea.higher_is_better.get(metric, True)
        jobs.append(
            (
                t,
                {t: (ea.items["ids"], ea.items[metric])},
                {t: (eb.items["ids"], eb.items[metric])},
                metric,
                hib,
            )
        )
        if ea.output_type != "perplexity":
            lm_tasks[t] = (metric, hib)
    if len(lm_tasks) >= 2 and len({h for _, h in lm_tasks.values()}) == 1:
        ta = {t: (a.metrics[t].items["ids"], a.metrics[t].items[m]) for t, (m, _) in lm_tasks.items()}
        tb = {t: (b.metrics[t].items["ids"], b.metrics[t].items[m]) for t, (m, _) in lm_tasks.items()}
        jobs.append((AVERAGE, ta, tb, "primary", next(iter(lm_tasks.values()))[1]))
    return jobs


def compare_arms(
    results: dict | Results,
    pairs: Sequence[tuple[str, str]] | None = None,
    *,
    B: int | None = None,
    seed: int = 0,
    alpha: float = 0.05,
) -> list[dict]:
    """Paired bootstrap of every (A, B) pair (default: each arm vs the baseline) on every shared task.

    Per pair: one comparison per task on its primary metric (perplexity streams: per-window mean
    nll), plus the task average over the lm-eval tasks when there are two or more with the same
    direction. Holm correction runs over all comparisons returned (one family). B defaults to
    `min_replicates(number of comparisons, alpha)`; every comparison uses the same `seed`.
    """
    res = results if isinstance(results, Results) else validate_results(results)
    arms = {a.name: a for a in res.arms}
    if pairs is None:
        pairs = [(a.name, res.baseline) for a in res.arms if a.name != res.baseline]
    jobs: list[
        tuple
    ] = []  # (a, b, task label, {task: (ids, vals)} for A, same for B, metric, higher_is_better)
    for na, nb in pairs:
        for n in (na, nb):
            if n not in arms:
                raise MoECompressError(f"No arm named '{n}' in the results; arms are {', '.join(arms)}.")
        jobs += [(na, nb, *job) for job in _pair_jobs(arms[na], arms[nb])]
    B = B if B is not None else min_replicates(len(jobs), alpha)
    out: list[dict] = []
    for na, nb, label, ta, tb, metric, hib in jobs:
        r = paired_bootstrap_tasks(
            ta, tb, metric=metric, higher_is_better=hib, B=B, seed=seed, alpha=alpha
        ).to_dict()
        r.pop("per_task")
        out.append(dict(r, a=na, b=nb, task=label, **({"tasks": list(ta)} if label == AVERAGE else {})))
    apply_holm(out, alpha)
    return out


def discriminating(comparisons: list[dict]) -> list[dict]:
    """The comparisons of the tasks where at least one paired interval excludes 0: a task on which every
    arm is indistinguishable from its reference says nothing, so it is not plotted."""
    tasks = {c["task"] for c in comparisons if c["ci_low"] > 0 or c["ci_high"] < 0}
    return [c for c in comparisons if c["task"] in tasks]
