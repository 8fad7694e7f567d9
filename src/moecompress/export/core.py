"""`export`: write a plan's result as a checkpoint, streaming one decoder layer at a time.

For every decoder layer the source materialises the layer, the format turns its tensors into
output tensors (the non-expert part at once; a scope's stored experts when the last layer of the
scope has been read), the writer appends them to the current shard, and the layer is freed.
Everything goes to a temporary sibling directory renamed on success (`atomic_dir`), so a crash
leaves no output. Bytes on disk are measured and printed against the original.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from .._version import __version__
from ..atomic import atomic_dir, dir_bytes
from ..atomic import human_bytes as _human
from ..plan import PLAN_FILE, CompressionPlan
from ..runtime import stored_weights
from ..runtime.build import _complete_bias, runtime_layout
from .budget import check_weight_budget, recorded_budget
from .formats import format_class
from .naming import child_name
from .readers import BASE_CONFIG_FILE
from .source import open_source
from .writer import ShardWriter

MARKER_FILE = "moecompress.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class ExportResult(BaseModel):
    """What an export wrote, and how big it really is."""

    format: str
    path: str
    evaluation_only: bool
    bytes_on_disk: int  # every file in the output directory
    weight_bytes: int  # the *.safetensors files
    original_bytes: int  # the source's weights (its safetensors files, or its tensors when in memory)
    logical_bytes: int  # plan.logical_bytes(): stored experts + operators + everything else
    shards: list[str]
    routed_bytes: int = (
        0  # what replaces the routed experts, as written (plan.logical_bytes, padding included)
    )
    original_routed_bytes: int = 0  # the original's routed experts, at its on-disk dtype
    other_bytes: int = (
        0  # every other tensor, as the plan stores it (quantized non-expert weights: packed bytes)
    )
    original_other_bytes: int = 0  # every other tensor of the original, at its on-disk dtypes
    # what the weight files hold beyond the plan's tensors, known before writing (a GGUF's metadata and tokenizer)
    container_bytes: int = 0
    # the budget the plan records for the weight files (auto's, headers included; checked before the rename)
    budget_bytes: int | None = None

    @property
    def ratio(self) -> float:
        return self.weight_bytes / self.original_bytes if self.original_bytes else float("nan")

    def describe(self) -> str:
        label = " (evaluation only: full size, NOT compressed)" if self.evaluation_only else ""
        routed = ""
        if self.original_routed_bytes and not self.evaluation_only:
            routed = (
                f"; routed experts {_human(self.routed_bytes)} vs {_human(self.original_routed_bytes)} "
                f"({100 * self.routed_bytes / self.original_routed_bytes:.1f}%)"
            )
        other = ""
        if (
            self.other_bytes != self.original_other_bytes
            and self.original_other_bytes
            and not self.evaluation_only
        ):
            other = (
                f"; other tensors {_human(self.other_bytes)} vs {_human(self.original_other_bytes)} "
                f"({100 * self.other_bytes / self.original_other_bytes:.1f}%)"
            )
        return (
            f"{self.format} checkpoint at {self.path}{label}: {_human(self.bytes_on_disk)} on disk, weights "
            f"{_human(self.weight_bytes)} vs original {_human(self.original_bytes)} ({100 * self.ratio:.1f}%)"
            f"{routed}{other}{self._budget()}"
        )

    def _budget(self) -> str:
        """The weight files' bytes against the budget the plan recorded, and the headroom left (none: '')."""
        if self.budget_bytes is None or self.evaluation_only:
            return ""
        left = self.budget_bytes - self.weight_bytes
        return (
            f"; weight files {self.weight_bytes} bytes of the {self.budget_bytes}-byte budget "
            f"({100 * left / self.budget_bytes:.2f}% left)"
        )


def _weights_bytes(directory: Path) -> int:
    from .imatrix import IMATRIX_FILE

    return sum(
        p.stat().st_size
        for p in directory.iterdir()
        if p.suffix in (".safetensors", ".gguf") and p.name != IMATRIX_FILE
    )


def _write_recipe(tmp: Path, recipe) -> None:
    if recipe is None:
        return
    if isinstance(recipe, (str, os.PathLike)) and Path(recipe).is_file():
        shutil.copyfile(recipe, tmp / ("recipe" + (Path(recipe).suffix or ".yaml")))
        return
    if isinstance(recipe, Mapping) or isinstance(recipe, BaseModel):
        import yaml

        data = recipe.model_dump(mode="json") if isinstance(recipe, BaseModel) else dict(recipe)
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=True))
        return
    (tmp / "recipe.yaml").write_text(str(recipe))


def _stream(source, plan: CompressionPlan, fmt, writer: ShardWriter, quiet: bool) -> None:
    """Write `source` through `fmt` into `writer` one decoder layer at a time: dense layers as they are, MoE
    layers' own tensors, each scope's stored experts once its last layer is read, then the other tensors."""
    from rich.progress import track

    from ..memory import release_freed_memory

    adapter = source.adapter
    remaining = {sc.id: set(sc.layers) for sc in plan.scopes}
    scope_of = {lp.layer: plan.scope(lp.scope) for lp in plan.layers}
    buffered: dict[tuple[int, int], Any] = {}  # sources of cross-layer scopes read before the scope completes
    n_layers = len(adapter.decoder_layers)
    for i in track(range(n_layers), description=f"export {fmt.name}", disable=quiet, transient=True):
        source.load_layer(i)
        if i not in adapter.layers:
            rel = source.layer_state(i)
            writer.add_all(fmt.dense_layer(i, rel))
            del rel  # its references would keep the layer alive past free_layer, beside the next one
            source.free_layer(i)
            continue
        layer = _write_moe_layer(source, plan, fmt, writer, i)
        sc = scope_of[i]
        remaining[sc.id].discard(i)
        complete, cross = not remaining[sc.id], len(sc.layers) > 1
        if cross or not complete:  # a cross-layer scope's sources are copied out, the last layer's too
            _buffer_sources(buffered, sc, i, layer)
        if cross and complete:
            source.free_layer(i)  # so the whole layer is not held while the scope is stacked
        if complete:
            _write_scope(plan, fmt, writer, sc, layer, buffered, cross)
        if cross and complete:
            release_freed_memory()  # the stacked scope is written: hand its pages back
        else:
            source.free_layer(i)
    writer.add_all(fmt.other(source.other_state()))


def _write_moe_layer(source, plan: CompressionPlan, fmt, writer: ShardWriter, i: int):
    """Write MoE layer `i`'s own tensors (all but its experts; merged router rows where the plan has them)
    and remember the layer in `fmt`; returns the layer."""
    from ..runtime.merged_router import merged_router_state, router_tensor_prefix

    adapter = source.adapter
    rel = source.layer_state(i)
    layer = adapter.layer(i)
    if (
        fmt.tensors and f"{router_tensor_prefix(i)}.weight" in fmt.tensors
    ):  # merged router rows (M-SMoE/HC-SMoE)
        rel = merged_router_state(
            plan, fmt.tensors, i, rel, child_name(adapter.decoder_layers[i], layer.router) + "."
        )
    fmt.remember(i, layer)
    exp_rel = fmt.expert_names[i][0] + "."
    writer.add_all(fmt.moe_layer(i, {k: v for k, v in rel.items() if not k.startswith(exp_rel)}, layer))
    del rel  # as in `_stream`: the layer's tensors are reachable from the layer alone from here on
    return layer


def _buffer_sources(buffered: dict, sc, i: int, layer) -> None:
    """Copy into `buffered` the experts of layer `i` that scope `sc`'s stored experts read (but elementwise
    merges), so they outlive the layer until the scope completes."""
    for s in sc.stored:
        for l, e in s.sources:
            if l == i and (s.construction != "elementwise_merge"):
                buffered[(l, e)] = layer.storage.read(e).map(lambda t: t.detach().clone())


def _write_scope(
    plan: CompressionPlan, fmt, writer: ShardWriter, sc, layer, buffered: dict, cross: bool
) -> None:
    """Write complete scope `sc`'s stored experts, built from `buffered` (a cross-layer scope) or `layer`."""

    def src(l, e, layer=layer, cross=cross):
        return buffered[(l, e)] if cross else layer.storage.read(e)

    # packed (PuzzleMoE) and quantized stored experts stay packed: the format reads their tensors itself
    weights = [
        None
        if s.packing is not None or s.quant is not None
        else _complete_bias(stored_weights(plan, sc, s, src, fmt.tensors), runtime_layout(layer))
        for s in sc.stored
    ]
    for key in [k for k in buffered if k[0] in sc.layers]:  # merged sources go before the scope is stacked
        del buffered[key]
    writer.add_all(fmt.scope(sc, weights))
    del weights


def export(
    model_or_path,
    plan: CompressionPlan,
    out: str | os.PathLike,
    format: str = "compact",
    tensors: Mapping[str, torch.Tensor] | None = None,
    recipe=None,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    quiet: bool = False,
    protect=(),
    inputs=None,
    extras=None,
) -> ExportResult:
    """Write `plan` applied to `model_or_path` (an original model, or its checkpoint directory) to `out`.

    format: ``compact`` (any plan without packed experts; read with `moecompress.load`), ``packed``
    (compact plus PuzzleMoE packed experts stored packed; read with `moecompress.load`), ``hf``
    (vanilla checkpoint when the family's config can express the plan), ``materialized`` (full
    size, evaluation only) or ``gguf`` (one model.gguf for llama.cpp; docs/export.md).

    protect: paths `out` may not be, contain or sit inside (the source directory is added); inputs: their
    fingerprints from when the run started (`atomic.fingerprint_inputs`), checked before the rename
    (default: `protect` as it is when the export starts). extras: called with the output's temporary directory
    once the weights are written, to add files that belong with them (gguf's ``imatrix.gguf``), so they are renamed
    into place with the rest or not at all.
    """
    fmt_class = format_class(format)
    source = open_source(model_or_path)
    plan.check_model(source.adapter)
    plan.check_tensors(tensors)
    fmt = fmt_class(plan, tensors, source)
    fmt.check()
    protect = [*protect, source.source_dir]
    with atomic_dir(
        out, overwrite=overwrite, protect=protect, kind=f"checkpoint:{format}", inputs=inputs
    ) as tmp:
        writer = ShardWriter(tmp, max_shard_size)
        _stream(source, plan, fmt, writer, quiet)
        own = fmt.write_files(tmp)  # a format that writes its own file (gguf) names it; else the shards
        shards = writer.close() if own is None else own
        # a budget the plan records bounds its weight files (auto's, headers included): refused before the rename
        check_weight_budget(plan, _weights_bytes(tmp), fmt.evaluation_only)
        _write_metadata(tmp, source, plan, fmt, recipe)
        (tmp / MARKER_FILE).write_text(
            json.dumps(_marker(format, fmt, plan), indent=1, sort_keys=True) + "\n"
        )
        if extras is not None:
            extras(tmp)
        weight_bytes = _weights_bytes(tmp)
        total = dir_bytes(tmp)
    return _export_result(format, out, fmt, plan, tensors, source, total, weight_bytes, shards)


def _write_metadata(tmp: Path, source, plan: CompressionPlan, fmt, recipe) -> None:
    """Write the output's config, plan, recipe, tokenizer files and generation config into `tmp`."""
    config = fmt.output_config()
    if fmt.runtime_tensors:
        # no config.json on purpose: plain from_pretrained must not load a compact dir with random experts
        (tmp / BASE_CONFIG_FILE).write_text(config.to_json_string(use_diff=False))
    else:
        config.save_pretrained(tmp)
    (tmp / PLAN_FILE).write_text(plan.to_json())
    _write_recipe(tmp, recipe)
    if source.source_dir is not None:
        for name in TOKENIZER_FILES:
            if (source.source_dir / name).is_file():
                shutil.copyfile(source.source_dir / name, tmp / name)
    gen = source.generation_config()
    if gen is not None and not (tmp / "generation_config.json").exists():
        try:
            gen.save_pretrained(tmp)
        except Exception:  # a generation config that does not validate is not worth failing an export
            pass


def _marker(format: str, fmt, plan: CompressionPlan) -> dict:
    """The output's marker file: its format, whether it is for evaluation only, and the versions it was written by."""
    marker = {
        "format": format,
        "evaluation_only": fmt.evaluation_only,
        "moecompress_version": __version__,
        "plan_schema_version": plan.schema_version,
        "model_type": plan.model.model_type,
        "layout": runtime_layout(fmt.expert_names[min(fmt.expert_names)][2]),
    }
    if fmt.evaluation_only:
        marker["note"] = (
            "every original slot is filled: full size, for evaluation only, never a compressed model"
        )
    return marker


def _export_result(
    format: str, out, fmt, plan: CompressionPlan, tensors, source, total: int, weight_bytes: int, shards
) -> ExportResult:
    """`export`'s result: where it wrote, and the sizes on disk, logical and original."""
    logical = plan.logical_bytes(tensors)
    written = plan.logical_bytes(tensors, accounting="stored" if fmt.runtime_tensors else "logical")
    original = _weights_bytes(source.source_dir) if source.source_dir is not None else 0
    result = ExportResult(
        format=format,
        path=str(out),
        evaluation_only=fmt.evaluation_only,
        bytes_on_disk=total,
        weight_bytes=weight_bytes,
        original_bytes=original or logical.original,
        logical_bytes=logical.total,
        shards=shards,
        routed_bytes=written.routed,
        original_routed_bytes=written.original_routed,
        other_bytes=written.other,
        original_other_bytes=plan.model.other_bytes,
        container_bytes=fmt.container_bytes(),
        budget_bytes=recorded_budget(plan),
    )
    # the summary line is the caller's to print (`compress` prints it once, on stdout); printing it here too
    # put it on stdout and stderr both
    return result
