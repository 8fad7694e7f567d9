"""`moecompress analyze`: the cross-layer nearest-neighbour analysis of a MoE checkpoint."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from ..analysis import analyze_model, write_analysis
from ..atomic import check_output
from ..errors import MoECompressError
from ..models.loading import resolve_fixture


def analyze_command(
    model: str = typer.Argument(..., help="Local checkpoint directory or hub id."),
    scope: int = typer.Option(4, "--scope", help="MoE layers per scope (consecutive); 1 = layer-local."),
    out: str = typer.Option(..., "--out", help="Output directory (analysis.json + nn_heatmap.png)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modeling code."),
) -> None:
    """For every routed expert, its nearest neighbour under ConMoE's distance within its scope: a
    source-layer → neighbour-layer heatmap, the per-layer cross-layer fraction, and the JSON behind them."""
    if scope < 1:
        raise MoECompressError(f"--scope must be at least 1 (got {scope}); use 1 for layer-local or e.g. 4.")
    model = resolve_fixture(model)
    check_output(out, overwrite, protect=[model])
    res = analyze_model(model, scope_size=scope, trust_remote_code=trust_remote_code, progress=True)
    path = write_analysis(res, out, overwrite=overwrite, protect=[model])
    console = Console()
    table = Table(title=f"cross-layer nearest neighbours (scope {scope})")
    table.add_column("layer", justify="right")
    table.add_column("cross-layer NN", justify="right")
    for layer in res.moe_layers:
        table.add_row(str(layer), f"{100 * res.cross_fraction[layer]:.1f}%")
    table.add_row("all", f"{100 * res.overall_cross_fraction:.1f}%")
    console.print(table)
    console.print(f"wrote {path / 'analysis.json'} and {path / 'nn_heatmap.png'}")
