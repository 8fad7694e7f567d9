"""`moecompress distill`: knowledge distillation from the MoE teacher into its dense student.

The distill package imports the HF Trainer stack (seconds), so it is imported inside the command.
"""

from __future__ import annotations

import typer
from rich.console import Console

from ..atomic import check_output
from ..models.loading import resolve_fixture
from ._common import build_config


def distill_command(
    teacher: str = typer.Option(..., "--teacher", help="MoE teacher directory or hub id."),
    student: str = typer.Option(..., "--student", help="Dense student directory (from `moecompress dense`)."),
    data: str = typer.Option(..., "--data", help="Training text spec (file, fixture name, hub dataset)."),
    tokens: int = typer.Option(..., "--tokens", help="Training tokens."),
    out: str = typer.Option(
        ..., "--out", "-o", help="Run directory (checkpoints/, student/, curve.png, distill.json)."
    ),
    eval_data: str | None = typer.Option(
        None, "--eval-data", help="Validation text spec (default: held out from --data)."
    ),
    loss: str = typer.Option(
        "forward_kl", help="forward_kl | reverse_kl | kl_hidden (logits KL + hidden MSE)."
    ),
    temperature: float = typer.Option(1.0, help="KD temperature T."),
    hidden_weight: float = typer.Option(1.0, help="λ of the hidden-state MSE (kl_hidden)."),
    expanded_top_k: int | None = typer.Option(
        None, "--expanded-top-k", help="Teacher routes to k' > k experts."
    ),
    seq_len: int = typer.Option(256, help="Tokens per training sequence."),
    batch_size: int = typer.Option(8, help="Sequences per device per step."),
    grad_accum: int = typer.Option(1, help="Gradient accumulation steps."),
    lr: float = typer.Option(1e-4, help="Peak learning rate."),
    warmup: float = typer.Option(0.05, help="Warm-up steps, or a fraction of the run when < 1."),
    bf16: bool = typer.Option(False, "--bf16", help="bf16 mixed precision."),
    gradient_checkpointing: bool = typer.Option(
        False, "--gradient-checkpointing", help="Recompute activations."
    ),
    eval_every: int = typer.Option(50, help="Steps between validations."),
    save_every: int = typer.Option(50, help="Steps between checkpoints."),
    teacher_dtype: str = typer.Option(
        "auto",
        help="Teacher load dtype (auto = the checkpoint's own, bf16 for bf16 checkpoints; bfloat16; float32).",
    ),
    resume: bool = typer.Option(
        True, "--resume/--no-resume", help="Continue from the last checkpoint in --out."
    ),
    overwrite: bool = typer.Option(False, help="Delete --out and start over."),
    seed: int = typer.Option(0, help="Seed."),
) -> None:
    """Knowledge distillation from the MoE teacher into the dense student (HF Trainer; use `accelerate launch`
    with configs/accelerate/*.yaml for DDP, FSDP2 or DeepSpeed ZeRO-3)."""
    from ..distill import DistillConfig, distill

    teacher, student = resolve_fixture(teacher), resolve_fixture(student)
    if overwrite:
        check_output(out, overwrite, protect=[teacher, student], kind="distill-run")
    cfg = build_config(
        DistillConfig,
        tokens=tokens,
        loss=loss,
        temperature=temperature,
        hidden_weight=hidden_weight,
        expanded_top_k=expanded_top_k,
        seq_len=seq_len,
        batch_size=batch_size,
        grad_accum=grad_accum,
        lr=lr,
        warmup=warmup,
        bf16=bf16,
        gradient_checkpointing=gradient_checkpointing,
        eval_every=eval_every,
        save_every=save_every,
        seed=seed,
    )
    r = distill(
        teacher,
        student,
        data,
        out=out,
        config=cfg,
        eval_data=eval_data,
        resume=resume,
        overwrite=overwrite,
        teacher_dtype=teacher_dtype,
    )
    _print_run(r)


def _print_run(r) -> None:
    """One line: the steps and tokens trained, validation KL and perplexity before and after, and the outputs."""
    m = r.metrics
    Console(markup=False).print(
        f"{m['steps']} steps, {m['tokens']:,} tokens: val KL {m['before']['eval_kl']:.4f} → "
        f"{m['after']['eval_kl']:.4f}, val ppl {m['before']['eval_ppl']:.2f} → {m['after']['eval_ppl']:.2f} "
        f"(teacher {m['teacher_ppl']:.2f}); student {r.student_dir}, curve {r.curve}"
    )
