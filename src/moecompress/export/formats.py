"""The export formats: one class each, saying which plans it holds, what it writes, and how it loads.

A format class answers `reason(plan)` (why it cannot hold a plan, or None), writes a layer, a
completed scope and the non-layer tensors (`core.export` streams them), and names its reader
(`load`, used by `load.load` through the format the export's marker records). `FORMATS` is the
registry; `AUTO_ORDER` is the preference `auto_format` (`--format auto`) follows. A new format is one
class plus its `FORMATS` entry (docs/architecture.md, "Worked example: a new export format").

* ``hf``: vanilla checkpoint — kept experts and their router rows (bias, score-correction bias)
  sliced, config's expert count updated, tensors in the family's on-disk naming (exactly what
  `save_pretrained` writes), so plain transformers and vLLM load it.
* ``compact``: the runtime's tensors — original non-expert weights under native names (routers
  kept whole), each scope's stored experts once (``moecompress.scopes.<id>.*``), operators
  (``<layer>.<block>.ops.*``); read back by `moecompress.load`.
* ``packed``: ``compact`` plus PuzzleMoE packed stored experts kept packed — a scope holding any is
  written as the runtime's `PackedScopeExperts` state (``moecompress.scopes.<id>.dense.*`` fused
  dense experts, ``moecompress.scopes.<id>.merged.s<k>.*`` each packed expert's tensors, once).
* ``materialized``: every original slot filled with what it computes (zeros for dropped slots; a
  slot of a packed merge gets its own member's decoded reconstruction), full size, evaluation only.
* ``gguf``: llama.cpp's GGUF, one ``model.gguf`` (export/gguf.py, docs/export.md).
"""

from __future__ import annotations

import copy

import torch

from ..errors import MoECompressError
from ..models import FAMILIES, ExpertWeights, MoELayer, skeleton
from ..models.families import expert_count_keys
from ..plan import CompressionPlan, Scope
from ..runtime import build_ops, native_tensors, runtime_layout
from ..runtime.build import _complete_bias, scope_from_weights, stored_weights
from .ct import tensor_quant_problem
from .gguf import GGUFFile
from .gguf import reason as gguf_reason
from .gguf_load import load_gguf_dir
from .naming import child_name, revert_names
from .readers import SCOPE_PREFIX, load_runtime, load_transformers


class Format:
    """One output format. Class level: which plans it holds and how its checkpoints load; an instance
    writes one plan (``check`` first, then the per-layer / per-scope methods `core.export` calls)."""

    name = ""
    evaluation_only = False  # full size, for evaluation only (never a compressed model)
    # writes the runtime's own tensors: base_config.json instead of config.json (plain from_pretrained must not
    # load it with random experts), and its bytes are counted as stored (padding included)
    runtime_tensors = False
    load = staticmethod(
        load_transformers
    )  # (directory, device_map, dtype, max_memory, offload_folder, *, trust_remote_code=False) -> model

    @classmethod
    def reason(cls, plan: CompressionPlan) -> str | None:
        """Why this format cannot hold `plan` (a clause), or None when it can."""
        return None

    @classmethod
    def refusal(cls, plan: CompressionPlan) -> str | None:
        """The one sentence `export` raises for a plan this format cannot hold (None when it can)."""
        why = cls.reason(plan)
        if why is None:
            return None
        return (
            f"The '{cls.name}' format cannot express this plan ({why}); export it with "
            f"format='{auto_format(plan)}' instead."
        )

    def __init__(self, plan: CompressionPlan, tensors, source):
        self.plan, self.tensors, self.source = plan, tensors or {}, source
        self.adapter = source.adapter
        self.prefix = source.prefix
        # layer -> (experts rel name, block rel name, handles, expert dtype), noted while the layer is loaded
        self.expert_names: dict[int, tuple[str, str, MoELayer, torch.dtype]] = {}

    def check(self) -> None:
        """Refuse a plan this format cannot hold (one sentence), before anything is written."""
        refusal = self.refusal(self.plan)
        if refusal is not None:
            raise MoECompressError(refusal)

    def output_config(self):
        return self.source.config

    def remember(self, i: int, layer: MoELayer) -> None:
        decoder = self.adapter.decoder_layers[i]
        self.expert_names[i] = (
            child_name(decoder, layer.storage.module),
            child_name(decoder, layer.block),
            layer,
            layer.storage.read(0).gate.dtype,
        )

    def full(self, i: int, rel: dict) -> dict:
        return {f"{self.prefix}.{i}.{k}": v for k, v in rel.items()}

    def finalize(self, tensors: dict) -> dict:
        return tensors

    def quantized_tensors(self, tensors: dict, packed: bool) -> dict:
        """`tensors` with each non-expert weight the plan quantizes (``plan.tensor_quant``) replaced by its
        pack-quantized tensors (`packed`) or by its dequantized weight in the original tensor's dtype."""
        if not self.plan.tensor_quant:
            return tensors
        from ..runtime.tensor_quant import dequantized, packed_of

        out = {}
        for k, v in tensors.items():
            if k not in self.plan.tensor_quant:
                out[k] = v
            elif packed:
                base = k.removesuffix(".weight")
                out.update({f"{base}.{s}": t for s, t in packed_of(self.tensors, k).items()})
            else:
                out[k] = dequantized(self.plan, self.tensors, k, v.dtype)
        return out

    def dense_layer(self, i: int, rel: dict) -> dict:
        return self.finalize(self.full(i, rel))

    def moe_layer(self, i: int, rel_nonexpert: dict, layer: MoELayer) -> dict:
        return self.finalize(self.full(i, rel_nonexpert))

    def scope(self, sc: Scope, weights: list[ExpertWeights]) -> dict:
        raise NotImplementedError

    def other(self, state: dict) -> dict:
        return self.finalize(state)

    def container_bytes(self) -> int:
        """Bytes the format's weight files hold beyond the plan's tensors, known before any is written (a GGUF's
        header, hyperparameters and tokenizer); safetensors headers are not counted."""
        return 0

    def write_files(self, directory) -> list[str] | None:
        """The files of a format that writes its own (gguf: one .gguf), once every tensor has streamed past;
        None: the tensors the hooks returned, in safetensors shards."""
        return None

    def expert_tensors(self, i: int, experts: list[ExpertWeights]) -> dict:
        """Experts of layer i in the layer's own storage layout and names (native)."""
        exp_rel, _, layer, dtype = self.expert_names[i]
        base = f"{self.prefix}.{i}.{exp_rel}"
        if layer.storage.layout == "modulelist":
            names = layer.storage.names
            out = {}
            for j, w in enumerate(experts):
                for part in ("gate", "up", "down"):
                    out[f"{base}.{j}.{names[part]}.weight"] = getattr(w, part).to(dtype)
                    if getattr(w, f"{part}_bias") is not None:
                        out[f"{base}.{j}.{names[part]}.bias"] = getattr(w, f"{part}_bias").to(dtype)
            return out
        t = native_tensors(experts, runtime_layout(layer), self.plan.model.layer(i).intermediate_size, dtype)
        return {f"{base}.{k}": v for k, v in t.items()}


class HFFormat(Format):
    name = "hf"

    @classmethod
    def reason(cls, plan: CompressionPlan) -> str | None:
        """Can a vanilla config express this plan (sliced experts + router rows, the family's own checkpoint
        layout; quantized: compressed-tensors)? None if so, else why not."""
        if plan.has_packed():
            return "it stores packed element-wise merges"
        problem = tensor_quant_problem(plan)
        if problem is not None:
            return problem
        specs = plan.quant_specs()
        if len(specs) > 1:
            return "its stored experts have different precisions"
        (spec,) = specs
        if spec is not None:
            family = FAMILIES.get(plan.model.model_type)
            if family is not None and not family.hf_quantized:
                return (
                    f"compressed-tensors cannot hold the {plan.model.model_type} family's experts quantized: its "
                    "checkpoints do not store them as per-expert gate/up/down_proj weights"
                )
            if spec.group_size is not None:
                dims = {plan.model.hidden_size} | {li.intermediate_size for li in plan.model.layers}
                if any(d % spec.group_size for d in dims):
                    return (
                        f"its quantization group {spec.group_size} leaves a shorter last group on input "
                        f"dimensions {sorted(dims)}, which compressed-tensors cannot load"
                    )
        counts = set()
        for lp in plan.layers:
            sc = plan.scope(lp.scope)
            li = plan.model.layer(lp.layer)
            if sc.layers != [lp.layer]:
                return f"layer {lp.layer} shares the cross-layer scope '{sc.id}'"
            if lp.operators():
                return f"layer {lp.layer} has replacement operators"
            if not (lp.gate == "renorm" or (lp.gate == "keep" and li.keep_equals_renorm) or not lp.dropped()):
                return f"layer {lp.layer} uses gate '{lp.gate}', which a standard router cannot express"
            ids = lp.stored_ids()
            if len(set(ids)) != len(ids):
                return f"layer {lp.layer} maps several slots to one stored expert"
            if any(plan.stored_width(sc, s) != li.intermediate_size for s in sc.stored):
                return f"layer {lp.layer} stores an expert of a different width"
            if li.n_group > 1:
                size = li.num_experts // li.n_group
                per_group = {
                    sum(1 for e in range(g * size, (g + 1) * size) if lp.slots[e] != "drop")
                    for g in range(li.n_group)
                }
                if len(per_group) != 1:
                    return f"layer {lp.layer} keeps unequal numbers of experts per router group"
            counts.add(len(ids))
        if len(counts) != 1:
            return f"layers keep different numbers of experts ({sorted(counts)})"
        return None

    def check(self) -> None:
        super().check()
        self.kept = {
            lp.layer: [e for e, t in enumerate(lp.slots) if isinstance(t, int)] for lp in self.plan.layers
        }
        self.k = len(next(iter(self.kept.values())))
        config = copy.deepcopy(self.source.config)
        for key in expert_count_keys(config):
            setattr(config, key, self.k)
        self.out_skeleton = skeleton(config)  # before quantization_config: on-disk names of the dense experts
        (self.quant,) = self.plan.quant_specs()  # `reason`: one precision for every stored expert
        if self.quant is not None or self.plan.tensor_quant:
            from .ct import quantization_config

            config.quantization_config = quantization_config(
                self.quant, {n.removesuffix(".weight"): tq.quant for n, tq in self.plan.tensor_quant.items()}
            )
        self.config = config

    def output_config(self):
        return self.config

    def finalize(self, tensors: dict) -> dict:
        # quantized non-expert weights keep their module names (compressed-tensors' pack-quantized keys)
        return self.quantized_tensors(revert_names(self.out_skeleton, tensors), packed=True)

    def moe_layer(self, i, rel_nonexpert, layer):
        router_rel = child_name(self.adapter.decoder_layers[i], layer.router) + "."
        e = self.plan.model.layer(i).num_experts
        idx = torch.tensor(self.kept[i], dtype=torch.long)
        out = {}
        for k, v in rel_nonexpert.items():
            if k.startswith(router_rel) and v.dim() >= 1 and v.shape[0] == e:
                v = v.index_select(0, idx.to(v.device))  # the deleted slots' router rows / biases
            out[k] = v
        return self.finalize(self.full(i, out))

    def scope(self, sc, weights):
        (i,) = sc.layers
        lp = self.plan.layer(i)
        ordered = [weights[lp.slots[e]] for e in self.kept[i]]
        if self.quant is None:
            return self.finalize(self.expert_tensors(i, ordered))
        from .ct import per_expert_quantized

        stored = [sc.stored[lp.slots[e]] for e in self.kept[i]]
        # names and shapes only: the packed codes replace every projection, so none is dequantized
        ordered = [
            _complete_bias(self._placeholder(sc, s), runtime_layout(self.expert_names[i][2])) for s in stored
        ]
        packed = [
            {
                part: {  # keys first: a store on disk (the streamed view) reads a tensor per lookup
                    k.rsplit(".", 1)[1]: self.tensors[k]
                    for k in self.tensors
                    if k.startswith(f"{s.tensor}.{part}.")
                }
                for part in ("gate", "up", "down")
            }
            for s in stored
        ]
        out = per_expert_quantized(
            self.finalize(self.expert_tensors(i, ordered)), packed, self.plan.model.model_type
        )
        if any(
            t.is_meta for t in out.values()
        ):  # a layout whose projections per_expert_quantized did not swap
            raise RuntimeError(
                f"Layer {i}'s export kept a placeholder weight; this is a bug, please report it."
            )
        return out

    def _placeholder(self, sc, s) -> ExpertWeights:
        """Stored expert `s` with its projections as meta tensors of their shapes and its biases as stored."""
        shapes, parts = self.plan.expert_shapes(sc, s), ("gate", "up", "down")
        weights = [torch.empty(shapes[p], dtype=torch.bfloat16, device="meta") for p in parts]
        return ExpertWeights(*weights, *(self.tensors.get(f"{s.tensor}.{p}_bias") for p in parts))


class MaterializedFormat(Format):
    name = "materialized"
    evaluation_only = True

    @classmethod
    def _problem(cls, plan) -> tuple[str, str] | None:
        """(reason clause, export's sentence) for the first thing this full-size format cannot hold, or None."""
        for lp in plan.layers:
            sc = plan.scope(lp.scope)
            if lp.operators():
                return (
                    f"layer {lp.layer} has replacement operators",
                    f"The 'materialized' format cannot express the replacement operators of layer {lp.layer}; "
                    "evaluate it with format='compact' or in memory (apply_plan).",
                )
            if lp.dropped() and lp.gate in ("renorm", "keep"):
                return (
                    f"it keeps the original router, so it cannot delete or mask the dropped slots of layer "
                    f"{lp.layer} (gate '{lp.gate}')",
                    f"The 'materialized' format keeps the original router, so it cannot delete or mask the "
                    f"dropped slots of layer {lp.layer} (gate '{lp.gate}'); use format='hf' or 'compact'.",
                )
            width = plan.model.layer(lp.layer).intermediate_size
            if any(plan.stored_width(sc, s) != width for s in sc.stored):
                return (
                    f"layer {lp.layer} stores experts of another width",
                    f"The 'materialized' format needs stored experts of the original width in layer "
                    f"{lp.layer}; use format='compact'.",
                )
        return None

    @classmethod
    def reason(cls, plan):
        problem = cls._problem(plan)
        return None if problem is None else problem[0]

    @classmethod
    def refusal(cls, plan):
        problem = cls._problem(plan)
        return None if problem is None else problem[1]

    def finalize(self, tensors):
        return revert_names(self.source.model, self.quantized_tensors(tensors, packed=False))

    def scope(self, sc, weights):
        out = {}
        _, _, layer, dtype = self.expert_names[sc.layers[0]]
        weights = [
            _complete_bias(stored_weights(self.plan, sc, s, None, self.tensors), runtime_layout(layer))
            if s.quant is not None
            else w
            for s, w in zip(sc.stored, weights)
        ]
        members = {}
        for s in sc.stored:  # packed merges: one decoded reconstruction per member (source)
            if s.packing is not None:
                from ..runtime.build import _complete_bias
                from ..runtime.packed import packed_member_weights

                members[s.id] = {
                    tuple(src): _complete_bias(w, runtime_layout(layer))
                    for src, w in zip(
                        s.sources, packed_member_weights(self.plan, sc, s, self.tensors, layer.act, dtype)
                    )
                }
        ref = (
            next(w for w in weights if w is not None)
            if any(w is not None for w in weights)
            else next(iter(next(iter(members.values())).values()))
        )
        for i in sc.layers:
            lp = self.plan.layer(i)
            zero = ref.map(torch.zeros_like)
            row = []
            for e, t in enumerate(lp.slots):
                if not isinstance(t, int):
                    row.append(zero)
                elif t in members:
                    row.append(members[t][(i, e)])
                else:
                    row.append(weights[t])
            out.update(self.expert_tensors(i, row))
        return self.finalize(out)


class CompactFormat(Format):
    name = "compact"
    runtime_tensors = True
    load = staticmethod(load_runtime)

    @classmethod
    def reason(cls, plan):
        return "it stores packed PuzzleMoE merges" if plan.has_packed() else None

    def finalize(self, tensors):
        return self.quantized_tensors(tensors, packed=True)  # quantized non-expert weights as pack-quantized

    def moe_layer(self, i, rel_nonexpert, layer):
        out = self.full(i, rel_nonexpert)
        lp = self.plan.layer(i)
        _, block_rel, _, dtype = self.expert_names[i]
        ops = build_ops(self.plan, lp, layer, self.tensors, dtype, "cpu")
        if ops is not None:
            for k, v in ops.state_dict().items():
                out[f"{self.prefix}.{i}.{block_rel}.ops.{k}"] = v
        return self.finalize(out)

    def scope(self, sc, weights):
        _, _, layer, dtype = self.expert_names[sc.layers[0]]
        stored = scope_from_weights(self.plan, sc, layer, weights, self.tensors, dtype)
        return {f"{SCOPE_PREFIX}{sc.id}.{k}": v for k, v in stored.state_dict().items()}


class PackedFormat(CompactFormat):
    """`compact` plus packed PuzzleMoE merges: each packed tensor stored once, exactly as the runtime holds it."""

    name = "packed"

    @classmethod
    def reason(cls, plan):
        return None


class GGUFFormat(Format):
    """llama.cpp's GGUF: one model.gguf in llama.cpp's names, layouts and types (export/gguf.py)."""

    name = "gguf"
    load = staticmethod(load_gguf_dir)

    @classmethod
    def reason(cls, plan):
        return gguf_reason(plan)

    def check(self):
        super().check()
        self.file = GGUFFile(self.plan, self.tensors, self.source)
        self.metadata = self.file.metadata_bytes()

    def container_bytes(self):
        return self.metadata

    def finalize(self, tensors):
        return revert_names(
            self.source.model, tensors
        )  # the checkpoint's own names, which gguf's name map knows

    def dense_layer(self, i, rel):
        self.file.add_all(self.finalize(self.full(i, rel)))
        return {}

    def moe_layer(self, i, rel_nonexpert, layer):
        self.file.add_all(self.finalize(self.full(i, rel_nonexpert)), layer=i)
        return {}

    def scope(self, sc, weights):
        (i,) = sc.layers
        kept = [self.plan.layer(i).slots[e] for e in self.file.kept[i]]
        self.file.experts(
            i, [sc.stored[s] for s in kept], [weights[s] for s in kept], self.expert_names[i][3]
        )
        return {}

    def other(self, state):
        self.file.add_all(self.finalize(state), outside=True)
        return {}

    def write_files(self, directory):
        return [self.file.write(directory)]


FORMATS: dict[str, type[Format]] = {
    f.name: f for f in (HFFormat, CompactFormat, PackedFormat, MaterializedFormat, GGUFFormat)
}
# `auto`: the first of these that holds the plan — a vanilla checkpoint when the family's config can express it,
# else the runtime's compact tensors, else (PuzzleMoE packed merges) the packed ones
AUTO_ORDER = ("hf", "compact", "packed")


def format_class(name: str) -> type[Format]:
    """The format registered as `name` (one sentence if none is)."""
    if name not in FORMATS:
        raise MoECompressError(f"Unknown export format '{name}'; use one of {', '.join(FORMATS)}.")
    return FORMATS[name]


def auto_format(plan: CompressionPlan) -> str:
    """The first format of `AUTO_ORDER` that holds `plan` (`packed` holds every plan)."""
    return next(name for name in AUTO_ORDER if FORMATS[name].reason(plan) is None)
