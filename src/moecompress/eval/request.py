"""`moecompress.evaluate`'s request: its checks before any model loads (options in range, inputs resolved, outputs
checked and claimed) and the writing of its results, so the API function reads as the steps it takes."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MoECompressError


def check_request(tasks, ppl, reference, include_path, trust_task_code, arithmetic: str = "exact") -> None:
    """`evaluate` refuses a run with nothing to measure, KL without a text stream, task code not trusted, and an
    arithmetic `load` does not know."""
    from ..export.gguf_arith import check_arithmetic

    check_arithmetic(arithmetic)
    if not tasks and not ppl:
        raise MoECompressError(
            "Nothing to evaluate; pass --tasks (e.g. fixture_cloze,fixture_nextword) and/or --ppl FILE."
        )
    if reference and not ppl:
        raise MoECompressError("--reference measures KL on a text stream; pass --ppl FILE as well.")
    if include_path and not trust_task_code:
        raise MoECompressError(
            "--include-path runs the Python code that its task YAML files name (lm-eval's "
            "!function); pass --trust-task-code if you trust that directory."
        )


def check_ranges(limit, batch_size, num_fewshot, window, stride, max_tokens, seed) -> None:
    """`evaluate`'s numeric options, each in its range (`validate.check_range`)."""
    from ..validate import check_range, check_seed

    check_range("--limit", limit, 0.0, lo_open=True, hint="pass a document count or a fraction below 1")
    check_range("--batch-size", batch_size, 1)
    check_range("--num-fewshot", num_fewshot, 0)
    check_range("--window", window, 2)
    check_range("--stride", stride, 1)
    check_range("--max-tokens", max_tokens, 1)
    check_seed("--seed", seed)


def resolve_paths(model, reference, ppl, include_path, out, report, overwrite):
    """`evaluate`'s inputs resolved and its outputs checked before any model loads: the model, the reference,
    `out` as a `Path` (or None) and what the run reads."""
    from ..atomic import check_apart, check_output
    from ..models.loading import resolve_fixture

    out = Path(out) if out is not None else None
    model = resolve_fixture(model)
    reference = resolve_fixture(reference) if reference else None
    reads = [model, reference, ppl, *(include_path or [])]  # the ones that exist here (`atomic.check_apart`)
    check_apart_outputs(out, report)
    if out is not None and out.is_dir():
        raise MoECompressError(
            f"--out {out} is a directory; pass a file path such as {out / 'results.json'}."
        )
    if out is not None:
        check_apart(out, reads)
        check_results_file(out, overwrite)
    if report is not None:
        check_output(report, overwrite, protect=reads, flag="--report", kind="report")
    if isinstance(
        ppl, (str, os.PathLike)
    ):  # a missing or unreadable text file is refused before any model loads
        from ..data import parse_spec

        parse_spec(str(ppl))
    return model, reference, out, reads


def claim_outputs(held, out, report) -> None:
    """Claim `evaluate`'s outputs (`atomic.claim`) for the run, on the exit stack `held`."""
    from ..atomic import claim

    for path, flag in ((out, "--out"), (report, "--report")):
        if path is not None:
            held.enter_context(claim(path, flag))


def check_apart_outputs(out, report) -> None:
    """Refuse, before any model loads, a results file (`--out`) that is the report directory (`--report`) or lies
    inside it, or a report under the results file: one would be written over the other after all the compute."""
    if out is None or report is None:
        return
    from ..atomic.checks import abs_path

    try:
        a, b = abs_path(out).resolve(), abs_path(report).resolve()
    except (RuntimeError, OSError):  # a loop of symbolic links: `check_output` refuses it in its own words
        return
    if a == b or b in a.parents or a in b.parents:
        raise MoECompressError(
            f"--out {out} and --report {report} overlap (the same path, or one inside the other); pass a "
            "results file outside the report directory (the report holds its own results.json)."
        )


def write_evaluation(results: dict, out, report, overwrite, reads, inputs) -> None:
    """Write `evaluate`'s results JSON to `out` and its report into `report` (each when asked for).

    The two are one output: the results file is staged (a hidden temporary, `atomic.stage_file`) while the report
    is written, and renamed into place only once the report is; if either fails neither remains, so a rerun is
    not refused for a results file left by a run that failed (a full disk while writing the report)."""
    from ..atomic import atomic_dir, commit_file, stage_file
    from .report import results_text, write_report

    staged = None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = stage_file(out, results_text(results))
    try:
        if report is not None:
            with atomic_dir(
                report, overwrite=overwrite, protect=reads, kind="report", inputs=inputs, flag="--report"
            ) as tmp:
                write_report(results, tmp)
    except BaseException:
        if staged is not None:
            staged.unlink(missing_ok=True)
        raise
    if staged is not None:
        try:
            commit_file(staged, out)
        except BaseException:
            _remove_report(report)
            raise


def _remove_report(report) -> None:
    """The report this run has just put in place, removed when its results file could not follow (one output)."""
    import shutil

    from ..atomic import marker_kind

    if report is not None and marker_kind(report) == "report":
        shutil.rmtree(report, ignore_errors=True)


def check_results_file(out: Path, overwrite: bool) -> None:
    """`out`: a new file, or (with `overwrite`) a results file moecompress wrote; its directory writable."""
    from ..atomic import check_path

    check_path(out)  # a parent that is a file or unwritable, a symlink loop, a name too long for .NAME.lock
    if out.exists():
        if not overwrite:
            raise MoECompressError(f"{out} already exists; choose another --out or pass --overwrite.")
        from ..safejson import try_load_json

        ours = str((try_load_json(out) or {}).get("schema", "")).startswith("moecompress.")  # bounded
        if not ours:
            raise MoECompressError(
                f"{out} is not a results file written by moecompress, so --overwrite will not "
                "replace it; pass another --out."
            )
