"""What `auto` reserves of its budget for the weight files' bytes that no choice of its own makes (issue 48, item 3;
docs/auto.md, "The budget and the byte count").

The budget bounds the bytes of the weight files written (every ``*.safetensors``, or ``model.gguf``), headers
included, while the solver counts tensor bytes (`CompressionPlan.logical_bytes`). So before the allocation the
budget loses an upper bound of everything else those files hold, computed from the names, dtypes and shapes of
the tensors an export of any plan in auto's search space may write, each at its longest representation:

* safetensors (`hf`, `compact`, `packed`): one header entry per tensor (`export.budget.safetensors_entry_bytes`,
  its data offsets at the digits of the files' budget), plus every shard's length, ``__metadata__`` and padding.
  A non-expert tensor counts its longest entry among kept (its checkpoint name and its in-memory name) and
  pack-quantized at each width auto may give it (``_packed`` / ``_scale`` / ``_shape``); a routed expert its
  longest among the compact runtime's slots (dense, or quantized at each width, under ``.dense.`` too when packed
  pairs are candidates, or a member of a packed pair) against the `hf` checkpoint's per-expert tensors (dense or
  pack-quantized); each layer adds its fused dense scope's tensors and, with operator candidates, its operators'.
* GGUF (`target: llama.cpp`): the file's metadata and tokenizer as `GGUFFile.metadata_bytes` measures them, one
  tensor info and the data's alignment padding per tensor it may write (`export.budget.GGUF_TENSOR_BYTES`), the
  F32 copies of norms, routers, biases and 1-D tensors a 16-bit checkpoint stores narrower, and the ``output``
  copy of a tied embedding where llama.cpp's architecture needs one.

The final check (`export.budget.check_weight_budget`) compares the files written with the budget and refuses
rather than exceed it, so the reserve only has to be an upper bound in practice; tests/test_budget_disk.py
measures both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..disk import DTYPES, checkpoint_dir, dtype_tag, read_header
from ..methods.auto.config import AutoConfig
from ..methods.auto.files import register_file_overhead
from ..methods.auto.target import unquantized_classes
from ..methods.auto.tensors import chosen_classes
from ..methods.tensor_quant import _layers_prefix
from ..models.tensor_classes import quantizable, tensor_classes, tensor_shapes
from ..plan import ModelInfo
from ..plan.schema import quant_tensor_prefix
from ..plan.targets import get_target
from ..quant.spec import QuantSpec
from ..runtime.quantized import packed_shapes
from .budget import (
    GGUF_FILE_BYTES,
    GGUF_TENSOR_BYTES,
    SAFETENSORS_SHARD_BYTES,
    offset_digits,
    safetensors_entry_bytes,
    safetensors_shards,
)
from .naming import child_name
from .readers import SCOPE_PREFIX

PARTS = ("gate", "up", "down")
OPERATORS = {"constant", "tilt", "partial"}


def reserve(config: AutoConfig, adapter, info: ModelInfo, files: int) -> int:
    """Upper bound of the weight files' bytes beyond the plan's tensor bytes, for any plan auto may choose and
    `files` bytes of weight files (module doc): GGUF's for ``target: llama.cpp``, else safetensors'."""
    if get_target(config.target).format == "gguf":
        return gguf_reserve(adapter, info)
    return safetensors_reserve(config, adapter, info, files)


# ---------------------------------------------------------------------------------------------------- safetensors
def safetensors_reserve(config: AutoConfig, adapter, info: ModelInfo, files: int) -> int:
    """Bytes of the safetensors headers of any export of a plan in `config`'s space (module doc)."""
    digits = offset_digits(files)
    disk = _disk_header(info)
    widths = config.quant_bits
    specs = [QuantSpec(bits=b, group_size=config.quant_group) for b in widths]
    total = safetensors_shards(files) * SAFETENSORS_SHARD_BYTES + _other_entries(
        config, adapter, disk, specs, digits
    )
    prefix = _layers_prefix(adapter)
    for i in adapter.moe_layers:
        total += _layer_entries(config, adapter, info, i, disk, specs, prefix, digits)
    return total


def _disk_header(info: ModelInfo) -> dict[str, tuple[str, list[int]]] | None:
    """name -> (dtype tag, shape) of every tensor of the checkpoint `info` describes, or None (in memory)."""
    found = checkpoint_dir(info.source)
    if found is None:
        return None
    out = {}
    for f in sorted(found.glob("*.safetensors")):
        out.update({k: (h["dtype"], list(h["shape"])) for k, h in read_header(f).items()})
    return out


def _tag(t: torch.Tensor | None, disk_tag: str | None) -> str:
    """The longer of a tensor's on-disk and in-memory dtype tags (an export writes one of them)."""
    tags = [x for x in (disk_tag, dtype_tag(t.dtype) if t is not None else None) if x]
    return max(tags, key=len) if tags else "BF16"


def _quantized(base: str, shape, spec: QuantSpec, digits: int, sep: str = ".") -> int:
    """Header entries of weight `base`'s pack-quantized tensors (``base.weight_packed`` ...)."""
    out, inp = shape
    return sum(
        safetensors_entry_bytes(f"{base}{sep}{sfx}", dtype_tag(dt), shp, digits)
        for sfx, (shp, dt) in packed_shapes(spec, out, inp).items()
    )


def _tensor_entry(name: str, tag: str, shape, quantize: bool, specs: list[QuantSpec], digits: int) -> int:
    """A non-expert tensor's longest entries: kept, or pack-quantized at each width (`quantize`)."""
    options = [safetensors_entry_bytes(name, tag, shape, digits)]
    if quantize:
        options += [_quantized(quant_tensor_prefix(name), shape, s, digits) for s in specs]
    return max(options)


def _other_entries(config: AutoConfig, adapter, disk, specs: list[QuantSpec], digits: int) -> int:
    """Entries of every tensor but the routed experts, under in-memory names and under the checkpoint's (an `hf`
    export writes the latter), each at its longest representation; the larger sum."""
    classes: set[str] = set()
    if config.budget_scope == "whole":
        classes = {
            c
            for c in chosen_classes(adapter, config.tensor_classes)
            if c not in unquantized_classes(config.target)
        }
    cls_of, shapes = tensor_classes(adapter), tensor_shapes(adapter)
    held = dict(adapter.model.named_parameters(remove_duplicate=False))
    held.update(dict(adapter.model.named_buffers(remove_duplicate=False)))
    native = 0
    for name, cls in cls_of.items():
        if cls == "experts":
            continue
        quantize = cls in classes and quantizable(name, shapes[name], cls)
        disk_tag = disk[name][0] if disk and name in disk else None
        native += _tensor_entry(name, _tag(held.get(name), disk_tag), shapes[name], quantize, specs, digits)
    on_disk = 0
    for name, (tag, shape) in (disk or {}).items():
        if _routed(name):
            continue
        cls = cls_of.get(name)
        if cls is not None:
            quantize = cls in classes and quantizable(name, shape, cls)
        else:  # a name the model does not hold as such: quantizable if any class is
            quantize = bool(classes) and len(shape) == 2 and name.endswith(".weight")
        on_disk += _tensor_entry(name, _tag(held.get(name), tag), shape, quantize, specs, digits)
    return max(native, on_disk)


def _routed(name: str) -> bool:
    """A routed expert's tensor in a checkpoint (`plan.model_info`'s rule)."""
    return ".experts." in name and "shared_expert" not in name


@dataclass
class _Layer:
    """One MoE layer's sizes, as its experts' header entries need them."""

    i: int
    e: int  # experts
    w: int  # expert width
    h: int  # hidden size
    tag: str  # the experts' dtype tag
    bias: bool
    digits: int  # of the data offsets

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {"gate": (self.w, self.h), "up": (self.w, self.h), "down": (self.h, self.w)}

    def entry(self, name: str, shape, tag: str | None = None) -> int:
        return safetensors_entry_bytes(name, tag or self.tag, shape, self.digits)


def _layer_entries(
    config: AutoConfig,
    adapter,
    info: ModelInfo,
    i: int,
    disk,
    specs: list[QuantSpec],
    prefix: str,
    digits: int,
) -> int:
    """Entries of MoE layer `i`'s routed experts at their longest representation (module doc): the compact
    runtime's per-slot tensors against the `hf` checkpoint's, plus the fused dense scope and the operators."""
    li = info.layer(i)
    tag = dtype_tag(getattr(torch, info.dtype)) or "BF16"
    d = _Layer(i, li.num_experts, li.intermediate_size, info.hidden_size, tag, info.expert_bias, digits)
    pairs = "pair" in config.candidates
    scopes = [f"{SCOPE_PREFIX}layer{i}."] + ([f"{SCOPE_PREFIX}layer{i}.dense."] if pairs else [])
    options = _slot_options(d, scopes, specs, pairs)
    compact = sum(max(b + n * (len(str(j)) - 1) for b, n in options) for j in range(d.e))
    total = max(compact, *_hf_layer(adapter, d, disk, specs, prefix))
    total += max(_fused(d, pre) for pre in scopes)  # a scope of dense experts only: one tensor per projection
    if OPERATORS & set(config.candidates):
        total += _operators(d, adapter, prefix, max(config.ranks))
    return total


def _slot_options(d: _Layer, scopes: list[str], specs: list[QuantSpec], pairs: bool) -> list[tuple[int, int]]:
    """Every way the compact runtime may write one slot, as (entry bytes for slot 0, names holding the slot
    number): a dense or quantized slot of each scope prefix, and a member of a packed pair (pair-bf16, its pair's
    tensors counted for each member)."""

    def biases(base: str) -> tuple[int, int]:  # (bytes, names) of a slot's biases
        if not d.bias:
            return 0, 0
        return sum(d.entry(f"{base}{p}_bias", d.shapes[p][:1]) for p in PARTS), 3

    options = []
    for pre in scopes:
        b_bytes, b_names = biases(f"{pre}experts.0.")
        dense = sum(d.entry(f"{pre}experts.0.{p}", d.shapes[p]) for p in PARTS)
        options.append((dense + b_bytes, 3 + b_names))
        for spec in specs:
            quant = sum(
                _quantized(f"{pre}experts.0.{p}", d.shapes[p], spec, d.digits, sep="_") for p in PARTS
            )
            options.append((quant + b_bytes, 3 * len(packed_shapes(spec, 1, 1)) + b_names))
    if pairs:
        pre = f"{SCOPE_PREFIX}layer{d.i}.merged.s0."
        member = d.entry(f"{pre}gate_up.packed", (2 * d.w, d.h), "I16") + d.entry(
            f"{pre}down.packed", (d.h, d.w), "I16"
        )
        if d.bias:
            sizes = (("gate_up_bias", 2 * d.w), ("down_bias", d.h))
            member += sum(d.entry(f"{pre}{n}_{m}", (s,)) for n, s in sizes for m in "ij")
        options.append((member, 2 + (4 if d.bias else 0)))
    return options


def _fused(d: _Layer, pre: str) -> int:
    """Entries of a scope of dense experts only, fused (`runtime.experts.StoredExperts`)."""
    f = d.entry(f"{pre}gate_up_proj", (d.e, 2 * d.w, d.h)) + d.entry(f"{pre}down_proj", (d.e, d.h, d.w))
    if d.bias:
        f += d.entry(f"{pre}gate_up_proj_bias", (d.e, 2 * d.w)) + d.entry(f"{pre}down_proj_bias", (d.e, d.h))
    return f


def _operators(d: _Layer, adapter, prefix: str, rank: int) -> int:
    """Entries of a layer's replacement operators (`runtime.operators.SlotOperators`), every kind at its largest."""
    block = child_name(adapter.decoder_layers[d.i], adapter.layer(d.i).block)
    e, h, w = d.e, d.h, d.w
    ops = {
        "constants": (e, h),
        "tilt_U": (e, h, rank),
        "tilt_V": (e, h, rank),
        "tilt_bias": (e, h),
        "part_gate": (e, w, h),
        "part_up": (e, w, h),
        "part_down": (e, h, w),
        "part_bias": (e, h),
    }
    if d.bias:
        ops.update(part_gate_bias=(e, w), part_up_bias=(e, w))
    return sum(d.entry(f"{prefix}.{d.i}.{block}.ops.{k}", s) for k, s in ops.items())


def _hf_layer(adapter, d: _Layer, disk, specs: list[QuantSpec], prefix: str) -> list[int]:
    """Entries of layer `d.i`'s experts in an `hf` checkpoint: dense, and pack-quantized at each width (the
    checkpoint's own per-expert names; for a model without one, the usual ``experts.E.gate_proj.weight``)."""
    found = re.compile(re.escape(prefix) + rf"\.{d.i}\.")
    if disk:
        tensors = [(n, t, s) for n, (t, s) in disk.items() if _routed(n) and found.match(n)]
    else:
        layer = adapter.layer(d.i)
        rel = child_name(adapter.decoder_layers[d.i], layer.storage.module)
        names = layer.storage.names or {p: f"{p}_proj" for p in PARTS}
        tensors = [
            (f"{prefix}.{d.i}.{rel}.{j}.{names[p]}.weight", d.tag, d.shapes[p])
            for j in range(d.e)
            for p in PARTS
        ]
    out = [sum(d.entry(n, s, t) for n, t, s in tensors)]
    for spec in specs:
        out.append(
            sum(
                _quantized(n.removesuffix(".weight"), s, spec, d.digits)
                if n.endswith(".weight") and len(s) == 2
                else d.entry(n, s, t)
                for n, t, s in tensors
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------------- GGUF
def gguf_reserve(adapter, info: ModelInfo) -> int:
    """Bytes of a GGUF of any plan beyond the plan's tensor bytes (module doc)."""
    from ..plan import CompressionPlan
    from .gguf import GGUFFile
    from .gguf_arches import ARCHES

    every = {x.layer: list(range(x.num_experts)) for x in info.layers}
    source = SimpleNamespace(config=adapter.model.config, source_dir=checkpoint_dir(info.source))
    metadata = GGUFFile(CompressionPlan.prune(info, every, method="auto"), {}, source).metadata_bytes()
    cls_of, shapes = tensor_classes(adapter), tensor_shapes(adapter)
    disk = _disk_header(info) or {}
    wider, others, embedding = 0, 0, 0
    for name, cls in cls_of.items():
        if cls == "experts":
            continue
        others += 1
        shape = shapes[name]
        el = DTYPES[disk[name][0]][1] if name in disk and disk[name][0] in DTYPES else 4
        if cls in ("norm", "router") or len(shape) <= 1 or not name.endswith(".weight"):
            wider += math.prod(shape) * max(0, 4 - el)  # written in F32 (`GGUFFile._put`)
        if cls == "embeddings":
            embedding = max(embedding, math.prod(shape) * el)
    arch = ARCHES.get(info.model_type)
    tied = "lm_head" not in cls_of.values()
    output = embedding if arch is not None and arch.output_required and tied else 0
    # a non-expert tensor may become two (DeepSeek-V2's attn_kv_b), a MoE layer writes 3 experts' tensors (+ biases)
    tensors = 2 * others + 6 * len(adapter.moe_layers) + 1
    return metadata + tensors * GGUF_TENSOR_BYTES + wider + output + GGUF_FILE_BYTES


register_file_overhead(
    reserve
)  # auto's build asks through methods/auto/files.py (methods never import export)
