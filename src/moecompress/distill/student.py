"""The dense student built in memory from a converted MoE (`build_student`): each layer's FFN placed, every
other tensor copied by name from the teacher, and every block checked to compute the converted FFN."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.view import is_streamed
from ..errors import MoECompressError
from ..methods.dense_convert import DenseConversion, mlp_weights
from ..methods.dense_fit import ffn_apply, pad_ffn
from ..models import ExpertWeights, MoEAdapter
from .student_config import StudentTarget, student_config, student_target


def _find_ffn(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(attribute, module) of a decoder layer's plain gate/up/down MLP, or None."""
    for attr in ("mlp", "block_sparse_moe", "feed_forward", "ffn"):
        m = getattr(layer, attr, None)
        if m is not None and all(
            isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            return attr, m
    return None


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
            out[i] = mlp_weights(found[1])
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
    # names and shapes for the checks below; on the streamed view mostly meta tensors (copied by _copy_teacher)
    teacher_sd = model.state_dict()
    s_layers = MoEAdapter(student) if target.kind == "moe" else None
    s_decoder = s_layers.decoder_layers if s_layers else _student_decoder(student)
    filled, consumed = _place_ffns(adapter, student, target, ffns, s_decoder, s_layers, teacher_sd)
    student_sd = student.state_dict()
    from_teacher = _match_teacher(student_sd, teacher_sd, filled, consumed, target)
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


def _place_ffns(
    adapter: MoEAdapter, student, target: StudentTarget, ffns, s_decoder, s_layers, teacher_sd
) -> tuple[dict[str, torch.Tensor | None], set[str]]:
    """(filled, consumed): the student tensors each layer's FFN fills (key -> value; None for a one-expert
    layer's experts and router, written through the adapter later) and the teacher keys those FFNs replace."""
    names_t = {id(m): n for n, m in adapter.model.named_modules()}
    names_s = {id(m): n for n, m in student.named_modules()}
    consumed: set[str] = set()
    filled: dict[str, torch.Tensor | None] = {}
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
    return filled, consumed


def _match_teacher(
    student_sd, teacher_sd, filled: dict, consumed: set[str], target: StudentTarget
) -> list[str]:
    """The student keys copied verbatim from the teacher tensor of the same name (added to `filled` and
    `consumed`); refused when a student tensor has no source, a shape differs or a teacher tensor no place."""
    from_teacher: list[str] = []
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
    return from_teacher


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
