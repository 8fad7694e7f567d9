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
  FFN before writing (`student._verify_blocks`), so a family where "one expert" is not exactly dense is
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
(`checkpoint.view.StreamedAdapter`), one decoder layer resident at a time — once for the conversion,
once more to copy that layer's attention and norm tensors into the student — so the peak is one
teacher layer plus the student being built (and the converted FFNs, float64, until they are written).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..atomic import atomic_dir, dir_bytes
from ..checkpoint.view import is_streamed
from ..errors import MoECompressError
from ..methods.dense_convert import convert
from ..methods.dense_fit import DenseConfig
from ..models import MoEAdapter
from .student import build_student
from .student_config import StudentTarget, student_target

PLAN_NAME = "dense_plan.json"
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
    """`export_dense`'s work once `out` is checked and claimed: convert, build, write, summarise."""
    config = config or DenseConfig()
    adapter, model, source = _open_teacher(model, dtype)
    tok_src = tokenizer_source or source
    tokenizer = _tokenizer_of(tok_src)
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
    return _summary(out, student, target, plan, source, adapter)


def _open_teacher(model, dtype: str):
    """(adapter, model, source): a path or hub id streamed (`teacher_view`, source its string), a loaded
    model wrapped as it is (source None)."""
    if isinstance(model, (str, Path)):
        source = str(model)
        adapter = teacher_view(source, dtype)
        return adapter, adapter.model, source
    return MoEAdapter(model), model, None


def _tokenizer_of(tok_src):
    """The tokenizer in directory `tok_src`, or None (no directory, or none there)."""
    if tok_src is None or not Path(tok_src).is_dir():
        return None
    try:
        from ..data import load_tokenizer

        return load_tokenizer(tok_src)
    except MoECompressError:
        return None


def _summary(out, student, target: StudentTarget, plan: dict, source, adapter) -> dict:
    """What `export_dense` returns (its docstring); a streamed teacher is released here."""
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
    from ..checkpoint.view import StreamedAdapter
    from ..disk import stored_dtype
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
