"""`moecompress dense` and `moecompress dense-sweep`: a MoE's dense student, and the pre-distillation sweep.

The distill package imports the HF Trainer stack (seconds), so it is imported inside the commands.
"""

from __future__ import annotations

import typer
from rich.console import Console

from ..atomic import check_output
from ..errors import MoECompressError
from ..methods.dense_fit import CRITERIA, GROUPINGS, SCALINGS, DenseConfig, canonical
from ..models.loading import resolve_fixture
from ..validate import check_range
from ._common import build_config, split_list


def dense_command(
    model: str = typer.Argument(..., help="MoE checkpoint directory or hub id."),
    out: str = typer.Option(..., "--out", "-o", help="Directory of the dense student checkpoint."),
    criterion: str = typer.Option("do-acp", help="frequency|pp|ps|cp|acp|do-cp|do-acp."),
    K: int | None = typer.Option(
        None, "--K", "-K", help="Experts kept per layer before grouping (default top-k)."
    ),
    grouping: str = typer.Option("rr", help="rr|wc|rc|ab|oc."),
    scaling: str = typer.Option("uniform", help="uniform|proportional|gate (down-projection scale α_g)."),
    mass_scale: bool = typer.Option(
        False, "--mass-scale", help="Scale α by the measured mean top-k routing mass."
    ),
    shared_gate: str = typer.Option(
        "fold", help="Qwen2-MoE gated shared expert: fold (dense Qwen2) | exact."
    ),
    target: str = typer.Option("auto", help="auto | dense | moe (same MoE class, one expert, top-1)."),
    calib: str = typer.Option("fixture-calib:32", help="Calibration data spec or stats store directory."),
    seq_len: int = typer.Option(256, help="Calibration sequence length."),
    dtype: str = typer.Option("auto", help="Load dtype."),
    overwrite: bool = typer.Option(False, help="Replace an existing --out."),
) -> None:
    """Convert a MoE into a dense student: score → top-K → k groups → merge → scale → concatenate."""
    from ..distill.dense_export import export_dense

    check_range("--K", K, 1)
    check_range("--seq-len", seq_len, 1)
    model = resolve_fixture(model)
    check_output(out, overwrite, protect=[model, calib], kind="checkpoint")
    cfg = build_config(
        DenseConfig,
        criterion=canonical(criterion, CRITERIA, "criterion"),
        K=K,
        grouping=canonical(grouping, GROUPINGS, "grouping"),
        scaling=canonical(scaling, SCALINGS, "scaling"),
        mass_scale=mass_scale,
        shared_gate=shared_gate,
        target=target,
    )
    s = export_dense(model, out, cfg, calib=calib, seq_len=seq_len, overwrite=overwrite, dtype=dtype)
    msg = (
        f"wrote {s['student_class']} ({s['form']}, FFN width {s['intermediate_size']}) to {s['out']}: "
        f"{s['bytes'] / 2**20:.2f} MiB"
    )
    if "teacher_bytes" in s:
        msg += f" (teacher {s['teacher_bytes'] / 2**20:.2f} MiB)"
    Console(markup=False).print(msg)


def dense_sweep_command(
    model: str = typer.Argument(..., help="MoE checkpoint directory or hub id."),
    out: str = typer.Option(
        "dense_sweep.md", "--out", "-o", help="Markdown table (raw rows beside it as .json)."
    ),
    calib: str = typer.Option("fixture-calib:32", help="Calibration data spec or stats store directory."),
    heldout: str = typer.Option("fixture-heldout", help="Held-out text spec for perplexity."),
    criteria: str = typer.Option("frequency,pp,ps,cp,acp,do-cp,do-acp", help="Comma-separated criteria."),
    groupings: str = typer.Option("rr,wc,rc,ab,oc", help="Comma-separated groupings."),
    K: str = typer.Option("", "--K", "-K", help="Comma-separated K values (default k, 2k, 4k, 8k up to E)."),
    scalings: str = typer.Option(
        "uniform,proportional",
        help="Comma-separated scalings (uniform, proportional, "
        "gate; '+mass' scales by the mean top-k routing mass, e.g. uniform+mass).",
    ),
    mass_scale: bool = typer.Option(
        False, "--mass-scale", help="Scale α by the measured mean top-k routing mass."
    ),
    heldout_tokens: int = typer.Option(16384, help="Held-out tokens scored per configuration."),
    window: int = typer.Option(256, help="Perplexity window."),
    seq_len: int = typer.Option(256, help="Calibration sequence length."),
    overwrite: bool = typer.Option(False, help="Replace an earlier sweep's --out (and its .json)."),
) -> None:
    """Pre-distillation perplexity over criterion × grouping × K × scaling, as a markdown table."""
    from ..atomic import claim, fingerprint_inputs
    from ..checkpoint import checkpoint_fingerprint
    from ..distill.sweep import check_sweep_out, dense_sweep, sweep_markdown, write_sweep

    for flag, v in (("--heldout-tokens", heldout_tokens), ("--window", window), ("--seq-len", seq_len)):
        check_range(flag, v, 2 if flag == "--window" else 1)
    try:
        Ks = [int(x) for x in split_list(K)] or None
    except ValueError:
        raise MoECompressError(
            f"--K '{K}' is not a comma-separated list of integers; write e.g. --K 2,4,8."
        ) from None
    for k in Ks or []:
        check_range("--K", k, 1)
    model = resolve_fixture(model)
    reads = [model, calib, heldout]
    check_sweep_out(out, overwrite, reads)
    with claim(out):  # one writer; what the sweep reads as it was when it started, checked before writing
        inputs = fingerprint_inputs(reads, checkpoint_fingerprint)
        res = dense_sweep(
            model,
            calib,
            heldout,
            criteria=split_list(criteria),
            groupings=split_list(groupings),
            Ks=Ks,
            scalings=split_list(scalings),
            mass_scale=mass_scale,
            seq_len=seq_len,
            heldout_tokens=heldout_tokens,
            window=window,
        )
        write_sweep(res, out, inputs)
    Console(markup=False).print(sweep_markdown(res))
    Console(markup=False).print(f"wrote {out}")
