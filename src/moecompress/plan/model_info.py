"""`ModelInfo`: the original model, as far as plans, byte accounting and validation need it (sizes and the
bytes of the routed experts and of everything else, at the checkpoint's on-disk dtypes)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field, field_validator

from ..errors import MoECompressError
from .schema import Strict, floating_dtype


class MoELayerInfo(Strict):
    """What the plan needs to know about one original MoE layer."""

    # a plan.json is input too: sizes are checked here, so a tampered file is one sentence, not a traceback later
    layer: int = Field(ge=0)
    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    bytes_per_expert: int = Field(ge=0)
    n_group: int = Field(1, ge=1)
    topk_group: int = Field(1, ge=1)
    group_score: Literal["max", "top2_sum"] = "max"
    keep_equals_renorm: bool = False  # the router renormalises (or scores elementwise): keep == renorm
    router: str = ""  # RouterSpec.describe(), for reports


class ModelInfo(Strict):
    """The original model, as far as plans, byte accounting and validation need it.

    Bytes are counted at the checkpoint's on-disk dtypes (read from its safetensors headers), not at
    the dtype the model happens to be loaded in: a bf16 checkpoint computed in float32 still costs
    2 bytes per parameter. A model with no checkpoint directory (built in memory) is counted as held.
    """

    model_type: str
    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    dtype: str  # on-disk dtype of the routed experts, e.g. "bfloat16"
    disk_dtypes: list[str] | None = None  # every dtype the checkpoint stores (None: counted from memory)
    expert_bias: bool = False  # experts carry biases (GPT-OSS)
    layers: list[MoELayerInfo]
    expert_bytes: int = Field(ge=0)  # all routed experts of the original, as stored
    other_bytes: int = Field(
        ge=0
    )  # every other saved tensor: embeddings, attention, norms, routers, shared experts
    source: str | None = None

    @field_validator("dtype")
    @classmethod
    def _floating_dtype(cls, v: str) -> str:
        return floating_dtype(v)

    def layer(self, i: int) -> MoELayerInfo:
        for info in self.layers:
            if info.layer == i:
                return info
        raise MoECompressError(
            f"Layer {i} is not a MoE layer of this {self.model_type} model; "
            f"MoE layers are {[x.layer for x in self.layers]}."
        )

    @property
    def element_size(self) -> int:
        """Bytes per element of a routed expert (and of anything stored in its place) on disk."""
        return _element_size(self.dtype)

    @classmethod
    def from_model(
        cls, model_or_adapter, source: str | None = None, checkpoint: str | os.PathLike | None = None
    ) -> ModelInfo:
        """Describe an original model. Bytes follow `checkpoint` (default: `source`, else the model's
        ``name_or_path``) when it is a directory of safetensors; otherwise the in-memory dtypes."""
        from ..disk import checkpoint_dir, stored_tensors
        from ..models import MoEAdapter

        adapter = (
            model_or_adapter if isinstance(model_or_adapter, MoEAdapter) else MoEAdapter(model_or_adapter)
        )
        model = adapter.model
        name = getattr(model, "name_or_path", None) or None
        found = checkpoint_dir(checkpoint) or checkpoint_dir(source) or checkpoint_dir(name)
        disk = stored_tensors(found) if found is not None else None
        expert_dtype = _disk_expert_dtype(disk) if disk else None
        layers, expert_params, dtype = _layer_infos(adapter, expert_dtype)
        first = adapter.layer(adapter.moe_layers[0])
        return cls(
            model_type=adapter.model_type,
            hidden_size=adapter.hidden_size,
            num_hidden_layers=len(adapter.decoder_layers),
            dtype=expert_dtype or str(dtype).removeprefix("torch."),
            disk_dtypes=sorted({d for d, _ in disk.values()}) if disk else None,
            expert_bias=first.storage.has_bias,
            layers=layers,
            expert_bytes=sum(x.bytes_per_expert * x.num_experts for x in layers),
            other_bytes=_other_bytes(model, expert_params, disk),
            source=source if source is not None else name,
        )


def _element_size(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _layer_infos(
    adapter, expert_dtype: str | None
) -> tuple[list[MoELayerInfo], set[int], torch.dtype | None]:
    """One `MoELayerInfo` per MoE layer, the ids of the routed experts' parameters and their in-memory dtype."""
    expert_params: set[int] = set()
    layers = []
    dtype = None
    for i in adapter.moe_layers:
        layer = adapter.layer(i)
        params = list(layer.storage.module.parameters())
        expert_params.update(id(p) for p in params)
        dtype = dtype or params[0].dtype
        numel = sum(p.numel() for p in params)
        nbytes = (
            numel * _element_size(expert_dtype)
            if expert_dtype
            else sum(p.numel() * p.element_size() for p in params)
        )
        spec = layer.spec
        layers.append(
            MoELayerInfo(
                layer=i,
                num_experts=spec.num_experts,
                top_k=spec.top_k,
                intermediate_size=layer.storage.intermediate_size,
                bytes_per_expert=nbytes // spec.num_experts,
                n_group=spec.n_group,
                topk_group=spec.topk_group,
                group_score=spec.group_score,
                keep_equals_renorm=bool(
                    spec.norm_topk_prob or spec.topk_before_softmax or spec.scoring == "sigmoid"
                ),
                router=spec.describe(),
            )
        )
    return layers, expert_params, dtype


def _other_bytes(model, expert_params: set[int], disk: Mapping[str, tuple[str, int]] | None) -> int:
    """Bytes of every saved tensor that is not a routed expert, at its on-disk dtype (else as held)."""
    rest = _disk_other_dtype(disk) if disk else None

    def nbytes_of(key: str, t: torch.Tensor) -> int:
        if disk is None:
            return t.numel() * t.element_size()
        stored = disk.get(key)  # non-expert tensors keep their names on disk
        return t.numel() * _element_size(stored[0] if stored else rest)

    other = 0
    for key, p in model.named_parameters():  # deduplicated: tied embeddings count once, as on disk
        if id(p) not in expert_params:
            other += nbytes_of(key, p)
    for mod_name, mod in model.named_modules():
        for buf, b in mod.named_buffers(recurse=False):
            if b is not None and buf not in mod._non_persistent_buffers_set:
                other += nbytes_of(f"{mod_name}.{buf}" if mod_name else buf, b)
    return other


def _dominant(disk: Mapping[str, tuple[str, int]], keep) -> str | None:
    """The dtype holding the most bytes among the stored tensors whose name passes `keep`."""
    by: dict[str, int] = {}
    for name, (dtype, n) in disk.items():
        if keep(name) and dtype.startswith(("float", "bfloat")):
            by[dtype] = by.get(dtype, 0) + n
    return min(by, key=lambda d: (-by[d], d)) if by else None


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_expert" not in name


def _disk_expert_dtype(disk: Mapping[str, tuple[str, int]]) -> str | None:
    """On-disk dtype of the routed experts: the dtype of tensors under ``.experts.`` (families that name
    their experts otherwise: the checkpoint's dominant floating dtype)."""
    return _dominant(disk, _is_routed_expert) or _dominant(disk, lambda n: True)


def _disk_other_dtype(disk: Mapping[str, tuple[str, int]]) -> str:
    return _dominant(disk, lambda n: not _is_routed_expert(n)) or _disk_expert_dtype(disk) or "float32"
