"""Issue 32 benchmark: what `auto`'s fast search (``search: fast``) costs in quality and saves in time against the
full search, on both bf16 fixtures at whole-file ratios 0.45, 0.33, 0.27 and 0.21.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_auto_search.py run   # -> benchmarks/results/auto_search.json
    python benchmarks/bench_auto_search.py report                         # BENCHMARKS.md section

Per fixture, one statistics store (`calibrate --for-method auto` on `fixture-calib:64` at 256 tokens) serves every
arm; ``auto-full-R`` is ``auto --budget R`` (whole-file scope, quantization group 32, every other field at its
default), ``auto-fast-R`` the same with ``search: fast``. Each arm is evaluated as the whole-file benchmark
evaluates (held-out windows of 512 from `fixture-heldout`, the first 65,536 tokens, KL to the original per
window), and the two arms of a ratio are paired (bootstrap over windows, Holm over the fixture's ratios). The
time is `compress` from the store: the search, the plan and the export, the calibration excluded (both share it).
On the 4.98 GB-class wide model the time ratio is `bench_gptq_scale.py run-auto --search fast`'s.
"""

from __future__ import annotations

import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._bench_md import fixture_main, kept_fixtures, load_results, save_results, write_section  # noqa: E402
from benchmarks.bench_whole_model import CALIB, GROUP, MAX_TOKENS, SEQ_LEN, WINDOW, file_bytes  # noqa: E402

RESULTS = "auto_search.json"
SECTION = "## auto: fast vs full search (issue 32)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
RATIOS = (0.45, 0.33, 0.27, 0.21)
SEARCHES = ("full", "fast")


def run_fixture(fixture: str, out: Path) -> dict:
    import moecompress
    from moecompress.testing import fixture_dir

    model = f"fixture:{fixture}"
    original = file_bytes(fixture_dir(fixture))
    stats = out / fixture / "stats"
    shutil.rmtree(stats, ignore_errors=True)
    moecompress.calibrate(model, CALIB, out=stats, for_method="auto", seq_len=SEQ_LEN, progress=False)
    arms = []
    for r in RATIOS:
        for search in SEARCHES:
            name = f"auto-{search}-{r:g}"
            dest = out / fixture / name
            shutil.rmtree(dest, ignore_errors=True)
            params = dict(budget=r, quant_group=GROUP, search=search)
            t0 = time.perf_counter()
            moecompress.compress(
                model, "auto", params, calib=str(stats), seq_len=SEQ_LEN, out=dest, progress=False
            )
            seconds = time.perf_counter() - t0
            res = moecompress.evaluate(
                str(dest),
                ppl="fixture-heldout",
                reference=model,
                window=WINDOW,
                max_tokens=MAX_TOKENS,
                batch_size=8,
                progress=False,
            )
            m = res["arms"][0]["metrics"]["ppl:fixture-heldout"]
            size = file_bytes(dest)
            arms.append(
                dict(
                    name=name,
                    search=search,
                    ratio=r,
                    bytes=size,
                    file_ratio=size / original,
                    kl=m["aggregate"]["kl"],
                    compress_seconds=round(seconds, 1),
                    ids=m["items"]["ids"],
                    window_kl=m["items"]["kl"],
                )
            )
            print(
                f"[{fixture}] {name}: {size / original:.3f}, KL {m['aggregate']['kl']:.4g}, {seconds:.0f} s"
            )
    ids = arms[0]["ids"]
    for a in arms:
        if a.pop("ids") != ids:
            raise SystemExit(f"{fixture}: arm {a['name']} was evaluated on other windows")
    return dict(fixture=fixture, original_bytes=original, window_ids=ids, arms=arms)


def run(fixtures, out: Path) -> None:
    import torch

    results = dict(
        machine=dict(platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads()),
        calib=CALIB,
        seq_len=SEQ_LEN,
        window=WINDOW,
        max_tokens=MAX_TOKENS,
        group=GROUP,
        fixtures=kept_fixtures(RESULTS, {f: run_fixture(f, out) for f in fixtures}, FIXTURES),
    )
    save_results(RESULTS, results)


def compare(fx: dict) -> list[dict]:
    """Per ratio: the fast arm paired with the full one (seeded: a report recomputes them exactly)."""
    from moecompress.eval.stats import apply_holm, paired_bootstrap

    by = {(a["search"], a["ratio"]): a for a in fx["arms"]}
    ids, comps = fx["window_ids"], []
    for r in sorted({a["ratio"] for a in fx["arms"]}, reverse=True):
        a, b = by[("fast", r)], by[("full", r)]
        c = paired_bootstrap(
            ids, a["window_kl"], ids, b["window_kl"], metric="kl", higher_is_better=False, B=4000, seed=0
        ).to_dict()
        c.pop("per_task", None)
        comps.append(dict(c, ratio=r, fast=a, full=b))
    apply_holm(comps, 0.05)
    return comps


def _g(x, nd=3):
    return "—" if x is None else f"{x:.{nd}g}"


def report() -> None:
    res = load_results(RESULTS)
    lines = [
        SECTION,
        "",
        f"Generated by `python -m benchmarks auto-search` ({Path(__file__).name}); results "
        f"`benchmarks/results/{RESULTS}`. Calibration `{res['calib']}` at {res['seq_len']} tokens, one store per "
        f"fixture for both searches; KL to the original on the first {res['max_tokens']:,} tokens of "
        f"`fixture-heldout` in windows of {res['window']}; file ratio = every tensor of the export at its stored "
        f"dtype over the original bf16 file's; quantization group {res['group']}; time = `compress` from the "
        f"store. Machine: {res['machine']['platform']}, torch {res['machine']['torch']}, "
        f'{res["machine"]["threads"]} threads. docs/auto.md, "Fast search", says what the fast search leaves '
        "out.",
        "",
        "| fixture | ratio | full: file ratio | full: KL | fast: file ratio | fast: KL | KL fast ÷ full | "
        "Holm p | verdict | time fast ÷ full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    words = {"A better": "fast lower", "B better": "fast higher"}
    times = []
    for fx in res["fixtures"]:
        for c in compare(fx):
            a, b = c["fast"], c["full"]
            t = a["compress_seconds"] / b["compress_seconds"]
            times.append(t)
            lines.append(
                f"| {fx['fixture']} | {c['ratio']:g} | {b['file_ratio']:.3f} | {_g(b['kl'])} | "
                f"{a['file_ratio']:.3f} | {_g(a['kl'])} | {_g(a['kl'] / b['kl'])} | {_g(c.get('p_adjusted'))} | "
                f"{words.get(c['verdict'], 'not detectably different')} | {t:.2f} |"
            )
    lines += [
        "",
        f"- Median time of the fast search over the full one, every row: {statistics.median(times):.2f}.",
    ]
    write_section(SECTION, "\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
    fixture_main(__doc__, FIXTURES, run, report, ROOT / "build" / "bench_auto_search")
