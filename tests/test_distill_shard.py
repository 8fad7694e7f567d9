"""The frozen teacher under FSDP2 (distill/shard.py), on 2 CPU processes with gloo.

`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/test_distill_shard.py OUT` runs the
worker below on each rank; the test launches it and checks what the ranks wrote to OUT:
(a) every teacher parameter is a DTensor whose local shard holds about half of it, (b) the sharded teacher's
logits (plain, expanded top-k', tied embeddings) equal the unsharded teacher's, (c) a 2-step distillation whose teacher is
sharded gives the KD losses of the same run in one process with the teacher whole.

accelerate never selects FSDP on a CPU (`use_cpu` runs are MULTI_CPU, the student DDP-wrapped), so the
worker forces the placement a GPU FSDP2 run picks; the layout code under test is the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moecompress.errors import MoECompressError

ROOT = Path(__file__).resolve().parents[1]

# every training block is the same 16 tokens, so each rank's batch equals the single process's batch and
# the two runs follow the same trajectory whatever the samplers pick
SEQ, BATCH, STEPS = 16, 4, 2
DATA = torch.arange(3, 3 + SEQ).repeat(64)
KW = {
    "seq_len": SEQ,
    "batch_size": BATCH,
    "eval_every": 1,
    "save_every": 100,
    "lr": 1e-3,
    "warmup": 0,
    "val_tokens": 2 * SEQ,
    "progress": False,
    "expanded_top_k": 4,
}


def _teacher():
    from moecompress.testing import tiny_model

    return tiny_model("qwen3_moe", dtype=torch.bfloat16)


def _student():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _worker(out: Path) -> None:
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moecompress.distill import distill, expanded_teacher, shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    teacher = _teacher()
    whole = copy.deepcopy(teacher)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    shard.shard_fsdp2(teacher)
    params = list(teacher.parameters())
    with torch.no_grad():
        diff = float((teacher(ids).logits.float() - whole(ids).logits.float()).abs().max())
        with expanded_teacher(teacher, 4) as t, expanded_teacher(whole, 4) as w:
            diff_expanded = float((t(ids).logits.float() - w(ids).logits.float()).abs().max())
    from moecompress.testing import tiny_model

    tied = tiny_model(
        "qwen3_moe", dtype=torch.bfloat16, tie_word_embeddings=True
    )  # embeddings stay in the root
    tied_whole = copy.deepcopy(tied)
    shard.shard_fsdp2(tied)
    with torch.no_grad():
        diff_tied = float((tied(ids).logits.float() - tied_whole(ids).logits.float()).abs().max())
    result = {
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
        "bf16": all(p.dtype == torch.bfloat16 for p in params),
        "local": sum(p.to_local().numel() for p in params),
        "full": sum(p.numel() for p in params),
        "whole": sum(p.numel() for p in whole.parameters()),
        "diff": diff,
        "diff_expanded": diff_expanded,
        "diff_tied": diff_tied,
    }
    # (c) the Trainer with a sharded teacher (a fresh one: `teacher` above is sharded already)
    from torch.distributed.fsdp import FSDPModule

    shard.teacher_placement = lambda accelerator: "fsdp2"
    fresh = _teacher()
    r = distill(fresh, _student(), DATA, tokens=STEPS * BATCH * 2 * SEQ, out=out / "run", **KW)
    result["steps"], result["trainer_sharded"] = r.metrics["steps"], isinstance(fresh, FSDPModule)  # in place
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _losses(report: Path) -> tuple[list[float], list[float]]:
    history = json.loads(report.read_text())["log_history"]
    return [h["eval_loss"] for h in history if "eval_loss" in h], [h["loss"] for h in history if "loss" in h]


def test_fsdp2_teacher_is_sharded_and_computes_the_same(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed with the gloo backend")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch build has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    from moecompress.distill import distill

    src = ROOT / "src"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert (
            r["all_dtensor"] and r["bf16"] and r["full"] == r["whole"]
        )  # (a): DTensors of the whole teacher
        assert abs(r["local"] - r["full"] / 2) <= 0.02 * r["full"]  # each rank holds about half
        assert (
            max(r["diff"], r["diff_expanded"], r["diff_tied"]) < 1e-6
        )  # (b): the same bf16 ops, the same logits
        assert r["steps"] == STEPS and r["trainer_sharded"]
    assert ranks[0]["local"] + ranks[1]["local"] == ranks[0]["full"]
    # (c): the single-process run with the teacher whole on its device
    single = distill(_teacher(), _student(), DATA, tokens=STEPS * BATCH * SEQ, out=tmp_path / "single", **KW)
    assert single.metrics["steps"] == STEPS
    (ev_s, tr_s), (ev_d, tr_d) = _losses(single.report), _losses(tmp_path / "run" / "distill.json")
    assert len(ev_s) == len(ev_d) == STEPS + 1 and len(tr_s) == len(tr_d) >= 1
    torch.testing.assert_close(torch.tensor(ev_d), torch.tensor(ev_s), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(tr_d), torch.tensor(tr_s), rtol=1e-4, atol=1e-5)


def test_placement_follows_the_accelerator():
    from types import SimpleNamespace as NS

    from moecompress.distill.shard import place_teacher, teacher_placement

    def acc(fsdp2=False, stage=None):
        plugin = (
            None
            if stage is None
            else NS(zero_stage=stage, deepspeed_config={"zero_optimization": {"stage": stage}})
        )
        return NS(is_fsdp2=fsdp2, state=NS(deepspeed_plugin=plugin))

    assert teacher_placement(acc(fsdp2=True)) == "fsdp2"
    assert teacher_placement(acc(stage=3)) == "zero3"
    assert (
        teacher_placement(acc(stage=2)) == teacher_placement(acc()) == "replicated"
    )  # ZeRO-2, DDP, one device
    teacher = _teacher().train()
    placed = place_teacher(teacher, acc(), torch.device("cpu"))
    assert (
        placed is teacher and not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    )
    with pytest.raises(MoECompressError, match="expanded teacher"):
        place_teacher(teacher, acc(stage=3), torch.device("cpu"), expanded_top_k=4)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(MoECompressError, match="deepspeed is not installed"):
            place_teacher(teacher, acc(stage=3), torch.device("cpu"))


def test_zero3_teacher_config_from_the_shipped_one():
    from moecompress.distill.shard import zero3_inference_config

    ds = json.loads((ROOT / "configs" / "accelerate" / "ds_zero3.json").read_text())
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto"}}
    cfg = zero3_inference_config(ds, hidden_size=192)
    zero = cfg["zero_optimization"]
    assert "optimizer" not in cfg and "scheduler" not in cfg and zero["stage"] == 3
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (192 * 192, int(0.9 * 192 * 192), 1920)
    assert (
        ds["zero_optimization"]["reduce_bucket_size"] == "auto" and "optimizer" in ds
    )  # the input is untouched


def test_a_bf16_checkpoint_gives_a_bf16_teacher():
    from moecompress.distill.trainer import _load  # what distill(teacher=PATH, teacher_dtype="auto") loads

    teacher, _ = _load("fixture:olmoe-tiny", "auto")
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}


if __name__ == "__main__":  # a rank of the test above, started by torch.distributed.run
    _worker(Path(sys.argv[1]))
