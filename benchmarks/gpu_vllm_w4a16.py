"""W4A16 MoE exports inside vLLM on a CUDA GPU (issue 31): one command, exit 0 when vLLM agrees with transformers.

    python benchmarks/gpu_vllm_w4a16.py [--json PATH] [--work DIR] [--new-tokens 16] [--case NAME ...]

Needs a CUDA GPU and vLLM (docs/export.md, "W4A16 MoE in vLLM (GPU)"). vLLM runs in a child process started with
VLLM_PYTHON (default: this interpreter), so it may live in a virtualenv of its own: vLLM pins older transformers
and compressed-tensors than moecompress. Without a CUDA device or vLLM there it prints one sentence and exits 2.

Per case: `moecompress compress SOURCE --method quant --quant w4gG --quant-algo rtn --format hf` (4-bit symmetric
integer experts in groups of G, compressed-tensors pack-quantized; RTN, as the check is of vLLM's kernels, not of
GPTQ), then
  * vLLM (bf16, `enforce_eager`, token ids in) greedily generates NEW_TOKENS tokens for 8 fixed prompts, in one
    batch, EOS ignored, with the logprob of every token it picks;
  * transformers (this interpreter, CPU, float32, the same export: compressed-tensors dequantizes the experts)
    scores each prompt followed by vLLM's tokens in one forward pass.
A prompt passes when transformers' greedy choice equals vLLM's token at every step (then transformers' own greedy
decoding produces the same tokens), or where they first differ, transformers' top choice beats vLLM's token by at
most --gap-tol (a near tie that bf16 arithmetic may break either way); and vLLM's logprob of its token is within
--max-lp-tol of transformers' at every step and within --mean-lp-tol on average. Results go to --json (default
benchmarks/results/gpu_vllm_w4a16.json); exit 0 if every prompt of every case passes, 1 otherwise, 2 when the
machine lacks CUDA or vLLM.

Group size: vLLM's compressed-tensors MoE method for W4A16 (`CompressedTensorsWNA16MarlinMoEMethod`) needs the
hidden size and the expert width divisible by the group, and its Marlin MoE kernel also hidden % 128 == 0 and
width % max(64, group) == 0 with group in {-1, 32, 64, 128} (`check_moe_marlin_supports_layer`, vLLM 0.33 and
main); otherwise vLLM picks another WNA16 MoE kernel (which one depends on its version: the results record the MoE
layers' method class and vLLM's log lines about MoE). The shipped fixtures have hidden size 192 (qwen3-moe-tiny:
expert width 128; olmoe-tiny: 96), so w4g128 is impossible on them (192 % 128; moecompress's hf export refuses it
too) and neither has Marlin's shape: they run at the largest group dividing both, w4g64 and w4g32. The third case,
qwen3-moe-wide, is qwen3-moe-tiny zero-padded to hidden size and expert width 256 (`build_wide`: the same function,
trained weights, not a random model), at w4g128 in Marlin's shape.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_vllm_w4a16.json"
NEEDS = "benchmarks/gpu_vllm_w4a16.py needs a CUDA GPU and vllm"
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In the beginning God created",
    "The quick brown fox",
    "A list in Python is",
    "Once upon a time, there was",
    "The meaning of the word 'cynic' is",
    "1, 2, 3, 4, 5,",
)
GROUPS = (128, 64, 32)  # the W4A16 group sizes tried, largest first
MARLIN_GROUPS = (-1, 32, 64, 128)
CASES = {  # name: (source, group or None for the largest that vLLM accepts)
    "qwen3-moe-tiny": ("fixture:qwen3-moe-tiny", None),
    "olmoe-tiny": ("fixture:olmoe-tiny", None),
    "qwen3-moe-wide": ("wide", 128),
}
WIDE = 256  # hidden size and expert width of the padded case (build_wide)
CHILD_TIMEOUT_S = 150  # per vLLM start and generation; three cases stay inside an 8-minute run


# ----------------------------------------------------------------------------- pure helpers
def largest_group(dims, groups=GROUPS) -> int | None:
    """The largest group size of `groups` dividing every dimension (vLLM's W4A16 MoE and our hf export need it)."""
    return next((g for g in groups if all(d % g == 0 for d in dims)), None)


def marlin_moe_ok(hidden: int, width: int, group: int) -> bool:
    """vLLM's `check_moe_marlin_supports_layer` (shape and group; tensor parallel size 1)."""
    return hidden % 128 == 0 and width % max(64, group) == 0 and group in MARLIN_GROUPS


def compare_prompt(vllm_tokens, vllm_lps, tf_top, tf_top_lps, tf_lps, tol: dict) -> dict:
    """One prompt: vLLM's greedy tokens and their logprobs against transformers' scores of the same sequence (its
    top token and top logprob at every step, and its logprob of vLLM's token). `tol`: ``gap`` (a first difference
    where transformers' top beats vLLM's token by at most this passes), ``max_lp`` and ``mean_lp`` (largest and
    mean |vLLM − transformers| logprob of vLLM's tokens)."""
    n = len(vllm_tokens)
    if not (len(vllm_lps) == len(tf_top) == len(tf_top_lps) == len(tf_lps) == n):
        raise ValueError("the per-step lists differ in length")
    first = next((i for i in range(n) if tf_top[i] != vllm_tokens[i]), None)
    gap = None if first is None else float(tf_top_lps[first] - tf_lps[first])
    dlp = [abs(float(a) - float(b)) for a, b in zip(vllm_lps, tf_lps)]
    max_dlp, mean_dlp = max(dlp, default=0.0), (sum(dlp) / n if n else 0.0)
    tokens_ok = first is None or gap <= tol["gap"]
    return {
        "equal": first is None,
        "first_diff": first,
        "gap_at_first_diff": gap,
        "max_abs_dlogprob": max_dlp,
        "mean_abs_dlogprob": mean_dlp,
        "ok": bool(tokens_ok and max_dlp <= tol["max_lp"] and mean_dlp <= tol["mean_lp"]),
    }


def problem_of(probe: dict | None, python: str) -> str | None:
    """Why the vLLM side cannot run (None when it can), from the child's probe."""
    if probe is None:
        return f"{python} could not be run to look for them"
    vllm = "no vllm" if not probe.get("vllm_error") else f"vllm does not import ({probe['vllm_error']})"
    missing = [
        what for what, ok in (("no CUDA device", probe.get("cuda")), (vllm, probe.get("vllm"))) if not ok
    ]
    return f"{' and '.join(missing)} for {python}" if missing else None


# ----------------------------------------------------------------------------- the vLLM child
def child_probe() -> None:
    """Print {"cuda": bool, "vllm": version or None, "vllm_error": why it does not import} as one JSON line; vLLM
    is imported only where there is a CUDA device (an import takes seconds)."""
    import importlib.metadata as md
    import importlib.util

    out = {"cuda": False, "vllm": None, "vllm_error": None}
    try:
        import torch

        out["cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        pass
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # a namespace directory named vllm is not vLLM
        print(json.dumps(out))
        return
    try:
        out["vllm"] = md.version("vllm")
    except md.PackageNotFoundError:
        out["vllm"] = "unknown version"
    if out["cuda"]:
        try:
            import vllm  # noqa: F401
        except Exception as exc:  # a broken install: reported in the exit-2 sentence
            out["vllm"], out["vllm_error"] = (
                None,
                f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:150]}",
            )
    print(json.dumps(out))


def _moe_methods(llm) -> list[str]:
    """The quantization methods of vLLM's MoE layers (where this vLLM lets us look)."""

    def names(model):
        return sorted(
            {
                type(m.quant_method).__name__
                for m in model.modules()
                if "MoE" in type(m).__name__ and hasattr(m, "quant_method")
            }
        )

    try:
        found = llm.apply_model(names)
        return sorted({n for part in found for n in part})
    except Exception as exc:  # an engine without apply_model: recorded, not fatal
        return [f"unknown ({type(exc).__name__})"]


def child_generate(export: str, prompts_path: str, out_path: str, new_tokens: int) -> None:
    """Runs inside vLLM's interpreter; imports nothing from moecompress."""
    import importlib.metadata as md

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(prompts_path).read_text())
    t0 = time.perf_counter()
    llm = LLM(
        model=export,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max(len(p) for p in prompts) + new_tokens,
        max_num_seqs=len(prompts),
        gpu_memory_utilization=0.3,
        seed=0,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=1, detokenize=False
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        tokens = [int(t) for t in c.token_ids]
        lps = [float(step[t].logprob) for t, step in zip(tokens, c.logprobs)]
        results.append({"tokens": tokens, "logprobs": lps})
    versions = {d: md.version(d) for d in ("vllm", "torch", "transformers", "compressed-tensors")}
    out = {"versions": versions, "load_s": load_s, "moe_methods": _moe_methods(llm), "outputs": results}
    Path(out_path).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- the parent
def vllm_python() -> str:
    return os.environ.get("VLLM_PYTHON") or sys.executable


def _child_env() -> dict:
    """This environment; for a vLLM interpreter of its own, without this one's PYTHONPATH / VIRTUAL_ENV."""
    own = bool(os.environ.get("VLLM_PYTHON"))
    env = {k: v for k, v in os.environ.items() if not (own and k in ("PYTHONPATH", "VIRTUAL_ENV"))}
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the child's own process
    return env


def probe(python: str) -> dict | None:
    try:
        proc = subprocess.run(
            [python, __file__, "--child-probe"], env=_child_env(), capture_output=True, text=True, timeout=180
        )
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def build_wide(dest: Path) -> Path:
    """qwen3-moe-tiny zero-padded to hidden size and expert width 256 (WIDE), saved in bf16 with its tokenizer.

    The padding is exact: the residual stream's new channels stay zero (zero columns in, zero rows out), the new
    expert channels are zero (silu(0) · 0), and the hidden-size RMSNorm weights are multiplied by
    sqrt(old / new hidden) to undo the longer mean; so the model computes the trained fixture's function (up to
    the norm epsilon) in the shape vLLM's Marlin MoE kernel takes at group 128."""
    import math

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from moecompress.testing import fixture_dir

    fixture = fixture_dir("qwen3-moe-tiny")
    small = AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32)
    config = AutoConfig.from_pretrained(fixture)
    h0, w0 = config.hidden_size, config.moe_intermediate_size
    config.hidden_size, config.moe_intermediate_size = WIDE, WIDE
    wide = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    big = wide.state_dict()
    with torch.no_grad():
        for name, t in small.state_dict().items():
            out = torch.zeros_like(big[name])
            if name.endswith("gate_up_proj"):  # [E, gate rows + up rows, H]: pad each half
                out[:, :w0, :h0], out[:, WIDE : WIDE + w0, :h0] = t[:, :w0], t[:, w0:]
            else:
                out[tuple(slice(0, n) for n in t.shape)] = t
            if name.endswith("norm.weight") and tuple(t.shape) == (h0,):
                out[:h0] *= math.sqrt(h0 / WIDE)
            big[name].copy_(out)
    wide.to(torch.bfloat16).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(fixture / name, dest / name)
    return dest


def compress(source: str, group: int, out: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "moecompress",
        "compress",
        source,
        "--method",
        "quant",
        "--quant",
        f"w4g{group}",
    ]
    args += ["--quant-algo", "rtn", "--format", "hf", "--out", str(out), "--overwrite"]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no message"]
        raise RuntimeError(f"moecompress compress failed: {lines[-1]}")


def moe_shape(export: Path) -> tuple[int, int]:
    """(hidden size, expert width) from a config.json."""
    cfg = json.loads((export / "config.json").read_text())
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return int(cfg["hidden_size"]), int(width)


def prompt_ids(source_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source_dir)
    return [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]


def run_vllm(export: Path, prompts: list[list[int]], new_tokens: int, work: Path) -> dict:
    (work / "prompts.json").write_text(json.dumps(prompts))
    out, log = work / "vllm.json", work / "vllm.log"
    args = [vllm_python(), __file__, "--child-generate", str(export), str(work / "prompts.json"), str(out)]
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                [*args, str(new_tokens)],
                env=_child_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=CHILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vLLM did not finish within {CHILD_TIMEOUT_S} s (log: {log})") from None
    if proc.returncode != 0 or not out.is_file():
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:] or ["no output"]
        raise RuntimeError(f"vLLM exited {proc.returncode}: {tail[0][:300]} (log: {log})")
    result = json.loads(out.read_text())
    result["log_moe_lines"] = [line[-200:] for line in log.read_text().splitlines() if "MoE" in line][:10]
    return result


def reference(export: Path, prompts: list[list[int]], generated: list[list[int]]) -> list[dict]:
    """transformers on the export (CPU, float32): per step its top token, top logprob and vLLM's token's logprob."""
    import torch

    from moecompress import load

    model = load(export, dtype="float32")
    rows = []
    for p, g in zip(prompts, generated):
        with torch.no_grad():
            logits = model(torch.tensor([p + g])).logits[0, len(p) - 1 : len(p) - 1 + len(g)].float()
        lp = torch.log_softmax(logits, dim=-1)
        top = lp.max(dim=-1)
        rows.append(
            {
                "top": top.indices.tolist(),
                "top_lps": top.values.tolist(),
                "lps": lp.gather(1, torch.tensor(g).unsqueeze(1)).squeeze(1).tolist(),
            }
        )
    return rows


def run_case(name: str, args) -> dict:
    source, group = CASES[name]
    work = Path(args.work) / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = build_wide(work / "source") if source == "wide" else Path(source_path(source))
    hidden, width = moe_shape(src)
    group = group or largest_group((hidden, width))
    case = {"case": name, "source": source, "hidden_size": hidden, "expert_width": width, "group": group}
    if group is None:
        return {
            **case,
            "ok": False,
            "error": f"no group of {GROUPS} divides hidden {hidden} and width {width}",
        }
    case["marlin_moe_shape"] = marlin_moe_ok(hidden, width, group)
    t0 = time.perf_counter()
    try:
        compress(str(src), group, work / "export")
        case["compress_s"] = round(time.perf_counter() - t0, 1)
        prompts = prompt_ids(src)
        v = run_vllm(work / "export", prompts, args.new_tokens, work)
        generated = [o["tokens"] for o in v["outputs"]]
        ref = reference(work / "export", prompts, generated)
    except RuntimeError as exc:
        return {**case, "ok": False, "error": str(exc)}
    per_prompt = [
        {
            "prompt": text,
            "vllm_tokens": o["tokens"],
            **compare_prompt(o["tokens"], o["logprobs"], r["top"], r["top_lps"], r["lps"], tolerances(args)),
        }
        for text, o, r in zip(PROMPTS, v["outputs"], ref)
    ]
    keep = ("versions", "load_s", "moe_methods", "log_moe_lines")
    return {
        **case,
        **{k: v.get(k) for k in keep},
        "prompts": per_prompt,
        "ok": all(p["ok"] for p in per_prompt),
    }


def source_path(source: str) -> str:
    from moecompress.models.loading import resolve_fixture

    return resolve_fixture(source)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(RESULTS), help="where the results JSON goes")
    ap.add_argument("--work", default=str(ROOT / "build" / "gpu_vllm_w4a16"), help="exports and logs")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument(
        "--gap-tol", type=float, default=0.25, help="a first difference within this passes (nats)"
    )
    ap.add_argument("--max-lp-tol", type=float, default=0.5, help="largest |dlogprob| of a prompt (nats)")
    ap.add_argument("--mean-lp-tol", type=float, default=0.1, help="mean |dlogprob| of a prompt (nats)")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (repeatable)")
    return ap.parse_args(argv)


def tolerances(args) -> dict:
    return {"gap": args.gap_tol, "max_lp": args.max_lp_tol, "mean_lp": args.mean_lp_tol}


def summary_line(case: dict) -> str:
    if "error" in case:
        return f"{case['case']}: FAILED ({case['error']})"
    equal = sum(p["equal"] for p in case["prompts"])
    passed = sum(p["ok"] for p in case["prompts"])
    worst = max(p["max_abs_dlogprob"] for p in case["prompts"])
    return (
        f"{case['case']} w4g{case['group']} (Marlin shape: {case['marlin_moe_shape']}; vLLM MoE method: "
        f"{', '.join(case.get('moe_methods') or ['?'])}): {passed}/{len(case['prompts'])} prompts pass, "
        f"{equal} token-identical, largest |dlogprob| {worst:.4f}"
    )


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    python = vllm_python()
    problem = problem_of(probe(python), python)
    if problem is not None:
        print(
            f"error: {NEEDS} ({problem}); set VLLM_PYTHON to a Python that has both, as "
            'docs/export.md "W4A16 MoE in vLLM (GPU)" shows.',
            file=sys.stderr,
        )
        return 2
    cases = [run_case(name, args) for name in (args.case or CASES)]
    ok = all(c["ok"] for c in cases)
    settings = {"new_tokens": args.new_tokens, "tolerances": tolerances(args)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"ok": ok, "settings": settings, "cases": cases}, indent=1) + "\n")
    for c in cases:
        print(summary_line(c))
    print(f"{'PASS' if ok else 'MISMATCH'}: results in {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    here = Path(__file__).resolve().parent  # benchmarks/vllm/ must not pass for vLLM in the child
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    if sys.argv[1:2] == ["--child-probe"]:
        child_probe()
    elif sys.argv[1:2] == ["--child-generate"]:
        child_generate(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        sys.exit(main())
