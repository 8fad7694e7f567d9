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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import MoECompressError
from .kd import expanded_teacher, hidden_mse, kd_loss
from .shard import place_teacher

STUDENT_DIR, CKPT_DIR, CURVE, REPORT = "student", "checkpoints", "curve.png", "distill.json"


class DistillConfig(BaseModel):
    """Settings of one distillation run (CLI flags map 1:1)."""

    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(..., ge=1, description="training tokens (sets the number of optimizer steps)")
    loss: Literal["forward_kl", "reverse_kl", "kl_hidden"] = "forward_kl"
    temperature: float = Field(1.0, gt=0)
    hidden_weight: float = Field(1.0, ge=0)  # λ of the hidden-state MSE (loss kl_hidden)
    expanded_top_k: int | None = Field(None, ge=1)  # teacher routes to k' experts
    seq_len: int = Field(256, ge=2)
    batch_size: int = Field(8, ge=1)  # per device
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup: float = Field(0.05, ge=0)  # steps, or a fraction of the run when < 1
    scheduler: str = "cosine"
    max_grad_norm: float = 1.0
    bf16: bool = False
    gradient_checkpointing: bool = False
    eval_every: int = Field(50, ge=1)  # optimizer steps between validations
    save_every: int = Field(50, ge=1)  # optimizer steps between checkpoints
    save_limit: int = Field(2, ge=1)
    val_fraction: float = Field(
        0.05, gt=0, lt=1
    )  # held out from the training text when no eval data is given
    val_tokens: int | None = Field(None, ge=2)  # cap on validation tokens
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy's seed range
    log_every: int = Field(10, ge=1)


@dataclass
class DistillResult:
    student_dir: Path
    curve: Path
    report: Path
    metrics: dict


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks of a token stream: {"input_ids": [seq_len]}."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        n = ids.numel() // seq_len
        self.blocks = ids[: n * seq_len].reshape(n, seq_len).long()

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i]}


def _trainer_class():
    from transformers import Trainer

    class DistillTrainer(Trainer):
        """Trainer whose loss is the KD objective against a frozen teacher (see kd.py)."""

        def __init__(self, *args, teacher, kd: DistillConfig, **kwargs):
            super().__init__(*args, **kwargs)
            self.kd = kd
            # replicated on each device, or sharded like the student under FSDP2 / ZeRO-3 (shard.py)
            self.teacher = place_teacher(teacher, self.accelerator, self.args.device, kd.expanded_top_k)

        def _teacher_out(self, ids, hidden: bool):
            with torch.no_grad(), expanded_teacher(self.teacher, self.kd.expanded_top_k):
                return self.teacher(input_ids=ids, output_hidden_states=hidden, use_cache=False)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"]
            hidden = self.kd.loss == "kl_hidden"
            t = self._teacher_out(ids, hidden)
            s = model(input_ids=ids, output_hidden_states=hidden, use_cache=False)
            kind = "reverse_kl" if self.kd.loss == "reverse_kl" else "forward_kl"
            loss = kd_loss(s.logits, t.logits, kind, self.kd.temperature)
            if hidden:
                loss = loss + self.kd.hidden_weight * hidden_mse(s.hidden_states, t.hidden_states)
            return (loss, s) if return_outputs else loss

        @torch.no_grad()
        def evaluate(
            self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
        ) -> dict[str, float]:
            """Validation: KD objective, forward KL(teacher ‖ student) at T=1, student CE and perplexity."""
            data = eval_dataset if eval_dataset is not None else self.eval_dataset
            model = self.model_wrapped if self.model_wrapped is not None else self.model
            was_training = model.training
            model.eval()
            tot = {"loss": 0.0, "kl": 0.0, "ce": 0.0}
            n_tok = 0
            bs = self.args.per_device_eval_batch_size
            hidden = self.kd.loss == "kl_hidden"
            for b in range(0, len(data), bs):
                ids = torch.stack([data[j]["input_ids"] for j in range(b, min(b + bs, len(data)))]).to(
                    self.args.device
                )
                with self.compute_loss_context_manager():
                    t = self._teacher_out(ids, hidden)
                    s = model(input_ids=ids, output_hidden_states=hidden, use_cache=False)
                kind = "reverse_kl" if self.kd.loss == "reverse_kl" else "forward_kl"
                loss = kd_loss(s.logits, t.logits, kind, self.kd.temperature)
                if hidden:
                    loss = loss + self.kd.hidden_weight * hidden_mse(s.hidden_states, t.hidden_states)
                m = ids.numel()
                tot["loss"] += float(loss) * m
                tot["kl"] += float(kd_loss(s.logits, t.logits, "forward_kl", 1.0)) * m
                logp = torch.log_softmax(s.logits[:, :-1].float(), -1)
                ce = -logp.gather(-1, ids[:, 1:, None]).mean()
                tot["ce"] += float(ce) * m
                n_tok += m
            if was_training:
                model.train()
            metrics = {f"{metric_key_prefix}_{k}": v / max(n_tok, 1) for k, v in tot.items()}
            metrics[f"{metric_key_prefix}_ppl"] = math.exp(min(metrics[f"{metric_key_prefix}_ce"], 50.0))
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    return DistillTrainer


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


def _teacher_ppl(trainer, data) -> float:
    """Teacher perplexity on the validation blocks (reference line of the curve)."""
    ce, n = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(data), 4):
            ids = torch.stack([data[j]["input_ids"] for j in range(b, min(b + 4, len(data)))]).to(
                trainer.args.device
            )
            t = trainer._teacher_out(ids, False)
            logp = torch.log_softmax(t.logits[:, :-1].float(), -1)
            ce += float(-logp.gather(-1, ids[:, 1:, None]).mean()) * ids.numel()
            n += ids.numel()
    return math.exp(ce / max(n, 1))


def plot_curve(history: list[dict], path: Path, teacher_ppl: float | None = None, title: str = "") -> Path:
    """Validation curve: KD objective and KL(teacher ‖ student) (left), student perplexity (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev: dict[int, dict] = {}
    for h in history:
        if "eval_loss" in h:
            ev[int(h["step"])] = h  # a resumed run may evaluate a step twice: keep the last
    train = [(int(h["step"]), h["loss"]) for h in history if "loss" in h and "eval_loss" not in h]
    steps = sorted(ev)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    if train:
        a.plot(*zip(*train), color="0.7", lw=1, label="train KD loss")
    a.plot(steps, [ev[s]["eval_loss"] for s in steps], "o-", color="C0", label="val KD loss")
    a.plot(steps, [ev[s]["eval_kl"] for s in steps], "s--", color="C1", label="val KL(teacher‖student), T=1")
    a.set_xlabel("optimizer step")
    a.set_ylabel("nats per token")
    a.set_title("distillation loss")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(steps, [ev[s]["eval_ppl"] for s in steps], "o-", color="C2", label="student")
    if teacher_ppl is not None:
        b.axhline(teacher_ppl, color="k", ls=":", label=f"MoE teacher ({teacher_ppl:.2f})")
    b.set_xlabel("optimizer step")
    b.set_ylabel("validation perplexity")
    ppl = [ev[s]["eval_ppl"] for s in steps] + ([teacher_ppl] if teacher_ppl else [])
    if max(ppl) / max(min(ppl), 1e-9) > 5:  # log scale only when the curve spans a wide range
        from matplotlib.ticker import FuncFormatter

        b.set_yscale("log")
        b.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        # minor ticks labelled at 2·10^n, 3·10^n, 5·10^n only, so labels never crowd
        b.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "235" else ""))
    b.set_title("held-out perplexity")
    b.legend()
    b.grid(alpha=0.3, which="both")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    if config is None:
        config = DistillConfig(tokens=tokens, **overrides)
    elif tokens is not None or overrides:
        config = config.model_copy(
            update=dict(overrides, **({"tokens": tokens} if tokens is not None else {}))
        )
    from contextlib import ExitStack

    from ..atomic import claim, fingerprint_inputs
    from ..checkpoint import checkpoint_fingerprint

    out = Path(out)
    final = out / STUDENT_DIR
    protect = [p for p in (teacher, student, data, eval_data) if isinstance(p, (str, Path))]
    _check_run_dir(out, overwrite, protect)
    held = ExitStack()
    if (
        os.environ.get("RANK", "0") == "0"
    ):  # one lock per run: the other ranks of this run write the same --out
        held.enter_context(claim(out))
    with held:
        if final.exists() and not overwrite:  # checked again under the lock: another run may have finished it
            raise MoECompressError(
                f"{final} already exists (this distillation finished); pass --overwrite to run "
                "again or choose another --out."
            )
        if overwrite and out.exists():
            shutil.rmtree(out)
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
    from ..atomic import MARKER, write_marker

    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).exists():  # so that a later --overwrite may replace this run directory
        write_marker(out, "distill-run")
    if tokenizer is None and not isinstance(data, torch.Tensor):
        from ..data import load_tokenizer

        for src in (student_src, teacher_src):
            if src is not None and Path(src).is_dir():
                try:
                    tokenizer = load_tokenizer(src)
                    break
                except MoECompressError:
                    continue
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
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt_flag = (
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    )
    args = TrainingArguments(
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
    per_step = config.batch_size * config.grad_accum * args.world_size * config.seq_len
    steps = max(1, math.ceil(config.tokens / per_step))
    args.max_steps = steps
    if config.gradient_checkpointing:
        student_model.config.use_cache = False
    student_model.train()
    Trainer = _trainer_class()
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
    last = last_complete_checkpoint(ckpt_dir) if resume else None
    t0 = time.time()
    trainer.train(resume_from_checkpoint=last)
    wall = time.time() - t0
    history = trainer.state.log_history
    teacher_ppl = _teacher_ppl(trainer, val_set)
    evals = [h for h in history if "eval_loss" in h]
    if not evals or evals[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    tmp = out / f".{STUDENT_DIR}.tmp"
    trainer.save_model(str(tmp))  # gathers FSDP / ZeRO-3 shards; every rank must call it
    metrics: dict[str, Any] = {
        "steps": trainer.state.global_step,
        "tokens": trainer.state.global_step * per_step,
        "resumed_from": last,
        "wall_s": round(wall, 1),
        "teacher_ppl": teacher_ppl,
        "before": {k: evals[0][k] for k in ("eval_loss", "eval_kl", "eval_ppl")},
        "after": {k: evals[-1][k] for k in ("eval_loss", "eval_kl", "eval_ppl")},
        "val_tokens": len(val_set) * config.seq_len,
        "train_blocks": len(train_set),
    }
    if trainer.is_world_process_zero():
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
        title = f"{Path(student_src).name if student_src else 'student'} ← {Path(teacher_src).name if teacher_src else 'teacher'}"
        curve = plot_curve(
            trainer.state.log_history, out / CURVE, teacher_ppl, title=f"KD {config.loss}: {title}"
        )
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
    return DistillResult(final, out / CURVE, out / REPORT, metrics)
