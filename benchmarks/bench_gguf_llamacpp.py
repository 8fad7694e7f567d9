"""Issue 31 item 4 (llama.cpp): every GGUF `--format gguf` writes, loaded and run inside llama.cpp itself.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_gguf_llamacpp.py run   # -> benchmarks/results/gguf_llamacpp.json
    python benchmarks/bench_gguf_llamacpp.py report                         # BENCHMARKS.md section

Needs llama.cpp's shared libraries and llama-cpp-python's pure-Python bindings, run in a virtualenv of their own
(docs/export.md, "Checked inside llama.cpp"): LLAMA_CPP_DIR (default /work/llama/llama_cpp_python-0.3.36, an
unpacked llama-cpp-python sdist whose vendor/llama.cpp was built with BUILD_SHARED_LIBS=ON), LLAMA_CPP_LIB_PATH
(default $LLAMA_CPP_DIR/vendor/llama.cpp/build/bin) and LLAMA_VENV_PYTHON (default build/llama-venv/bin/python).
The child, benchmarks/llamacpp/child.py, imports nothing from moecompress.

Per bf16 fixture and arm (the original; a 50 % REAP prune; RTN w8g32 / w4g32 of the experts, and of everything
`--quant-scope all` quantizes; the prune with w4g32): one plan, exported twice, `gguf` and `compact`. llama.cpp
computes every position's logits of held-out windows (token ids fed directly) from the GGUF; our runtime
(`moecompress.load` of the compact export, float32) from the same plan; KL(ours || llama.cpp) is averaged over
tokens. A control GGUF per arm holds exactly the weights the runtime computes with, as F32 (dequantized; the
experts as bf16(code·scale), which is what the runtime multiplies by), so llama.cpp's graph is checked apart from
its arithmetic on bf16/Q8_0/Q5_0/Q4_0 weights. Bytes: the GGUF's tensors and whole file against
`CompressionPlan.logical_bytes` plus any copy llama.cpp requires (a tied lm_head's output.weight for olmoe/qwen2moe).
Speed and memory: llama.cpp with 2 threads, prompt and greedy decode tokens/s and peak RSS, each run a fresh
process, arms alternating, medians over repeats.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._bench_md import (  # noqa: E402
    fixture_main,
    kept_fixtures,
    load_results,
    machine,
    model_shape,
    save_results,
    write_section,
)

RESULTS = ROOT / "benchmarks" / "results" / "gguf_llamacpp.json"
SECTION = "## GGUF inside llama.cpp (issue 31)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
CHILD = ROOT / "benchmarks" / "llamacpp" / "child.py"
CALIBRATION = dict(data="fixture-calib:64", seq_len=256, seed=0)
HELDOUT = "fixture-heldout"
WINDOWS, WINDOW = 16, 128
THREADS = 2
PROMPT, DECODE, REPEATS = 128, 128, 11
KL_TARGET, BYTES_TARGET = 1e-4, 0.01
NOISE = 1e-7  # relative, about float32's rounding (2^-24 = 6e-8)
DECODE_TARGET, RSS_TARGET = 1.3, 0.45
PRUNE = dict(criterion="reap", ratio=0.5, gate="renorm")
ALL8 = dict(
    scope="all", classes=dict(embeddings="w8g32", lm_head="w8g32")
)  # w8c (the scope's default): no GGUF type
# name -> (method, params, quant setting): every kind of GGUF the exporter writes from these fixtures
ARMS = {
    "original": ("quant", dict(quant=None), None),
    "reap50": ("prune", PRUNE, None),
    "w8": ("quant", dict(quant="w8g32", algo="rtn"), None),
    "w8-all": ("quant", dict(quant="w8g32", algo="rtn", **ALL8), None),
    "w5": ("quant", dict(quant="w5g32", algo="rtn"), None),
    "w4": ("quant", dict(quant="w4g32", algo="rtn"), None),
    "w4-all": ("quant", dict(quant="w4g32", algo="rtn", **ALL8), None),
    "reap50-w4": ("prune", PRUNE, dict(quant="w4g32", algo="rtn")),
    "reap50-w4-all": ("prune", PRUNE, dict(quant="w4g32", algo="rtn", **ALL8)),
}
QUANT_TYPES = ("Q8_0", "Q5_0", "Q4_0")  # the types the writer stores from our codes
SPEED_ARMS = ("original", "reap50-w4", "reap50-w4-all")
BASE, SMALL = "original", "reap50-w4-all"  # the side-by-side pair the targets are about
# llama.cpp's extra CPU buffer types (repacking, AMX) crashed on Q8_0/Q4_0 matmuls on an AMX machine here (probed
# below on every run): the fixtures' measurements run with them off (gguf-wide times both settings)
EXTRA_BUFTS = "off"


def llama_env(spin: bool = False) -> tuple[str, dict]:
    """(the venv's python, the environment) the child runs with. OpenMP threads wait passively (they share the
    machine with other jobs) unless `spin`: llama.cpp's default, which speed runs use. Passive waiting puts a
    futex wake-up on every one of a decode step's thread barriers: on the wide model it held decode at the same
    27.8 tokens/s for a 4.98 GB and a 0.73 GB file."""
    src = Path(os.environ.get("LLAMA_CPP_DIR", "/work/llama/llama_cpp_python-0.3.36"))
    lib = os.environ.get("LLAMA_CPP_LIB_PATH", str(src / "vendor" / "llama.cpp" / "build" / "bin"))
    py = os.environ.get("LLAMA_VENV_PYTHON", str(ROOT / "build" / "llama-venv" / "bin" / "python"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(src), LLAMA_CPP_LIB_PATH=lib, PYTHONNOUSERSITE="1")
    env.pop("OMP_WAIT_POLICY", None)  # this run's own setting is not inherited
    if not spin:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return py, env


def child(*args, check: bool = True, spin: bool = False) -> tuple[int, str]:
    py, env = llama_env(spin)
    proc = subprocess.run(
        [py, str(CHILD), *map(str, args)], env=env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    if check and proc.returncode != 0:
        sys.exit(
            f"llama.cpp child {args} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return proc.returncode, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def heldout_windows(model: str):
    import torch

    from moecompress.data import load_tokenizer, token_stream

    ids = token_stream(HELDOUT, load_tokenizer(model)).ids.reshape(-1)
    return ids[: WINDOWS * WINDOW].reshape(WINDOWS, WINDOW).to(torch.long)


def build_plan(model: str, arm: str, stats):
    from moecompress.workflows.pipeline import make_plan

    method, params, quant = ARMS[arm]
    if params.get("quant", "") is None:  # the original: the identity plan
        from moecompress.models import load_model
        from moecompress.plan import CompressionPlan

        return CompressionPlan.identity(load_model(model)), {}
    return make_plan(model, method, params, stats if method == "prune" else None, quant=quant)


def control_gguf(src: Path, dst: Path, runtime_rounding: bool = True) -> None:
    """`src` with every tensor as F32 holding the weights our runtime computes with: dequantized, and the expert stacks
    of a quantized type rounded through bf16 (the runtime's bf16(code·scale)); without `runtime_rounding`, exactly the
    file's weights."""
    import gguf
    import numpy as np
    import torch

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if runtime_rounding and "_exps." in t.name and t.tensor_type.name in QUANT_TYPES:
            w = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
        writer.add_tensor(t.name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def kl_stats(ours, theirs) -> dict:
    """KL(ours || llama.cpp) per token (float64), its mean and max, and top-1 agreement."""
    import torch

    a = torch.as_tensor(ours).double().log_softmax(-1)
    b = torch.as_tensor(theirs).double().log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1)
    q = torch.quantile(kl.flatten(), torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    return dict(
        kl=kl.mean().item(),
        kl_median=q[0],
        kl_p99=q[1],
        kl_max=kl.max().item(),
        window_kl=kl.mean(-1).tolist(),
        top1=(a.argmax(-1) == b.argmax(-1)).double().mean().item(),
    )


def gguf_facts(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    types = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return dict(
        file_bytes=path.stat().st_size,
        tensor_bytes=sum(types.values()),
        bytes_by_type=types,
        output_bytes=next((int(t.n_bytes) for t in reader.tensors if t.name == "output.weight"), 0),
        file_type=int(reader.fields["general.file_type"].contents()),
    )


def runtime_logits(compact: Path, ids, arithmetic: str, noise: float = 0.0):
    """Our runtime's float32 logits of `ids` from a compact export, computing with `arithmetic`; `noise`: the
    embeddings' output multiplied by 1 + noise·N(0, 1) (seeded), a perturbation of float rounding's size."""
    import torch

    from moecompress.api import load

    model = load(compact, dtype="float32", arithmetic=arithmetic)
    if noise:
        gen = torch.Generator().manual_seed(0)
        model.get_input_embeddings().register_forward_hook(
            lambda mod, args, out: out * (1 + noise * torch.randn(out.shape, generator=gen))
        )
    with torch.no_grad():
        return model(ids).logits.float()


def run_arm(model: str, fixture: str, arm: str, stats, ids, work: Path) -> dict:
    import numpy as np

    from moecompress.api import export

    d = work / fixture / arm
    t0 = time.perf_counter()
    plan, tensors = build_plan(model, arm, stats)
    written = export(model, plan, d / "gguf", format="gguf", tensors=tensors, overwrite=True, quiet=True)
    export(model, plan, d / "compact", format="compact", tensors=tensors, overwrite=True, quiet=True)
    ours, emulated = (runtime_logits(d / "compact", ids, a) for a in ("exact", "llama.cpp"))
    # how far float noise alone moves this plan's logits under that arithmetic: a floor for any second implementation
    noisy = runtime_logits(d / "compact", ids, "llama.cpp", noise=NOISE)
    np.save(d / "ids.npy", ids.numpy().astype(np.int32))
    gg = d / "gguf" / "model.gguf"
    row = dict(
        arm=arm,
        method=ARMS[arm][0],
        params=ARMS[arm][1],
        quant=ARMS[arm][2],
        plan_bytes=plan.logical_bytes(tensors).total,
        container_bytes=written.container_bytes,
        noise_kl=kl_stats(emulated, noisy),
        **gguf_facts(gg),
    )
    files = {"gguf": gg, "control": d / "control.gguf"}
    control_gguf(gg, files["control"])
    # the file's own weights, without the runtime's bf16 rounding
    if set(row["bytes_by_type"]) & set(QUANT_TYPES):
        files["exact"] = d / "exact.gguf"
        control_gguf(gg, files["exact"], runtime_rounding=False)
    cfg = json.loads((Path(model) / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings"))
    # llama.cpp's olmoe/qwen2moe graphs need output.weight: for a tied head that is a second copy of the embedding
    row.update(tied=tied, required_extra_bytes=row["output_bytes"] if tied else 0)
    for which, path in files.items():
        _, desc = child(
            "logits",
            path,
            d / "ids.npy",
            d / f"llama_{which}.npy",
            "--threads",
            THREADS,
            "--extra-bufts",
            EXTRA_BUFTS,
        )
        row[f"llama_{which}"] = json.loads(desc)
        row[f"{which}_kl"] = kl_stats(ours, np.load(d / f"llama_{which}.npy"))
        if which == "gguf":
            row["emulated_kl"] = kl_stats(emulated, np.load(d / "llama_gguf.npy"))
            # llama.cpp against itself: the same windows one token per call (its matrix-vector kernels)
            one = d / "llama_gguf_1by1.npy"
            child(
                "logits",
                path,
                d / "ids.npy",
                one,
                "--threads",
                THREADS,
                "--extra-bufts",
                EXTRA_BUFTS,
                "--batch",
                1,
            )
            row["self_kl"] = kl_stats(np.load(d / "llama_gguf.npy"), np.load(one))
            one.unlink()
        (d / f"llama_{which}.npy").unlink()
        if which != "gguf":
            path.unlink()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(
        f"[{fixture}] {arm}: KL {row['gguf_kl']['kl']:.3g} (emulated {row['emulated_kl']['kl']:.3g}, control "
        f"{row['control_kl']['kl']:.3g}), "
        f"tensors {row['tensor_bytes']} / plan {row['plan_bytes']}",
        flush=True,
    )
    return row


def probe_extra_bufts(d: Path, ids_path: Path) -> dict:
    """With llama.cpp's extra buffer types on (its default), a Q4_0 file of ours and one llama.cpp's own quantizer
    made from our bf16 file: the child's exit codes (negative: killed by that signal)."""
    q_ours = d / "w4-all" / "gguf" / "model.gguf"
    q_theirs = d / "llama-quantized-q4_0.gguf"
    child("quantize", d / "original" / "gguf" / "model.gguf", ids_path, q_theirs)
    out = {}
    for name, path in (("ours_w4-all", q_ours), ("llama_quantize_q4_0_of_original", q_theirs)):
        rc, _ = child("logits", path, ids_path, d / "probe.npy", "--extra-bufts", "on", check=False)
        out[name] = rc
    q_theirs.unlink()
    return out


def speed_runs(
    d: Path, ids, arms=SPEED_ARMS, repeats: int = REPEATS, spin: bool = True, extra_bufts: str = EXTRA_BUFTS
) -> dict:
    import numpy as np

    prompt = d / "prompt.npy"
    np.save(prompt, ids.reshape(-1)[:PROMPT].numpy().astype(np.int32))
    runs = {a: [] for a in arms}
    for r in range(repeats):
        order = arms if r % 2 == 0 else arms[::-1]  # alternate, and which goes first
        for arm in order:
            out = d / f"speed_{arm}_{extra_bufts}_{r}.json"
            load = os.getloadavg()[0]  # the machine is shared: its 1-minute load average as each run starts
            child(
                "speed",
                d / arm / "gguf" / "model.gguf",
                prompt,
                out,
                "--threads",
                THREADS,
                "--decode",
                DECODE,
                "--extra-bufts",
                extra_bufts,
                spin=spin,
            )
            res = json.loads(out.read_text())
            res.pop("model")
            runs[arm].append(dict(res, loadavg=load))
    summary = {}
    for arm, rs in runs.items():
        summary[arm] = {
            k: statistics.median(r[k] for r in rs)
            for k in (
                "prompt_tok_s",
                "decode_tok_s",
                "prompt_tok_s_wall",
                "decode_tok_s_wall",
                "peak_rss",
                "rss_start",
                "rss_loaded",
                "load_s",
            )
        }
        summary[arm]["greedy_first16"] = rs[0]["greedy"][:16]
    loads = [r["loadavg"] for rs in runs.values() for r in rs]
    return dict(
        omp_wait_policy="llama.cpp's default (spinning)" if spin else "PASSIVE",
        extra_bufts=extra_bufts,
        repeats=repeats,
        prompt_tokens=PROMPT,
        decode_tokens=DECODE,
        threads=THREADS,
        loadavg=dict(min=min(loads), median=statistics.median(loads), max=max(loads)),
        medians=summary,
        runs={a: [{k: v for k, v in r.items() if k != "greedy"} for r in rs] for a, rs in runs.items()},
    )


def run_fixture(fixture: str, work: Path) -> dict:
    from moecompress.testing import fixture_dir
    from moecompress.workflows.pipeline import needs_for, resolve_calibration

    model = str(fixture_dir(fixture))
    t0 = time.perf_counter()
    stats = resolve_calibration(
        model,
        CALIBRATION["data"],
        needs_for("prune", PRUNE),
        seq_len=CALIBRATION["seq_len"],
        seed=CALIBRATION["seed"],
        work_dir=work / fixture,
        progress=False,
    )
    ids = heldout_windows(model)
    arms = [run_arm(model, fixture, a, stats, ids, work) for a in ARMS]
    probe = probe_extra_bufts(work / fixture, work / fixture / "original" / "ids.npy")
    speed = speed_runs(work / fixture, ids)
    return dict(
        fixture=fixture,
        shape=model_shape(Path(model)),
        seconds=round(time.perf_counter() - t0, 1),
        arms=arms,
        extra_bufts_probe=probe,
        speed=speed,
    )


def run(fixtures, out: Path) -> None:
    import gguf
    import torch

    _, desc = child("info", "-", "-", "-")
    results = dict(
        machine=dict(
            machine=machine(),
            platform=platform.platform(),
            torch=torch.__version__,
            gguf=gguf.__version__ if hasattr(gguf, "__version__") else None,
            llama_cpp=json.loads(desc),
        ),
        calibration=CALIBRATION,
        heldout=HELDOUT,
        windows=WINDOWS,
        window=WINDOW,
        threads=THREADS,
        extra_bufts=EXTRA_BUFTS,
        targets=dict(kl=KL_TARGET, bytes=BYTES_TARGET, decode=DECODE_TARGET, rss=RSS_TARGET),
        pair=[BASE, SMALL],
        fixtures=kept_fixtures(RESULTS.name, {f: run_fixture(f, out) for f in fixtures}, FIXTURES),
    )
    save_results(RESULTS.name, results)


def _pct(x: float) -> str:
    return f"{100 * x:+.2f} %"


def _g(x, nd=3) -> str:
    return "—" if x is None else f"{x:.{nd}g}"


def _quant_words(arm: dict) -> str:
    q = arm["quant"] or (arm["params"] if arm["method"] == "quant" else None)
    parts = ["50 % REAP prune, renorm gates" if arm["method"] == "prune" else "all 16 experts"]
    if not q or q.get("quant") is None:
        return parts[0] + "; bf16"
    parts.append(f"experts {q['quant']} ({q['algo'].upper()})")
    if q.get("scope") == "all":
        cls = q.get("classes") or {}
        parts.append("attention " + q["quant"] + ", " + ", ".join(f"{k} {v}" for k, v in cls.items()))
    return "; ".join(parts)


def bytes_row(a: dict) -> tuple[float, float]:
    """(tensors / (plan + required copies) − 1, file / (plan + required copies + GGUF metadata) − 1)."""
    want = a["plan_bytes"] + a["required_extra_bytes"]
    return a["tensor_bytes"] / want - 1, a["file_bytes"] / (want + a["container_bytes"]) - 1


def markdown(res: dict) -> str:
    t = res["targets"]
    mach = res["machine"]
    lc = mach["llama_cpp"]
    lines = [
        SECTION,
        "",
        "Regenerate: `python -m benchmarks gguf-llamacpp` (results: `benchmarks/results/gguf_llamacpp.json`; "
        'needs llama.cpp built as in docs/export.md, "Checked inside llama.cpp").',
        "",
        f"Every kind of GGUF `--format gguf` writes from the two bf16 fixtures, loaded by llama.cpp "
        f"(llama-cpp-python {lc['llama_cpp_python']}'s bindings over the llama.cpp it vendors, built here; "
        f"`{lc['system_info']}`) in a process and virtualenv of its own. KL(ours ‖ llama.cpp), mean over "
        f"{res['windows']} windows × {res['window']} tokens of `{res['heldout']}` (token ids fed directly, each "
        "window from an empty context), where ours is `moecompress.load` of the same plan exported `compact`, in "
        "float32. The control is the same GGUF with every tensor F32, holding exactly the weights our runtime "
        "multiplies by (quantized experts as bf16(code·scale), the compressed-tensors convention; other "
        "quantized weights as code·scale): it checks llama.cpp's graph, names, layouts and router semantics "
        "apart from llama.cpp's arithmetic on bf16/Q8_0/Q5_0/Q4_0 weights (its CPU kernels round activations to "
        "bf16 for BF16 weights and quantize them to 8 bits per block of 32 for Q8_0/Q5_0/Q4_0). Quantized arms "
        "are round-to-nearest: the check is the file, and GPTQ's codes land on the same grid. "
        f"Machine: {mach['machine']}, {mach['platform']}, torch {mach['torch']}, {res['threads']} llama.cpp "
        f"threads, extra buffer types {res['extra_bufts']} (below). Targets: KL ≤ {t['kl']:g} per file; "
        f"GGUF within {100 * t['bytes']:g} % of the plan's bytes.",
        "",
    ]
    for fx in res["fixtures"]:
        s = fx["shape"]
        lines += [
            f"### {fx['fixture']} ({s['model_type']}, {s['num_hidden_layers']} layers, {s['num_experts']} "
            f"experts, top-{s['num_experts_per_tok']}, hidden {s['hidden_size']}; run "
            f"{fx['seconds'] / 60:.1f} min)",
            "",
            "| arm | weights | GGUF types | llama.cpp loads | KL | median token KL | max token KL | top-1 agree "
            "| KL, llama.cpp's arithmetic (median) | control KL (median) | exact-weights KL | plan bytes "
            "(+ GGUF metadata) | GGUF tensors | GGUF file |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for a in fx["arms"]:
            tb, fb = bytes_row(a)
            types = ", ".join(sorted(a["bytes_by_type"]))
            g, c, e = a["gguf_kl"], a["control_kl"], a["emulated_kl"]
            exact = _g(a["exact_kl"]["kl"]) if "exact_kl" in a else "—"
            lines.append(
                f"| {a['arm']} | {_quant_words(a)} | {types} | {a['llama_gguf']['desc']} | {_g(g['kl'])} | "
                f"{_g(g['kl_median'])} | {_g(g['kl_max'])} | {100 * g['top1']:.2f} % | {_g(e['kl'])} "
                f"({_g(e['kl_median'])}) | {_g(c['kl'])} ({_g(c['kl_median'])}) | {exact} | {a['plan_bytes']:,} "
                f"(+ {a['container_bytes']:,}) | {a['tensor_bytes']:,} ({_pct(tb)}) | {a['file_bytes']:,} ({_pct(fb)}) |"
            )
        lines += ["", *kl_lines(fx, t), *bytes_lines(fx, t), ""]
        lines += speed_lines(fx, t)
        probe = fx["extra_bufts_probe"]
        amx = "AMX_INT8 = 1" in res["machine"]["llama_cpp"]["system_info"]
        lines += [
            "",
            "- llama.cpp's extra CPU buffer types (its default; weight repacking"
            + (
                ", and on this AMX-capable CPU the AMX kernels for Q4_0/Q8_0"
                if amx
                else "; this CPU has no AMX"
            )
            + ") on, exit code of the logits run: "
            + "; ".join(f"{k} {v}" for k, v in probe.items())
            + (
                " (negative: killed by that signal; llama.cpp's own Q4_0 file fails the same way, so it is not "
                "the file). Every measurement above ran with them off (`use_extra_bufts = false`)."
                if all(v != 0 for v in probe.values())
                else " (0: ran). Every measurement above ran with them off (`use_extra_bufts = false`)."
            ),
            "",
        ]
    return "\n".join(lines)


def kl_lines(fx: dict, t: dict) -> list[str]:
    arms = fx["arms"]
    over = [a for a in arms if a["gguf_kl"]["kl"] > t["kl"]]
    emul_over = [a for a in arms if a["emulated_kl"]["kl"] > t["kl"]]
    ctrl = max(arms, key=lambda a: a["control_kl"]["kl"])
    worst = max(ctrl["control_kl"]["window_kl"])
    share = worst / (ctrl["control_kl"]["kl"] * len(ctrl["control_kl"]["window_kl"]))
    quant = [a for a in arms if "exact_kl" in a]
    out = [
        f"- llama.cpp loaded all {len(arms)} files and ran them. KL ≤ {t['kl']:g}: "
        + (
            "every file."
            if not over
            else f"{len(arms) - len(over)} of {len(arms)} files; not "
            + ", ".join(f"{a['arm']} ({_g(a['gguf_kl']['kl'])})" for a in over)
            + "."
        )
        + ' With our runtime computing as llama.cpp\'s kernels do (`load(..., arithmetic="llama.cpp")`: '
        "activations quantized to Q8_0 before Q8_0/Q5_0/Q4_0 weights and rounded to bf16 before BF16 ones, quantized "
        "weights exactly code·d, attention from an fp16 KV cache; docs/export.md): "
        + (
            "every file."
            if not emul_over
            else f"{len(arms) - len(emul_over)} of {len(arms)} files; not "
            + ", ".join(f"{a['arm']} ({_g(a['emulated_kl']['kl'])})" for a in emul_over)
            + "."
        )
        + " llama.cpp against itself (the same windows one token per call, its matrix-vector kernels, against one "
        "window per call): "
        + ", ".join(f"{a['arm']} {_g(a['self_kl']['kl'])}" for a in arms)
        + f". Our runtime computing as llama.cpp does against itself with the embeddings' output perturbed by "
        f"{NOISE:g} relative (seeded Gaussian; float32 rounds to 6e-8): "
        + ", ".join(f"{a['arm']} {_g(a['noise_kl']['kl'])}" for a in arms)
        + (
            ". Over the target with that arithmetic, beside the KL float-sized noise alone gives the same file: "
            + ", ".join(
                f"{a['arm']} {_g(a['emulated_kl']['kl'])} (noise {_g(a['noise_kl']['kl'])})"
                for a in emul_over
            )
            if emul_over
            else ""
        )
        + ". Median token KL with our runtime computing as llama.cpp does: "
        + ", ".join(f"{a['arm']} {_g(a['emulated_kl']['kl_median'])}" for a in arms)
        + f" (exact runtime: {_g(min(a['gguf_kl']['kl_median'] for a in arms))}–"
        f"{_g(max(a['gguf_kl']['kl_median'] for a in arms))}).",
        f"- Control (llama.cpp on the weights our runtime computes with, as F32): median token KL at most "
        f"{_g(max(a['control_kl']['kl_median'] for a in arms))} over the arms; the largest mean is {ctrl['arm']}'s "
        f"{_g(ctrl['control_kl']['kl'])}, of which its worst window carries {100 * share:.0f} % (max token KL "
        f"{_g(ctrl['control_kl']['kl_max'])}). The KL column and the control differ only in llama.cpp's arithmetic "
        "on the file's types.",
    ]
    if quant:
        out.append(
            "- Exact-weights KL (llama.cpp on the file's own weights as F32, no bf16 rounding of the experts' "
            "code·scale as our runtime does): per quantized arm "
            + ", ".join(
                f"{a['arm']} {_g(a['exact_kl']['kl'])} (control {_g(a['control_kl']['kl'])}, "
                f"file {_g(a['gguf_kl']['kl'])})"
                for a in quant
            )
            + ". By construction, the control and exact-weights arms differ only in our runtime's bf16 rounding "
            "of the dequantized experts (control minus exact-weights: "
            + ", ".join(f"{a['arm']} {_g(a['control_kl']['kl'] - a['exact_kl']['kl'])}" for a in quant)
            + "), and exact-weights and the file only in llama.cpp's arithmetic on the file's types (file minus "
            "exact-weights: "
            + ", ".join(f"{a['arm']} {_g(a['gguf_kl']['kl'] - a['exact_kl']['kl'])}" for a in quant)
            + ")."
        )
    return out


def bytes_lines(fx: dict, t: dict) -> list[str]:
    arms = fx["arms"]
    tb_bad = [a["arm"] for a in arms if abs(bytes_row(a)[0]) > t["bytes"]]
    fb_bad = [a["arm"] for a in arms if abs(bytes_row(a)[1]) > t["bytes"]]
    extra = [a["arm"] for a in arms if a["required_extra_bytes"]]
    header = [a["file_bytes"] - a["tensor_bytes"] for a in arms]
    return [
        "- Bytes: "
        + (
            "the output.weight copy of the tied embedding that llama.cpp requires is counted in the "
            "plan's side for " + ", ".join(extra)
            if extra
            else "this fixture's lm_head is not tied, so llama.cpp requires no extra copy"
        )
        + f". GGUF tensor data within {100 * t['bytes']:g} % of the plan's bytes: "
        + ("every file" if not tb_bad else "not " + ", ".join(tb_bad))
        + f"; the whole file within {100 * t['bytes']:g} %: "
        + (
            "every file"
            if not fb_bad
            else "no file"
            if len(fb_bad) == len(arms)
            else "not " + ", ".join(fb_bad)
        )
        + f". The file adds the header and alignment ({min(header) / 1e3:.0f}–{max(header) / 1e3:.0f} kB: "
        "metadata and the tokenizer with its merges) to the tensor data; llama.cpp reads the tokenizer "
        "from it, and its size does not grow with the model. The whole file is compared with the plan's bytes plus "
        "the GGUF metadata the export reports before writing any tensor (`ExportResult.container_bytes`: header, "
        f"hyperparameters, tokenizer; {min(a['container_bytes'] for a in arms):,}–"
        f"{max(a['container_bytes'] for a in arms):,} bytes here)."
    ]


def speed_lines(fx: dict, t: dict) -> list[str]:
    sp = fx["speed"]
    m = sp["medians"]
    base = m[BASE]
    lines = [
        f"Speed and memory in llama.cpp ({sp['threads']} threads, OpenMP waiting "
        f"{sp.get('omp_wait_policy', 'PASSIVE')}; prompt of {sp['prompt_tokens']} tokens in one "
        f"batch, then {sp['decode_tokens']} greedy tokens; every run a fresh process, arms alternating, medians "
        f"of {sp['repeats']}; tokens/s from llama.cpp's own timers, wall clock of the Python loop beside; peak RSS is "
        f"the process's VmHWM; the shared machine's 1-minute load average as runs started: median "
        f"{sp['loadavg']['median']:.1f}, {sp['loadavg']['min']:.1f}–{sp['loadavg']['max']:.1f}):",
        "",
        "| arm | prompt tok/s | decode tok/s | decode tok/s (wall) | peak RSS | RSS before load | ratio decode "
        "| ratio peak RSS | ratio RSS growth from load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, r in m.items():
        growth = (r["peak_rss"] - r["rss_start"]) / (base["peak_rss"] - base["rss_start"])
        lines.append(
            f"| {arm} | {r['prompt_tok_s']:.0f} | {r['decode_tok_s']:.0f} | {r['decode_tok_s_wall']:.0f} | "
            f"{r['peak_rss'] / 2**20:.1f} MiB | {r['rss_start'] / 2**20:.1f} MiB | "
            f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}× | {r['peak_rss'] / base['peak_rss']:.2f}× | "
            f"{growth:.2f}× |"
        )
    small = m[SMALL]
    dec = small["decode_tok_s"] / base["decode_tok_s"]
    rss = small["peak_rss"] / base["peak_rss"]
    growth = (small["peak_rss"] - small["rss_start"]) / (base["peak_rss"] - base["rss_start"])
    lines += [
        "",
        f"- {SMALL} against {BASE}: decode {dec:.2f}× (target ≥ {t['decode']:g}×: "
        f"{'met' if dec >= t['decode'] else 'missed'}), peak RSS {rss:.2f}× (target ≤ {t['rss']:g}×: "
        f"{'met' if rss <= t['rss'] else 'missed'}); the RSS the model adds to the process (peak minus the "
        f"interpreter's before loading) {growth:.2f}× ({'met' if growth <= t['rss'] else 'missed'} against the "
        f"same target). Of the original's {base['peak_rss'] / 2**20:.0f} MiB peak, {base['rss_start'] / 2**20:.0f} MiB "
        "are there before the model is loaded (the Python interpreter, numpy, llama.cpp's code); a decode step "
        f"reads at most the original's {fx['arms'][0]['tensor_bytes'] / 2**20:.1f} MiB of weights in "
        f"{1000 / base['decode_tok_s']:.2f} ms per token measured, so per-token fixed costs (graph, threads, "
        "activation quantization) weigh far more here than on a real model, whose decode time is dominated by "
        "reading GBs of weights: these ratios are this tiny model's, not a forecast for a real one.",
    ]
    return lines


def report() -> None:
    write_section(SECTION, markdown(load_results(RESULTS.name)))


if __name__ == "__main__":
    fixture_main(__doc__, FIXTURES, run, report, ROOT / "build" / "bench_gguf_llamacpp")
