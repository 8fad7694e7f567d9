"""``moecompress calibrate``: a thin shell over `moecompress.calibrate` (`api.calibrate`).

``--for-method`` is resolved by the front end (`api.calibrate`), through the method registry
(`moecompress.methods.stats_to_gather`): calibration itself only knows statistic names."""

from __future__ import annotations

import json
import os

import typer
from rich.console import Console
from rich.table import Table

from ..api import calibrate
from ..errors import MoECompressError
from ..validate import check_range, check_seed


def calibrate_command(
    model: str = typer.Argument(
        ..., help="Checkpoint directory (safetensors) or hub id; streamed layer by layer."
    ),
    data: str = typer.Option(
        ...,
        "--data",
        help="Data spec: c4:128, wikitext2:64, fineweb-edu:256, gsm8k:128, "
        "fixture-calib:64, file.txt, file.jsonl#text, mixtures a:64+b:64.",
    ),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per calibration sequence."),
    out: str = typer.Option(..., "--out", help="Stats store directory to write."),
    stats: str | None = typer.Option(None, "--stats", help="Comma-separated statistic names to gather."),
    for_method: str | None = typer.Option(None, "--for-method", help="Gather what this method needs."),
    offload_dir: str | None = typer.Option(None, "--offload-dir", help="Keep hidden states on disk here."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue an interrupted run from its last finished layer."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only estimate memory, disk and time, then stop."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per batch."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's), float32 or bfloat16."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling calibration sequences."),
    device: str | None = typer.Option(
        None, "--device", help="cuda, cuda:1 or cpu (default: CUDA if present)."
    ),
    pad: bool = typer.Option(False, "--pad", help="Pad documents with a mask instead of packing them."),
    chat_template: bool = typer.Option(
        False, "--chat-template", help="Render text with the tokenizer's chat template (instruct models)."
    ),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="Tokenizer directory or id if the model directory has none."
    ),
    moment_experts: str | None = typer.Option(
        None,
        "--moment-experts",
        help="Experts for input/cross moments: '0,3,5' or JSON {\"layer\": [ids]} (default: all).",
    ),
    hessian_layers: str | None = typer.Option(
        None, "--hessian-layers", help="MoE layers whose GPTQ Hessians to gather: '0,1,2' (default: all)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing stats store."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modeling code."),
) -> None:
    """Gather per-expert statistics layer by layer into a stats store (streams the checkpoint)."""
    check_range("--seq-len", seq_len, 1)
    check_seed("--seed", seed)
    check_range("--batch-size", batch_size, 1)
    experts = _moment_experts(moment_experts) if moment_experts else None
    console = Console(markup=False)  # what it prints embeds paths and data specs: never read as rich markup
    try:
        result = calibrate(
            model,
            data,
            seq_len=seq_len,
            out=out,
            stats=stats,
            for_method=for_method,
            offload_dir=offload_dir,
            resume=resume,
            dry_run=dry_run,
            batch_size=batch_size,
            dtype=dtype,
            seed=seed,
            device=device,
            padding=pad,
            chat_template=chat_template,
            tokenizer=tokenizer,
            moment_experts=experts,
            hessian_layers=hessian_layers,
            overwrite=overwrite,
            trust_remote_code=trust_remote_code,
        )
    finally:
        _leave_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 reports
    _report(result, dry_run, as_json, console, _output(model, out, overwrite) if dry_run else None)


def _output(model: str, out: str, overwrite: bool) -> str:
    """What a dry run says of --out: new, replaced, reused (a finished store that answers the request is), or
    the sentence the run would be refused with (`atomic.dry_run_output`)."""
    from pathlib import Path

    from ..atomic import dry_run_output
    from ..models import resolve_source

    if not overwrite and (Path(out) / "stats.json").is_file():
        return (
            f"{out} exists: a stats store, reused if it answers this request (else refused); --overwrite "
            "recomputes it"
        )
    return dry_run_output(out, overwrite, [resolve_source(model)], kind="stats")


def _leave_process_group() -> None:
    """Under torchrun: leave the process group cleanly."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # under torchrun: leave cleanly
        dist.destroy_process_group()


def _report(result, dry_run: bool, as_json: bool, console: Console, output: str | None = None) -> None:
    """Print the dry run's estimate (refused when it does not fit) with what becomes of --out (`output`), or the
    stats store written, as a table or JSON."""
    if dry_run:
        if as_json:
            typer.echo(json.dumps({**result.to_dict(), "output": output}, indent=2))
        else:
            from rich.text import Text

            table = Table(title="calibration dry run", show_header=False)
            for k, v in result.rows():
                table.add_row(k, v)
            table.add_row("output", Text(str(output)))
            console.print(table)
        if not result.fits:
            raise MoECompressError(result.problem())
        return
    if as_json:
        typer.echo(json.dumps({"out": str(result.path), **result.meta}, indent=2))
        return
    from rich.text import Text

    console.print(Text.assemble(("stats store", "bold"), f" {result.path}"))
    console.print(result.describe())
    console.print(f"statistics: {', '.join(result.names)}")
    console.print(f"MoE layers: {result.layers}")


def _moment_experts(text: str):
    """'0,3,5' -> [0, 3, 5]; '{"1": [0, 2]}' -> {"1": [0, 2]}; anything else refused in one sentence."""
    bad = MoECompressError(
        f"--moment-experts '{text}' is neither '0,3,5' nor a JSON object {{\"layer\": [ids]}} "
        "of non-negative integers; fix it."
    )
    try:
        if text.strip().startswith("{"):
            value = json.loads(text)
            ok = isinstance(value, dict) and all(
                str(k).isdigit() and isinstance(v, list) and all(type(e) is int and e >= 0 for e in v)
                for k, v in value.items()
            )
        else:
            value = [int(e) for e in text.split(",") if e.strip()]
            ok = bool(value) and all(e >= 0 for e in value)
    except ValueError:
        ok = False
    if not ok:
        raise bad
    return value
