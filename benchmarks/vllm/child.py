"""Runs inside vLLM's CPU build (build/vllm-venv; docs/export.md, "Checked inside vLLM (CPU)"); imports nothing
from moecompress. Called by benchmarks/bench_vllm_cpu.py:

    python benchmarks/vllm/child.py info
    python benchmarks/vllm/child.py generate CHECKPOINT PROMPTS.json OUT.json MAX_TOKENS DTYPE

`generate` loads CHECKPOINT in DTYPE (bfloat16 or float32; token ids in, no tokenizer), greedily generates MAX_TOKENS tokens for each
prompt of PROMPTS.json (a list of token-id lists) in one batch, EOS ignored, and writes the generated ids, vLLM's
top-2 logprobs at every step, the load and generation wall times and the versions to OUT.json. `info` prints the
versions as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no spawned worker
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would reserve far more than needed
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def versions() -> dict:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "torch", "transformers", "compressed-tensors"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def generate(checkpoint: str, prompts_path: str, out_path: str, max_tokens: int, dtype: str) -> None:
    prompts = json.loads(open(prompts_path).read())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(
        model=checkpoint,
        dtype=dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max(len(p) for p in prompts) + max_tokens,
        max_num_seqs=len(prompts),
        seed=0,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, detokenize=False
    )
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    results = []
    for o in outs:
        c = o.outputs[0]
        top2 = []
        for step in c.logprobs or []:
            best = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:2]
            top2.append([[int(t), float(lp.logprob)] for t, lp in best])
        results.append({"tokens": [int(t) for t in c.token_ids], "top2": top2})
    json.dump(
        {
            "versions": versions(),
            "import_s": t_import,
            "load_s": load_s,
            "generate_s": gen_s,
            "outputs": results,
        },
        open(out_path, "w"),
    )


if __name__ == "__main__":
    if sys.argv[1] == "info":
        print(json.dumps(versions()))
    else:
        generate(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
