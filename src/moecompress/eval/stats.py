"""Paired bootstrap intervals, bootstrap p-values, Holm correction and verdict wording.

Two arms A and B scored on the same items i = 1..n give paired differences d_i = a_i - b_i and the
observed mean difference delta = mean(d). One bootstrap replicate draws n item indices uniformly
with replacement and takes the mean of d over them:

    delta*_b = (1/n) sum_j d_{I_bj},   I_bj ~ U{0..n-1},   b = 1..B

* interval: the percentile interval [q_{alpha/2}, q_{1-alpha/2}] of delta*_1..B (numpy "linear");
* p-value (two-sided, from the same replicates, with the +1 correction so it is never 0):
      p = min(1, 2 * (1 + min(#{delta*_b <= 0}, #{delta*_b >= 0})) / (B + 1));
* task average: several tasks, each with its own items, are bootstrapped jointly — replicate b
  resamples every task's items (independently, within the task) and takes the unweighted mean of
  the per-task mean differences, so the average's interval reflects every task's noise.

Random draws (reproducible): ``rng = numpy.random.default_rng(seed)``; for each task in the order
given, ``rng.integers(0, n_task, size=(B, n_task))``.

Holm (1979) step-down across a family of m comparisons: sort p ascending, p_(1) <= ... <= p_(m);
adjusted p_(i) = max_{j<=i} min(1, (m - j + 1) p_(j)); comparison (i) is significant when its
adjusted p <= alpha.

Verdict: "A better" / "B better" only when the interval excludes 0 *and* the (Holm-adjusted) p is
<= alpha; otherwise "not detectably different" — never "equal".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import MoECompressError

A_BETTER, B_BETTER, NOT_DIFFERENT = "A better", "B better", "not detectably different"


@dataclass
class PairedResult:
    """One paired comparison: mean of (A - B), its bootstrap interval and p-value, and the verdict."""

    metric: str
    n: int
    mean_a: float
    mean_b: float
    delta: float
    ci_low: float
    ci_high: float
    p: float
    higher_is_better: bool
    alpha: float = 0.05
    B: int = 1000
    seed: int = 0
    p_adjusted: float | None = None
    verdict: str = NOT_DIFFERENT
    per_task: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def verdict(
    delta: float, ci_low: float, ci_high: float, p: float, alpha: float, higher_is_better: bool
) -> str:
    """ "A better" / "B better" when the interval excludes 0 and p <= alpha, else "not detectably different"."""
    if p > alpha or ci_low <= 0.0 <= ci_high:
        return NOT_DIFFERENT
    a_higher = delta > 0
    return A_BETTER if a_higher == higher_is_better else B_BETTER


def align(
    ids_a: Sequence, a: Sequence[float], ids_b: Sequence, b: Sequence[float], what: str = "the two arms"
) -> tuple[list, np.ndarray, np.ndarray]:
    """Pair per-item values by item id; refuse arms that were not evaluated on the same items."""
    ids_a, ids_b = [str(i) for i in ids_a], [str(i) for i in ids_b]
    if len(ids_a) != len(a) or len(ids_b) != len(b):
        raise MoECompressError(
            f"The per-item ids and values of {what} have different lengths; pass one value per item id."
        )
    if len(set(ids_a)) != len(ids_a) or len(set(ids_b)) != len(ids_b):
        raise MoECompressError(f"Item ids of {what} repeat; pass one value per distinct item.")
    sa, sb = set(ids_a), set(ids_b)
    if sa != sb:
        only_a, only_b = sorted(sa - sb)[:3], sorted(sb - sa)[:3]
        raise MoECompressError(
            f"Cannot pair {what}: they were not evaluated on the same items ({len(sa - sb)} only in A, e.g. "
            f"{only_a}; {len(sb - sa)} only in B, e.g. {only_b}); evaluate both on the same data, limit and task "
            "versions."
        )
    if not ids_a:
        raise MoECompressError(f"Cannot pair {what}: there are no items; evaluate on at least one item.")
    pos = {i: k for k, i in enumerate(ids_b)}
    order = [pos[i] for i in ids_a]
    va, vb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)[order]
    if np.isnan(va).any() or np.isnan(vb).any():
        raise MoECompressError(
            f"Some per-item values of {what} are missing (NaN); re-run the evaluation so every "
            "item has a score."
        )
    return ids_a, va, vb


def _draw_means(rng: np.random.Generator, d: np.ndarray, B: int, chunk: int = 256) -> np.ndarray:
    """B bootstrap means of d; the draws equal one rng.integers(0, n, size=(B, n)) call (row chunks)."""
    n = d.size
    out = np.empty(B)
    rows = max(1, min(B, (chunk * 4096) // max(n, 1)))
    for s in range(0, B, rows):
        idx = rng.integers(0, n, size=(min(rows, B - s), n))
        out[s : s + idx.shape[0]] = d[idx].mean(axis=1)
    return out


def _interval_p(boot: np.ndarray, alpha: float) -> tuple[float, float, float]:
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    B = boot.size
    tail = min(int((boot <= 0).sum()), int((boot >= 0).sum()))
    p = min(1.0, 2.0 * (1 + tail) / (B + 1))
    return float(lo), float(hi), p


def paired_bootstrap(
    ids_a,
    a,
    ids_b,
    b,
    *,
    metric: str = "value",
    higher_is_better: bool = True,
    B: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> PairedResult:
    """Paired bootstrap of mean(A - B) over the items both arms share (see module doc)."""
    return paired_bootstrap_tasks(
        {"task": (ids_a, a)},
        {"task": (ids_b, b)},
        metric=metric,
        higher_is_better=higher_is_better,
        B=B,
        seed=seed,
        alpha=alpha,
    )


def paired_bootstrap_tasks(
    arm_a: Mapping[str, tuple],
    arm_b: Mapping[str, tuple],
    *,
    metric: str = "value",
    higher_is_better: bool | Mapping[str, bool] = True,
    B: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> PairedResult:
    """Joint paired bootstrap over tasks: per-task results in ``per_task`` and the task average on top.

    `arm_a` / `arm_b`: {task: (ids, values)}; both arms need the same tasks and, per task, the same
    item ids. `higher_is_better` may differ per task only in name: the average needs one direction,
    so mixed directions are refused.
    """
    hib = _task_directions(arm_a, arm_b, higher_is_better, B, alpha)
    rng = np.random.default_rng(seed)
    boots, per_task, means_a, means_b = [], {}, [], []
    for t in arm_a:  # order as given: it fixes the random draws
        ids, va, vb = align(*arm_a[t], *arm_b[t], what=f"the two arms on task '{t}'")
        per_task[t], boot = _task_pair(rng, va, vb, metric, B, alpha, hib[t])
        boots.append(boot)
        means_a.append(float(va.mean()))
        means_b.append(float(vb.mean()))
    avg = np.mean(boots, axis=0)
    lo, hi, p = _interval_p(avg, alpha)
    delta = float(np.mean([per_task[t]["delta"] for t in per_task]))
    h = next(iter(hib.values()))
    res = PairedResult(
        metric=metric,
        n=sum(v["n"] for v in per_task.values()),
        mean_a=float(np.mean(means_a)),
        mean_b=float(np.mean(means_b)),
        delta=delta,
        ci_low=lo,
        ci_high=hi,
        p=p,
        higher_is_better=h,
        alpha=alpha,
        B=B,
        seed=seed,
        verdict=verdict(delta, lo, hi, p, alpha, h),
        per_task=per_task if len(per_task) > 1 or "task" not in per_task else {},
    )
    return res


def _task_directions(arm_a, arm_b, higher_is_better, B: int, alpha: float) -> dict:
    """`paired_bootstrap_tasks`'s checks (same tasks, B, alpha, one direction); each task's direction."""
    if set(arm_a) != set(arm_b):
        raise MoECompressError(
            f"Cannot pair the arms: task sets differ ({sorted(set(arm_a) ^ set(arm_b))} in only "
            "one); evaluate both arms on the same tasks."
        )
    if B < 1:
        raise MoECompressError(
            f"B={B} bootstrap replicates is too few; use B >= 1 (1000 or more for reports)."
        )
    if not 0 < alpha < 1:
        raise MoECompressError(f"alpha={alpha} is outside (0, 1); use e.g. 0.05.")
    hib = {
        t: (higher_is_better[t] if isinstance(higher_is_better, Mapping) else higher_is_better) for t in arm_a
    }
    if len(set(hib.values())) > 1:
        raise MoECompressError(
            "Cannot average tasks whose metrics point in opposite directions (higher vs lower is "
            "better); compare them separately."
        )
    return hib


def _task_pair(rng, va: np.ndarray, vb: np.ndarray, metric: str, B: int, alpha: float, hib: bool):
    """One task's paired bootstrap of `va` - `vb`: its result dict and its bootstrap means (drawn from `rng`)."""
    d = va - vb
    boot = _draw_means(rng, d, B)
    lo, hi, p = _interval_p(boot, alpha)
    delta = float(d.mean())
    result = dict(
        metric=metric,
        n=int(d.size),
        mean_a=float(va.mean()),
        mean_b=float(vb.mean()),
        delta=delta,
        ci_low=lo,
        ci_high=hi,
        p=p,
        higher_is_better=hib,
        verdict=verdict(delta, lo, hi, p, alpha, hib),
    )
    return result, boot


def holm(pvalues: Sequence[float], alpha: float = 0.05) -> tuple[list[float], list[bool]]:
    """Holm step-down adjusted p-values and rejections (adjusted p <= alpha), in the input order."""
    p = np.asarray(pvalues, dtype=float)
    m = p.size
    if m == 0:
        return [], []
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise MoECompressError("Holm correction needs p-values in [0, 1]; check the comparisons' p-values.")
    order = np.argsort(p, kind="stable")
    adj_sorted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    adj = np.empty(m)
    adj[order] = adj_sorted
    return adj.tolist(), (adj <= alpha).tolist()


def apply_holm(results: Sequence[PairedResult | dict], alpha: float | None = None) -> None:
    """Holm-adjust a family of comparisons in place and reword their verdicts with the adjusted p."""
    if not results:
        return
    get = (lambda r, k: r[k]) if isinstance(results[0], dict) else getattr
    a = alpha if alpha is not None else get(results[0], "alpha")
    adj, _ = holm([get(r, "p") for r in results], a)
    for r, pa in zip(results, adj):
        v = verdict(get(r, "delta"), get(r, "ci_low"), get(r, "ci_high"), pa, a, get(r, "higher_is_better"))
        if isinstance(r, dict):
            r["p_adjusted"], r["verdict"] = pa, v
        else:
            r.p_adjusted, r.verdict = pa, v
