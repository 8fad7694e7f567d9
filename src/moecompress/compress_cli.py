"""`moecompress compress`: one method, one output checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .errors import MoECompressError


def parse_params(pairs: list[str]) -> dict:
    """`key=value` strings -> dict, values parsed as YAML scalars (numbers, booleans, lists)."""
    import yaml

    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise MoECompressError(f"--param '{pair}' is not key=value; write e.g. --param rank=8.")
        key, value = pair.split("=", 1)
        params[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return params


def compress_command(
    model: str = typer.Argument(..., help="Checkpoint directory or hub id."),
    method: str = typer.Option("prune", help="prune | conmoe | m-smoe | hc-smoe | puzzlemoe | dense | auto ..."),
    out: Path = typer.Option(..., help="Output directory (written atomically)."),
    calib: Optional[str] = typer.Option(None, help="Stats directory from `moecompress calibrate`, or a data spec."),
    ratio: Optional[float] = typer.Option(None, help="Fraction of routed experts removed, in [0, 1)."),
    criterion: Optional[str] = typer.Option(None, help="Selection criterion (prune/dense)."),
    operator: Optional[str] = typer.Option(None, help="Replacement operator (prune)."),
    rank: Optional[int] = typer.Option(None, help="Tilt rank / partial-copy budget (prune)."),
    gate: Optional[str] = typer.Option(None, help="keep | renorm (prune, reroute)."),
    budget: Optional[str] = typer.Option(None, help="Routed-expert bytes kept (auto): a fraction of the original's "
                                         "as stored on disk (0.5, 50%), or a size (4GB, 500MB, 1.5GiB)."),
    param: list[str] = typer.Option([], help="Any other method parameter as key=value (repeatable)."),
    recipe: Optional[Path] = typer.Option(None, help="YAML recipe {method, params}; CLI options override it."),
    format: str = typer.Option("auto", help="auto | hf | compact | packed | materialized."),
    seq_len: int = typer.Option(256, help="Calibration sequence length."),
    seed: int = typer.Option(0),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
) -> None:
    """Compress MODEL with one method and write a checkpoint that is really smaller."""
    import yaml
    from rich.console import Console

    from .pipeline import compress

    params: dict = {}
    if recipe is not None:
        if not recipe.is_file():
            raise MoECompressError(f"No recipe at {recipe}; pass a YAML file with 'method' and 'params'.")
        data = yaml.safe_load(recipe.read_text()) or {}
        method = data.get("method", method)
        params.update(data.get("params") or {})
    given = dict(ratio=ratio, criterion=criterion, operator=operator, rank=rank, gate=gate, budget=budget)
    params.update({k: v for k, v in given.items() if v is not None})
    params.update(parse_params(param))
    result = compress(model, method, params, calib=calib, out=out, format=format, seq_len=seq_len, seed=seed,
                      overwrite=overwrite)
    Console().print(result.describe())
