"""`moecompress grid`: the fixed-mask operator grid of the replacement-operators paper (`api.compare`).

For every criterion × ratio the mask is computed once; every operator and gate scale then runs on
that same mask, and each cell is compared with the constant (MoNE) operator on the same mask by
paired bootstrap, Holm-corrected across the grid.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ..api import compare
from ..compare.ranking import ranking_table
from ..errors import MoECompressError
from ..validate import check_range, parse_floats
from ._common import split_list

OPERATOR_CELLS = {
    "constant": {"operator": "constant"},
    "reroute-keep": {"operator": "reroute", "gate": "keep"},
    "reroute-renorm": {"operator": "reroute", "gate": "renorm"},
    "drop": {"operator": "drop"},
    "tilt": {"operator": "tilt"},
    "partial": {"operator": "partial"},
    "remap": {"operator": "remap"},
}


def grid_arms(criteria: list[str], operators: list[str], ratios: list[float], rank: int) -> tuple[list, list]:
    """(arms, pairs): one arm per criterion × ratio × operator cell; pairs against that mask's constant."""
    from ..recipe import ArmSpec  # the schema imports the quantizer and transformers: only here

    unknown = [o for o in operators if o not in OPERATOR_CELLS]
    if unknown:
        raise MoECompressError(
            f"Unknown operator cell '{unknown[0]}'; choose from {', '.join(OPERATOR_CELLS)}."
        )
    cells = list(dict.fromkeys(["constant", *operators]))
    arms, pairs = [], []
    for criterion in criteria:
        for ratio in ratios:
            base = f"{criterion}-{round(100 * ratio)}"
            for cell in cells:
                params = dict(criterion=criterion, ratio=ratio, rank=rank, **OPERATOR_CELLS[cell])
                arms.append(ArmSpec(name=f"{base}-{cell}", method="prune", params=params))
                if cell != "constant":
                    pairs.append((f"{base}-{cell}", f"{base}-constant"))
    return arms, pairs


def grid_command(
    model: str = typer.Argument(..., help="Checkpoint directory, hub id, or fixture:NAME."),
    criteria: str = typer.Option("mone,reap,frequency", help="Comma-separated selection criteria."),
    operators: str = typer.Option(
        "reroute-keep,reroute-renorm,tilt,partial,drop,remap",
        help=f"Comma-separated operator cells ({', '.join(OPERATOR_CELLS)}).",
    ),
    ratios: str = typer.Option("0.25,0.5", help="Comma-separated reduction ratios."),
    rank: int = typer.Option(32, help="Tilt rank (and partial-copy budget)."),
    calib: str = typer.Option("fixture-calib:64", help="Calibration data spec or stats directory."),
    ppl: str = typer.Option("fixture-heldout", help="Perplexity / KL text spec."),
    tasks: str = typer.Option(
        "fixture_cloze,fixture_nextword", help="lm-eval tasks (comma-separated; '' for none)."
    ),
    limit: int = typer.Option(100, help="Documents per task."),
    out: Path = typer.Option(Path("runs/grid"), help="Report directory."),
    overwrite: bool = typer.Option(False),
    allow_nan: bool = typer.Option(
        False,
        "--allow-nan",
        help="Keep arms whose metrics are NaN or infinite (stored as null) instead of exiting 1.",
    ),
) -> None:
    """Hold each mask fixed, run every operator and gate scale on it, report paired intervals vs constant."""
    from ..recipe import CalibrationSpec, EvalSpec, Recipe

    ratio_list = parse_floats("--ratios", ratios)
    for r in ratio_list:
        check_range("--ratios", r, 0.0, 1.0, lo_open=True, hi_open=True)
    check_range("--rank", rank, 1)
    check_range("--limit", limit, 1)
    arms, pairs = grid_arms(split_list(criteria), split_list(operators), ratio_list, rank)
    recipe = Recipe(
        model=model,
        calibration=CalibrationSpec(data=calib),
        eval=EvalSpec(ppl=ppl, tasks=split_list(tasks), limit=limit, latency=False, quant_baselines=[]),
        arms=arms,
    )
    results = compare(
        recipe, out, overwrite=overwrite, keep_checkpoints=False, pairs=pairs, allow_nan=allow_nan
    )
    Console(markup=False).print(ranking_table(results))
    Console(markup=False).print(f"grid report: {out / 'report.md'}")
