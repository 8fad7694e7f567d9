"""Issue 7 benchmark: what the bf16 exponent clamp changes, and the PuzzleMoE arms end to end.

Two parts per fixture (qwen3-moe-tiny, olmoe-tiny; calibration `fixture-calib:64`, 64 × 256 tokens;
perplexity / KL(original ‖ model) on `fixture-heldout`, windows of 256, the first 16384 tokens):

* ``clamp`` — perplexity before/after the exponent clamp at 112 (values below 2^-15), in fp32 compute:
  (a) every routed-expert weight rounded to bf16, then clamped by each underflow rule;
  (b) the PuzzleMoE 50 % merge (seeded random pairs, activation saliency, τ = 0.4) reconstructed densely
      from bf16 W_merged without the clamp, and with each rule (what packing stores);
  plus how many values each clamp changes (`puzzle.clamp_report`).
* ``compare`` — `moecompress.compare.run_compare` with the PuzzleMoE arms of the demo recipe
  (puzzle-25, puzzle-50, puzzle-50-q3; plus puzzle-50-evolve and puzzle-75 = groups of 4) and the
  matched-storage RTN 4/3-bit baselines, on a **bf16 copy** of the fixture (the shipped fixtures are
  fp32; PuzzleMoE packs bf16 words, so bytes are only meaningful against a bf16 original): each arm is
  built, exported (`packed`), loaded back and evaluated on identical windows and lm-eval items.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_puzzle.py --out build/bench_puzzle   # scratch under --out
    python benchmarks/bench_puzzle.py --report benchmarks/results/puzzle --write         # BENCHMARKS.md

Results (committed, what `--report` reads): benchmarks/results/puzzle/results-<fixture>.json.

There is no GPU on the machine these numbers come from, so the Triton decode-GEMM table
(`benchmarks/bench_puzzle_kernel.py`) is not measured here.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from _bench_md import RESULTS, machine

SECTION = "## PuzzleMoE (issue 7)"
EVAL = dict(ppl="fixture-heldout", window=256, max_tokens=16384)
ARMS = [
    dict(name="puzzle-25", method="puzzlemoe", params=dict(ratio=0.25)),
    dict(name="puzzle-50", method="puzzlemoe", params=dict(ratio=0.5)),
    dict(name="puzzle-50-q3", method="puzzlemoe", params=dict(ratio=0.5, quant_bits=3)),
    dict(name="puzzle-50-evolve", method="puzzlemoe", params=dict(ratio=0.5, pairing="evolve")),
    dict(name="puzzle-75", method="puzzlemoe", params=dict(ratio=0.75)),
]
RULES = ("nearest", "clamp", "flush")


def _fixture_path(fixture: str) -> str:
    from moecompress.testing import fixture_dir

    return fixture if Path(fixture).is_dir() else str(fixture_dir(fixture))


def _ppl(model, tokenizer, reference=None) -> dict:
    from moecompress.eval.metrics import evaluate_stream

    with torch.no_grad():
        agg = evaluate_stream(
            model,
            EVAL["ppl"],
            tokenizer,
            reference=reference,
            window=EVAL["window"],
            max_tokens=EVAL["max_tokens"],
            progress=False,
        )["aggregate"]
    return {k: agg[k] for k in ("ppl", "kl") if k in agg}


def _set_all(adapter, fn) -> None:
    """Replace every routed expert weight w by fn(w) (biases untouched)."""
    from moecompress.models import ExpertWeights

    for i in adapter.moe_layers:
        for e in range(adapter.num_experts(i)):
            w = adapter.get_expert(i, e)
            adapter.set_expert(
                i, e, ExpertWeights(fn(w.gate), fn(w.up), fn(w.down), w.gate_bias, w.up_bias, w.down_bias)
            )


# ----------------------------------------------------------------------------- part A: the clamp
def run_clamp(fixture: str, out: Path) -> dict:
    from transformers import AutoTokenizer

    from moecompress.methods.puzzle import _layer_seed, layer_norms
    from moecompress.models import ExpertWeights, MoEAdapter, load_model
    from moecompress.puzzle import clamp_exponent, clamp_report, merge_expert_pair, random_pairing
    from moecompress.workflows.pipeline import resolve_calibration

    path = _fixture_path(fixture)
    tok = AutoTokenizer.from_pretrained(path)
    stats = resolve_calibration(
        path,
        "fixture-calib:64",
        ["counts", "tokens", "in_channel_norm", "mid_channel_norm"],
        seq_len=256,
        seed=0,
        work_dir=out / f"calib-{Path(fixture).name}",
        dtype="float32",
        progress=False,
    )
    ref = load_model(path, dtype="float32")
    rows = {"original fp32": _ppl(ref, tok, ref)}

    bf = copy.deepcopy(ref)
    _set_all(MoEAdapter(bf), lambda t: t.to(torch.bfloat16).float())
    rows["experts bf16"] = _ppl(bf, tok, ref)
    ad = MoEAdapter(ref)
    weights = [
        t
        for i in ad.moe_layers
        for e in range(ad.num_experts(i))
        for t in (ad.get_expert(i, e).gate, ad.get_expert(i, e).up, ad.get_expert(i, e).down)
    ]
    counts = {}
    for rule in RULES:
        m = copy.deepcopy(ref)
        _set_all(MoEAdapter(m), lambda t, rule=rule: clamp_exponent(t.to(torch.bfloat16), rule).float())
        rows[f"experts bf16 + clamp ({rule})"] = _ppl(m, tok, ref)
        rows[f"experts bf16 + clamp ({rule})"]["kl_unclamped"] = _ppl(m, tok, bf)[
            "kl"
        ]  # KL(bf16 ‖ bf16+clamp)
        del m
        counts[f"experts ({rule})"] = clamp_report(weights, rule).to_dict()
    del weights, bf

    # PuzzleMoE 50 %: the method's pairs and norms, reconstructed densely with / without the clamp
    merges = []
    for i in ad.moe_layers:
        e_count = ad.num_experts(i)
        norms = layer_norms(stats, i, e_count)
        for a, b in random_pairing(e_count, e_count // 2, seed=_layer_seed(0, i)):
            merges.append(
                (
                    i,
                    a,
                    b,
                    merge_expert_pair(ad.get_expert(i, a), ad.get_expert(i, b), norms[a], norms[b], 0.4),
                )
            )
    w_merged = [t for *_, mg in merges for t in (mg.gate_up.w_merged, mg.down.w_merged)]
    variants = {"puzzle-50, bf16 W_merged, no clamp": None, **{f"puzzle-50, clamp ({r})": r for r in RULES}}
    unclamped = None
    for name, rule in variants.items():
        m = copy.deepcopy(ref)
        madapter = MoEAdapter(m)
        for i, a, b, mg in merges:
            if rule is None:
                bf_merge = replace(
                    mg,
                    gate_up=replace(mg.gate_up, w_merged=mg.gate_up.w_merged.bfloat16().float()),
                    down=replace(mg.down, w_merged=mg.down.w_merged.bfloat16().float()),
                )
            else:
                bf_merge = mg.rounded(rule)
            for e, w in zip((a, b), bf_merge.reconstruct(torch.float32)):
                madapter.set_expert(i, e, ExpertWeights(w.gate, w.up, w.down))
        rows[name] = _ppl(m, tok, ref)
        if rule is None:
            unclamped = m
        else:
            rows[name]["kl_unclamped"] = _ppl(m, tok, unclamped)["kl"]
            counts[f"W_merged ({rule})"] = clamp_report(w_merged, rule).to_dict()
    return dict(fixture=fixture, rows=rows, counts=counts)


# ----------------------------------------------------------------------------- part B: arms
def bf16_copy(fixture: str, out: Path) -> Path:
    """The fixture saved in bfloat16 (with its tokenizer) — the original the packed bytes are measured against."""
    from moecompress.export.core import TOKENIZER_FILES
    from moecompress.models import load_model

    src = Path(_fixture_path(fixture))
    dest = out / f"{src.name}-bf16"
    if not (dest / "config.json").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        load_model(str(src), dtype="bfloat16").save_pretrained(dest)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, dest / name)
    return dest


def run_compare_part(fixture: str, out: Path) -> dict:
    from moecompress.compare import run_compare
    from moecompress.recipe import parse_recipe

    model = bf16_copy(fixture, out)
    recipe = parse_recipe(
        dict(
            model=str(model),
            calibration=dict(data="fixture-calib:64", seq_len=256, seed=0),
            eval=dict(
                EVAL, tasks=["fixture_mc", "fixture_gen"], limit=100, latency=False, quant_baselines=[4, 3]
            ),
            arms=ARMS,
        ),
        where="bench_puzzle",
    )
    t0 = time.perf_counter()
    res = run_compare(recipe, out / f"compare-{Path(fixture).name}", overwrite=True, progress=False)
    seconds = time.perf_counter() - t0
    stream = next(k for k in res["arms"][0]["metrics"] if k.startswith("ppl:"))
    n_params = _expert_params(model)
    routed = 2 * n_params  # the bf16 original's routed-expert bytes
    original_disk = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    table = []
    for a in res["arms"]:
        agg = a["metrics"][stream]["aggregate"]
        mc = a["metrics"].get("fixture_mc", {}).get("aggregate", {}).get("acc")
        gen = a["metrics"].get("fixture_gen", {}).get("aggregate", {})
        em = next(
            (v for k, v in gen.items() if k.startswith("exact_match") and not k.endswith("stderr")), None
        )
        row = dict(
            name=a["name"],
            kind=a["kind"],
            ppl=agg.get("ppl"),
            kl=agg.get("kl"),
            mc=mc,
            gen=em,
            compress_seconds=a.get("compress_seconds"),
        )
        if a["kind"] == "original":
            row.update(routed_bytes=routed, routed_fraction=1.0, bits_per_weight=16.0, disk=original_disk)
        elif a["kind"] == "compressed":
            ckpt = Path(a["path"])
            plan = json.loads((ckpt / "plan.json").read_text())
            on_disk = _scope_bytes(ckpt)  # the routed experts as the packed checkpoint stores them
            row.update(
                routed_bytes=on_disk,
                routed_fraction=on_disk / routed,
                bits_per_weight=8 * on_disk / n_params,
                disk=a["bytes"].get("weights"),
                clamp=plan["params"]["puzzle"]["clamp"],
                removed=plan["params"]["puzzle"]["removed_fraction"],
                format=a.get("export_format"),
            )
        elif a["kind"] == "quant_baseline":  # the GPTQ reference arms (method quant), sized by their plan
            bpw = a.get("bits_per_weight")
            row.update(
                bits_per_weight=bpw,
                routed_bytes=round(bpw * n_params / 8),
                routed_fraction=bpw / 16,
                disk=a["bytes"].get("weights"),
            )
        table.append(row)
    paired = {c["a"]: c for c in res.get("comparisons", []) if c["task"] == stream}
    for row, a in zip(table, res["arms"]):
        c = paired.get(a["name"])
        if c:  # the paired bootstrap against the original on the perplexity stream (per-window NLL)
            row["paired"] = {k: c[k] for k in ("delta", "ci_low", "ci_high", "p_adjusted", "verdict")}
        row["windows"] = a["metrics"][stream].get(
            "items"
        )  # per-window values, so the table can be re-derived
    items = {
        t: len(next(iter(res["arms"][0]["metrics"][t].get("items", {}).values()), []) or [])
        for t in ("fixture_mc", "fixture_gen")
        if t in res["arms"][0]["metrics"]
    }
    return dict(
        fixture=fixture,
        model=str(model),
        seconds=round(seconds, 1),
        arms=table,
        routed_bytes=routed,
        original_disk=original_disk,
        calibration=res.get("calibration"),
        eval=dict(EVAL),
        items=items,
        machine=machine(),
        baselines=sum(a["kind"] == "quant_baseline" for a in res["arms"]),
    )


def _expert_params(model_dir: Path) -> int:
    from moecompress.models import MoEAdapter, load_model

    ad = MoEAdapter(load_model(str(model_dir), dtype="bfloat16"))
    return sum(
        t.numel() for i in ad.moe_layers for t in (ad.experts(i).gate, ad.experts(i).up, ad.experts(i).down)
    )


def _scope_bytes(ckpt: Path) -> int:
    """Bytes of the stored-expert tensors (``moecompress.scopes.*``) in a compact/packed checkpoint."""
    import struct

    total = 0
    for f in ckpt.glob("*.safetensors"):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8 : 8 + n])
        total += sum(
            v["data_offsets"][1] - v["data_offsets"][0]
            for k, v in head.items()
            if k.startswith("moecompress.scopes.")
        )
    return total


# ----------------------------------------------------------------------------- report
def _f(x, nd=4):
    if x is None:
        return "—"
    return f"{x:.{nd}g}" if isinstance(x, float) else str(x)


def markdown(results: dict) -> str:
    first = next((r["compare"] for r in results.values() if r.get("compare")), None)
    lines = [
        SECTION,
        "",
        "Measured by `python -m benchmarks puzzle` (`benchmarks/bench_puzzle.py`); results "
        "`benchmarks/results/puzzle/results-<fixture>.json` (per-window values included).",
    ]
    if first:
        cal, ev = first.get("calibration") or {}, first["eval"]
        lines[-1] += (
            f" Machine: {first['machine']}, shared. Calibration `{cal.get('source')}` ({cal.get('tokens'):,} "
            f"tokens, per-expert input-channel norms); perplexity and KL(original ‖ model) on the first "
            f"{ev['max_tokens']} tokens of `{ev['ppl']}` (windows of {ev['window']}). One calibration seed "
            "and one pairing seed: the `paired` column is each arm's paired bootstrap against the "
            "original on per-window NLL (Holm-adjusted), so a difference is read only where its "
            "interval excludes 0."
        )
    lines.append("")
    for fixture, r in results.items():
        lines += [f"### {fixture}", ""]
        c = r.get("clamp")
        if c:
            base = c["rows"]["original fp32"]["ppl"]
            lines += [
                f"**What the bf16 exponent clamp changes** (exponent < 112, i.e. |w| < 2^-15 ≈ {2**-15:.2e}; "
                "fp32 compute, KL against the fp32 original):",
                "",
                "| weights | ppl | Δ ppl vs fp32 | KL to fp32 original | Δ ppl from the clamp | "
                "KL(unclamped ‖ clamped) |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            prev = None
            for name, v in c["rows"].items():
                if "kl_unclamped" not in v:
                    prev = v
                    extra = "| | |"
                else:
                    extra = f"| {v['ppl'] - prev['ppl']:+.2e} | {v['kl_unclamped']:.2e} |"
                lines.append(
                    f"| {name} | {v['ppl']:.5f} | {v['ppl'] - base:+.5f} | {_f(v.get('kl'), 3)} {extra}"
                )
            lines += [
                "",
                "| clamp applied to | values | changed | changed fraction | to 0 | to 2^-15 | max abs change | "
                "Σ\\|Δw\\| / Σ\\|w\\| |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for name, v in c["counts"].items():
                lines.append(
                    f"| {name} | {v['total']:,} | {v['changed']:,} | {v['changed_fraction']:.2e} | "
                    f"{v['to_zero']:,} | {v['to_min']:,} | {v['max_abs_change']:.2e} | "
                    f"{v['relative_l1_change']:.2e} |"
                )
            clamped = [v for v in c["rows"].values() if "kl_unclamped" in v]
            worst_kl = max(v["kl_unclamped"] for v in clamped)
            lines += [
                "",
                f"Reading: the clamp touches {c['counts']['experts (nearest)']['changed_fraction']:.1e} of the "
                f"expert weights and {c['counts']['W_merged (nearest)']['changed_fraction']:.1e} of the merged "
                f"magnitudes (a merged magnitude is the mean of two or the more salient one, so fewer tiny values survive); every rule changes the model by at "
                f"most KL {worst_kl:.1e} nats/token against its unclamped bf16 twin, "
                f"{c['rows']['experts bf16']['kl'] / worst_kl:,.0f}× less than bf16 rounding of the experts "
                f"costs (KL {c['rows']['experts bf16']['kl']:.1e}), and perplexity moves by at most "
                f"{max(abs(v['ppl'] - b['ppl']) for v, b in _pairs(c['rows'])):.1e}.",
            ]
            lines.append("")
        cp = r.get("compare")
        if cp:
            lines += [
                f"**Arms** (a bf16 copy of the fixture: routed experts {cp['routed_bytes']:,} B, checkpoint "
                f"{cp['original_disk']:,} B; every PuzzleMoE arm exported as `packed`, loaded back and evaluated "
                "on the same windows, KL against the bf16 original; lm-eval "
                + ", ".join(f"`{t}` ({n} items)" for t, n in cp.get("items", {}).items())
                + "; routed bytes = the `moecompress.scopes.*` tensors in the checkpoint; quant rows are "
                "the pure-quantization reference arms (`eval.quant_baselines`, GPTQ), sized as codes + scales; "
                "compress s = "
                "the method's wall time to build the plan and its packed tensors, export excluded):",
                "",
                "| arm | experts removed | routed bytes (fraction of bf16) | bits / weight | checkpoint bytes | "
                "ppl | KL | mc acc | gen em | compress s | paired vs original: ΔNLL [95 % CI], verdict |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
            ]
            for a in cp["arms"]:
                rb = (
                    f"{a['routed_bytes']:,} ({a['routed_fraction']:.3f})"
                    if a.get("routed_bytes") is not None
                    else "—"
                )
                disk = f"{a['disk']:,}" if a.get("disk") else "—"
                lines.append(
                    f"| {a['name']} | {_f(a.get('removed'), 3)} | {rb} | {_f(a.get('bits_per_weight'), 4)} | "
                    f"{disk} | {_f(a['ppl'])} | {_f(a['kl'], 3)} | "
                    f"{_f(a['mc'], 3)} | {_f(a['gen'], 3)} | {_f(a.get('compress_seconds'))} | "
                    f"{_paired(a.get('paired'))} |"
                )
            by = {a["name"]: a for a in cp["arms"]}
            refs = ("puzzle-50", "puzzle-50-evolve", "puzzle-50-q3", "quant-w3g128-gptq", "quant-w4g128-gptq")
            if set(refs) <= set(by):
                p50, ev, q3, r3, r4 = (by[k] for k in refs)
                lines += [
                    "",
                    f"Reading: puzzle-50 stores exactly {p50['routed_fraction']:.3f} of the bf16 routed bytes "
                    f"(KL {p50['kl']:.4f}); evolved pairs (proxy: channel-norm-weighted reconstruction error) give "
                    f"KL {ev['kl']:.4f} vs {p50['kl']:.4f} for random pairs; puzzle-50-q3 at "
                    f"{q3['bits_per_weight']:.2f} bits/weight has KL {q3['kl']:.4f} against {r3['kl']:.4f} for "
                    f"GPTQ 3-bit ({r3['bits_per_weight']:.2f} bits) and {r4['kl']:.4f} for GPTQ 4-bit "
                    f"({r4['bits_per_weight']:.2f} bits).",
                ]
            n_base = cp.get("baselines", sum(a["kind"] == "quant_baseline" for a in cp["arms"]))
            n_arms = sum(a["kind"] not in ("original", "quant_baseline") for a in cp["arms"])
            lines += [
                "",
                f"Whole comparison (calibration, {n_arms} arms, {n_base} baselines, evaluation): "
                f"{cp['seconds']} s.",
                "",
            ]
    lines += [
        "**GPU kernel table**: not measured — there is no GPU on the machine this benchmark ran on; "
        "`benchmarks/bench_puzzle_kernel.py` writes it where CUDA and Triton exist (the kernel's correctness is "
        "tested in Triton's CPU interpreter, see docs/puzzlemoe.md).",
        "",
    ]
    return "\n".join(lines) + "\n"


def _paired(c: dict | None) -> str:
    if not c:
        return "—"
    return f"{c['delta']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}], {c['verdict']}"


def _pairs(rows: dict):
    """(clamped row, its unclamped twin) for every clamped row, in table order."""
    prev = None
    for v in rows.values():
        if "kl_unclamped" in v:
            yield v, prev
        else:
            prev = v


def write_benchmarks(text: str, path: Path) -> None:
    from _bench_md import write_section

    write_section(SECTION, text, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", action="append", default=None)
    ap.add_argument("--out", type=Path, default=Path("build/bench_puzzle"))
    ap.add_argument("--part", choices=["all", "clamp", "compare"], default="all")
    ap.add_argument(
        "--report", type=Path, default=None, help="only render results-*.json files under this dir"
    )
    ap.add_argument("--write", action="store_true", help="update the BENCHMARKS.md section")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = args.out  # scratch: bf16 copies, compare reports
    res_dir = args.report or RESULTS / "puzzle"  # the committed results the report reads
    res_dir.mkdir(parents=True, exist_ok=True)
    if args.report is None:
        out.mkdir(parents=True, exist_ok=True)
        for fixture in args.fixture or ["qwen3-moe-tiny", "olmoe-tiny"]:
            file = res_dir / f"results-{Path(fixture).name}.json"
            res = json.loads(file.read_text()) if file.exists() else {}
            if args.part in ("all", "clamp"):
                res["clamp"] = run_clamp(fixture, out)
                file.write_text(json.dumps(res, indent=1))
            if args.part in ("all", "compare"):
                res["compare"] = run_compare_part(fixture, out)
                file.write_text(json.dumps(res, indent=1))
    results = {
        f.stem.removeprefix("results-"): json.loads(f.read_text())
        for f in sorted(res_dir.glob("results-*.json"))
    }
    text = markdown(results)
    print(text)
    if args.write:
        write_benchmarks(text, Path(__file__).resolve().parents[1] / "BENCHMARKS.md")


if __name__ == "__main__":
    main()
