r"""Loss estimates for the budget-optimal ``auto`` method: per-slot candidates, their fits and losses.

For slot e of MoE layer l and a replacement f̂ of expert e, the estimated loss is the gate²-weighted
output error per calibration token of the layer (statistics of calibrate/auto_stats.py),

    L_e(f̂) = (1/N) Σ_{t ∈ T_e} g_e(t)² ‖f_e(h_t) − f̂(h_t)‖²,

in closed form from moments (no forward pass per candidate):

* drop (zero operator):           L = S_yy
* constant c:                     L = S_yy − 2cᵀs_y + w‖c‖²
* affine b + M x (tilt, any fit): L = S_yy − 2bᵀs_y − 2 tr(M S_xy) + w‖b‖² + 2bᵀM s_x + tr(M S_xx Mᵀ)
* partial copy (kept neurons S, rest R, bias b):
                                  L = tr(D_R S_aa[R,R] D_Rᵀ) − 2bᵀ D_R s_a[R] + w‖b‖²
* remap to stored expert p:       L = (1/N) Σ_{T_e} g_e² ‖f_e − f_p‖²          (auto_remap, exact)
* reroute (keep / renorm gate):   L = (1/N) Σ_{t: e∈K(t)} ‖ŷ_t − y_t‖²        (auto_reroute_*, exact
                                  for removing e alone; removals are summed, interactions ignored)

with w = (1/N)Σ g², s_y = (1/N)Σ g² y, S_yy = (1/N)Σ g²‖y‖², s_x, S_xx, S_xy, s_a, S_aa likewise.
Cross terms between two replaced slots of the same token are ignored (the layer error is taken
as the sum of slot errors); `measure.sample_layer_error` measures the real layer error of a whole layer
plan on a uniform token sample, so the report shows how far the sum is from it.

A layer's errors become a KL estimate through its sensitivity s_l (`sensitivity.layer_sensitivity`): the
increase of KL(original ‖ perturbed) per unit of mean squared perturbation of the layer's MoE
output, measured once with Gaussian noise of known energy (a few forward passes):

    est_KL = Σ_l s_l · Σ_{e ∈ l} L_e(choice_e).

Fits: ``weighted`` (default) fits each operator to minimise exactly this loss (gate²-weighted
least squares / mean / centred neuron energy); ``unweighted`` builds the very operators of
`methods.prune` (its tensors, bit for bit) and scores them with the same closed forms.
"""

from __future__ import annotations

from typing import Literal

import torch

from ...plan import ConstantOp, PartialOp, TiltOp
from ...scoring import rank as rank_order
from ..operators import (
    fit_tilt,
    neuron_energy,
    partial_copy_bias,
    partial_copy_size,
    tilt_basis,
    tilt_of_rank,
)
from .moments import LayerMoments
from .solver import Candidate

Fit = Literal["weighted", "unweighted"]


# ----------------------------------------------------------------------------- closed-form losses
def drop_loss(m: LayerMoments, e: int) -> float:
    return max(float(m.s_yy[e]), 0.0)


def constant_loss(m: LayerMoments, e: int, c: torch.Tensor) -> float:
    c = c.double()
    return max(float(m.s_yy[e] - 2 * c @ m.s_y[e] + m.w[e] * (c @ c)), 0.0)


def affine_loss(m: LayerMoments, e: int, b: torch.Tensor, mat: torch.Tensor) -> float:
    """L for f̂(x) = b + M x (M [H_out, H_in])."""
    b, mat = b.double(), mat.double()
    val = (
        m.s_yy[e]
        - 2 * b @ m.s_y[e]
        - 2 * torch.trace(mat @ m.s_xy[e])
        + m.w[e] * (b @ b)
        + 2 * b @ (mat @ m.s_x[e])
        + torch.trace(mat @ m.s_xx[e] @ mat.T)
    )
    return max(float(val), 0.0)


def low_rank_affine_loss(m: LayerMoments, e: int, b: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> float:
    """`affine_loss` for M = U Vᵀ (U [H_out, r], V [H_in, r]) without forming M: tr(M S_xy) = tr(Vᵀ S_xy U)
    and tr(M S_xx Mᵀ) = tr((UᵀU)(Vᵀ S_xx V)), O(r H²) instead of O(H³) (a tilt's loss is read six times
    per slot and rank with cross-fitting)."""
    b, u, v = b.double(), u.double(), v.double()
    vt_xy = v.T @ m.s_xy[e]  # [r, H_out]
    vt_xx_v = v.T @ m.s_xx[e] @ v  # [r, r]
    val = (
        m.s_yy[e]
        - 2 * b @ m.s_y[e]
        - 2 * torch.trace(vt_xy @ u)
        + m.w[e] * (b @ b)
        + 2 * b @ (u @ (v.T @ m.s_x[e]))
        + torch.trace((u.T @ u) @ vt_xx_v)
    )
    return max(float(val), 0.0)


def partial_loss(
    m: LayerMoments, e: int, down: torch.Tensor, kept: torch.Tensor, bias: torch.Tensor
) -> float:
    """L for a partial copy keeping neurons `kept` of expert e (down [H, I]) plus output bias."""
    rest = torch.ones(down.shape[1], dtype=torch.bool)
    rest[kept] = False
    d = down.double()[:, rest]
    b = bias.double()
    val = torch.trace(d @ m.s_aa[e][rest][:, rest] @ d.T) - 2 * b @ (d @ m.s_a[e][rest]) + m.w[e] * (b @ b)
    return max(float(val), 0.0)


def _key(layer: int, e: int) -> str:
    return f"layer{layer}.expert{e}"  # the same tensor names as methods.prune


def _cross_fitted(m: LayerMoments, e: int, fit, loss) -> float | None:
    """L_cv = L_fold1(fit on fold 0) + L_fold0(fit on fold 1): an out-of-sample loss of a fitted operator
    (each half scored by an operator that never saw it; moments share the 1/N scale, so the two add up to
    a per-token loss over all N tokens). None without fold statistics."""
    folds = m.folds()
    if folds is None:
        return None
    f0, f1 = folds
    return loss(f1, e, fit(f0, e)) + loss(f0, e, fit(f1, e))


def _weighted_constant(m: LayerMoments, e: int) -> torch.Tensor:
    w = float(m.w[e])
    return m.s_y[e] / w if w > 0 else torch.zeros_like(m.s_y[e])


def constant_candidate(
    m: LayerMoments, stats, e: int, fit: Fit, el: int, h: int, dtype, cross_fit: bool = False
) -> Candidate:
    c = _weighted_constant(m, e) if fit == "weighted" else stats.get(m.layer, "out_mean")[e].double()
    key = _key(m.layer, e)
    value = c.to(dtype)
    loss = constant_loss(m, e, value)
    if cross_fit and fit == "weighted":
        loss = _cross_fitted(m, e, _weighted_constant, constant_loss) if m.fold1 is not None else loss
    return Candidate("constant", loss, 0, h * el, op=ConstantOp(tensor=key), tensors={f"{key}.value": value})


def _weighted_tilt(m: LayerMoments, e: int, rank: int, ridge: float):
    """`fit_tilt` of slot e; its rank-independent basis is kept for the slot's other ranks (last slot only)."""
    key = (e, ridge)
    if m._basis is None or m._basis[0] != key:
        m._basis = None
        m._basis = (key, tilt_basis(float(m.w[e]), m.s_x[e], m.s_y[e], m.s_xx[e], m.s_xy[e], ridge=ridge))
    return tilt_of_rank(m._basis[1], rank)


def _tilt_loss(m: LayerMoments, e: int, tilt) -> float:
    return low_rank_affine_loss(m, e, tilt.b, tilt.B, tilt.A.T)


def tilt_candidate(
    m: LayerMoments,
    stats,
    e: int,
    rank: int,
    fit: Fit,
    ridge: float,
    el: int,
    h: int,
    dtype,
    cross_fit: bool = False,
) -> Candidate | None:
    """Rank-r tilt of slot e (None when it would not be a tilt: no tokens reached the expert)."""
    rank = min(rank, h)
    if fit == "weighted":
        tilt = _weighted_tilt(m, e, rank, ridge)
    else:
        sel = stats.get(m.layer, "moment_experts").tolist()
        if e not in sel:
            return None
        s = sel.index(e)
        n = float(stats.get(m.layer, "moment_count")[s])
        mom = lambda name: stats.get_row(m.layer, name, s).double() * n  # means -> sums
        tilt = fit_tilt(
            n,
            mom("moment_in_mean"),
            mom("moment_out_mean"),
            mom("input_moment"),
            mom("cross_moment"),
            rank=rank,
            ridge=ridge,
        )
    if tilt.rank == 0:
        return None
    key = _key(m.layer, e)
    u, v, b = tilt.B.to(dtype), tilt.A.T.contiguous().to(dtype), tilt.b.to(dtype)
    loss = low_rank_affine_loss(m, e, b, u, v)
    if cross_fit and fit == "weighted" and m.fold1 is not None:
        loss = _cross_fitted(m, e, lambda f, e_: _weighted_tilt(f, e_, rank, ridge), _tilt_loss)
    return Candidate(
        "tilt",
        loss,
        tilt.rank,
        (2 * h * tilt.rank + h) * el,
        op=TiltOp(rank=tilt.rank, tensor=key),
        tensors={f"{key}.U": u, f"{key}.V": v, f"{key}.bias": b},
    )


def _weighted_partial(m: LayerMoments, e: int, down: torch.Tensor, width: int):
    """Neurons with the largest centred weighted energy Var_w(a_j)·‖d_j‖² and the bias D_R·E_w[a_R]."""
    tot = float(m.w[e])
    mean = m.s_a[e] / tot if tot > 0 else torch.zeros_like(m.s_a[e])
    var = (m.s_aa[e].diagonal() / tot - mean.square()).clamp_min(0) if tot > 0 else torch.zeros_like(mean)
    energy = var * down.double().square().sum(0)  # centred: the bias absorbs each neuron's mean
    neurons = torch.tensor(sorted(rank_order(energy)[:width]))
    rest = torch.ones(down.shape[1], dtype=torch.bool)
    rest[neurons] = False
    return neurons, down.double()[:, rest] @ mean[rest]


def partial_candidate(
    m: LayerMoments,
    stats,
    adapter,
    e: int,
    rank: int,
    fit: Fit,
    el: int,
    h: int,
    dtype,
    cross_fit: bool = False,
) -> Candidate | None:
    """Partial copy of slot e at the parameter budget of a rank-r tilt (None for biased experts)."""
    w = adapter.get_expert(m.layer, e)
    if w.has_bias:
        return None
    width = max(1, min(partial_copy_size(rank, h), w.down.shape[1]))
    if fit == "weighted":
        neurons, bias = _weighted_partial(m, e, w.down, width)
    else:
        count = float(stats.get(m.layer, "counts")[e])
        energy = neuron_energy(stats.get(m.layer, "mid_channel_norm")[e].double().square(), count, w.down)
        neurons = torch.tensor(sorted(rank_order(energy)[:width]))
        bias = partial_copy_bias(stats.get(m.layer, "mid_mean")[e].double() * count, count, w.down, neurons)
    key = _key(m.layer, e)
    bias = bias.to(dtype)
    tensors = {
        f"{key}.gate": w.gate[neurons].to(dtype),
        f"{key}.up": w.up[neurons].to(dtype),
        f"{key}.down": w.down[:, neurons].to(dtype),
        f"{key}.bias": bias,
    }
    loss = partial_loss(m, e, w.down, neurons, bias)
    if cross_fit and fit == "weighted" and m.fold1 is not None:
        loss = _cross_fitted(
            m,
            e,
            lambda f, e_: _weighted_partial(f, e_, w.down, width),
            lambda f, e_, nb: partial_loss(f, e_, w.down, nb[0], nb[1]),
        )
    return Candidate(
        "partial",
        loss,
        width,
        (3 * width * h + h) * el,
        op=PartialOp(source=(m.layer, e), width=width, tensor=key),
        tensors=tensors,
    )
