"""benchmarks/gpu_vllm_w4a16.py (issue 31, W4A16 MoE in vLLM on a GPU): without CUDA and vLLM it exits 2 with one
sentence; its pure helpers (token and logprob comparison, vLLM's group and Marlin shape rules, the padded wide
model) behave. The GPU run itself is not part of the tests (docs/export.md, "W4A16 MoE in vLLM (GPU)")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_vllm_w4a16.py"
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_vllm_w4a16 import (  # noqa: E402
    build_wide,
    compare_prompt,
    largest_group,
    marlin_moe_ok,
    problem_of,
)

TOL = {"gap": 0.25, "max_lp": 0.5, "mean_lp": 0.1}


def _run(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k != "VLLM_PYTHON"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(tmp_path / "r.json"), "--work", str(tmp_path / "w")],
        env={**base, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_and_vllm_it_exits_2_in_one_sentence(tmp_path):
    for env, why in (
        ({}, "no CUDA device"),
        ({"VLLM_PYTHON": str(tmp_path / "nopython")}, "could not be run"),
    ):
        proc = _run(tmp_path, **env)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
        assert len(lines) == 1 and lines[0].startswith(
            "error: benchmarks/gpu_vllm_w4a16.py needs a CUDA GPU and vllm ("
        )
        assert why in lines[0] and lines[0].endswith('"W4A16 MoE in vLLM (GPU)" shows.')
        assert not (tmp_path / "r.json").exists() and not (tmp_path / "w").exists()


def test_compare_prompt():
    toks, lps = [5, 6, 7], [-0.1, -0.2, -0.3]
    same = compare_prompt(toks, lps, [5, 6, 7], [-0.1, -0.2, -0.3], [-0.12, -0.2, -0.3], TOL)
    assert same["equal"] and same["ok"] and same["first_diff"] is None
    assert same["max_abs_dlogprob"] == pytest.approx(0.02)
    # transformers prefers token 9 at step 1, by 0.1 over vLLM's 6: a near tie, passes
    tie = compare_prompt(toks, lps, [5, 9, 7], [-0.1, -0.15, -0.3], [-0.1, -0.25, -0.3], TOL)
    assert not tie["equal"] and tie["ok"] and tie["first_diff"] == 1
    assert tie["gap_at_first_diff"] == pytest.approx(0.1)
    # by 2 nats: vLLM picked a token transformers ranks well below its top, fails
    far = compare_prompt(toks, lps, [5, 9, 7], [-0.1, -0.1, -0.3], [-0.1, -2.1, -0.3], TOL)
    assert not far["ok"] and far["gap_at_first_diff"] == pytest.approx(2.0)
    # equal tokens, but one logprob 0.7 away (max) or every one 0.2 away (mean): fails
    assert not compare_prompt(toks, lps, toks, lps, [-0.1, -0.9, -0.3], TOL)["ok"]
    assert not compare_prompt(toks, lps, toks, lps, [-0.3, -0.4, -0.5], TOL)["ok"]
    with pytest.raises(ValueError):
        compare_prompt(toks, lps, [5, 6], lps, lps, TOL)


def test_group_and_marlin_shape_rules():
    assert largest_group((192, 128)) == 64  # qwen3-moe-tiny: hidden 192, expert width 128
    assert largest_group((192, 96)) == 32  # olmoe-tiny
    assert largest_group((256, 256)) == 128 and largest_group((192, 100)) is None
    assert not marlin_moe_ok(192, 128, 64) and not marlin_moe_ok(192, 96, 32)  # hidden % 128
    assert marlin_moe_ok(256, 256, 128) and marlin_moe_ok(256, 64, 32)
    assert not marlin_moe_ok(256, 96, 32) and not marlin_moe_ok(256, 256, 256)


def test_problem_of():
    assert problem_of({"cuda": True, "vllm": "0.33.0"}, "py") is None
    assert problem_of({"cuda": False, "vllm": None}, "py") == "no CUDA device and no vllm for py"
    assert problem_of({"cuda": True, "vllm": None}, "py") == "no vllm for py"
    assert problem_of(None, "py") == "py could not be run to look for them"
    broken = {"cuda": True, "vllm": None, "vllm_error": "ImportError: libcudart.so.13"}
    assert problem_of(broken, "py") == "vllm does not import (ImportError: libcudart.so.13) for py"


def test_the_wide_model_is_the_fixture_zero_padded(tmp_path):
    from transformers import AutoModelForCausalLM

    from moecompress.testing import fixture_dir

    wide = AutoModelForCausalLM.from_pretrained(build_wide(tmp_path / "wide"), dtype=torch.float32)
    small = AutoModelForCausalLM.from_pretrained(fixture_dir("qwen3-moe-tiny"), dtype=torch.float32)
    assert wide.config.hidden_size == wide.config.moe_intermediate_size == 256
    ids = torch.randint(2, 4096, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(ids).logits, wide(ids).logits
    torch.testing.assert_close(a, b, atol=0.05, rtol=0)  # bf16 norm weights, norm epsilon
    assert torch.equal(a.argmax(-1), b.argmax(-1))
