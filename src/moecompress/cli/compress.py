"""`moecompress compress`: one method, one output checkpoint (`api.compress`)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import typer
import yaml
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from ..api import compress
from ..errors import MoECompressError
from ..export.formats import FORMATS
from ..plan.targets import TARGETS
from ..validate import check_range, check_seed, parse_size
from ..workflows.compress_dryrun import estimate_compress, refuse_if_over
from ..workflows.pipeline import moment_fraction, needs_for, streamed_chunk


def parse_params(pairs: list[str]) -> dict:
    """`key=value` strings -> dict, values parsed as YAML scalars (numbers, booleans, lists)."""
    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise MoECompressError(f"--param '{pair}' is not key=value; write e.g. --param rank=8.")
        key, value = pair.split("=", 1)
        try:
            params[key.strip().replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise MoECompressError(
                f"--param '{pair}' has a value that is not a YAML scalar or list; quote it or "
                "write e.g. --param rank=8."
            ) from None
    return params


def compress_command(
    model: str = typer.Argument(..., help="Checkpoint directory or hub id."),
    method: str = typer.Option(
        "prune", help="prune | conmoe | m-smoe | hc-smoe | puzzlemoe | dense | auto ..."
    ),
    out: Path = typer.Option(..., help="Output directory (written atomically)."),
    calib: str | None = typer.Option(
        None, help="Stats directory from `moecompress calibrate`, or a data spec."
    ),
    ratio: float | None = typer.Option(None, help="Fraction of routed experts removed, in [0, 1)."),
    criterion: str | None = typer.Option(None, help="Selection criterion (prune/dense)."),
    operator: str | None = typer.Option(None, help="Replacement operator (prune)."),
    rank: int | None = typer.Option(None, help="Tilt rank / partial-copy budget (prune)."),
    gate: str | None = typer.Option(None, help="keep | renorm (prune, reroute)."),
    budget: str | None = typer.Option(
        None,
        help="Bytes kept (auto): a fraction of the original's weights as "
        "stored on disk (0.5, 50%), or a size (4GB, 500MB, 1.5GiB); of the whole "
        "file unless --budget-scope routed.",
    ),
    budget_scope: str | None = typer.Option(
        None,
        help="whole (default): --budget counts every weight of the "
        "file and auto also gives attention, shared experts, dense MLPs, "
        "embeddings and lm_head a precision | routed: it counts the routed "
        "experts only, the rest stays as it is (auto).",
    ),
    param: list[str] = typer.Option([], help="Any other method parameter as key=value (repeatable)."),
    recipe: Path | None = typer.Option(None, help="YAML recipe {method, params}; CLI options override it."),
    quant: str | None = typer.Option(
        None,
        help="Also quantize every stored expert: w4g128, w3g64, w2g32, w8c "
        "('a' suffix: asymmetric); --method quant quantizes the original experts.",
    ),
    quant_algo: str = typer.Option(
        "gptq",
        help="gptq (calibration Hessians) | rtn (round-to-nearest). GPTQ's "
        "defaults are llm-compressor's: act order on (--param actorder=false), damp "
        "0.01 (--param damp=0.1), block 128, each expert's routed tokens "
        "(docs/quantization.md, 'Defaults').",
    ),
    quant_weighting: str = typer.Option(
        "uniform", help="GPTQ Hessian: uniform | gate2 (gate²-weighted tokens)."
    ),
    quant_scope: str | None = typer.Option(
        None,
        help="experts (default): --quant applies to the routed experts "
        "| all: also to attention, shared experts and dense MLPs, with "
        "embeddings and lm_head at w8c (round-to-nearest) and the router "
        "untouched; written --format compact (docs/quantization.md, "
        "'Non-expert tensors').",
    ),
    format: str = typer.Option("auto", help=" | ".join(("auto", *FORMATS)) + "."),
    target: str = typer.Option(
        "moecompress",
        help="The runtime that serves the output: "
        + " | ".join(f"{t.name} ({t.help})" for t in TARGETS.values())
        + "; a plan the runtime cannot run is refused.",
    ),
    imatrix: bool = typer.Option(
        False,
        "--imatrix",
        help="With a GGUF output: also write imatrix.gguf, llama.cpp's "
        "importance matrix from the --calib statistics store, for llama-quantize "
        "--imatrix (K- and i-quants); the store needs --stats "
        "counts,tokens,in_channel_norm,mid_channel_norm.",
    ),
    seq_len: int = typer.Option(256, help="Calibration sequence length."),
    calib_mode: str = typer.Option(
        "one-pass",
        help="one-pass: every layer's statistics on the original model's "
        "activations | sequential: on the already-quantized earlier layers (GPTQ's "
        "pipeline; --method quant with --calib a data spec).",
    ),
    seed: int = typer.Option(0),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print memory, disk and time estimates; compute nothing."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="With --dry-run: print the estimates as JSON (bytes, seconds)."
    ),
    max_memory: str | None = typer.Option(
        None,
        help="Refuse when the estimated peak memory exceeds this "
        "(e.g. 16GB; default: the memory available now).",
    ),
) -> None:
    """Compress MODEL with one method and write a checkpoint that is really smaller."""
    if as_json and not dry_run:  # it was ignored: the run went ahead and printed no JSON
        raise MoECompressError("--json prints the --dry-run estimates as JSON; add --dry-run or drop --json.")
    check_range("--ratio", ratio, 0.0, 1.0, hi_open=True)
    check_range("--seq-len", seq_len, 1)
    check_seed("--seed", seed)
    given = dict(
        ratio=ratio,
        criterion=criterion,
        operator=operator,
        rank=rank,
        gate=gate,
        budget=budget,
        budget_scope=budget_scope,
    )
    method, params, quant_setting, format = _settings(
        model, method, recipe, format, given, param, quant, quant_algo, quant_weighting, quant_scope
    )
    if dry_run or max_memory is not None:
        _estimate(
            model, method, params, calib, seq_len, quant_setting, out, dry_run, as_json, max_memory, overwrite
        )
        if dry_run:
            return
    result = compress(
        model,
        method,
        params,
        calib=calib,
        out=out,
        format=format,
        seq_len=seq_len,
        seed=seed,
        overwrite=overwrite,
        quant=quant_setting,
        calib_mode=calib_mode,
        target=target,
        imatrix=imatrix,
    )
    _print_result(result)


def _settings(
    model, method, recipe, format, given: dict, param, quant, quant_algo, quant_weighting, quant_scope
):
    """(method, params, quantization setting, format): the recipe's arm, if any, overridden by the flags; the
    params are the recipe's validated config object when no flag changed them."""
    params: dict = {}
    quant_setting = None
    validated = recipe_params = None  # the recipe arm's config, validated when the recipe was loaded
    if recipe is not None:
        arm = _recipe_arm(recipe, model)
        method = arm.method
        params.update(arm.params)
        validated = arm.config
        recipe_params = dict(arm.params)
        quant_setting = arm.quant  # validated with the recipe: passed down as it is unless a flag changes it
        if format == "auto":
            format = arm.format
    params.update({k: v for k, v in given.items() if v is not None})
    params.update(parse_params(param))
    quant_setting = _quant_flags(
        method, params, quant_setting, quant, quant_algo, quant_weighting, quant_scope
    )
    if validated is not None and params == recipe_params:
        params = validated  # no flag changed the recipe's params: its config object goes down as it is
    return method, params, quant_setting, format


def _recipe_arm(recipe: Path, model: str):
    """The one arm of the recipe file `recipe` (compress builds one)."""
    from ..recipe import load_recipe  # the schema imports the quantizer and transformers: only here

    spec = load_recipe(recipe, model=model)
    if len(spec.arms) != 1:
        raise MoECompressError(
            f"{recipe} holds {len(spec.arms)} arms but compress builds one; use "
            "`moecompress compare` for several arms."
        )
    return spec.arms[0]


def _quant_flags(method: str, params: dict, quant_setting, quant, quant_algo, quant_weighting, quant_scope):
    """Apply --quant, --quant-algo, --quant-weighting and --quant-scope: to `params` for --method quant, else
    to the quantization setting, which is returned."""
    if quant is not None and method == "quant":
        params.update(quant=quant, algo=quant_algo, weighting=quant_weighting)
    elif quant is not None:
        quant_setting = dict(quant=quant, algo=quant_algo, weighting=quant_weighting)
    if quant_scope is not None and isinstance(quant_setting, BaseModel):
        quant_setting = (
            quant_setting.model_dump()
        )  # a flag changes the recipe's setting: validated again below
    if quant_scope is not None:
        if quant_scope not in ("experts", "all"):
            raise MoECompressError(f"--quant-scope '{quant_scope}' is not known; use experts or all.")
        if method == "quant":
            params["scope"] = quant_scope
        elif quant_setting is not None:
            quant_setting["scope"] = quant_scope
        else:
            raise MoECompressError(
                "--quant-scope says which weights --quant applies to; give --quant too (e.g. "
                "--quant w4g128 --quant-scope all)."
            )
    return quant_setting


def _estimate(
    model, method, params, calib, seq_len, quant_setting, out, dry_run, as_json, max_memory, overwrite=False
) -> None:
    """Estimate the run (`compress_dryrun`), print it with --dry-run (as JSON with --json) with what becomes of
    --out (`atomic.dry_run_output`: new, replaced, or refused), and refuse it when its peak exceeds --max-memory
    (default: the memory available now)."""
    try:
        limit = parse_size(max_memory) if max_memory is not None else psutil.virtual_memory().available
    except ValueError:
        limit = -1
    if limit <= 0:  # "-5GB" parsed to a negative limit, refused only after the estimate
        raise MoECompressError(f"--max-memory '{max_memory}' is not a positive size such as 16GB or 512MB.")
    est = estimate_compress(
        model,
        method,
        params,
        calib,
        seq_len,
        stats=needs_for(method, params, quant_setting),
        moment_fraction=moment_fraction(method, params),
        streamed_chunk=streamed_chunk(method, calib, quant_setting, params),
        out=out,
    )
    if dry_run:
        from ..atomic import dry_run_output
        from ..models import resolve_source

        protect = [resolve_source(model), calib if calib is not None and Path(calib).is_dir() else None]
        output = dry_run_output(out, overwrite, protect, kind="checkpoint")
    if dry_run and as_json:
        typer.echo(json.dumps({**est.to_dict(), "output": output}, indent=2))
    elif dry_run:
        for k, v in est.rows():
            Console(markup=False).print(f"{k}: {v}", highlight=False)
        Console(markup=False).print(f"output: {output}", highlight=False, markup=False)
    refuse_if_over(est, limit)


def _print_result(result) -> None:
    """Print the export's summary line, and auto's per-layer table when the method was auto."""
    Console(markup=False).print(result.describe())
    table = auto_table(Path(result.path) / "plan.json")
    if table is not None:
        Console(markup=False).print(table)


def auto_table(plan_json: Path):
    """`auto`'s per-layer choices as a table — representation × bits — or None for other methods."""
    if not plan_json.is_file():
        return None
    summary = json.loads(plan_json.read_text()).get("params", {}).get("auto", {})
    rows = summary.get("layers")
    if not rows:
        return None
    table = Table(
        "layer", "gate", "representations", "stored bits", "bytes", "est. KL", title="auto: per-layer choices"
    )
    for r in rows:
        table.add_row(
            str(r["layer"]),
            r["gate"],
            ", ".join(f"{k} {v}" for k, v in r["choices"].items()),
            ", ".join(f"{k}-bit {v}" for k, v in r.get("bits", {}).items()) or "—",
            str(r["routed_bytes"]),
            f"{r['est_kl']:.3g}",
        )
    for r in summary.get("tensors", []):  # a whole-file budget: the non-expert weights, one row per class
        table.add_row(
            r["cls"],
            "",
            f"{sum(r['bits'].values())} tensors",
            ", ".join(f"{k}-bit {v}" for k, v in r["bits"].items()),
            str(r["bytes"]),
            f"{r['est_kl']:.3g}",
        )
    return table
