"""Issue 31 item 4 (vLLM): bf16 hf exports of a pruned plan, loaded and greedily decoded inside vLLM's CPU build.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_vllm_cpu.py run   # -> benchmarks/results/vllm_cpu.json
    python benchmarks/bench_vllm_cpu.py report                         # BENCHMARKS.md section

Needs vLLM's CPU build in a virtualenv of its own (docs/export.md, "Checked inside vLLM (CPU)"): VLLM_VENV_PYTHON
(default build/vllm-venv/bin/python). The child, benchmarks/vllm/child.py, imports nothing from moecompress.

Per bf16 fixture: the original checkpoint and a 50 % REAP prune with renorm gates exported `--format hf`. The
prompts are windows of the fixture's held-out text (token ids, no tokenizer round trip). vLLM (eager, one batch,
EOS ignored) and transformers (this interpreter, the same checkpoint, `generate(do_sample=False)` one prompt at a
time, EOS ignored) each greedily generate the same number of new tokens, both in bf16 (what issue 31 asks) and
both in float32 (the control: bf16 rounding taken out); per prompt the two token sequences are compared, and where
they first differ, transformers' and vLLM's gaps between their two highest logits at that step are recorded (a
near-tie decided differently by two bf16 computations), with transformers' gap between its own token and vLLM's
and its top logit (for the bf16 spacing there). Load times: `LLM(...)` and `from_pretrained`, wall clock.
"""

from __future__ import annotations

import json
import math
import os
import platform
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

RESULTS = ROOT / "benchmarks" / "results" / "vllm_cpu.json"
SECTION = "## vLLM CPU: pruned hf exports (issue 31)"
FIXTURES = ("olmoe-tiny", "qwen3-moe-tiny")
CHILD = ROOT / "benchmarks" / "vllm" / "child.py"
CALIBRATION = dict(data="fixture-calib:64", seq_len=256, seed=0)
PRUNE = dict(criterion="reap", ratio=0.5, gate="renorm")
HELDOUT = "fixture-heldout"
PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 32, 32
THREADS = 2
# bf16 is what issue 31 asks about; float32 on both sides is the control that takes bf16 rounding out
DTYPES = ("bfloat16", "float32")


def vllm_env() -> tuple[str, dict]:
    """(the venv's python, the environment) the child runs with."""
    py = os.environ.get("VLLM_VENV_PYTHON", str(ROOT / "build" / "vllm-venv" / "bin" / "python"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS=str(THREADS),
        PYTHONNOUSERSITE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    return py, env


def child(*args) -> str:
    py, env = vllm_env()
    proc = subprocess.run(
        [py, str(CHILD), *map(str, args)], env=env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        sys.exit(
            f"vLLM child {args} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def prompts(model: str) -> list[list[int]]:
    from moecompress.data import load_tokenizer, token_stream

    ids = token_stream(HELDOUT, load_tokenizer(model)).ids.reshape(-1)
    return ids[: PROMPTS * PROMPT_LEN].reshape(PROMPTS, PROMPT_LEN).tolist()


def hf_generate(checkpoint: Path, batch: list[list[int]], dtype: str) -> dict:
    """transformers in `dtype`, greedy, one prompt at a time: the new tokens and every step's raw logits (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=0,
        eos_token_id=None,  # EOS ignored, as vLLM's ignore_eos: both run the full length
        pad_token_id=model.config.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    outs = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p], dtype=torch.long)
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            outs.append(
                dict(
                    tokens=g.sequences[0, len(p) :].tolist(),
                    logits=torch.stack([x[0].float() for x in g.logits]),
                )
            )
    return dict(load_s=load_s, generate_s=time.perf_counter() - t0, outputs=outs)


def compare(hf: dict, vl: dict) -> dict:
    """One prompt: equal or not, the first differing step and the logit gaps there."""
    import torch

    a, b = hf["tokens"], vl["tokens"]
    logits = hf["logits"]
    top2 = torch.topk(logits, 2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    row = dict(
        equal=a == b,
        first_diff=first,
        hf_min_top2_gap=min(gaps),
        hf_tokens=a,
        vllm_tokens=b,
    )
    if first is not None and first < min(len(a), len(b)):
        v2 = vl["top2"][first]
        row.update(
            hf_top2_gap=gaps[first],
            hf_gap_to_vllm_token=float(logits[first, a[first]] - logits[first, b[first]]),
            vllm_top2_gap=v2[0][1] - v2[1][1] if len(v2) > 1 else None,  # logprob gap = logit gap
            hf_top1_logit=float(logits[first, a[first]]),
        )
    return row


def run_checkpoint(arm: str, checkpoint: Path, batch: list[list[int]], work: Path, dtype: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    pfile, vfile = work / "prompts.json", work / f"vllm_{arm}_{dtype}.json"
    pfile.write_text(json.dumps(batch))
    child("generate", checkpoint, pfile, vfile, NEW_TOKENS, dtype)
    vl = json.loads(vfile.read_text())
    hf = hf_generate(checkpoint, batch, dtype)
    rows = [compare(h, v) for h, v in zip(hf["outputs"], vl["outputs"])]
    cfg = json.loads((checkpoint / "config.json").read_text())
    return dict(
        arm=arm,
        dtype=dtype,
        experts=next(cfg[k] for k in ("num_experts", "num_local_experts") if k in cfg),
        equal=sum(r["equal"] for r in rows),
        hf_load_s=round(hf["load_s"], 2),
        hf_generate_s=round(hf["generate_s"], 2),
        vllm_load_s=round(vl["load_s"], 2),
        vllm_import_s=round(vl["import_s"], 2),
        vllm_generate_s=round(vl["generate_s"], 2),
        prompts=rows,
    )


def run_fixture(fixture: str, out: Path) -> dict:
    import moecompress
    from moecompress.testing import fixture_dir

    model = fixture_dir(fixture)
    work = out / fixture
    t0 = time.perf_counter()
    pruned = work / "reap50-hf"
    moecompress.compress(
        str(model),
        "prune",
        PRUNE,
        calib=CALIBRATION["data"],
        seq_len=CALIBRATION["seq_len"],
        seed=CALIBRATION["seed"],
        out=pruned,
        format="hf",
        overwrite=True,
        progress=False,
    )
    batch = prompts(str(model))
    arms = [
        run_checkpoint(arm, path, batch, work, dtype)
        for dtype in DTYPES
        for arm, path in (("original", model), ("reap50", pruned))
    ]
    return dict(
        fixture=fixture,
        shape=model_shape(model),
        seconds=round(time.perf_counter() - t0, 1),
        prompt_ids_first=[p[:4] for p in batch],
        arms=arms,
    )


def run(fixtures, out: Path) -> None:
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(THREADS)
    results = dict(
        machine=dict(
            machine=machine(),
            platform=platform.platform(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            vllm_venv=json.loads(child("info")),
        ),
        calibration=CALIBRATION,
        prune=PRUNE,
        heldout=HELDOUT,
        prompts=PROMPTS,
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        threads=THREADS,
        dtypes=list(DTYPES),
        fixtures=kept_fixtures(RESULTS.name, {f: run_fixture(f, out) for f in fixtures}, FIXTURES),
    )
    save_results(RESULTS.name, results)


def _g(x, nd=3) -> str:
    return "—" if x is None else f"{x:.{nd}g}"


def _bf16_steps(gap: float, top: float) -> float:
    """`gap` in units of bf16's spacing at the magnitude of `top` (8 significant bits)."""
    return gap / 2.0 ** (math.floor(math.log2(abs(top))) - 7) if top else float("nan")


def _diffs(arm: dict) -> str:
    rows = [(i, r) for i, r in enumerate(arm["prompts"]) if not r["equal"]]
    if not rows:
        return "—"
    return "; ".join(
        f"#{i}: step {r['first_diff']}, gap {_g(r.get('hf_top2_gap'))} / {_g(r.get('vllm_top2_gap'))}"
        for i, r in rows
    )


def markdown(res: dict) -> str:
    mach = res["machine"]
    v = mach["vllm_venv"]
    p = res["prune"]
    lines = [
        SECTION,
        "",
        "Regenerate: `python -m benchmarks vllm-cpu` (results: `benchmarks/results/vllm_cpu.json`; needs vLLM's CPU "
        'build in `build/vllm-venv` as in docs/export.md, "Checked inside vLLM (CPU)").',
        "",
        f"Per bf16 fixture, the original checkpoint and a {100 * p['ratio']:g} % {p['criterion'].upper()} prune "
        f"with {p['gate']} gates exported `--format hf` (calibration `{res['calibration']['data']}`, sequence length "
        f"{res['calibration']['seq_len']}), loaded by vLLM's CPU build (vllm-cpu {v['vllm-cpu']}, torch "
        f"{v['torch']}, transformers {v['transformers']}, compressed-tensors {v['compressed-tensors']}; "
        "`LLM(dtype=..., skip_tokenizer_init=True, enforce_eager=True)`, in a process and virtualenv of its own) "
        f"and by transformers in this project's environment (transformers {mach['transformers']}, torch "
        f"{mach['torch']}, the same checkpoint in the same dtype). {res['prompts']} prompts, windows of "
        f"{res['prompt_len']} token ids of `{res['heldout']}`; each side greedily generates {res['new_tokens']} new "
        "tokens (vLLM: `SamplingParams(temperature=0)`, all prompts in one batch; transformers: "
        "`generate(do_sample=False)`, one prompt at a time; EOS ignored by both), in "
        + " and ".join(f"`{d}`" for d in res["dtypes"])
        + " (bf16 is the checkpoints' dtype and what issue 31 asks about; float32 on both sides is the control "
        "that takes bf16 rounding out). A prompt counts as equal when all its generated tokens are. Where a "
        "sequence differs, the first differing step is given with transformers' / vLLM's gap between their two "
        "highest logits at that step (logit units; 0 is an exact tie). Load: wall clock of `LLM(...)` (engine "
        "start included, import of vLLM not) and of `from_pretrained`. Machine: "
        f"{mach['machine']}, {mach['platform']}, {res['threads']} threads.",
        "",
        "| fixture | checkpoint | experts | dtype | prompts equal | first differences (prompt: step, gap "
        "transformers / vLLM) | smallest transformers top-2 gap | vLLM load | transformers load | vLLM generate "
        "(batch) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fx in res["fixtures"]:
        s = fx["shape"]
        for a in fx["arms"]:
            what = (
                "original"
                if a["arm"] == "original"
                else f"{100 * p['ratio']:g} % {p['criterion'].upper()}, {p['gate']}, hf export"
            )
            lines.append(
                f"| {fx['fixture']} ({s['model_type']}, top-{s['num_experts_per_tok']}) | {what} | "
                f"{a['experts']} | {a['dtype']} | {a['equal']} / {len(a['prompts'])} | {_diffs(a)} | "
                f"{_g(min(r['hf_min_top2_gap'] for r in a['prompts']))} | {a['vllm_load_s']:.1f} s | "
                f"{a['hf_load_s']:.2f} s | {a['vllm_generate_s']:.2f} s |"
            )
    arms = [(fx["fixture"], a) for fx in res["fixtures"] for a in fx["arms"]]
    pruned = [(f, a) for f, a in arms if a["arm"] != "original" and a["dtype"] == "bfloat16"]
    met = len(pruned) == len(FIXTURES) and all(a["equal"] == len(a["prompts"]) for _, a in pruned)
    bf16 = [r for _, a in arms if a["dtype"] == "bfloat16" for r in a["prompts"] if not r["equal"]]
    f32 = [(f, a) for f, a in arms if a["dtype"] == "float32"]
    lines += [
        "",
        "- Issue 31's done-when (vLLM-CPU greedy tokens equal transformers' for every prompt on a pruned bf16 "
        "export of each fixture): "
        + ("met" if met else "not met")
        + "; pruned bf16 exports: "
        + ", ".join(f"{f} {a['equal']} / {len(a['prompts'])}" for f, a in pruned)
        + ".",
    ]
    if bf16:
        steps = [_bf16_steps(r["hf_top2_gap"], r["hf_top1_logit"]) for r in bf16 if "hf_top2_gap" in r]
        lines.append(
            f"- In bf16, {len(bf16)} sequences differ (originals and prunes together); at their first differing "
            "step transformers' gap between its two highest logits is "
            + ", ".join(f"{x:g}" for x in sorted(steps))
            + " in units of bf16's spacing at that logit's magnitude (logits are bf16 values on both sides; "
            "0 is an exact tie)."
        )
    if f32:
        lines.append(
            "- Control, float32 on both sides: "
            + ", ".join(f"{f} {a['arm']} {a['equal']} / {len(a['prompts'])}" for f, a in f32)
            + (
                " prompts equal: with bf16 rounding taken out, vLLM and transformers generate the same tokens "
                "from every checkpoint here, the pruned exports included."
                if all(a["equal"] == len(a["prompts"]) for _, a in f32)
                else " prompts equal; where float32 sequences differ too, the table gives the steps and gaps."
            )
        )
    lines += [
        "- The smallest-gap column is the closest call transformers made in any generated step of any prompt: how "
        "near a tie the compared sequences came, equal or not.",
        "- Only bf16/float32 (unquantized) exports are compared here; quantized (compressed-tensors) exports are "
        "not part of this section.",
        "",
    ]
    return "\n".join(lines)


def report() -> None:
    write_section(SECTION, markdown(load_results(RESULTS.name)))


if __name__ == "__main__":
    fixture_main(__doc__, FIXTURES, run, report, ROOT / "build" / "bench_vllm_cpu")
