r"""`auto` over the whole file (issue 30, item 4): a precision for every non-expert weight, in one budget with
the experts' structure and bits.

Each quantizable non-expert tensor (`models.tensor_classes`: attention — MLA's low-rank projections included —,
shared experts, dense MLPs, embeddings, an untied lm_head; never the router, which keeps ≥ 8 bits,
docs/quantization.md "Non-expert tensors") is one more item of the multiple-choice knapsack `auto.solver.allocate`
solves, beside the MoE layers. Its options: kept at its on-disk dtype, or quantized at each width of ``bits``
(group ``quant_group``; GPTQ for linears, round-to-nearest for the embeddings), priced at its pack-quantized bytes
(`QuantSpec.tensor_bytes`, the byte rule of `CompressionPlan.logical_bytes`).

Estimated loss of option s of weight W [out, in] (GPTQ's own objective, Frantar et al. 2023 eq. 1-2):

    L_W(s) = tr(ΔW H ΔWᵀ) / N,   ΔW = W − Ŵ_s,   H = Σ_t x_t x_tᵀ over the N calibration tokens reaching W;

for the embeddings, whose input is a one-hot token, H = diag(c_v) (token counts): L = Σ_v c_v ‖ΔW_v‖² / N.
Losses become KL units through a measured per-class sensitivity, as expert candidates are (s_{l,k}, docs/auto.md):

    s_c = KL(original ‖ model with every class-c weight rounded to the probe width) / Σ_{W∈c} L_W(rtn probe),

and option s of W costs s_c · L_W(s). Hessians come one decoder layer at a time from the streamed checkpoint
(`calibrate.linear_hessian.linear_hessian_pass`, the calibration data the statistics record) or, for an
in-memory model, from forward pre-hooks on the sensitivity token ids (a small model: all held at once).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import MoECompressError
from ...models.tensor_classes import QUANTIZABLE, quantizable, tensor_classes, tensor_shapes
from ...quant import gptq, rtn
from ...quant.gptq import diagonal_loss, gptq_loss
from ...quant.spec import QuantSpec
from ..tensor_quant import ROUTER_MIN_BITS, _layer_of, _layers_prefix, _read, hessian_source
from .measure import kl_per_slice, logprobs

# classes auto may give a precision; the router keeps its dtype (ROUTER_MIN_BITS is above every width auto tries)
AUTO_CLASSES = tuple(c for c in QUANTIZABLE if c != "router")
PROBE_BITS = (
    4  # the width the class sensitivities are measured at (the nearest width auto tries, if not this)
)


@dataclass
class TensorOption:
    """One precision of a tensor: its spec (None: the on-disk dtype), bytes, raw objective L_W and loss in KL."""

    spec: QuantSpec | None
    bytes: int
    raw: float
    loss: float = 0.0

    @property
    def bits(self) -> int:
        return 16 if self.spec is None else self.spec.bits


@dataclass
class TensorItem:
    """A quantizable non-expert weight: name, class, decoder layer (-1 outside the layers) and its options."""

    name: str
    cls: str
    layer: int
    shape: tuple[int, int]
    options: list[TensorOption] = field(default_factory=list)
    probe_raw: float = 0.0  # L_W of round-to-nearest at the probe width (the sensitivity's denominator)


def spec_for(cls: str, bits: int, group: int | None, algo: str) -> QuantSpec:
    """The spec auto gives class `cls` at `bits`: GPTQ (act order, the defaults) or round-to-nearest; the
    embeddings always round-to-nearest (no Hessian)."""
    text = f"w{bits}g{group}" if group is not None else f"w{bits}c"
    return QuantSpec.parse(text, algo="rtn" if algo == "rtn" or cls == "embeddings" else "gptq")


def probe_width(bits: list[int]) -> int:
    return min(bits, key=lambda b: (abs(b - PROBE_BITS), b))


def chosen_classes(adapter, classes: list[str] | None) -> list[str]:
    """The classes auto prices: `classes` (checked: known, present, not the router) or every present one."""
    from ..tensor_quant import present_classes

    present = present_classes(adapter)
    if classes is None:
        return [c for c in AUTO_CLASSES if c in present]
    for c in classes:
        if c == "router":
            raise MoECompressError(
                f"auto does not quantize the router: router weights keep at least "
                f"{ROUTER_MIN_BITS} bits (docs/quantization.md, 'Non-expert tensors'); remove "
                "'router' from tensor_classes."
            )
        if c not in AUTO_CLASSES:
            raise MoECompressError(
                f"'{c}' is not a tensor class auto can give a precision; use {', '.join(AUTO_CLASSES)}."
            )
        if c not in present:
            raise MoECompressError(
                f"This {adapter.model_type} model has no {c} weights (its classes: "
                f"{', '.join(sorted(present))}); remove '{c}' from tensor_classes."
            )
    return list(classes)


def _modules_of(adapter, name: str) -> list[nn.Module]:
    """The modules computing with weight `name`: its own, and a tied lm_head for the embeddings."""
    model = adapter.model
    mods = [model.get_submodule(name.removesuffix(".weight"))]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and head not in mods and head.weight is getattr(mods[0], "weight", None):
        mods.append(head)
    return mods


def _in_memory_hessians(adapter, names: list[str], ids: torch.Tensor) -> Iterator[tuple[int | None, dict]]:
    """(decoder layer or None, {name: H float64}) from forward pre-hooks while the model runs on `ids`."""
    acc: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            acc[name] = acc[name] + x.T @ x if name in acc else x.T @ x

        return fn

    handles = [
        adapter.model.get_submodule(n.removesuffix(".weight")).register_forward_pre_hook(hook(n))
        for n in names
    ]
    try:
        logprobs(adapter.model, ids)
    finally:
        for h in handles:
            h.remove()
    prefix = _layers_prefix(adapter)
    by_layer: dict[int | None, dict] = {}
    for n, h in acc.items():
        i = _layer_of(n, prefix)
        by_layer.setdefault(None if i < 0 else i, {})[n] = h
    for i in sorted(by_layer, key=lambda i: (i is None, i or 0)):
        yield i, by_layer[i]


def hessians(adapter, stats, ids: torch.Tensor):
    """names -> iterator of (layer or None, {name: H}): the streamed pass where the view has a checkpoint and the
    statistics a data spec it can read again (`tensor_quant.hessian_source`), else hooks while the model runs on
    `ids` (statistics gathered from token ids, ``tokens:…``, record no text to re-read)."""
    spec = str(((getattr(stats, "meta", None) or {}).get("data") or {}).get("spec", ""))
    streamed = hessian_source(adapter, stats) if spec and not spec.startswith("tokens:") else None
    return streamed if streamed is not None else (lambda names: _in_memory_hessians(adapter, names, ids))


def _embedding_loss(w: torch.Tensor, w_hat: torch.Tensor, counts: torch.Tensor) -> float:
    """Σ_v c_v ‖W_v − Ŵ_v‖²: GPTQ's objective for a one-hot input (H = diag(c))."""
    d = (w.double() - w_hat.double()).square().sum(1)
    return float((counts.double() * d).sum())


def tensor_items(
    adapter,
    stats,
    classes: list[str],
    bits: list[int],
    group: int | None,
    algo: str,
    ids: torch.Tensor,
    disk: dict[str, tuple[str, int]] | None,
    proxy: bool = False,
) -> list[TensorItem]:
    """Every quantizable tensor of `classes` with its options and their raw objectives (one Hessian pass; each
    layer's Hessians dropped once its tensors are priced). `disk`: name -> (dtype, bytes) on disk, if known.
    proxy: priced as the fast search prices them (`_Linears`)."""
    cls_of, shapes = tensor_classes(adapter), tensor_shapes(adapter)
    prefix = _layers_prefix(adapter)
    names = [n for n, c in cls_of.items() if c in classes and quantizable(n, shapes[n], c)]
    if not names:
        return []
    probe = probe_width(bits)
    counts = torch.bincount(ids.reshape(-1), minlength=int(adapter.model.config.vocab_size))
    items = {n: TensorItem(n, cls_of[n], _layer_of(n, prefix), tuple(shapes[n])) for n in names}
    need_h = [n for n in names if cls_of[n] != "embeddings"]
    done: set[str] = set()
    linears = _Linears(proxy, counts)

    def price(name: str, w: torch.Tensor, h: torch.Tensor | None) -> None:
        it = items[name]
        kept = disk[name][1] if disk is not None and name in disk else w.numel() * w.element_size()
        it.options.append(TensorOption(None, kept, 0.0))
        w = w.float()
        probe_spec = spec_for(it.cls, probe, group, "rtn")
        for b in bits:
            spec = spec_for(it.cls, b, group, algo)
            if h is None or it.cls == "embeddings" or not bool(h.diagonal().gt(0).any()):
                spec = spec.as_rtn()
                raw = _objective(it, w, rtn(w, spec), h, counts)
            else:
                raw = linears.raw(it, w, h, spec)
            it.options.append(TensorOption(spec, spec.tensor_bytes(*it.shape), raw))
        it.probe_raw = _objective(it, w, rtn(w, probe_spec), h, counts)
        done.add(name)

    by_layer: dict[int, list[str]] = {}
    for n in names:
        by_layer.setdefault(items[n].layer, []).append(n)
    source = hessians(adapter, stats, ids)(need_h) if need_h else iter(())
    for layer, hs in source:
        key = -1 if layer is None else layer
        mine = [n for n in by_layer.get(key, []) if n not in done]
        for n, w in _read(adapter, mine).items():
            price(n, w, hs.get(n))
        del hs
    rest = [n for n in names if n not in done]  # the embeddings, and weights no token reached
    for n, w in _read(adapter, rest).items() if rest else ():
        price(n, w, None)
    return [items[n] for n in names]


class _Linears:
    """L_W of a linear's option, from its Hessian: GPTQ's objective on its GPTQ codes, or with `proxy` (``search:
    fast``) priced as the experts are (`quant.proxy_candidates`): a class's tensors in the first layer holding it
    are quantized by GPTQ and by round-to-nearest at each width b, r_{c,b} = Σ L_W(GPTQ) / Σ L_W(RTN) over them,
    and every other tensor of the class costs r_{c,b} · L_W(RTN), L_W(RTN) taken as its diagonal estimate
    Σ_j H_jj Σ_i ΔW_ij² (`_diag_objective`): one GPTQ per class and width instead of one per tensor. The tensors
    come layer by layer in order, so r_{c,b} is known before it is needed."""

    def __init__(self, proxy: bool, counts: torch.Tensor):
        self.proxy, self.counts = proxy, counts
        self.first: dict[str, int] = {}  # class -> the layer whose tensors give r_{c,b}
        self.sums: dict[tuple[str, int], list[float]] = {}  # (class, b) -> [Σ L(GPTQ), Σ L(RTN)] over them

    def raw(self, it: TensorItem, w: torch.Tensor, h: torch.Tensor, spec: QuantSpec) -> float:
        if not self.proxy:
            return _objective(it, w, gptq(w, h, spec), h, self.counts)
        diag = _diag_objective(w, rtn(w, spec.as_rtn()), h)
        if self.first.setdefault(it.cls, it.layer) == it.layer:
            exact = _objective(it, w, gptq(w, h, spec), h, self.counts)
            acc = self.sums.setdefault((it.cls, spec.bits), [0.0, 0.0])
            acc[0], acc[1] = acc[0] + exact, acc[1] + diag
            return exact
        gq, rq = self.sums.get((it.cls, spec.bits), (0.0, 0.0))
        return (gq / rq if rq > 0 else 1.0) * diag


def _diag_objective(w: torch.Tensor, q, h: torch.Tensor) -> float:
    return float(diagonal_loss(w, q.dequantize(torch.float32), h.diagonal()))


def _objective(it: TensorItem, w: torch.Tensor, q, h: torch.Tensor | None, counts: torch.Tensor) -> float:
    """L_W summed over the calibration tokens (the 1/N of the module doc is one constant per class, which the
    class sensitivity absorbs); 0 for a weight no token reached (it changes nothing the calibration sees)."""
    if it.cls == "embeddings":
        return _embedding_loss(w, q.dequantize(torch.float32), counts)
    return 0.0 if h is None else gptq_loss(w, q, h)


@contextlib.contextmanager
def weights_installed(adapter, weights: dict[str, torch.Tensor]):
    """Temporarily compute every module of `weights` (weight name -> replacement) with its replacement: forward
    hooks recompute the output, so it works on the streamed view too (where a layer's weights are re-read)."""
    hooks = {
        name: (lambda module, args, output, w=w: _recomputed(module, args, output, w))
        for name, w in weights.items()
    }
    with _hooked(adapter, hooks):
        yield


def _recomputed(module, args, output, w: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """`module`'s output computed with weight `w` instead of its own (on batch rows `rows` only, if given)."""
    x = args[0] if rows is None else args[0][rows]
    if isinstance(module, nn.Embedding):
        new = F.embedding(x, w.to(output.dtype), module.padding_idx)
    else:
        new = F.linear(x, w.to(x.dtype), module.bias)
    if rows is None:
        return new
    out = output.clone()
    out[rows] = new
    return out


@contextlib.contextmanager
def _hooked(adapter, hooks: dict):
    """Forward hook `hooks[name]` on every module computing with weight `name` (`_modules_of`), removed after."""
    handles = [
        mod.register_forward_hook(fn) for name, fn in hooks.items() for mod in _modules_of(adapter, name)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def class_sensitivity(
    adapter,
    items: list[TensorItem],
    bits: list[int],
    group: int | None,
    ids: torch.Tensor,
    ref: torch.Tensor,
    extra=None,
) -> tuple[dict[str, float], float | None]:
    """s_c (module doc) for every class of `items`: the class rounded to the probe width in every layer, KL on
    `ids`, over Σ L_W(probe). A class whose probe moves nothing measurable takes the median of the others (1.0
    when none is measurable). `extra`: one more probe (rows -> context manager, e.g. `sensitivity.noise_installed`) run in the
    same forward, in the first rows; its KL is returned beside the sensitivities (None without it)."""
    probe, classes, n = probe_width(bits), sorted({it.cls for it in items}), len(ids)
    probes = [extra] if extra is not None else []
    for cls in classes:
        names = [it.name for it in items if it.cls == cls]
        spec = spec_for(cls, probe, group, "rtn")
        probes.append(lambda rows, names=names, spec=spec: rounded_installed(adapter, names, spec, rows))
    with contextlib.ExitStack() as stack:  # one forward: probe v in batch rows v·n … (v+1)·n
        for v, make in enumerate(probes):
            stack.enter_context(make(slice(v * n, (v + 1) * n)))
        kls = kl_per_slice(ref, adapter.model, ids, len(probes))
    extra_kl = kls.pop(0) if extra is not None else None
    found: dict[str, float] = {}
    for cls, kl in zip(classes, kls):
        raw = sum(it.probe_raw for it in items if it.cls == cls)
        if raw > 0 and kl > 0 and math.isfinite(kl):
            found[cls] = float(f"{kl / raw:.4g}")
    fallback = sorted(found.values())[len(found) // 2] if found else 1.0
    return {cls: found.get(cls, fallback) for cls in classes}, extra_kl


@contextlib.contextmanager
def rounded_installed(adapter, names: list[str], spec: QuantSpec, rows: slice):
    """Batch rows `rows` computed with every weight of `names` rounded to `spec` (round-to-nearest of the weight
    the module holds when it runs: nothing is kept between forwards, and the streamed view reads it anyway); the
    other rows as they were. Forward hooks chain, so probes of other weights on other rows stack."""

    def fn(module, args, output):
        w = rtn(module.weight.float(), spec).dequantize(torch.float32)
        return _recomputed(module, args, output, w, rows)

    with _hooked(adapter, dict.fromkeys(names, fn)):
        yield


def scale_items(items: list[TensorItem], sens: dict[str, float]) -> None:
    for it in items:
        for o in it.options:
            o.loss = sens[it.cls] * o.raw


EDGE_CLASSES = (
    "embeddings",
    "lm_head",
)  # pure whole-model GPTQ keeps these at 8 bits (`tensor_quant.EDGE_SPEC`)
KEY_OFFSET = 1 << 20  # allocation keys of tensor items: after every MoE layer index


@dataclass
class TensorPoint:
    """A tensor item's option as the allocation sees it (`auto.solver.allocate` reads bytes and loss)."""

    bytes: int
    loss: float
    option: TensorOption


@dataclass
class WholeFile:
    """The non-expert part of a whole-file allocation: the priced tensors, their class sensitivities, and the
    bytes no choice changes (norms, routers, biases, classes not priced)."""

    items: list[TensorItem]
    sens: dict[str, float]
    fixed: int
    ids: torch.Tensor  # the token ids the in-memory Hessians and the class probes ran on
    extra_kl: float | None = None  # the KL of `price`'s extra probe, when it ran

    @classmethod
    def price(
        cls,
        adapter,
        stats,
        info,
        classes: list[str],
        bits: list[int],
        group: int | None,
        algo: str,
        ids: torch.Tensor,
        ref: torch.Tensor,
        proxy: bool = False,
        extra=None,
    ) -> WholeFile:
        """`tensor_items` (`proxy`: priced as the fast search prices them) and their class sensitivities, whose
        forward also runs `extra` (`class_sensitivity`) when there are tensors to price."""
        from ..tensor_quant import on_disk_dtypes

        disk = on_disk_dtypes(info)
        items = tensor_items(adapter, stats, classes, bits, group, algo, ids, disk, proxy) if bits else []
        sens, extra_kl = (
            class_sensitivity(adapter, items, bits, group, ids, ref, extra) if items else ({}, None)
        )
        scale_items(items, sens)
        fixed = info.other_bytes - sum(it.options[0].bytes for it in items)
        return cls(items, sens, fixed, ids, extra_kl)

    def fronts(self) -> dict[int, list[TensorPoint]]:
        """key -> the item's options by increasing bytes with strictly decreasing loss."""
        out = {}
        for k, it in enumerate(self.items):
            pts: list[TensorPoint] = []
            for o in sorted(it.options, key=lambda o: (o.bytes, o.loss)):
                if not pts or o.loss < pts[-1].loss:
                    pts.append(TensorPoint(o.bytes, o.loss, o))
            out[KEY_OFFSET + k] = pts
        return out

    def uniform(self, bits: int) -> dict[int, int]:
        """key -> bytes of pure whole-model GPTQ at `bits`: every item at that width, the embeddings and lm_head
        at 8 bits (their dtype when 8 is not tried), as ``--quant-scope all`` quantizes."""
        out = {}
        for k, it in enumerate(self.items):
            want = max(bits, 8) if it.cls in EDGE_CLASSES else bits
            o = next((o for o in it.options if o.bits == want), it.options[0])
            out[KEY_OFFSET + k] = o.bytes
        return out

    def specs(self, fronts: dict[int, list[TensorPoint]], chosen: dict[int, int]) -> dict[str, QuantSpec]:
        """name -> spec of every item the allocation quantizes."""
        return {
            self.items[k - KEY_OFFSET].name: fronts[k][i].option.spec
            for k, i in chosen.items()
            if k >= KEY_OFFSET and fronts[k][i].option.spec is not None
        }

    def table(self, fronts: dict[int, list[TensorPoint]], chosen: dict[int, int]) -> list[dict]:
        """Per class: how many tensors at which width, their bytes, estimated KL and sensitivity."""
        rows: dict[str, dict] = {}
        for k, i in chosen.items():
            if k < KEY_OFFSET:
                continue
            it, o = self.items[k - KEY_OFFSET], fronts[k][i].option
            row = rows.setdefault(
                it.cls,
                dict(
                    cls=it.cls, bits={}, bytes=0, original_bytes=0, est_kl=0.0, sensitivity=self.sens[it.cls]
                ),
            )
            row["bits"][str(o.bits)] = row["bits"].get(str(o.bits), 0) + 1
            row["bytes"] += o.bytes
            row["original_bytes"] += it.options[0].bytes
            row["est_kl"] += o.loss
        for row in rows.values():
            row["bits"] = dict(sorted(row["bits"].items(), key=lambda kv: -int(kv[0])))
            row["est_kl"] = float(f"{row['est_kl']:.6g}")
        return [rows[c] for c in sorted(rows)]


def dequantized_weights(plan, tensors) -> dict[str, torch.Tensor]:
    """name -> the weight each quantized non-expert tensor of `plan` computes with (`weights_installed`)."""
    from ...runtime.tensor_quant import dequantized

    return {n: dequantized(plan, tensors, n, torch.float32) for n in plan.tensor_quant}
