"""Shared by the benchmark generators: each owns one `## ` section of BENCHMARKS.md and one results
file under benchmarks/results/ (committed), so `report` regenerates the section without recomputing."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def write_section(title: str, text: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    """`text` starts with the `title` heading line; everything up to the next `## ` heading is replaced.
    The preamble's list of sections still due for a re-run is recomputed too (`preamble`)."""
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    text = text.rstrip("\n") + "\n"
    if title in doc:
        start = doc.index(title)
        nxt = doc.find("\n## ", start + len(title))
        doc = doc[:start] + text + ("\n" + doc[nxt + 1 :] if nxt >= 0 else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    first = doc.find("\n## ")
    if doc.startswith("# Benchmarks\n") and first >= 0:
        doc = "# Benchmarks\n\n" + preamble(doc) + "\n" + doc[first + 1 :]
    path.write_text(doc)


def write_block(name: str, text: str, path: Path = ROOT / "README.md") -> None:
    """Replace what lies between `<!-- NAME:start ... -->` and `<!-- NAME:end -->` in `path` with `text` (a generated
    table inside a hand-written page); the markers must be there."""
    doc = path.read_text()
    start, end = f"<!-- {name}:start", f"<!-- {name}:end -->"
    if start not in doc or end not in doc:
        raise SystemExit(f"{path.name} has no '{start} ... {end}' block for the generated {name} table.")
    head = doc.index("\n", doc.index(start)) + 1
    path.write_text(doc[:head] + text.rstrip("\n") + "\n" + doc[doc.index(end) :])


def stale_sections(doc: str) -> list[str]:
    """Headings in `doc` whose results files under benchmarks/results/ are not all there: sections measured
    before results were committed, i.e. on the float32 fixtures that preceded issue 17's bf16 ones."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_sections", ROOT / "benchmarks" / "__main__.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    headings = [line for line in doc.splitlines() if line.startswith("## ")]
    out = []
    for sec in mod.SECTIONS.values():
        if sec.title in headings and not all((RESULTS / r).exists() for r in sec.results):
            out.append(sec.title)
    return sorted(out, key=headings.index)


def preamble(doc: str) -> str:
    """BENCHMARKS.md's opening paragraph, with the sections still due for a re-run computed from `doc`."""
    stale = [t.removeprefix("## ") for t in stale_sections(doc)]
    due = (
        f"These sections have no results file there yet and were last measured on the earlier float32 "
        f"fixtures; they are due for a re-run with their command: {'; '.join(stale)}."
        if stale
        else "Every section has its results file there, i.e. was measured on the bf16 fixtures."
    )
    return (
        "Every section below is written by the command it names (`python -m benchmarks --list`), from results "
        "committed under `benchmarks/results/`. The shipped fixtures are bf16 since issue 17. " + due + "\n"
    )


def results_path(name: str) -> Path:
    """benchmarks/results/NAME: where a generator's `run` writes and its `report` reads."""
    return RESULTS / name


def save_results(name: str, obj) -> Path:
    path = results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def kept_fixtures(name: str, fresh: dict[str, object], order) -> list:
    """Per-fixture results for `order`: the fresh ones, else those committed in `name` (list entries with a
    "fixture" key). A `run` of some fixtures so keeps the others' committed results instead of dropping them."""
    path = results_path(name)
    old = json.loads(path.read_text()).get("fixtures", []) if path.is_file() else []
    by = {fx["fixture"]: fx for fx in old} if isinstance(old, list) else {}
    return [fresh.get(f) or by[f] for f in order if f in fresh or f in by]


def fixture_main(doc: str, fixtures, run, report, out: Path) -> None:
    """The command line of a per-fixture generator: ``run [--fixtures F ...] [--out DIR]`` measures (`run(fixtures,
    out)`), ``report`` rewrites its section from the committed results (`report()`)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["run", "report"])
    ap.add_argument("--fixtures", nargs="+", default=list(fixtures), choices=fixtures)
    ap.add_argument("--out", type=Path, default=out)
    args = ap.parse_args()
    if args.step == "run":
        run(args.fixtures, args.out)
    else:
        report()


def load_results(name: str):
    path = results_path(name)
    if not path.is_file():
        raise SystemExit(
            f"{path.relative_to(ROOT)} is missing: run this section's `run` step first "
            f"(python -m benchmarks --list)."
        )
    return json.loads(path.read_text())


def machine() -> str:
    """The machine, as measured now (goes into each results file, so a report never hand-types it)."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores"


_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # as the families spell it


def model_shape(path: Path) -> dict:
    """The architecture fields a report cites, read from checkpoint `path`'s config.json (never typed by hand).
    The routed-expert count is stored under a family-specific key (Qwen3-MoE: ``num_local_experts`` since
    transformers 5); it is reported as ``num_experts``."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    shape = {
        k: cfg.get(k)
        for k in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "moe_intermediate_size",
            "num_experts_per_tok",
        )
    }
    shape["num_experts"] = next((cfg[k] for k in _EXPERT_COUNT_KEYS if cfg.get(k) is not None), None)
    shape["dtype"] = cfg.get("dtype") or cfg.get("torch_dtype")
    return shape


def rel(path: Path) -> str:
    """A results path as the report cites it (repository-relative)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def frontier_plot(
    panels: dict[str, dict[str, list[tuple[float, float]]]], xlabel: str, ylabel: str, path: Path
):
    """One log-KL frontier panel per fixture: {fixture: {family: [(bytes ratio, KL), ...]}}, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (fixture, series) in zip(axes[0], panels.items()):
        for family, pts in sorted(series.items()):
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=family)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(fixture)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
