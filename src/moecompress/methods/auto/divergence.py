"""Served-precision divergence (issue 30): the KL a change costs only because the model is served in 16 bits.

A bf16 checkpoint runs, and its reference is evaluated, in bf16. Two bf16 forwards that differ anywhere round
differently from there on, and near-tied routing decisions turn the other way, so the served model's KL to the
original has a part that depends on where the first change is, not on how large it is (BENCHMARKS.md's
whole-model evaluation floor: one bf16 step of one norm weight in the first layer). Computed in float32 the same
plans rank otherwise; `auto`'s estimator, whose sensitivities are measured in float32, does not see it.

So, with a whole-file budget, `auto` chooses how many of the model's leading *stages* to keep exact, in
computation order: the embeddings, then each decoder layer's attention and its MLP (the MoE block with its shared
experts, or a dense MLP). `prefix_allocations` gives the allocation with the first p stages exact, for each p that
fits; `choose` measures

    D_s = KL_served(original ‖ original with stage s's outputs moved by a rounding-level step)

(`divergence_kl`: forwards in the served dtype, each stage in its own batch rows beside the reference's) and
minimises

    total(p) = Σ_items s·loss(allocation p) + D_{first stage allocation p changes}

over p; a change after the last measured stage counts as that stage's D. D_s is measured only when some p > 0
could pay for itself (`choose`'s bound), so low budgets skip its forwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .measure import _kl, kl_per_slice, logprobs, output_hook, sig
from .tensors import KEY_OFFSET, _modules_of

SERVED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # checkpoint dtype -> what serves it
STEP = 2.0**-8  # the relative move of a stage's outputs: about one bf16 rounding step
BOUND = 4.0  # D_0 over the rounding KL (`choose`): about 1 to 2 on the fixtures; 4 leaves room for 8 sequences' noise


@dataclass
class Stage:
    """A stage of the forward: its label, its allocation keys (MoE layers, tensor items) and output modules."""

    label: str
    keys: list[int] = field(default_factory=list)
    modules: list = field(default_factory=list)


def stages(adapter, whole, n: int) -> list[Stage]:
    """The first `n` stages that hold something the allocation may change, in computation order."""
    found: dict[tuple[int, int], Stage] = {}

    def stage(layer: int, part: int) -> Stage:
        label = "embeddings" if layer < 0 else f"layer {layer} {('attention', 'mlp')[part]}"
        return found.setdefault((layer, part), Stage(label))

    for i in adapter.moe_layers:
        s = stage(i, 1)
        s.keys.append(i)
        s.modules.append(adapter.layer(i).block)
    for k, it in enumerate(whole.items if whole is not None else []):
        if it.cls == "lm_head":  # the last computation: nothing after it rounds differently
            continue
        if it.cls == "embeddings":
            s = stage(-1, 0)
        else:
            s = stage(it.layer, 0 if it.cls == "attention" else 1)
        s.keys.append(KEY_OFFSET + k)
        s.modules.append(_modules_of(adapter, it.name)[0])
    return [found[key] for key in sorted(found)][:n]


def _moved(rows: slice, seed: int):
    """A forward hook moving the output's batch rows `rows` by ±STEP relatively (seeded signs)."""

    def fn(o: torch.Tensor) -> torch.Tensor:
        part = o[rows].float()
        sign = torch.randint(0, 2, part.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
        o = o.clone()
        o[rows] = (part * (1 + STEP * sign)).to(o.dtype)
        return o

    return output_hook(fn)


def divergence_kl(
    adapter, found: list[Stage], ids: torch.Tensor, dtype: torch.dtype, batch: int = 8
) -> list[float]:
    """D_s of every stage (module doc) on `ids`, in `dtype`: per `batch` sequences one forward, the original in
    its first rows and stage s moved in rows (s+1)·batch … (s+2)·batch, so its logits are (stages + 1) × batch
    sequences at once. D_s is a difference of roundings, noisy on few tokens: hence more sequences than the
    sensitivities' (`divergence_sequences`), batched as `measure.logprobs` batches, and the non-increasing fit."""
    total = torch.zeros(len(found), dtype=torch.float64)
    with adapter.computing_in(dtype):
        for start in range(0, len(ids), batch):
            chunk = ids[start : start + batch]
            total += torch.tensor(_chunk_kl(adapter, found, chunk)) * len(chunk)
    return [sig(d, 4) for d in non_increasing([float(t) / len(ids) for t in total])]


def non_increasing(values: list[float]) -> list[float]:
    """The least-squares non-increasing fit of `values` (pool adjacent violators). A first change at stage s
    changes every later stage too, so D_s ≥ D_t for s < t in expectation; the fit takes out what the tokens'
    noise puts against that order."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(count)]


def _chunk_kl(adapter, found: list[Stage], ids: torch.Tensor) -> list[float]:
    b = len(ids)
    with contextlib.ExitStack() as stack:
        for s, st in enumerate(found):
            fn = _moved(slice((s + 1) * b, (s + 2) * b), seed=s)
            for mod in st.modules:
                stack.callback(mod.register_forward_hook(fn).remove)
        return kl_per_slice(None, adapter.model, ids, len(found) + 1)


def first_changed(found: list[Stage], fronts: dict, chosen: dict[int, int]) -> int | None:
    """The index of the first stage where `chosen` is not every item's exact (least-loss, last) state."""
    return next(
        (s for s, st in enumerate(found) if any(chosen[k] != len(fronts[k]) - 1 for k in st.keys)), None
    )


def prefix_allocations(fronts: dict, scale: dict, budget: int, chosen: dict[int, int], found, allocate):
    """[(p, allocation)] for p = 0 (`chosen`, the unconstrained allocation) … len(found) while it fits: the first p
    stages kept exact (each item at its last, least-loss state), `allocate(fronts, budget)` for the rest."""
    out = [(0, chosen)]
    for p in range(1, len(found) + 1):
        kept = {k: len(fronts[k]) - 1 for st in found[:p] for k in st.keys}
        rest = {k: f for k, f in fronts.items() if k not in kept}
        left = budget - sum(fronts[k][i].bytes for k, i in kept.items())
        if not rest or sum(f[0].bytes for f in rest.values()) > left:
            break  # keeping more exact does not fit either
        out.append((p, {**allocate(rest, left), **kept}))
    return out


def choose(
    adapter, found: list[Stage], fronts: dict, scale: dict, options, probe
) -> tuple[dict[int, int], dict]:
    """(allocation, report) of the exact prefix (module doc) among `options` (`prefix_allocations`).

    `probe`: (ids, float32 log-probs of the original on ids, more ids, served dtype). The divergence can lower the
    KL by at most D_0, which is of the order of the served dtype's own rounding KL to float32: one forward on
    the first ids measures that; only when some prefix costs less estimated KL than `BOUND` times it are the
    stages' D_s measured (on the more ids) and the total minimised."""
    ids, ref, more, dtype = probe

    def est(idx: dict[int, int]) -> float:
        return sum(fronts[k][i].loss * scale[k] for k, i in idx.items())

    chosen = options[0][1]
    report = dict(stages=[], exact_stages=0, first_changed=None)
    if len(options) > 1:
        with adapter.computing_in(dtype):
            rounding = _kl(ref, logprobs(adapter.model, ids))
        report["rounding_kl"] = sig(rounding, 4)
        if min(est(idx) for _, idx in options[1:]) - est(chosen) < BOUND * rounding:
            kl = divergence_kl(adapter, found, more, dtype)
            report["stages"] = [dict(stage=st.label, kl=d) for st, d in zip(found, kl)]

            def total(idx: dict[int, int]) -> float:
                s = first_changed(found, fronts, idx)
                return est(idx) + kl[len(kl) - 1 if s is None else s]

            best = total(chosen)
            for p, idx in options[1:]:  # ties keep the smaller p
                if (cost := total(idx)) < best * (1 - 1e-9):
                    report["exact_stages"], chosen, best = p, idx, cost
    first = first_changed(found, fronts, chosen)
    report["first_changed"] = None if first is None else found[first].label
    return chosen, report
