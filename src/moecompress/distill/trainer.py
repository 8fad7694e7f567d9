"""Knowledge distillation from the MoE teacher into the dense student on `transformers.Trainer`.

The Trainer (and accelerate under it) owns devices, mixed precision, gradient accumulation,
gradient checkpointing, checkpoints and distributed wrapping, so the same code runs on one CPU,
one GPU, DDP, FSDP2 or DeepSpeed ZeRO-3 — `accelerate launch --config_file configs/accelerate/<x>.yaml
-m moecompress.cli distill ...`. Our part is `DistillTrainer.compute_loss` (`kd.py`), a frozen teacher
kept outside the optimizer (in the checkpoint's dtype, bf16 for bf16 checkpoints, never float32 by
default; replicated on each device, or sharded like the student under FSDP2 and ZeRO-3 — `shard.py`),
the data blocks and the validation curve.

Output layout of `distill(..., out=DIR)`::

    DIR/checkpoints/checkpoint-<step>/   Trainer checkpoints (safetensors weights, optimizer, RNG) — resume
    DIR/student/                         the distilled student (written atomically at the end)
    DIR/curve.png                        validation KD loss / KL / perplexity vs optimizer step
    DIR/distill.json                     settings, metrics before/after, log history
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import MoECompressError
from .config import DistillConfig, DistillResult
from .curve import plot_curve
from .kd_trainer import teacher_ppl, trainer_class

STUDENT_DIR, CKPT_DIR, CURVE, REPORT = "student", "checkpoints", "curve.png", "distill.json"


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks of a token stream: {"input_ids": [seq_len]}."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        n = ids.numel() // seq_len
        self.blocks = ids[: n * seq_len].reshape(n, seq_len).long()

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i]}


def _load(model, dtype: str):
    if isinstance(model, torch.nn.Module):
        return model, None
    from ..models import load_model

    return load_model(str(model), dtype=dtype), str(model)


def _stream(data, tokenizer) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).long()
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], int):
        return torch.tensor(data, dtype=torch.long)
    if tokenizer is None:
        raise MoECompressError(
            "Distilling on a text spec needs a tokenizer; pass a student or teacher directory that "
            "holds one (or token ids)."
        )
    from ..data import token_stream

    return token_stream(str(data), tokenizer).ids


def last_complete_checkpoint(ckpt_dir: Path) -> str | None:
    """The newest checkpoint whose save finished (trainer_state.json is written last); partial ones
    left by a run killed while saving are removed so that checkpoint rotation never counts them."""
    if not Path(ckpt_dir).is_dir():
        return None
    found = []
    for p in Path(ckpt_dir).glob("checkpoint-*"):
        step = p.name.split("-")[-1]
        if p.is_dir() and step.isdigit():
            found.append((int(step), p))
    for _, p in sorted(found, reverse=True):
        if (p / "trainer_state.json").is_file():
            return str(p)
        shutil.rmtree(p, ignore_errors=True)
    return None


def distill(
    teacher,
    student,
    data,
    tokens: int | None = None,
    out: str | os.PathLike = "distill-out",
    *,
    config: DistillConfig | None = None,
    eval_data=None,
    tokenizer=None,
    resume: bool = True,
    overwrite: bool = False,
    teacher_dtype: str = "auto",
    callbacks: list | None = None,
    progress: bool = True,
    **overrides,
) -> DistillResult:
    """Distil `teacher` (MoE) into `student` (dense) on `data` for `tokens` tokens; see the module doc.

    teacher/student: directories, hub ids or loaded models. data / eval_data: a data spec (text file,
    fixture name, hub dataset) or token ids. A run whose checkpoints exist in `out` resumes from the
    last one unless resume=False. Returns paths of the student, the curve PNG and the JSON report.

    `out` is checked before any model loads (`_check_run_dir`) and claimed (`atomic.claim`, by rank 0) for
    the whole run, so a second run on it refuses instead of training into the same checkpoints; teacher,
    student and data files are fingerprinted when it starts and checked before the student's rename.
    """
    config = _merged_config(config, tokens, overrides)
    from contextlib import ExitStack

    from ..atomic import claim, fingerprint_inputs
    from ..checkpoint import checkpoint_fingerprint

    out = Path(out)
    protect = [p for p in (teacher, student, data, eval_data) if isinstance(p, (str, Path))]
    _check_run_dir(out, overwrite, protect)
    held = ExitStack()
    if (
        os.environ.get("RANK", "0") == "0"
    ):  # one lock per run: the other ranks of this run write the same --out
        held.enter_context(claim(out))
    with held:
        _clear_run_dir(out, overwrite)
        inputs = fingerprint_inputs(protect, checkpoint_fingerprint)  # checked before the student's rename
        return _distill(
            teacher,
            student,
            data,
            out,
            config,
            eval_data,
            tokenizer,
            resume,
            teacher_dtype,
            callbacks,
            progress,
            inputs,
        )


def _merged_config(config: DistillConfig | None, tokens: int | None, overrides: dict) -> DistillConfig:
    """`config` with `tokens` and the keyword `overrides` applied (a new one from them when None)."""
    if config is None:
        return DistillConfig(tokens=tokens, **overrides)
    if tokens is not None or overrides:
        return config.model_copy(update=dict(overrides, **({"tokens": tokens} if tokens is not None else {})))
    return config


def _clear_run_dir(out: Path, overwrite: bool) -> None:
    """Under the lock: refuse a run another run finished meanwhile, or with `overwrite` remove the old run."""
    final = out / STUDENT_DIR
    if final.exists() and not overwrite:  # checked again under the lock: another run may have finished it
        raise MoECompressError(
            f"{final} already exists (this distillation finished); pass --overwrite to run "
            "again or choose another --out."
        )
    if overwrite and out.exists():
        shutil.rmtree(out)


def _check_run_dir(out: Path, overwrite: bool, protect) -> None:
    """Refuse, before any model loads, a run directory `distill` may not write into.

    It may not be, contain or sit inside the teacher, the student or a data file (`atomic.check_apart`). An
    existing one is used only when it is empty or a distill run (marker kind ``distill-run``: resumed from its
    checkpoints), so neither a checkpoint nor someone's own directory gets checkpoints/ written into it and a
    marker that a later --overwrite would take as leave to delete it; --overwrite replaces only a distill run."""
    from ..atomic import MARKER, check_apart, check_output, check_path, marker_kind

    check_path(out)
    check_apart(out, protect)
    if overwrite or not out.exists():
        if overwrite and out.exists():
            check_output(out, overwrite, protect, kind="distill-run")
        return
    if not out.is_dir():
        raise MoECompressError(
            f"--out {out} is an existing file, not a directory; pass a new directory path."
        )
    kind = marker_kind(out)
    if (out / MARKER).is_file() and kind in (None, "distill-run"):
        return  # a run to resume (None: a marker from before kinds were recorded)
    if kind is not None:
        raise MoECompressError(
            f"--out {out} holds moecompress output of kind '{kind.split(':')[0]}', not a distill "
            "run; pass another --out."
        )
    if any(out.iterdir()):
        raise MoECompressError(
            f"--out {out} is a directory that distill did not write (no {MARKER} marker), so it "
            "will not write its run into it; pass a new or empty directory."
        )


def _distill(
    teacher,
    student,
    data,
    out: Path,
    config,
    eval_data,
    tokenizer,
    resume,
    teacher_dtype,
    callbacks,
    progress,
    inputs,
) -> DistillResult:
    """`distill`'s run, once `out` is checked and claimed."""
    final, ckpt_dir = out / STUDENT_DIR, out / CKPT_DIR
    # models before TrainingArguments, so both load whole (no ZeRO-3 zero.Init, no rank-0-only FSDP loading);
    # the Trainer then shards the student and `place_teacher` the teacher
    teacher_model, teacher_src = _load(teacher, teacher_dtype)
    student_model, student_src = _load(student, "auto")
    _mark_run_dir(out)
    if tokenizer is None and not isinstance(data, torch.Tensor):
        tokenizer = _find_tokenizer(student_src, teacher_src)
    train_set, val_set = _datasets(data, eval_data, tokenizer, config)
    args = _training_args(config, ckpt_dir, progress)
    per_step = config.batch_size * config.grad_accum * args.world_size * config.seq_len
    args.max_steps = max(1, math.ceil(config.tokens / per_step))
    trainer = _make_trainer(
        student_model, teacher_model, args, train_set, val_set, config, callbacks, progress
    )
    last = last_complete_checkpoint(ckpt_dir) if resume else None
    t0 = time.time()
    trainer.train(resume_from_checkpoint=last)
    wall = time.time() - t0
    teacher_ppl_ = teacher_ppl(trainer, val_set)
    evals = _final_evals(trainer)
    tmp = out / f".{STUDENT_DIR}.tmp"
    trainer.save_model(str(tmp))  # gathers FSDP / ZeRO-3 shards; every rank must call it
    metrics: dict[str, Any] = {
        "steps": trainer.state.global_step,
        "tokens": trainer.state.global_step * per_step,
        "resumed_from": last,
        "wall_s": round(wall, 1),
        "teacher_ppl": teacher_ppl_,
        "before": {k: evals[0][k] for k in ("eval_loss", "eval_kl", "eval_ppl")},
        "after": {k: evals[-1][k] for k in ("eval_loss", "eval_kl", "eval_ppl")},
        "val_tokens": len(val_set) * config.seq_len,
        "train_blocks": len(train_set),
    }
    if trainer.is_world_process_zero():
        _place_student(tmp, final, student_src, tokenizer, inputs)
        title = f"{Path(student_src).name if student_src else 'student'} ← {Path(teacher_src).name if teacher_src else 'teacher'}"
        curve = plot_curve(
            trainer.state.log_history, out / CURVE, teacher_ppl_, title=f"KD {config.loss}: {title}"
        )
        _write_report(out, trainer, config, teacher_src, student_src, data, eval_data, metrics, curve)
    return DistillResult(final, out / CURVE, out / REPORT, metrics)


def _mark_run_dir(out: Path) -> None:
    """Create the run directory with its ``distill-run`` marker, so a later --overwrite may replace it."""
    from ..atomic import MARKER, write_marker

    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).exists():  # so that a later --overwrite may replace this run directory
        write_marker(out, "distill-run")


def _find_tokenizer(student_src, teacher_src):
    """The tokenizer of the student's directory, else the teacher's; None when neither has one."""
    from ..data import load_tokenizer

    for src in (student_src, teacher_src):
        if src is not None and Path(src).is_dir():
            try:
                return load_tokenizer(src)
            except MoECompressError:
                continue
    return None


def _datasets(data, eval_data, tokenizer, config: DistillConfig) -> tuple[TokenBlocks, TokenBlocks]:
    """(training, validation) blocks of `seq_len` tokens; without `eval_data` the validation blocks are the
    end of the training text (`val_fraction`); refused when either is empty."""
    ids = _stream(data, tokenizer)
    if eval_data is not None:
        val_ids = _stream(eval_data, tokenizer)
    else:
        n_val = max(int(ids.numel() * config.val_fraction), 2 * config.seq_len)
        ids, val_ids = ids[:-n_val], ids[-n_val:]
    if config.val_tokens is not None:
        val_ids = val_ids[: max(config.val_tokens, config.seq_len)]
    train_set, val_set = TokenBlocks(ids, config.seq_len), TokenBlocks(val_ids, config.seq_len)
    if len(train_set) == 0 or len(val_set) == 0:
        raise MoECompressError(
            f"The data gives {len(train_set)} training and {len(val_set)} validation blocks of "
            f"{config.seq_len} tokens; pass more text or a smaller --seq-len."
        )
    return train_set, val_set


def _training_args(config: DistillConfig, ckpt_dir: Path, progress: bool):
    """The `TrainingArguments` of the run (`max_steps` is set by the caller once the world size is known)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt_flag = (
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    )
    return TrainingArguments(
        **{ckpt_flag: config.gradient_checkpointing},
        output_dir=str(ckpt_dir),
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup,
        lr_scheduler_type=config.scheduler,
        max_grad_norm=config.max_grad_norm,
        max_steps=1,
        bf16=config.bf16,
        eval_strategy="steps",
        eval_steps=config.eval_every,
        eval_on_start=True,
        save_strategy="steps",
        save_steps=config.save_every,
        save_total_limit=config.save_limit,
        logging_steps=config.log_every,
        logging_first_step=True,
        report_to="none",
        seed=config.seed,
        data_seed=config.seed,
        remove_unused_columns=False,
        label_names=[],
        dataloader_drop_last=True,
        disable_tqdm=not progress,
        use_cpu=not torch.cuda.is_available(),
    )


def _make_trainer(student_model, teacher_model, args, train_set, val_set, config, callbacks, progress):
    """The `DistillTrainer` over the student in training mode (without its log printer when progress is off)."""
    if config.gradient_checkpointing:
        student_model.config.use_cache = False
    student_model.train()
    Trainer = trainer_class()
    from transformers import default_data_collator

    trainer = Trainer(
        model=student_model,
        args=args,
        train_dataset=train_set,
        eval_dataset=val_set,
        data_collator=default_data_collator,
        teacher=teacher_model,
        kd=config,
        callbacks=callbacks or [],
    )
    if not progress:
        from transformers.trainer_callback import PrinterCallback

        # with its bars off the Trainer prints every log dict instead; the caller's display stays the only one
        trainer.remove_callback(PrinterCallback)
    return trainer


def _final_evals(trainer) -> list[dict]:
    """The validation entries of the log history, after a last validation when the final step had none."""
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    if not evals or evals[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    return evals


def _place_student(tmp: Path, final: Path, student_src, tokenizer, inputs) -> None:
    """Rank 0: complete the saved student in `tmp` (tokenizer, dense plan, marker), fsync it, check the inputs
    unchanged, and rename it to `final`; `tmp` is removed when that fails."""
    from .dense_export import PLAN_NAME, copy_tokenizer

    if student_src is not None:
        copy_tokenizer(student_src, tmp)
        if (Path(student_src) / PLAN_NAME).is_file():
            shutil.copy2(Path(student_src) / PLAN_NAME, tmp / PLAN_NAME)
    elif tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / "training_args.bin").unlink(missing_ok=True)  # a pickle; the student needs none
    from ..atomic import fsync_tree, write_marker

    try:
        write_marker(tmp, "checkpoint:dense")
        fsync_tree(tmp)  # complete on disk before it is renamed into place
        inputs.check()  # teacher, student and data as they were when the run started
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _write_report(
    out: Path, trainer, config, teacher_src, student_src, data, eval_data, metrics, curve
) -> None:
    """Rank 0: ``distill.json``: settings, sources, metrics, the curve's path and the log history."""
    report = {
        "config": config.model_dump(),
        "teacher": teacher_src,
        "student": student_src,
        "data": str(data) if not isinstance(data, torch.Tensor) else "token ids",
        "eval_data": None
        if eval_data is None
        else (str(eval_data) if not isinstance(eval_data, torch.Tensor) else "token ids"),
        "metrics": metrics,
        "curve": str(curve),
        "log_history": trainer.state.log_history,
    }
    from ..atomic import write_file

    write_file(out / REPORT, json.dumps(report, indent=2, default=str) + "\n")
