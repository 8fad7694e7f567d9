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
as the sum of slot errors); `sample_layer_error` measures the real layer error of a whole layer
plan on a uniform token sample, so the report shows how far the sum is from it.

A layer's errors become a KL estimate through its sensitivity s_l (`layer_sensitivity`): the
increase of KL(original ‖ perturbed) per unit of mean squared perturbation of the layer's MoE
output, measured once with Gaussian noise of known energy (a few forward passes):

    est_KL = Σ_l s_l · Σ_{e ∈ l} L_e(choice_e).

Fits: ``weighted`` (default) fits each operator to minimise exactly this loss (gate²-weighted
least squares / mean / centred neuron energy); ``unweighted`` builds the very operators of
`methods.prune` (its tensors, bit for bit) and scores them with the same closed forms.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import MoECompressError
from ..plan import ConstantOp, PartialOp, TiltOp
from ..scoring import rank as rank_order
from .operators import fit_tilt, neuron_energy, partial_copy_bias, partial_copy_size, tilt_basis, tilt_of_rank

Fit = Literal["weighted", "unweighted"]


# ----------------------------------------------------------------------------- per-layer statistics
class Rows:
    """An [E, D, D] statistic read one expert at a time, float64: ``rows[e]`` is ``stats.get(layer, name)[e]``
    (minus ``minus[e]`` for a fold difference). Never read whole: it is many times the layer's weights."""

    def __init__(self, stats, layer: int, name: str, minus: Rows | None = None):
        self.stats, self.layer, self.name, self.minus = stats, layer, name, minus
        self._last: tuple[int, torch.Tensor] | None = None  # fits and losses read one expert several times

    def __getitem__(self, e: int) -> torch.Tensor:
        if self._last is None or self._last[0] != e:
            row = self.stats.get_row(self.layer, self.name, e).double()
            self._last = (e, row if self.minus is None else row - self.minus[e])
        return self._last[1]

    def __sub__(self, other: Rows) -> Rows:
        return Rows(self.stats, self.layer, self.name, minus=other)


SQUARE_MOMENTS = frozenset({"auto_g2_xx", "auto_g2_xy", "auto_g2_aa"})  # [E, D, D]: read as `Rows`


@dataclass
class LayerMoments:
    """Gate²-weighted statistics of one MoE layer (float64, per calibration token)."""

    layer: int
    w: torch.Tensor  # [E]
    s_y: torch.Tensor  # [E, H]
    s_yy: torch.Tensor  # [E]
    s_x: torch.Tensor | None = None  # [E, H]
    s_xx: Rows | torch.Tensor | None = None  # [E, H, H]
    s_xy: Rows | torch.Tensor | None = None  # [E, H, H]
    s_a: torch.Tensor | None = None  # [E, I]
    s_aa: Rows | torch.Tensor | None = None  # [E, I, I]
    remap: torch.Tensor | None = None  # [E, E]
    reroute: dict[str, torch.Tensor] = field(default_factory=dict)  # gate -> [E]
    sample: torch.Tensor | None = None  # [S, H] float32
    fold1: LayerMoments | None = None  # the moment sums over fold 1 only (same 1/N scale)
    _folds: tuple | None = field(default=None, repr=False, compare=False)  # `folds()`, made once
    _basis: tuple | None = field(
        default=None, repr=False, compare=False
    )  # ((slot, ridge), TiltBasis) of one slot

    _MOMENTS = ("w", "s_y", "s_yy", "s_x", "s_xx", "s_xy", "s_a", "s_aa")
    _NAMES = (
        "auto_g2",
        "auto_g2_y",
        "auto_g2_yy",
        "auto_g2_x",
        "auto_g2_xx",
        "auto_g2_xy",
        "auto_g2_a",
        "auto_g2_aa",
    )

    @classmethod
    def load(cls, stats, layer: int) -> LayerMoments:
        def get(name):
            if not stats.has(name):
                return None
            return (
                Rows(stats, layer, name)
                if name.removesuffix("_f1") in SQUARE_MOMENTS
                else stats.get(layer, name).double()
            )

        m = cls(layer, *(get(n) for n in cls._NAMES), get("auto_remap"))
        for gate in ("keep", "renorm"):
            t = get(f"auto_reroute_{gate}")
            if t is not None:
                m.reroute[gate] = t
        if stats.has("auto_sample"):
            m.sample = stats.get(layer, "auto_sample")
        if stats.has("auto_g2_f1"):
            m.fold1 = cls(layer, *(get(f"{n}_f1") if stats.has(n) else None for n in cls._NAMES))
        return m

    def folds(self) -> tuple[LayerMoments, LayerMoments] | None:
        """(fold 0, fold 1) moments, or None without fold statistics."""
        if self.fold1 is None:
            return None
        if self._folds is None:
            f0 = LayerMoments(
                self.layer,
                *(
                    None if getattr(self, k) is None else getattr(self, k) - getattr(self.fold1, k)
                    for k in self._MOMENTS
                ),
            )
            self._folds = (f0, self.fold1)
        return self._folds


def approximate_moments(stats, layer: int) -> LayerMoments:
    """The cheaper approximation the estimator could use instead of gate²-weighted moments: the plain
    moments over routed tokens (out_mean/out_var, moment_*) scaled by the mean g² of the expert's tokens,
    i.e. E[g²·err] ≈ E[g²]·E[err]. Kept for measuring what weighting buys (benchmarks/bench_auto.py);
    drop/constant/tilt losses only (no intermediate or substitute terms)."""
    counts = stats.get(layer, "counts").double()
    g2 = stats.get(layer, "auto_g2").double()  # (1/N) Σ g² = (|T_e|/N) · mean g² over T_e
    mean, var = stats.get(layer, "out_mean").double(), stats.get(layer, "out_var").double()
    m = LayerMoments(layer, g2, g2[:, None] * mean, g2 * (var.sum(-1) + mean.square().sum(-1)))
    if stats.has("input_moment"):
        sel = stats.get(layer, "moment_experts").tolist()
        h = mean.shape[1]
        m.s_x = torch.zeros(len(counts), h, dtype=torch.float64)
        m.s_xx = torch.zeros(len(counts), h, h, dtype=torch.float64)
        m.s_xy = torch.zeros(len(counts), h, h, dtype=torch.float64)
        for k, e in enumerate(sel):
            m.s_x[e] = g2[e] * stats.get_row(layer, "moment_in_mean", k).double()
            m.s_xx[e] = g2[e] * stats.get_row(layer, "input_moment", k).double()
            m.s_xy[e] = g2[e] * stats.get_row(layer, "cross_moment", k).double()
    return m


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


# ----------------------------------------------------------------------------- candidates
@dataclass
class Candidate:
    """One way to serve slot e: its estimated loss and what the plan needs to realise it.

    kind: keep | quant | drop | reroute | constant | tilt | partial | remap | pair;
    param: tilt rank, partial width, remap prototype, pair partner or the bits of a quantized keep (0 otherwise);
    bytes: routed bytes it adds on its own (keep: the expert; quant: its packed codes and scales; pairs: half
    the packed pair).
    """

    kind: str
    loss: float
    param: int = 0
    bytes: int = 0
    op: object = None  # the plan operator (ConstantOp / TiltOp / PartialOp) for operator kinds
    gate: str = ""  # reroute: the gate scale (keep / renorm)
    tensors: dict = field(default_factory=dict)  # its plan tensors
    raw: float | None = None  # the unscaled estimated error when `loss` carries a per-kind sensitivity

    @property
    def error(self) -> float:
        """The estimated output error L_e (unscaled)."""
        return self.loss if self.raw is None else self.raw

    @property
    def kind_key(self) -> str:
        """What a per-kind sensitivity is keyed by: the kind, reroutes by gate."""
        return f"reroute:{self.gate}" if self.kind == "reroute" else self.kind

    @property
    def label(self) -> str:
        if self.kind == "quant":
            return f"keep-w{self.param}"  # the expert kept at `param` bits
        return f"{self.kind}{self.param}" if self.kind in ("tilt", "partial") else self.kind


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


@dataclass
class PairRef:
    """A PuzzleMoE packed pair (i, j) of one layer as a joint candidate of its two slots.

    nbytes: what the plan stores for the pair (packed words + biases); losses: the sample estimates of
    L_i and L_j; `merge()` rebuilds the `MergeCandidate` (tensors) when the plan needs it.
    """

    layer: int
    members: tuple[int, int]
    nbytes: int
    losses: tuple[float, float]
    kwargs: dict = field(default_factory=dict, repr=False)
    adapter: object = field(default=None, repr=False)
    scale: float | None = None  # per-kind sensitivity applied to the losses in the solver
    _merge: object = field(default=None, repr=False)

    def merge(self):
        if self._merge is None:
            from .puzzle import pair_candidate

            self._merge = pair_candidate(self.adapter, self.layer, *self.members, **self.kwargs)
        return self._merge


def pair_options(adapter, stats, m: LayerMoments, partners: int, pairs: set | None = None) -> list[PairRef]:
    """Packed-pair candidates of a layer: each expert with its `partners` nearest experts (normalised parameter
    distance), losses estimated on the layer's uniform token sample (``auto_sample``, S tokens):

        L_i ≈ (1/S) Σ_{t ∈ sample, i ∈ K(t)} g_i(t)² ‖f_i(h_t) − f̂_i(h_t)‖²,

    an unbiased Monte-Carlo estimate of the closed-form quantity, f̂_i the pair's packed reconstruction of i
    run by the PuzzleMoE runtime (`MergeCandidate.forward`)."""
    from .conmoe import scope_distance
    from .puzzle import UpcastExperts, layer_norms, pair_candidate

    layer = m.layer
    if m.sample is None:
        raise MoECompressError(
            "Pair candidates are estimated on a token sample; re-run calibration with the "
            "'auto_sample' statistic (--for-method auto)."
        )
    e_all = adapter.num_experts(layer)
    if pairs is None:  # `pairwise_distance` of the layer, read one projection at a time
        dist = scope_distance(lambda name: [adapter.expert_part_at_rest(layer, name)])
        pairs = set()
        for i in range(e_all):
            order = sorted((float(dist[i, j]), j) for j in range(e_all) if j != i)
            for _, j in order[:partners]:
                pairs.add((min(i, j), max(i, j)))
    norms = layer_norms(stats, layer, e_all)
    dtype = adapter.expert_dtype(layer)
    x = m.sample.to(dtype)
    n = len(x)
    with torch.no_grad():
        r = adapter.route(layer, x)
        routed = {}
        for e in range(e_all):
            tok, slot = torch.where(r.index == e)
            routed[e] = (
                tok,
                r.weight[tok, slot].double().square(),
                adapter.expert_forward(layer, e, x[tok]).double() if len(tok) else None,
            )
        # after the forwards: on a streamed view this evicts the computed layer, so it is not held beside these
        experts = UpcastExperts(adapter.experts_at_rest(layer), dtype, e_all)  # one expert upcast per read
        out = []
        for i, j in sorted(pairs):
            kwargs = dict(norms=norms, experts=experts)
            c = pair_candidate(adapter, layer, i, j, **kwargs)
            xs = [x[routed[e][0]] if len(routed[e][0]) else None for e in (i, j)]
            ys = c.forward(xs)
            losses = []
            for e, yhat in zip((i, j), ys):
                tok, g2, y = routed[e]
                losses.append(0.0 if y is None else float(g2 @ (y - yhat.double()).square().sum(-1)) / n)
            out.append(
                PairRef(layer, (i, j), int(c.nbytes), (losses[0], losses[1]), dict(norms=norms), adapter)
            )
    return out


# ----------------------------------------------------------------------------- calibration tokens
def calibration_ids(stats, adapter, sequences: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """Token ids [B, T] for the sensitivity passes: the calibration spec of `stats` re-tokenised with the
    model's tokenizer when possible, else seeded random ids (and a note saying so)."""
    spec = stats.meta.get("data", {}).get("spec", "") if stats is not None else ""
    source = getattr(adapter.model, "name_or_path", "") or ""
    if spec and not spec.startswith("tokens:") and source:
        with contextlib.suppress(MoECompressError, OSError, ValueError):
            from ..data import load_calibration, load_tokenizer

            data = load_calibration(spec, load_tokenizer(str(source)), seq_len, seed)
            ids = data.input_ids[:sequences]
            return ids, f"{spec} (first {len(ids)} sequences of {seq_len} tokens)"
    vocab = int(adapter.model.config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sequences, seq_len), generator=gen)
    return (
        ids,
        f"random token ids ({sequences} x {seq_len}, seed {seed}): calibration spec '{spec}' not reloadable",
    )


# ----------------------------------------------------------------------------- KL measurements
def input_device(model) -> torch.device:
    """Where a forward's inputs go: the device of the model's first materialised parameter. Not
    ``model.device``: on the streamed view every parameter is meta until the forward's hooks load it, and
    ids moved to meta gave garbage logits on the first forward (auto's reference log-probs)."""
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def _logprobs(model, ids: torch.Tensor, batch: int = 4) -> torch.Tensor:
    out = []
    device = input_device(model)
    with torch.no_grad():
        for s in range(0, len(ids), batch):
            logits = model(ids[s : s + batch].to(device)).logits
            out.append(torch.log_softmax(logits.double(), -1).cpu())
    return torch.cat(out)


def kl_to(ref: torch.Tensor, model, ids: torch.Tensor) -> float:
    """Mean over tokens of KL(original ‖ model) given the original's log-probs `ref`."""
    lp = _logprobs(model, ids)
    return float((ref.exp() * (ref - lp)).sum(-1).mean())


@contextlib.contextmanager
def perturbed(adapter, layer: int, fn):
    """Temporarily replace layer `layer`'s MoE output o by fn(o) (a forward hook on its block)."""

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (fn(output[0]),) + tuple(output[1:])
        return fn(output)

    handle = adapter.layer(layer).block.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def output_energy(adapter, ids: torch.Tensor) -> dict[int, float]:
    """Mean per-token ‖MoE block output‖² of every MoE layer on `ids`."""
    acc: dict[int, list[float]] = {i: [0.0, 0] for i in adapter.moe_layers}

    def make(i):
        def fn(o):
            acc[i][0] += float(o.double().square().sum())
            acc[i][1] += o.numel() // o.shape[-1]
            return o

        return fn

    with contextlib.ExitStack() as stack:
        for i in adapter.moe_layers:
            stack.enter_context(perturbed(adapter, i, make(i)))
        _logprobs(adapter.model, ids)
    return {i: a / max(n, 1) for i, (a, n) in acc.items()}


def layer_sensitivity(
    adapter, ids: torch.Tensor, rel: float = 0.05, seeds: int = 2, ref: torch.Tensor | None = None
) -> dict[int, float]:
    """s_l = KL(original ‖ noisy) / ε_l for isotropic Gaussian noise of mean per-token energy ε_l added to
    layer l's MoE output (ε_l = rel × mean ‖output‖²), averaged over `seeds` noise draws.

    KL is quadratic in a small perturbation, so s_l is the KL cost per unit of squared output error:
    the factor that turns the per-token errors L_e of layer l into a KL estimate.
    """
    model = adapter.model
    ref = _logprobs(model, ids) if ref is None else ref
    energy = output_energy(adapter, ids)
    out = {}
    for i in adapter.moe_layers:
        eps = rel * energy[i]
        if eps <= 0:
            out[i] = 0.0
            continue
        total = 0.0
        for s in range(seeds):
            gen = torch.Generator().manual_seed(1000 * i + s)

            def noisy(o, gen=gen, eps=eps):
                noise = torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype)
                return o + noise * (eps / o.shape[-1]) ** 0.5

            with perturbed(adapter, i, noisy):
                total += kl_to(ref, model, ids)
        out[i] = total / seeds / eps
    return out


@contextlib.contextmanager
def plan_installed(adapter, plan, tensors, layers):
    """Temporarily run `layers` of the in-memory model through the plan's runtime blocks (originals kept)."""
    from ..runtime import CompressedMoEBlock, build_ops, build_scope
    from ..runtime.build import scope_dtype

    source = lambda l, e: adapter.layer(l).storage.read(e)
    installed = []
    try:
        with torch.no_grad():
            for i in layers:
                lp = plan.layer(i)
                sc = plan.scope(lp.scope)
                layer = adapter.layer(i)
                stored = build_scope(plan, sc, layer, source, tensors, config=adapter.model.config)
                ops = build_ops(plan, lp, layer, tensors, scope_dtype(stored), layer.router.weight.device)
                adapter.set_block(i, CompressedMoEBlock(layer, lp, stored, ops, adapter.returns_tuple))
                installed.append(i)
        yield
    finally:
        for i in installed:
            adapter.set_block(i, adapter.layer(i).block)


def sample_layer_error(adapter, plan, tensors, layer: int, x: torch.Tensor) -> float:
    """Mean over the sampled block inputs x of ‖ŷ − y‖²: the plan's real error in `layer` (all interactions)."""
    x = x.to(adapter.expert_dtype(layer))
    with torch.no_grad():
        ref = adapter.moe_forward(layer, x)
        with plan_installed(adapter, plan, tensors, [layer]):
            adapter.hold_layer(layer)  # the block below runs on the layer's own router (and shared experts)
            out = adapter.block_forward(layer, x)
    return float((out.double() - ref.double()).square().sum(-1).mean())
