"""`moecompress analyze`: the cross-layer nearest-neighbour analysis of a MoE checkpoint, or (`--mask-drift`) how
far a pruning mask moves across calibration domains against resampling."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from ..atomic import check_output, claim, fingerprint_inputs
from ..errors import MoECompressError
from ..models.loading import resolve_fixture
from ..validate import check_range, check_seed
from ..workflows.analysis import analyze_model, write_analysis

FIXTURE_DOMAINS = ["fixture-calib/technical", "fixture-calib/scripture", "fixture-calib/aphorisms"]


def analyze_command(
    model: str = typer.Argument(..., help="Local checkpoint directory or hub id."),
    scope: int = typer.Option(4, "--scope", help="MoE layers per scope (consecutive); 1 = layer-local."),
    out: str = typer.Option(
        ...,
        "--out",
        help="Output directory (analysis.json + nn_heatmap.png, or drift.json + "
        "drift_<criterion>_<ratio>.png with --mask-drift).",
    ),
    mask_drift: bool = typer.Option(
        False, "--mask-drift", help="Mask drift across --data specs vs resampling."
    ),
    data: list[str] = typer.Option(
        [],
        "--data",
        help="--mask-drift: a calibration spec (repeatable; default for a fixture: its three corpora).",
    ),
    criterion: str = typer.Option("reap", "--criterion", help="--mask-drift: the pruning criterion."),
    ratio: float = typer.Option(0.5, "--ratio", help="--mask-drift: the fraction of routed experts pruned."),
    draws: int = typer.Option(4, "--draws", help="--mask-drift: disjoint, token-matched draws of each spec."),
    sequences: int | None = typer.Option(
        None,
        "--sequences",
        help="--mask-drift: windows per draw (default: the most every spec can fill --draws times).",
    ),
    seq_len: int = typer.Option(256, "--seq-len", help="--mask-drift: tokens per window."),
    seed: int = typer.Option(0, "--seed", help="--mask-drift: shuffles the documents before they are dealt."),
    bootstrap: int = typer.Option(1000, "--bootstrap", help="--mask-drift: bootstrap replicates over draws."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modeling code."),
) -> None:
    """For every routed expert, its nearest neighbour under ConMoE's distance within its scope: a
    source-layer → neighbour-layer heatmap, the per-layer cross-layer fraction, and the JSON behind them.
    With --mask-drift: the Jaccard distance between pruned sets across calibration domains and across
    resamples of each, and their ratio (routing-semantics paper §6.4)."""
    source = model
    model = resolve_fixture(model)
    if mask_drift:
        return _mask_drift(
            source, model, out, data, criterion, ratio, draws, sequences, seq_len, seed, bootstrap, overwrite
        )
    if scope < 1:
        raise MoECompressError(f"--scope must be at least 1 (got {scope}); use 1 for layer-local or e.g. 4.")
    check_output(out, overwrite, protect=[model], kind="analysis")
    with claim(out):  # one writer, and the model as it was when the analysis started (`_reads`)
        inputs = _reads(model)
        res = analyze_model(model, scope_size=scope, trust_remote_code=trust_remote_code, progress=True)
        path = write_analysis(res, out, overwrite=overwrite, protect=[model], inputs=inputs)
    console = Console(markup=False)
    table = Table(title=f"cross-layer nearest neighbours (scope {scope})")
    table.add_column("layer", justify="right")
    table.add_column("cross-layer NN", justify="right")
    for layer in res.moe_layers:
        table.add_row(str(layer), f"{100 * res.cross_fraction[layer]:.1f}%")
    table.add_row("all", f"{100 * res.overall_cross_fraction:.1f}%")
    console.print(table)
    console.print(f"wrote {path / 'analysis.json'} and {path / 'nn_heatmap.png'}")


def _reads(model):
    """The model's fingerprint taken before the analysis reads it, checked again before the output's rename
    (`atomic.Inputs`): taken only when writing starts, it missed a model replaced during the analysis."""
    from ..checkpoint import checkpoint_fingerprint

    return fingerprint_inputs([model], checkpoint_fingerprint)


def _mask_drift(
    source, model, out, data, criterion, ratio, draws, sequences, seq_len, seed, bootstrap, overwrite
) -> None:
    from ..workflows.drift import mask_drift, write_drift

    check_range("--draws", draws, 2, hint="two draws or more")
    check_seed("--seed", seed)
    check_range("--sequences", sequences, 1)
    check_range("--seq-len", seq_len, 1)
    check_range("--bootstrap", bootstrap, 1)
    specs = list(data) or (FIXTURE_DOMAINS if str(source).startswith("fixture:") else [])
    if not specs:
        raise MoECompressError(
            "--mask-drift needs calibration specs to compare; pass --data SPEC once per domain, "
            "e.g. --data c4:64 --data gsm8k:64."
        )
    check_output(out, overwrite, protect=[model], kind="analysis")
    with claim(out):
        inputs = _reads(model)
        res = mask_drift(
            model,
            specs,
            [criterion],
            [ratio],
            draws=draws,
            sequences=sequences,
            seq_len=seq_len,
            seed=seed,
            bootstrap=bootstrap,
        )
        path = write_drift(res, out, overwrite=overwrite, protect=[model], inputs=inputs)
    ((name, s),) = res.summary.items()
    table = Table(
        title=f"mask drift, {name}: {res.draws} draws x {res.sequences * res.seq_len:,} tokens per spec"
    )
    for col in ("pair", "Jaccard distance", "drift ratio"):
        table.add_column(col, justify="left" if col == "pair" else "right")
    for pair, v in s["domain"].items():
        table.add_row(f"{pair} (domain)", f"{v['overall']:.3f}", f"{s['ratio'][pair]:.2f}")
    for spec, v in s["resampling"].items():
        table.add_row(f"{spec} (resampled)", f"{v['overall']:.3f}", "")
    if "overall" in s["interval"]:
        lo, hi = s["interval"]["overall"]
        table.add_row(
            "all domain pairs ÷ resampling", "", f"{s['overall']['ratio']:.2f} [{lo:.2f}, {hi:.2f}]"
        )
    Console(markup=False).print(table)
    Console(markup=False).print(
        f"wrote {path / 'drift.json'} and {path / f'drift_{name.replace(chr(64), chr(95))}.png'}"
    )
