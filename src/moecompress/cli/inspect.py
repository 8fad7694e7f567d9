"""`moecompress inspect MODEL`: family, layers, experts, top-k, router semantics and a byte breakdown."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from ..atomic import human_bytes
from ..models.loading import resolve_fixture
from ..workflows.summary import inspect_model


def inspect_command(
    model: str = typer.Argument(..., help="Local checkpoint directory or hub id."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modeling code."),
) -> None:
    """Family, layers, experts, top-k, router semantics and a byte breakdown."""
    info = inspect_model(resolve_fixture(model), trust_remote_code)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    console = Console(markup=False)
    head = Table(title=f"{info['architecture']} ({info['model_type']})", show_header=False)
    head.add_row(
        "layers", f"{info['num_layers']} ({len(info['moe_layers'])} MoE, {len(info['dense_layers'])} dense)"
    )
    head.add_row("routed experts / layer", ", ".join(map(str, info["experts_per_layer"])))
    head.add_row("top-k", str(info["top_k"]))
    head.add_row("router", info["router_convention"])
    head.add_row("dtype", info["dtype"])
    console.print(head)
    sizes = Table(title="bytes")
    for col in ("part", "parameters", "bytes", "share"):
        sizes.add_column(col, justify="right" if col != "part" else "left")
    total = info["bytes"]["total"]
    for part in ("routed_experts", "shared_experts", "router", "rest", "total"):
        b = info["bytes"][part]
        sizes.add_row(
            part.replace("_", " "), f"{info['parameters'][part]:,}", human_bytes(b), f"{100 * b / total:.1f}%"
        )
    if "bytes_on_disk" in info:
        sizes.add_row("on disk", "", human_bytes(info["bytes_on_disk"]), "")
    console.print(sizes)
