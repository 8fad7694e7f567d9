"""Write a converted MoE as a standard dense checkpoint that loads with plain `from_pretrained`.

Student class per teacher family (`student_target`):

* the dense model of the same family when transformers has one with the identical attention and
  norm path — Qwen3-MoE → Qwen3, Qwen2-MoE → Qwen2, Mixtral → Mistral, Granite-MoE → Granite,
  DeepSeek-V2/V3 → the same class with every layer dense (``first_k_dense_replace = num_layers``);
* otherwise the same MoE class with **one expert and top-1**, which is exactly dense: with E = 1 a
  softmax over the experts (before or after top-k) gives the expert weight 1 — OLMoE (its q/k norms
  span the whole projection and it is pre-norm; Olmo2/Olmo3 are post-norm, Olmo has no q/k norm) and
  GPT-OSS (clamped SwiGLU with biases, sinks; no dense sibling). Sigmoid routers are never given
  this form unless they renormalise; every student block is checked numerically against the dense
  FFN before writing (`_verify_blocks`), so a family where "one expert" is not exactly dense is
  refused rather than written.

Qwen2-MoE's shared expert is gated per token by sigmoid(w·h), which no plain MLP can express. With
``shared_gate='fold'`` (default) the gate is replaced by its calibration mean and the shared expert is
appended to the dense FFN (a Qwen2 student; KD absorbs the approximation); with ``'exact'`` the
student is a one-expert Qwen2-MoE keeping the gated shared expert, exactly the converted function.

Layers whose FFN widths differ (a teacher's dense layers, e.g. DeepSeek's first layers, and the
converted layers of width k·I (+ shared)) are zero-padded to the widest: exact, since act(0)·0 = 0.
Every non-FFN tensor is copied by name from the teacher, and a teacher tensor with no place in the
student (or a student tensor with no source) is refused: that is the check that the attention and
norm path really is identical.

A teacher given as a checkpoint path is never loaded whole: it is read through the streamed view
(`methods.streamed.StreamedAdapter`), one decoder layer resident at a time — once for the conversion,
once more to copy that layer's attention and norm tensors into the student — so the peak is one
teacher layer plus the student being built (and the converted FFNs, float64, until they are written).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_dir, dir_bytes
from ..errors import MoECompressError
from ..methods.dense_convert import DenseConversion, convert
from ..methods.dense_fit import DenseConfig, ffn_apply, pad_ffn
from ..methods.streamed import is_streamed
from ..models import FAMILIES, ExpertWeights, MoEAdapter
from ..models.families import expert_count_keys

PLAN_NAME = "dense_plan.json"
# teacher model_type -> dense model_type with the identical attention + norm path (`FamilySpec.dense_family`;
# the teacher's own type: the same class with every layer dense through first_k_dense_replace)
DENSE_TARGETS = {f.model_type: f.dense_family for f in FAMILIES.values() if f.dense_family is not None}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class StudentTarget:
    kind: str  # "dense" (a dense class) or "moe" (same MoE class, one expert, top-1)
    model_type: str
    reason: str

    @property
    def fold_shared(self) -> bool:
        return self.kind == "dense"


def student_target(adapter: MoEAdapter, config: DenseConfig | None = None) -> StudentTarget:
    """Which class the student of this teacher is written as (module doc)."""
    config = config or DenseConfig()
    mt = adapter.model_type
    dense = DENSE_TARGETS.get(mt)
    if config.target == "moe":
        if dense == mt:
            raise MoECompressError(
                f"A {mt} student is always written dense (every layer dense through "
                "first_k_dense_replace, exact); drop --target moe."
            )
        return StudentTarget("moe", mt, "one-expert top-1 form requested")
    why_not = None
    if dense is None:
        why_not = f"transformers has no dense {mt} sibling with the identical attention and norm path"
    elif adapter.family.shared_gate_attr is not None and config.shared_gate == "exact":
        why_not = "the sigmoid-gated shared expert is kept exactly (--shared-gate exact)"
    elif not getattr(adapter.config, "qkv_bias", True):  # a Qwen2-MoE switch the dense Qwen2 class lacks
        why_not = f"this {mt} has no q/k/v biases, which {dense} always has"
    if why_not is None:
        return StudentTarget("dense", dense, f"{dense} has the same attention and norm path as {mt}")
    if config.target == "dense":
        raise MoECompressError(
            f"A dense {mt} student is not possible: {why_not}; use --target auto for the "
            "one-expert MoE form (exactly dense)."
        )
    return StudentTarget("moe", mt, why_not + "; written as the same MoE class with one expert, top-1")


# ----------------------------------------------------------------------------- configs
def _find_ffn(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(attribute, module) of a decoder layer's plain gate/up/down MLP, or None."""
    for attr in ("mlp", "block_sparse_moe", "feed_forward", "ffn"):
        m = getattr(layer, attr, None)
        if m is not None and all(
            isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            return attr, m
    return None


def _mlp_weights(m: nn.Module) -> ExpertWeights:
    g, u, d = m.gate_proj, m.up_proj, m.down_proj
    return ExpertWeights(
        g.weight.detach().double(),
        u.weight.detach().double(),
        d.weight.detach().double(),
        None if g.bias is None else g.bias.detach().double(),
        None if u.bias is None else u.bias.detach().double(),
        None if d.bias is None else d.bias.detach().double(),
    )


def _config_dict(config) -> dict:
    d = config.to_dict()
    for k in (
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "auto_map",
        "dtype",
        "torch_dtype",
    ):
        d.pop(k, None)
    return d


def student_config(adapter: MoEAdapter, target: StudentTarget, width: int):
    """The student's config: the teacher's fields the student class knows, FFN width `width`."""
    from transformers import AutoConfig

    teacher = adapter.config
    d = _config_dict(teacher)
    L = len(adapter.decoder_layers)
    if target.kind == "moe":
        for key in expert_count_keys(teacher):
            d[key] = 1
        d["num_experts_per_tok"] = 1
        d["moe_intermediate_size" if "moe_intermediate_size" in d else "intermediate_size"] = width
        for key, value in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0)):
            if d.get(key) is not None:
                d[key] = value
        if "topk_method" in d:
            d["topk_method"] = "greedy"
        cfg = AutoConfig.for_model(target.model_type, **d)
    elif target.model_type == adapter.model_type:  # the same class, every layer dense
        d["first_k_dense_replace"] = L
        d["intermediate_size"] = width
        cfg = AutoConfig.for_model(target.model_type, **d)
    else:
        known = set(AutoConfig.for_model(target.model_type).to_dict()) | {"rope_parameters", "rope_scaling"}
        kept = {k: v for k, v in d.items() if k in known}
        kept["intermediate_size"] = width
        if "layer_types" in known and "layer_types" not in d and target.model_type != "mistral":
            # Qwen3-MoE applies its sliding window (if any) to every layer
            kind = "sliding_attention" if getattr(teacher, "sliding_window", None) else "full_attention"
            kept["layer_types"] = [kind] * L
        kept.pop("mlp_only_layers", None)
        cfg = AutoConfig.for_model(target.model_type, **kept)
    dt = next(p.dtype for p in adapter.model.parameters())
    cfg.dtype = dt
    return cfg


# ----------------------------------------------------------------------------- the student model
def _new_model(config, dtype):
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every parameter is overwritten below
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _layer_ffns(
    adapter: MoEAdapter, conversion: DenseConversion, fold_shared: bool
) -> dict[int, ExpertWeights]:
    """Each decoder layer's FFN as the student will hold it (MoE layers converted, dense layers as is)."""
    out: dict[int, ExpertWeights] = {}
    for i, layer in enumerate(adapter.decoder_layers):
        if i in adapter.layers:
            out[i] = conversion.layers[i].ffn(fold_shared)
        else:
            found = _find_ffn(layer)
            if found is None:
                raise MoECompressError(
                    f"Decoder layer {i} has neither routed experts nor a gate/up/down MLP; this "
                    "architecture cannot be converted to dense."
                )
            if is_streamed(adapter):
                adapter._ensure(
                    i
                )  # a teacher dense layer (DeepSeek's first layers): bring it in to copy its MLP
            out[i] = _mlp_weights(found[1])
    return out


def _copy_teacher(adapter: MoEAdapter, targets: dict[str, torch.Tensor]) -> None:
    """Copy teacher tensor `key` into student tensor `targets[key]` for every key (same name in both models).

    A loaded teacher is read from its state dict. The streamed view holds one decoder layer at a time, so
    the keys are grouped by decoder layer and each layer is brought in once, copied, and evicted by the
    next; the non-layer tensors (embeddings, final norm, lm_head) are read once, before the layers.
    """
    if not is_streamed(adapter):
        teacher_sd = adapter.model.state_dict()
        for key, t in targets.items():
            t.copy_(teacher_sd[key].to(t.dtype))
        return
    prefix = adapter.reader.layers_prefix + "."
    by_layer: dict[int | None, list[str]] = {}
    for key in targets:
        i = int(key[len(prefix) :].split(".")[0]) if key.startswith(prefix) else None
        by_layer.setdefault(i, []).append(key)
    model = adapter.model
    if None in by_layer:
        adapter.reader.load_non_layer(model, "cpu", adapter.compute_dtype)
        for key in by_layer.pop(None):
            targets[key].copy_(_live(model, key).to(targets[key].dtype))
    for i in sorted(by_layer):
        adapter._ensure(i)
        for key in by_layer[i]:
            module, leaf = adapter._slots[i][key]
            src = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
            targets[key].copy_(src.detach().to(targets[key].dtype))
    adapter.release()


def _live(model: nn.Module, key: str) -> torch.Tensor:
    mod_name, _, leaf = key.rpartition(".")
    module = model.get_submodule(mod_name)
    t = module._parameters.get(leaf)
    return (t if t is not None else module._buffers[leaf]).detach()


def build_student(teacher, conversion: DenseConversion, target: StudentTarget | None = None):
    """The dense student as an in-memory HF model (weights in the teacher's dtype)."""
    adapter = teacher if isinstance(teacher, MoEAdapter) else MoEAdapter(teacher)
    target = target or student_target(adapter, conversion.config)
    if target.fold_shared != conversion.fold_shared:
        raise MoECompressError(
            "The conversion was made for a different student form (shared experts folded or "
            "not); convert again with fold_shared matching the target."
        )
    model = adapter.model
    dtype = next(
        p.dtype for p in model.parameters()
    )  # the streamed view's skeleton reports its compute dtype
    ffns = _layer_ffns(adapter, conversion, target.fold_shared)
    if target.kind == "dense":
        width = max(w.gate.shape[0] for w in ffns.values())
    else:
        width = max(w.gate.shape[0] for i, w in ffns.items() if i in adapter.layers)
    student = _new_model(student_config(adapter, target, width), dtype)
    names_t = {id(m): n for n, m in model.named_modules()}
    # names and shapes for the checks below; on the streamed view mostly meta tensors (copied by _copy_teacher)
    teacher_sd = model.state_dict()
    consumed: set[str] = set()
    filled: dict[str, torch.Tensor] = {}
    from_teacher: list[str] = []  # student keys copied verbatim from the teacher tensor of the same name
    s_layers = MoEAdapter(student) if target.kind == "moe" else None
    s_decoder = s_layers.decoder_layers if s_layers else _student_decoder(student)
    names_s = {id(m): n for n, m in student.named_modules()}

    for i in range(len(adapter.decoder_layers)):
        if target.kind == "dense" or i not in adapter.layers:
            found = _find_ffn(s_decoder[i])
            if found is None:
                raise MoECompressError(
                    f"The {target.model_type} student's layer {i} has no gate/up/down MLP; "
                    "cannot place the dense FFN."
                )
            w = pad_ffn(ffns[i], found[1].gate_proj.out_features)
            prefix = names_s[id(found[1])]
            for part, lin in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                filled[f"{prefix}.{lin}.weight"] = getattr(w, part)
                if getattr(w, f"{part}_bias") is not None:
                    filled[f"{prefix}.{lin}.bias"] = getattr(w, f"{part}_bias")
            src = adapter.layers[i].block if i in adapter.layers else _find_ffn(adapter.decoder_layers[i])[1]
            src_prefix = names_t[id(src)] + "."
            consumed |= {k for k in teacher_sd if k.startswith(src_prefix)}
        else:
            # one-expert MoE: experts and router come from the conversion; shared experts copy by name
            tl = adapter.layer(i)
            for mod in (tl.storage.module, tl.router):
                p = names_t[id(mod)] + "."
                consumed |= {k for k in teacher_sd if k.startswith(p)}
            sl = s_layers.layer(i)
            for mod in (sl.storage.module, sl.router):
                p = names_s[id(mod)]
                for k, _ in list(mod.named_parameters()) + list(mod.named_buffers()):
                    filled.setdefault(f"{p}.{k}", None)  # written through the adapter below

    student_sd = student.state_dict()
    missing = []
    for key in student_sd:
        if key in filled:
            continue
        if key not in teacher_sd:
            missing.append(key)
            continue
        if teacher_sd[key].shape != student_sd[key].shape:
            raise MoECompressError(
                f"Tensor {key} has shape {tuple(teacher_sd[key].shape)} in the teacher but "
                f"{tuple(student_sd[key].shape)} in the {target.model_type} student; the attention "
                "path differs — use --target moe."
            )
        filled[key] = teacher_sd[key]
        from_teacher.append(key)
        consumed.add(key)
    if missing:
        raise MoECompressError(
            f"The {target.model_type} student needs {missing[0]}, which the teacher does not have; "
            "the attention/norm path differs — use --target moe."
        )
    leftover = [k for k in teacher_sd if k not in consumed]
    if leftover:
        raise MoECompressError(
            f"The teacher's {leftover[0]} has no place in the {target.model_type} student; the "
            "attention/norm path differs — use --target moe."
        )
    with torch.no_grad():
        copied = set(from_teacher)
        for key, t in student_sd.items():
            if filled.get(key) is not None and key not in copied:
                t.copy_(filled[key].to(t.dtype))
        _copy_teacher(adapter, {key: student_sd[key] for key in from_teacher})
        if s_layers is not None:
            for i in adapter.moe_layers:
                w = ffns[i]
                s_layers.set_expert(i, 0, w.map(lambda x: x.to(dtype)))
                for p in s_layers.router_params(i):
                    if p is not None:
                        p.zero_()
    if getattr(student.config, "tie_word_embeddings", False):
        student.tie_weights()
    _verify_blocks(adapter, student, s_decoder, s_layers, ffns, conversion, target)
    return student


def _student_decoder(student) -> nn.ModuleList:
    base = student.get_decoder() if hasattr(student, "get_decoder") else student.model
    return base.layers


@torch.no_grad()
def _verify_blocks(adapter, student, s_decoder, s_layers, ffns, conversion, target) -> None:
    """Each student FFN block must compute the converted FFN (plus kept shared experts) exactly."""
    gen = torch.Generator().manual_seed(0)
    dtype = next(p.dtype for p in student.parameters())
    for i in range(len(adapter.decoder_layers)):
        h = torch.randn(16, adapter.hidden_size, generator=gen).to(dtype)
        if s_layers is not None and i in adapter.layers:
            block = s_layers.layer(i).block
            act = conversion.layers[i].act
        else:
            block = _find_ffn(s_decoder[i])[1]
            act = (
                conversion.layers[i].act if i in adapter.layers else adapter.layers[adapter.moe_layers[0]].act
            )
        got = block(h[None])
        got = (got[0] if isinstance(got, tuple) else got)[0]
        want = ffn_apply(ffns[i].map(lambda t: t.to(dtype)), h, act)
        if s_layers is not None and i in adapter.layers and s_layers.layer(i).shared is not None:
            want = want + s_layers.shared_forward(i, h)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(
            got.float(), want.float(), atol=tol * max(1.0, float(want.abs().max())), rtol=tol
        ):
            raise MoECompressError(
                f"The {target.model_type} student's layer {i} does not compute the converted FFN "
                f"(max difference {float((got - want).abs().max()):.3g}); this family's "
                f"{'one-expert' if target.kind == 'moe' else 'dense'} form is not exact here — "
                "please report it."
            )


# ----------------------------------------------------------------------------- writing
def copy_tokenizer(source: str | Path | None, out: Path) -> list[str]:
    """Copy the tokenizer (and generation config) files of `source` into `out`; returns the names copied."""
    copied = []
    if source is None or not Path(source).is_dir():
        return copied
    for name in _TOKENIZER_FILES:
        p = Path(source) / name
        if p.is_file():
            shutil.copy2(p, out / name)
            copied.append(name)
    return copied


def save_student(
    student,
    out: str | Path,
    *,
    plan: dict,
    tokenizer_source=None,
    overwrite: bool = False,
    protect=(),
    inputs=None,
) -> Path:
    """Write the student atomically: safetensors weights, config, tokenizer, and the plan beside them.

    `protect`: what the conversion read (teacher, stats store, tokenizer), which `out` may not be, contain or
    sit inside; `inputs`: their fingerprints from when it started, checked before the rename."""
    with atomic_dir(out, overwrite=overwrite, protect=protect, kind="checkpoint:dense", inputs=inputs) as tmp:
        student.save_pretrained(tmp)
        copy_tokenizer(tokenizer_source, tmp)
        (tmp / PLAN_NAME).write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    return Path(out)


def load_stats(
    calib,
    model,
    tokenizer=None,
    *,
    seq_len: int = 256,
    num_sequences: int | None = None,
    gram: bool = True,
    progress: bool = True,
) -> tuple[dict, dict]:
    """(stats per layer, description) from a stats store directory, a {layer: {name: tensor}} mapping, or
    a calibration data spec (text file, fixture name, hub dataset) collected here with a full forward."""
    from ..methods.dense_stats import collect_dense_stats

    if isinstance(calib, dict):
        return calib, {"source": "in-memory statistics"}
    path = Path(str(calib))
    if path.is_dir():
        return _read_store(path)
    if tokenizer is None:
        raise MoECompressError(
            "Calibrating from text needs the model's tokenizer; pass a model directory that has one."
        )
    from ..data import load_calibration

    spec = str(calib) if num_sequences is None or ":" in str(calib) else f"{calib}:{num_sequences}"
    data = load_calibration(spec, tokenizer, seq_len=seq_len)
    stats = collect_dense_stats(model, data.input_ids, gram=gram, progress=progress)
    return stats, {"source": data.describe(), "spec": data.spec, "tokens": data.num_tokens}


def _read_store(path: Path) -> tuple[dict, dict]:
    """Per-layer statistics from a calibration stats store directory (the calibration engine's format)."""
    try:
        from ..calibrate import store as _store  # type: ignore[attr-defined]
    except ImportError:
        _store = None
    loader = getattr(_store, "load_stats", None) if _store is not None else None
    if loader is None:
        raise MoECompressError(
            f"{path} is a directory but this installation cannot read calibration stats stores yet; "
            "pass a calibration text (e.g. --calib fixture-calib:64) instead."
        )
    store = loader(path)
    layers = getattr(store, "layers", None)
    stats = {int(i): dict(store.layer(int(i))) for i in layers} if layers is not None else dict(store)
    return stats, {"source": str(path)}


def export_dense(
    model,
    out: str | Path,
    config: DenseConfig | None = None,
    *,
    calib="fixture-calib:32",
    seq_len: int = 256,
    tokenizer_source: str | None = None,
    overwrite: bool = False,
    dtype: str = "auto",
    progress: bool = True,
) -> dict:
    """Convert `model` (directory, hub id or loaded model) and write the dense student to `out`.

    A directory or hub id is streamed (module doc): `dtype` is the arithmetic and student dtype, "auto" the
    checkpoint's own. Returns a summary: path, student class and form, FFN width, bytes on disk of teacher
    and student, and ``teacher_layer_loads`` (decoder layer -> times read) for a streamed teacher.

    `out` is checked and claimed (`atomic.claim`) before the teacher is read, and what the conversion reads
    (teacher, a stats store, the tokenizer) is fingerprinted then and checked before the rename: a teacher
    replaced while it streamed is refused instead of giving a student made of two checkpoints.
    """
    from ..atomic import check_output, claim, fingerprint_inputs
    from ..checkpoint import checkpoint_fingerprint

    protect = [p for p in (model, calib, tokenizer_source) if isinstance(p, (str, Path))]
    check_output(out, overwrite, protect, kind="checkpoint:dense")
    with claim(out):
        inputs = fingerprint_inputs(protect, checkpoint_fingerprint)
        return _export_dense(
            model,
            out,
            config,
            calib=calib,
            seq_len=seq_len,
            tokenizer_source=tokenizer_source,
            overwrite=overwrite,
            dtype=dtype,
            progress=progress,
            protect=protect,
            inputs=inputs,
        )


def _export_dense(
    model, out, config, *, calib, seq_len, tokenizer_source, overwrite, dtype, progress, protect, inputs
) -> dict:
    config = config or DenseConfig()
    source = None
    if isinstance(model, (str, Path)):
        source = str(model)
        adapter = teacher_view(source, dtype)
        model = adapter.model
    else:
        adapter = MoEAdapter(model)
    tokenizer = None
    tok_src = tokenizer_source or source
    if tok_src is not None and Path(tok_src).is_dir():
        try:
            from ..data import load_tokenizer

            tokenizer = load_tokenizer(tok_src)
        except MoECompressError:
            tokenizer = None
    target = student_target(adapter, config)
    stats, calib_info = load_stats(
        calib,
        model,
        tokenizer,
        seq_len=seq_len,
        gram=config.criterion.startswith("do-") or config.grouping == "oc",
        progress=progress,
    )
    conversion = convert(adapter, stats, config, fold_shared=target.fold_shared, progress=progress)
    student = build_student(adapter, conversion, target)
    plan = dict(
        conversion.plan,
        teacher=source or getattr(model, "name_or_path", None),
        calibration=calib_info,
        student={
            "kind": target.kind,
            "model_type": target.model_type,
            "class": type(student).__name__,
            "reason": target.reason,
            "intermediate_size": _width(student, target),
        },
    )
    save_student(
        student, out, plan=plan, tokenizer_source=tok_src, overwrite=overwrite, protect=protect, inputs=inputs
    )
    summary = {
        "out": str(out),
        "student_class": type(student).__name__,
        "form": target.kind,
        "model_type": target.model_type,
        "intermediate_size": plan["student"]["intermediate_size"],
        "bytes": dir_bytes(out),
    }
    if source is not None and Path(source).is_dir():
        summary["teacher_bytes"] = dir_bytes(source)
    if is_streamed(adapter):
        adapter.release()
        loads: dict[int, int] = {}
        for counts in (adapter.layer_loads, adapter.forward_loads):
            for i, n in counts.items():
                loads[i] = loads.get(i, 0) + n
        summary["teacher_layer_loads"] = dict(sorted(loads.items()))
    return summary


def teacher_view(source: str, dtype: str = "auto"):
    """The streamed, read-only view of teacher checkpoint `source` in `dtype` ("auto": its stored dtype)."""
    from ..checkpoint import CheckpointReader
    from ..disk import stored_dtype
    from ..methods.streamed import StreamedAdapter
    from ..models import parse_dtype

    reader = CheckpointReader(source)
    if dtype in (None, "auto"):
        dtype = stored_dtype(reader.path) or "float32"
    return StreamedAdapter(str(reader.path), compute_dtype=parse_dtype(dtype), reader=reader)


def _width(student, target: StudentTarget) -> int:
    cfg = student.config
    if target.kind == "moe":
        return int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    return int(cfg.intermediate_size)
