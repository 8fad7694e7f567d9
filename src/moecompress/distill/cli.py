"""CLI verbs `dense`, `dense-sweep` and `distill` (registered in moecompress/cli.py; imports stay lazy)."""

from __future__ import annotations

from pathlib import Path

import typer


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _config(cls, **kwargs):
    """Build a pydantic config; a bad option becomes one sentence naming it."""
    from pydantic import ValidationError

    from ..errors import MoECompressError

    try:
        return cls(**kwargs)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "an option"
        raise MoECompressError(f"Option {name} is invalid: {err['msg']}.") from None


def dense_command(
    model: str = typer.Argument(..., help="MoE checkpoint directory or hub id."),
    out: str = typer.Option(..., "--out", "-o", help="Directory of the dense student checkpoint."),
    criterion: str = typer.Option("do-acp", help="frequency|pp|ps|cp|acp|do-cp|do-acp."),
    K: int | None = typer.Option(None, "--K", "-K", help="Experts kept per layer before grouping (default top-k)."),
    grouping: str = typer.Option("rr", help="rr|wc|rc|ab|oc."),
    scaling: str = typer.Option("uniform", help="uniform|proportional|gate (down-projection scale α_g)."),
    mass_scale: bool = typer.Option(False, "--mass-scale", help="Scale α by the measured mean top-k routing mass."),
    shared_gate: str = typer.Option("fold", help="Qwen2-MoE gated shared expert: fold (dense Qwen2) | exact."),
    target: str = typer.Option("auto", help="auto | dense | moe (same MoE class, one expert, top-1)."),
    calib: str = typer.Option("fixture-calib:32", help="Calibration data spec or stats store directory."),
    seq_len: int = typer.Option(256, help="Calibration sequence length."),
    dtype: str = typer.Option("auto", help="Load dtype."),
    overwrite: bool = typer.Option(False, help="Replace an existing --out."),
) -> None:
    """Convert a MoE into a dense student: score → top-K → k groups → merge → scale → concatenate."""
    from rich.console import Console

    from ..methods.dense import CRITERIA, GROUPINGS, SCALINGS, DenseConfig, canonical
    from .dense_export import export_dense

    from ..atomic import check_output
    from ..models.loading import resolve_fixture
    from ..validate import check_range

    check_range("--K", K, 1)
    check_range("--seq-len", seq_len, 1)
    model = resolve_fixture(model)
    check_output(out, overwrite, protect=[model, calib])
    cfg = _config(DenseConfig, criterion=canonical(criterion, CRITERIA, "criterion"), K=K,
                      grouping=canonical(grouping, GROUPINGS, "grouping"),
                      scaling=canonical(scaling, SCALINGS, "scaling"), mass_scale=mass_scale,
                      shared_gate=shared_gate, target=target)
    s = export_dense(model, out, cfg, calib=calib, seq_len=seq_len, overwrite=overwrite, dtype=dtype)
    msg = (f"wrote {s['student_class']} ({s['form']}, FFN width {s['intermediate_size']}) to {s['out']}: "
           f"{s['bytes'] / 2**20:.2f} MiB")
    if "teacher_bytes" in s:
        msg += f" (teacher {s['teacher_bytes'] / 2**20:.2f} MiB)"
    Console().print(msg)


def dense_sweep_command(
    model: str = typer.Argument(..., help="MoE checkpoint directory or hub id."),
    out: str = typer.Option("dense_sweep.md", "--out", "-o", help="Markdown table (raw rows beside it as .json)."),
    calib: str = typer.Option("fixture-calib:32", help="Calibration data spec or stats store directory."),
    heldout: str = typer.Option("fixture-heldout", help="Held-out text spec for perplexity."),
    criteria: str = typer.Option("frequency,pp,ps,cp,acp,do-cp,do-acp",
                                 help="Comma-separated criteria."),
    groupings: str = typer.Option("rr,wc,rc,ab,oc", help="Comma-separated groupings."),
    K: str = typer.Option("", "--K", "-K", help="Comma-separated K values (default k, 2k, 4k, 8k up to E)."),
    scalings: str = typer.Option("uniform,proportional", help="Comma-separated scalings (uniform, proportional, "
                                 "gate; '+mass' scales by the mean top-k routing mass, e.g. uniform+mass)."),
    mass_scale: bool = typer.Option(False, "--mass-scale", help="Scale α by the measured mean top-k routing mass."),
    heldout_tokens: int = typer.Option(16384, help="Held-out tokens scored per configuration."),
    window: int = typer.Option(256, help="Perplexity window."),
    seq_len: int = typer.Option(256, help="Calibration sequence length."),
) -> None:
    """Pre-distillation perplexity over criterion × grouping × K × scaling, as a markdown table."""
    from rich.console import Console

    from ..errors import MoECompressError
    from ..models.loading import resolve_fixture
    from ..validate import check_range
    from .sweep import dense_sweep, sweep_markdown, write_sweep

    for flag, v in (("--heldout-tokens", heldout_tokens), ("--window", window), ("--seq-len", seq_len)):
        check_range(flag, v, 2 if flag == "--window" else 1)
    try:
        Ks = [int(x) for x in _split(K)] or None
    except ValueError:
        raise MoECompressError(f"--K '{K}' is not a comma-separated list of integers; write e.g. --K 2,4,8.") from None
    for k in Ks or []:
        check_range("--K", k, 1)
    if Path(out).is_dir():
        raise MoECompressError(f"--out {out} is a directory; pass a markdown file path such as dense_sweep.md.")
    model = resolve_fixture(model)
    res = dense_sweep(model, calib, heldout, criteria=_split(criteria), groupings=_split(groupings),
                      Ks=Ks, scalings=_split(scalings), mass_scale=mass_scale,
                      seq_len=seq_len, heldout_tokens=heldout_tokens, window=window)
    write_sweep(res, out)
    Console().print(sweep_markdown(res))
    Console().print(f"wrote {out}")


def distill_command(
    teacher: str = typer.Option(..., "--teacher", help="MoE teacher directory or hub id."),
    student: str = typer.Option(..., "--student", help="Dense student directory (from `moecompress dense`)."),
    data: str = typer.Option(..., "--data", help="Training text spec (file, fixture name, hub dataset)."),
    tokens: int = typer.Option(..., "--tokens", help="Training tokens."),
    out: str = typer.Option(..., "--out", "-o", help="Run directory (checkpoints/, student/, curve.png, distill.json)."),
    eval_data: str | None = typer.Option(None, "--eval-data", help="Validation text spec (default: held out from --data)."),
    loss: str = typer.Option("forward_kl", help="forward_kl | reverse_kl | kl_hidden (logits KL + hidden MSE)."),
    temperature: float = typer.Option(1.0, help="KD temperature T."),
    hidden_weight: float = typer.Option(1.0, help="λ of the hidden-state MSE (kl_hidden)."),
    expanded_top_k: int | None = typer.Option(None, "--expanded-top-k", help="Teacher routes to k' > k experts."),
    seq_len: int = typer.Option(256, help="Tokens per training sequence."),
    batch_size: int = typer.Option(8, help="Sequences per device per step."),
    grad_accum: int = typer.Option(1, help="Gradient accumulation steps."),
    lr: float = typer.Option(1e-4, help="Peak learning rate."),
    warmup: float = typer.Option(0.05, help="Warm-up steps, or a fraction of the run when < 1."),
    bf16: bool = typer.Option(False, "--bf16", help="bf16 mixed precision."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing", help="Recompute activations."),
    eval_every: int = typer.Option(50, help="Steps between validations."),
    save_every: int = typer.Option(50, help="Steps between checkpoints."),
    teacher_dtype: str = typer.Option("auto", help="Teacher load dtype (auto = the checkpoint's own, bf16 for bf16 checkpoints; bfloat16; float32)."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue from the last checkpoint in --out."),
    overwrite: bool = typer.Option(False, help="Delete --out and start over."),
    seed: int = typer.Option(0, help="Seed."),
) -> None:
    """Knowledge distillation from the MoE teacher into the dense student (HF Trainer; use `accelerate launch`
    with configs/accelerate/*.yaml for DDP, FSDP2 or DeepSpeed ZeRO-3)."""
    from rich.console import Console

    from ..atomic import check_output
    from ..models.loading import resolve_fixture
    from .trainer import DistillConfig, distill

    teacher, student = resolve_fixture(teacher), resolve_fixture(student)
    if overwrite:
        check_output(out, overwrite, protect=[teacher, student])
    cfg = _config(DistillConfig, tokens=tokens, loss=loss, temperature=temperature, hidden_weight=hidden_weight,
                        expanded_top_k=expanded_top_k, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                        lr=lr, warmup=warmup, bf16=bf16, gradient_checkpointing=gradient_checkpointing,
                        eval_every=eval_every, save_every=save_every, seed=seed)
    r = distill(teacher, student, data, out=out, config=cfg, eval_data=eval_data, resume=resume, overwrite=overwrite,
                teacher_dtype=teacher_dtype)
    m = r.metrics
    Console().print(f"{m['steps']} steps, {m['tokens']:,} tokens: val KL {m['before']['eval_kl']:.4f} → "
                    f"{m['after']['eval_kl']:.4f}, val ppl {m['before']['eval_ppl']:.2f} → {m['after']['eval_ppl']:.2f} "
                    f"(teacher {m['teacher_ppl']:.2f}); student {r.student_dir}, curve {r.curve}")
