"""Issue 31 benchmark: `auto --target llama.cpp` against llama.cpp's own quantization pipeline, KL measured by
llama.cpp itself, at the file sizes of llama.cpp's types.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_gguf_head2head.py run   # -> benchmarks/results/gguf_head2head.json
    python benchmarks/bench_gguf_head2head.py report                         # BENCHMARKS.md section + frontier plot

Per bf16 fixture:

* **llama.cpp's pipeline**: the original as a bf16 GGUF, `llama-imatrix` on the calibration text (the same
  `fixture-calib:64` sequences of 256 tokens, decoded to text; 64 chunks of 256), then `llama-quantize --imatrix`
  at Q8_0, Q4_K_M, Q3_K_M, Q2_K, IQ2_XXS and IQ1_M. llama.cpp's converter refuses the fixtures' custom BPE
  tokenizer (../shared/notes/llama-cpp-and-vllm-cpu.md), so the bf16 GGUF is our writer's identity export, which
  the "GGUF inside llama.cpp" section checks against our runtime inside llama.cpp.
* **ours**: `auto --target llama.cpp` (one expert count, one Q8_0 / Q5_0 / Q4_0 / bf16 type per layer tensor, the whole
  file in the budget) with the budget set to each llama.cpp file's weight bytes, minus what our writer adds to
  the plan's bytes on the identity (F32 norms and routers, the metadata: measured on the bf16 GGUF); and
  llama.cpp's quantizer fed with *our* importance matrix (`compress --imatrix`) at the same types, which shows
  whether one calibration can serve both.

Every GGUF is evaluated inside llama.cpp (llama-cpp-python's bindings in their own virtualenv, the child of the
"GGUF inside llama.cpp" benchmark) on held-out windows from an empty context; KL(bf16 GGUF ‖ arm) per window.
At each llama.cpp type, `auto` is paired with that type (bootstrap over windows, Holm over the fixture's
comparisons), only where its file is no larger.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks._bench_md import (  # noqa: E402
    fixture_main,
    frontier_plot,
    kept_fixtures,
    load_results,
    save_results,
    write_section,
)

RESULTS = ROOT / "benchmarks" / "results" / "gguf_head2head.json"
PLOT = ROOT / "benchmarks" / "results" / "gguf_head2head_frontier.png"
SECTION = "## GGUF head to head with llama.cpp's quantizer (issue 31)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
CALIB, SEQ_LEN, CHUNKS = "fixture-calib:64", 256, 64
TYPES = ("Q8_0", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ2_XXS", "IQ1_M")
PAIRED = ("Q4_K_M", "Q3_K_M", "Q2_K", "IQ2_XXS")  # the done-when types
WINDOWS, WINDOW = 32, 128
THREADS = 2


def tool(name: str) -> list[str]:
    from bench_gguf_llamacpp import llama_env

    _, env = llama_env()
    return [str(Path(env["LLAMA_CPP_LIB_PATH"]) / name)]


def run_tool(args: list, log: Path) -> None:
    from bench_gguf_llamacpp import llama_env

    _, env = llama_env()
    env["LD_LIBRARY_PATH"] = env["LLAMA_CPP_LIB_PATH"]
    with open(log, "w") as fh:
        rc = subprocess.run([str(a) for a in args], env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"{args[0]} failed (exit {rc}); see {log}")


def calibration_text(model: str, path: Path) -> None:
    """The calibration sequences our side uses, decoded to text for llama-imatrix (which tokenizes it again)."""
    from moecompress.data import load_calibration, load_tokenizer

    tok = load_tokenizer(model)
    data = load_calibration(CALIB, tok, SEQ_LEN, 0)
    path.write_text("".join(tok.decode(row.tolist()) for row in data.input_ids))


def windows(model: str):
    import torch

    from moecompress.data import load_tokenizer, token_stream

    ids = token_stream("fixture-heldout", load_tokenizer(model)).ids.reshape(-1)
    return ids[: WINDOWS * WINDOW].reshape(WINDOWS, WINDOW).to(torch.long)


def logits(gguf_path: Path, ids_path: Path, out: Path):
    import numpy as np
    from bench_gguf_llamacpp import child

    child(
        "logits", gguf_path, ids_path, out, "--threads", THREADS, "--extra-bufts", "off"
    )  # as the GGUF check does
    x = np.load(out)
    out.unlink()
    return x


def identity_gguf(model: str, d: Path) -> tuple[Path, Path]:
    """(statistics store, bf16 identity export) under `d`: our calibration and the original as our writer's bf16
    GGUF with our importance matrix."""
    import moecompress
    from moecompress.export.imatrix import EXPERT_STATS

    stats, orig = d / "stats", d / "bf16"
    moecompress.calibrate(
        model, CALIB, out=stats, for_method="auto", seq_len=SEQ_LEN, progress=False, stats=list(EXPERT_STATS)
    )
    moecompress.compress(
        model,
        "auto",
        {"budget": 1.0, "search": "full"},
        calib=str(stats),
        out=orig,
        format="gguf",
        imatrix=True,
        progress=False,
    )
    return stats, orig


def llama_imatrix(model: str, original_gguf: Path, d: Path) -> None:
    """`llama-imatrix` on the calibration text our side uses, into ``d/llama_imatrix.gguf``."""
    calibration_text(model, d / "calib.txt")
    args = ["-m", original_gguf, "-f", d / "calib.txt", "-c", SEQ_LEN, "--chunks", CHUNKS]
    run_tool(
        [*tool("llama-imatrix"), *args, "-o", d / "llama_imatrix.gguf", "-t", THREADS], d / "imatrix.log"
    )


def window_kl(ref, x) -> list[float]:
    import torch

    a = torch.as_tensor(ref).double().log_softmax(-1)
    b = torch.as_tensor(x).double().log_softmax(-1)
    return (a.exp() * (a - b)).sum(-1).mean(-1).tolist()


def run_fixture(fixture: str, work: Path) -> dict:
    import numpy as np

    import moecompress
    from moecompress.disk import stored_tensors
    from moecompress.testing import fixture_dir

    model = str(fixture_dir(fixture))
    d = work / fixture
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    ids = windows(model)
    np.save(d / "ids.npy", ids.numpy().astype(np.int32))
    stats, orig = identity_gguf(model, d)
    original_gguf = orig / "model.gguf"
    ref = logits(original_gguf, d / "ids.npy", d / "ref.npy")
    whole = sum(n for _, n in stored_tensors(model).values())
    overhead = (
        original_gguf.stat().st_size - whole
    )  # what our writer adds to the plan's bytes (F32 norms, metadata)
    llama_imatrix(model, original_gguf, d)
    arms = [
        dict(
            name="bf16",
            family="original",
            file_bytes=original_gguf.stat().st_size,
            kl=0.0,
            window_kl=[0.0] * WINDOWS,
        )
    ]
    for t in TYPES:
        for fam, imx in (
            ("llama.cpp (its imatrix)", d / "llama_imatrix.gguf"),
            ("llama.cpp (our imatrix)", orig / "imatrix.gguf"),
        ):
            out = d / f"{t}-{'ours' if 'our' in fam else 'llama'}.gguf"
            run_tool(
                [*tool("llama-quantize"), "--imatrix", imx, original_gguf, out, t, THREADS],
                d / f"{out.stem}.log",
            )
            wk = window_kl(ref, logits(out, d / "ids.npy", d / "x.npy"))
            arms.append(
                dict(
                    name=f"{t} ({'our' if 'our' in fam else 'its'} imatrix)",
                    family=fam,
                    type=t,
                    written=written_types(out),
                    file_bytes=out.stat().st_size,
                    kl=float(np.mean(wk)),
                    window_kl=wk,
                )
            )
            out.unlink()
        llama = next(a for a in arms if a.get("type") == t and a["family"] == "llama.cpp (its imatrix)")
        budget = llama["file_bytes"] - overhead
        dest = d / f"auto-{t}"
        t0 = time.perf_counter()
        try:
            moecompress.compress(
                model,
                "auto",
                {"budget": f"{budget}B", "search": "full"},
                calib=str(stats),
                out=dest,
                target="llama.cpp",
                progress=False,
            )
        except (
            moecompress.MoECompressError
        ) as exc:  # below what llama.cpp's types reach with Q4_0 and pruning
            arms.append(dict(name=f"auto @ {t}", family="auto --target llama.cpp", type=t, refused=str(exc)))
            continue
        seconds = time.perf_counter() - t0
        wk = window_kl(ref, logits(dest / "model.gguf", d / "ids.npy", d / "x.npy"))
        arms.append(
            dict(
                name=f"auto @ {t}",
                family="auto --target llama.cpp",
                type=t,
                file_bytes=(dest / "model.gguf").stat().st_size,
                kl=float(np.mean(wk)),
                window_kl=wk,
                compress_seconds=round(seconds, 1),
            )
        )
        print(
            f"[{fixture}] {t}: llama.cpp {llama['file_bytes']} B KL {llama['kl']:.4g}; auto "
            f"{arms[-1]['file_bytes']} B KL {arms[-1]['kl']:.4g}",
            flush=True,
        )
    return dict(
        fixture=fixture,
        original_bytes=whole,
        gguf_overhead=overhead,
        windows=WINDOWS,
        window=WINDOW,
        arms=arms,
    )


def tensor_class(name: str) -> str:
    """The class of a GGUF tensor, from llama.cpp's tensor names."""
    base = name.rsplit(".", 1)[0].split(".")[-1] if name.startswith("blk.") else name.split(".")[0]
    if base.endswith("_norm") or base.endswith("norm"):
        return "norms"
    if base == "token_embd":
        return "embeddings"
    if base == "output":
        return "output"
    if base.startswith("attn_"):
        return "attention"
    if base == "ffn_gate_inp":
        return "router"
    if base.endswith("_exps"):
        return "experts"
    if base.endswith("_shexp"):
        return "shared experts"
    return "other"


def written_types(path: Path) -> dict[str, dict[str, int]]:
    """What a GGUF file really holds: tensor class -> {GGML type: tensor count}, read back with `gguf`'s reader."""
    import gguf

    out: dict[str, dict[str, int]] = {}
    for t in gguf.GGUFReader(path).tensors:
        kind = out.setdefault(tensor_class(t.name), {})
        kind[t.tensor_type.name] = kind.get(t.tensor_type.name, 0) + 1
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def holds(arm: dict) -> str:
    """An arm named by what its file holds: the quantizable classes' types (norms and routers stay F32)."""
    w = arm.get("written")
    if not w:
        return "not recorded"
    return "; ".join(f"{k} {'/'.join(v)}" for k, v in w.items() if k not in ("norms", "router"))


def fell_back(arm: dict) -> bool:
    """Whether llama-quantize wrote none of the requested type's own block types (a K-/i-quant request whose rows
    were not a multiple of its super-block). A mix (Q4_K_M writes Q4_K and Q6_K) counts as written."""
    w = arm.get("written") or {}
    family = arm["type"].split("_")[0]  # "Q4" of Q4_K_M, "IQ2" of IQ2_XXS
    return bool(w) and not any(t.startswith(family) for v in w.values() for t in v)


def label(arm: dict) -> str:
    """A llama.cpp arm named by what its file holds: the experts' types, and the request when it fell back."""
    imatrix = "our imatrix" if "our" in arm["family"] else "its imatrix"
    experts = "/".join((arm.get("written") or {}).get("experts", {}))
    if not experts:
        return f"llama-quantize {arm['type']} ({imatrix}; types not recorded)"
    if fell_back(arm):
        return f"experts {experts} (llama-quantize {arm['type']} fell back; {imatrix})"
    return f"experts {experts} (llama-quantize {arm['type']}; {imatrix})"


def record_types(fixtures, work: Path) -> None:
    """Re-create llama-quantize's files (the same bf16 GGUF, calibration, importance matrices, paths and commands as
    `run`) and record the types each holds in the committed results. Which type llama-quantize writes depends on
    the requested type and the tensors' shapes, not on the matrices' values, and each file's bytes must equal the
    measured one's up to one 32-byte alignment step of metadata, so these are the measured files' types; refused
    otherwise."""
    from moecompress.testing import fixture_dir

    res = load_results(RESULTS.name)
    for fx in res["fixtures"]:
        if fx["fixture"] not in fixtures:
            continue
        model = str(fixture_dir(fx["fixture"]))
        d = work / fx["fixture"]  # the paths `run` used: llama-quantize records the matrix's file name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        stats, orig = identity_gguf(model, d)
        llama_imatrix(model, orig / "model.gguf", d)
        for a in fx["arms"]:
            if not a["family"].startswith("llama.cpp"):
                continue
            ours = "our" in a["family"]
            out = d / f"{a['type']}-{'ours' if ours else 'llama'}.gguf"
            imatrix = orig / "imatrix.gguf" if ours else d / "llama_imatrix.gguf"
            run_tool(
                [*tool("llama-quantize"), "--imatrix", imatrix, orig / "model.gguf", out, a["type"], THREADS],
                d / f"{out.stem}.log",
            )
            # metadata strings (the matrices' names and datasets) move the tensor data by at most one 32-byte
            # alignment step; a different type on any tensor moves it by far more
            if abs(out.stat().st_size - a["file_bytes"]) > 32:
                sys.exit(
                    f"{fx['fixture']} {a['name']}: re-quantized file has {out.stat().st_size} bytes, the "
                    f"measured one {a['file_bytes']}; run the whole section instead."
                )
            a["written"] = written_types(out)
            out.unlink()
    save_results(RESULTS.name, res)


def compare(fx: dict) -> list[dict]:
    from moecompress.eval.stats import apply_holm, paired_bootstrap

    ids = list(range(fx["windows"]))
    comps = []
    for t in PAIRED:
        a = next((x for x in fx["arms"] if x.get("type") == t and x["family"].startswith("auto")), None)
        b = next(x for x in fx["arms"] if x.get("type") == t and x["family"] == "llama.cpp (its imatrix)")
        if a is None or "window_kl" not in a or a["file_bytes"] > b["file_bytes"]:
            continue
        c = paired_bootstrap(
            ids, a["window_kl"], ids, b["window_kl"], metric="kl", higher_is_better=False, B=4000, seed=0
        ).to_dict()
        c.pop("per_task", None)
        comps.append(dict(c, type=t, auto=a, rival=b, kl_ratio=a["kl"] / b["kl"] if b["kl"] else None))
    apply_holm(comps, 0.05)
    return comps


def run(fixtures, out: Path) -> None:
    import torch

    results = dict(
        machine=dict(platform=platform.platform(), torch=torch.__version__, cpu=os.cpu_count()),
        calib=CALIB,
        seq_len=SEQ_LEN,
        chunks=CHUNKS,
        threads=THREADS,
        fixtures=kept_fixtures(RESULTS.name, {f: run_fixture(f, out) for f in fixtures}, FIXTURES),
    )
    save_results(RESULTS.name, results)


def _g(x, nd=3):
    return "—" if x is None else f"{x:.{nd}g}"


def plot(res: dict) -> None:
    panels = {}
    for fx in res["fixtures"]:
        series: dict[str, list] = {}
        for a in fx["arms"]:
            if a["family"] != "original" and a.get("kl"):
                series.setdefault(a["family"], []).append((a["file_bytes"] / fx["original_bytes"], a["kl"]))
        panels[fx["fixture"]] = series
    frontier_plot(
        panels, "GGUF file bytes / original weights", "KL to the bf16 GGUF (held-out, in llama.cpp)", PLOT
    )


def imatrix_and_fallback_lines(fx: dict) -> list[str]:
    """Our importance matrix against llama-imatrix's (KL ratio per type), and the types whose files came out the
    same size (llama-quantize's fallbacks where a row is not a multiple of its 256-weight super-block)."""
    from benchmarks._bench_md import model_shape
    from moecompress.testing import fixture_dir

    by = {(a["family"], a.get("type")): a for a in fx["arms"] if "kl" in a}
    ratios = [
        f"{t} {by[('llama.cpp (our imatrix)', t)]['kl'] / by[('llama.cpp (its imatrix)', t)]['kl']:.4f}"
        for t in TYPES
        if ("llama.cpp (our imatrix)", t) in by and by[("llama.cpp (its imatrix)", t)]["kl"]
    ]
    sizes: dict[int, list[str]] = {}
    for t in TYPES:
        a = by.get(("llama.cpp (its imatrix)", t))
        if a is not None:
            sizes.setdefault(a["file_bytes"], []).append(t)
    same = [", ".join(ts) for ts in sizes.values() if len(ts) > 1]
    hidden = model_shape(fixture_dir(fx["fixture"]))["hidden_size"]
    lines = [
        "",
        "KL with our importance matrix over KL with llama-imatrix's, same type: " + "; ".join(ratios) + ".",
    ]
    if same:
        lines.append(
            f"Types whose files have the same bytes: {'; '.join(same)} (the hidden size is {hidden}; "
            "llama-quantize writes a fallback type for rows that are not a multiple of its 256-weight "
            "super-blocks)."
        )
    return lines


def report() -> None:
    res = load_results(RESULTS.name)
    lines = [
        SECTION,
        "",
        f"Generated by `python -m benchmarks gguf` ({Path(__file__).name}); results "
        f"`benchmarks/results/{RESULTS.name}`, plot `benchmarks/results/{PLOT.name}`. Calibration `{res['calib']}` "
        f"at {res['seq_len']} tokens for both sides ({res['chunks']} llama-imatrix chunks); KL to the bf16 GGUF "
        f"measured inside llama.cpp ({res['threads']} threads) on held-out windows; file bytes over the original "
        f"checkpoint's weights. Machine: {res['machine']['platform']}, torch {res['machine']['torch']}.",
        "",
    ]
    words = {"A better": "auto lower", "B better": "auto higher"}
    for fx in res["fixtures"]:
        whole = fx["original_bytes"]
        lines += [
            f"### {fx['fixture']}",
            "",
            f"{fx['windows']} windows of {fx['window']} tokens.",
            "",
            "Each llama.cpp arm is named by the experts' types its file holds, then the `llama-quantize` type "
            "argument that produced it; *holds* lists every tensor class's types, read back with `gguf`'s reader. "
            "Where no tensor holds the requested type, the arm says the request fell back (llama-quantize writes a "
            "fallback type for rows that are not a multiple of the requested type's block).",
            "",
            "| arm | family | holds | file ratio | KL |",
            "| --- | --- | --- | --- | --- |",
        ]
        for a in sorted(fx["arms"], key=lambda a: -a.get("file_bytes", 0)):
            if "refused" in a:
                lines.append(f"| {a['name']} | {a['family']} | — | — | refused: {a['refused']} |")
                continue
            name = label(a) if a["family"].startswith("llama.cpp") else a["name"]
            held = holds(a) if a["family"].startswith("llama.cpp") else "—"
            lines.append(
                f"| {name} | {a['family']} | {held} | {a['file_bytes'] / whole:.3f} | {_g(a['kl'])} |"
            )
        lines += imatrix_and_fallback_lines(fx)
        lines += [
            "",
            "Pairing rule: at each requested type, `auto` at that type's file size against llama-quantize's file "
            "with llama-imatrix's matrix, only where `auto`'s file is no larger.",
            "",
            "| requested type | llama.cpp's file holds | its file ratio | auto's file ratio | KL ratio auto / llama.cpp "
            "| Δ KL [95 % CI] | Holm p | verdict |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in compare(fx):
            held = holds(c["rival"]) + (" (fell back: no " + c["type"] + ")" if fell_back(c["rival"]) else "")
            lines.append(
                f"| {c['type']} | {held} | {c['rival']['file_bytes'] / whole:.3f} | "
                f"{c['auto']['file_bytes'] / whole:.3f} | {_g(c['kl_ratio'])} | {_g(c['delta'])} [{_g(c['ci_low'])}, "
                f"{_g(c['ci_high'])}] | {_g(c.get('p_adjusted'))} | "
                f"{words.get(c['verdict'], 'not detectably different')} |"
            )
        lines.append("")
    plot(res)
    write_section(SECTION, "\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == [
        "types"
    ]:  # `types [FIXTURE ...]`: record the written types into the committed results
        record_types(sys.argv[2:] or FIXTURES, ROOT / "build" / "bench_gguf_head2head")
    else:
        fixture_main(__doc__, FIXTURES, run, report, ROOT / "build" / "bench_gguf_head2head")
