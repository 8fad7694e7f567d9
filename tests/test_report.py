"""report.md + PNGs + results.json: every checklist item printed, MISSING when absent, refusals in one sentence."""

import json

import numpy as np
import pytest

from moecompress.errors import MoECompressError
from moecompress.eval.report import write_report
from moecompress.eval.report_checklist import CHECKLIST_TITLES, checklist
from moecompress.eval.report_comparisons import compare_arms


def entry(output_type, metric, values, ids=None, hib=True):
    values = [float(v) for v in values]
    ids = list(range(len(values))) if ids is None else ids
    e = {
        "output_type": output_type,
        "aggregate": {metric: float(np.mean(values))},
        "higher_is_better": {metric: hib},
        "primary": metric,
        "n": len(values),
        "items": {"ids": ids, metric: values},
    }
    return e


def ppl_entry(nll, kl=None):
    ids = [f"abc:{i * 64}" for i in range(len(nll))]
    e = {
        "output_type": "perplexity",
        "aggregate": {"ppl": float(np.exp(np.mean(nll))), "nll": float(np.mean(nll))},
        "higher_is_better": {"ppl": False, "nll": False, "acc": True},
        "primary": "nll",
        "n": len(nll),
        "items": {"ids": ids, "nll": list(nll), "n_tokens": [64] * len(nll)},
    }
    if kl is not None:
        e["aggregate"]["kl"] = float(np.mean(kl))
        e["items"]["kl"] = list(kl)
    return e


def full_results():
    rng = np.random.default_rng(0)
    base_mc = rng.integers(0, 2, 80)
    base_gen = rng.integers(0, 2, 60)
    base_nll = rng.normal(3.0, 0.2, 40)

    def arm(name, method, kind, drop, size, **kw):
        mc = np.where(rng.random(80) < drop, 0, base_mc)
        gen = np.where(rng.random(60) < drop, 0, base_gen)
        nll = base_nll + drop + rng.normal(0, 0.02, 40)
        kl = np.abs(rng.normal(drop, 0.01, 40)) if kind != "original" else np.zeros(40)
        a = {
            "name": name,
            "method": method,
            "kind": kind,
            "bytes": {"model": size},
            "metrics": {
                "ppl:heldout.txt": ppl_entry(nll, kl),
                "fixture_mc": entry("multiple_choice", "acc", mc),
                "fixture_gen": entry("generate_until", "exact_match", gen),
            },
        }
        a.update(kw)
        return a

    layers = [{"layer": i, "experts": 8, "retained": 4, "remapped": 0, "dropped": 4} for i in range(3)]
    return {
        "model": {
            "name": "qwen3-moe-tiny",
            "model_type": "qwen3_moe",
            "router_convention": "softmax → top-2 → renorm",
            "num_experts": 8,
            "top_k": 2,
        },
        "calibration": {"domain": "English prose", "source": "fixture-calib", "tokens": 65536},
        "arms": [
            arm(
                "original",
                "original",
                "original",
                0.0,
                40_000_000,
                latency={
                    "prefill_tok_s": 900.0,
                    "decode_tok_s": 40.0,
                    "batch_size": 1,
                    "prompt_len": 128,
                    "new_tokens": 32,
                    "repeats": 3,
                    "warmup": 1,
                    "device": "cpu",
                },
                memory={"peak_bytes": 600_000_000, "kind": "cpu_rss"},
            ),
            arm(
                "reap-50-reroute",
                "reap",
                "compressed",
                0.3,
                22_000_000,
                gate_semantics="keep",
                operator="reroute",
                mask_id="m1",
                params={"ratio": 0.5},
                per_layer=layers,
            ),
            arm(
                "reap-50-drop",
                "reap",
                "compressed",
                0.05,
                22_000_000,
                gate_semantics="keep",
                operator="drop",
                mask_id="m1",
                params={"ratio": 0.5},
                per_layer=layers,
            ),
            arm(
                "quant-w4g128-gptq",
                "quant",
                "quant_baseline",
                0.02,
                12_000_000,
                gate_semantics="renorm",
                params={"quant": "w4g128", "algo": "gptq"},
                precision="w4g128",
                bits_per_weight=4.125,
            ),
        ],
        "settings": {"seed": 0},
        "notes": ["synthetic results for the report test"],
    }


def test_report_with_every_checklist_item(tmp_path):
    path = write_report(full_results(), tmp_path / "rep")
    text = path.read_text()
    for i, title in enumerate(CHECKLIST_TITLES, 1):
        assert f"{i}. **done** — {title}" in text
    assert "MISSING" not in text
    for png in ("quality_vs_bytes.png", "task_deltas.png", "per_layer_experts.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 5000
        assert f"]({png})" in text
    data = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert data["schema"] == "moecompress.results/1" and data["baseline"] == "original"
    assert [c["done"] for c in data["checklist"]] == [True] * 5
    comps = data["comparisons"]
    # 3 arms x (ppl + 2 tasks + task average) vs the baseline, one Holm family
    assert len(comps) == 12 and all(c["b"] == "original" and c["p_adjusted"] >= c["p"] for c in comps)
    assert {c["verdict"] for c in comps} <= {"A better", "B better", "not detectably different"}
    bad = next(c for c in comps if c["a"] == "reap-50-reroute" and c["task"] == "ppl:heldout.txt")
    assert bad["delta"] > 0 and bad["verdict"] == "B better"  # NLL up by 0.3 nats: the original is better
    assert "not detectably different" in text or "B better" in text
    assert "mask m1: operators drop, reroute" in text
    assert data["settings"]["B"] == 1920 and "Warning" not in text  # B >= 8 m / alpha for m = 12


def test_too_few_replicates_are_flagged():
    from moecompress.eval.report_markdown import render_markdown
    from moecompress.eval.schema import validate_results

    res = validate_results(full_results())
    comps = compare_arms(res, B=300)
    text = render_markdown(res, comps, checklist(res), {}, {"B": 300, "seed": 0, "alpha": 0.05})
    assert "with B = 300 replicates" in text and "B ≥ 1920" in text
    assert {c["verdict"] for c in comps} == {
        "not detectably different"
    }  # 12 * 2/301 > 0.05: nothing survives Holm


def test_missing_items_are_listed_not_hidden(tmp_path):
    r = full_results()
    r.pop("calibration")
    r["model"].pop("router_convention")
    r["arms"] = [a for a in r["arms"] if a["kind"] != "quant_baseline"][:2]
    for a in r["arms"]:
        a["metrics"].pop("fixture_gen")
    text = write_report(r, tmp_path / "rep").read_text()
    for i, title in enumerate(CHECKLIST_TITLES, 1):
        assert f"{i}. **MISSING** — {title}" in text
    items = checklist(r)
    assert (
        "router convention" in items[0]["detail"]
        and "calibration domain, source, tokens" in items[3]["detail"]
    )


def test_unpaired_arms_are_refused(tmp_path):
    r = full_results()
    r["arms"][1]["metrics"]["fixture_mc"]["items"]["ids"] = list(range(1, 81))
    with pytest.raises(MoECompressError, match="not evaluated on the same items"):
        write_report(r, tmp_path / "rep")


def test_invalid_results_point_at_the_field(tmp_path):
    r = full_results()
    r["arms"][1]["name"] = "original"
    with pytest.raises(MoECompressError, match="'arms'.*unique"):
        write_report(r, tmp_path / "rep")
    r = full_results()
    r["arms"][0]["metrics"]["fixture_mc"]["items"]["acc"] = [1.0]
    with pytest.raises(MoECompressError, match="arms.0.metrics.fixture_mc"):
        compare_arms(r)


# ------------------------------------------------------------------------ summary table and plots
def _many_arms(n: int = 28) -> dict:
    """full_results with n compressed arms of long names and per-layer records, for layout checks."""
    import copy

    r = full_results()
    template = r["arms"][1]
    arms = [r["arms"][0]]
    for i in range(n):
        a = copy.deepcopy(template)
        a["name"] = f"conmoe-fixed-k-scope{i % 4}-ratio-{i:02d}"
        a["bytes"]["model"] = 10_000_000 + 500_000 * i
        a["per_layer"] = [
            {"layer": k, "experts": 16, "retained": 8 - k, "remapped": k, "operators": 0, "dropped": 8}
            for k in range(4)
        ]
        arms.append(a)
    r["arms"] = arms
    return r


def test_ranking_table_fits_100_columns_and_is_written_as_markdown(tmp_path):
    from rich.console import Console

    from moecompress.compare.ranking import TABLE_WIDTH, ranking_table
    from moecompress.eval.report_tables import ranking_rows

    r = _many_arms()
    console = Console(width=200, record=True, file=open(tmp_path / "tty.txt", "w"))
    console.print(ranking_table(r), width=TABLE_WIDTH)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100 and "…" not in text  # wrapped, never cut
    header, rows = ranking_rows(r)
    assert header[:7] == ["arm", "kind", "size", "vs orig", "bpw", "KL", "ppl"]
    assert header[7:] == ["fixture_mc", "fixture_gen"]
    kls = [float(row[5]) for row in rows]
    assert kls == sorted(kls) and rows[0][0] == "original" and rows[0][3] == "100%"
    write_report(r, tmp_path / "rep")
    md = (tmp_path / "rep" / "ranking.md").read_text()
    assert all(f"| {row[0]} | {row[1]} | {row[2]} |" in md for row in rows)


def test_per_layer_heatmap_is_one_figure_of_sane_height(tmp_path):
    from PIL import Image

    from moecompress.eval.report_plots import per_layer_cells
    from moecompress.eval.schema import validate_results

    r = _many_arms(28)
    write_report(r, tmp_path / "rep")
    width, height = Image.open(tmp_path / "rep" / "per_layer_experts.png").size
    assert height < 1400 and width < 2000  # 28 arms in one heatmap, not 28 stacked panels (6,936 px before)
    arm = validate_results(r).arms[1]
    assert per_layer_cells(arm)[3] == (5, 3, 0, 8)  # kept, merged, operator, dropped of layer 3


def test_pareto_front_and_discriminating_tasks():
    from moecompress.eval.report_comparisons import discriminating
    from moecompress.eval.report_plots import pareto_front

    pts = [(10.0, 0.5), (5.0, 1.0), (7.0, 0.2), (8.0, 0.3), (12.0, 0.1), (5.0, 2.0)]
    assert pareto_front(pts) == [1, 2, 4]  # (5, 1.0) -> (7, 0.2) -> (12, 0.1); the rest are dominated
    comps = [
        dict(task="mc", ci_low=-0.1, ci_high=0.05),
        dict(task="mc", ci_low=-0.2, ci_high=0.1),
        dict(task="ppl", ci_low=0.01, ci_high=0.3),
        dict(task="ppl", ci_low=-0.1, ci_high=0.2),
    ]
    assert [c["task"] for c in discriminating(comps)] == ["ppl", "ppl"]  # no mc interval excludes 0


def test_task_plot_is_omitted_when_no_task_discriminates(tmp_path):
    r = full_results()
    r["arms"] = r["arms"][:1] + [dict(r["arms"][0], name="copy", kind="compressed")]  # identical items
    text = write_report(r, tmp_path / "rep").read_text()
    assert not (tmp_path / "rep" / "task_deltas.png").exists() and "No per-task plot" in text


def test_a_pipe_gets_the_full_table_width():
    from moecompress.compare.ranking import TABLE_WIDTH, summary_console, table_width

    console = summary_console()  # pytest captures stdout: not a terminal, so rich alone would assume 80
    assert not console.is_terminal and console.width == TABLE_WIDTH and table_width(console) == TABLE_WIDTH
