"""Distillation: objectives, expanded teacher, resumable Trainer runs, accelerate configs, CLI errors."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

from moecompress.distill.kd import expanded_teacher, hidden_mse, kd_loss
from moecompress.errors import MoECompressError
from moecompress.methods.dense_convert import convert
from moecompress.methods.dense_fit import DenseConfig
from moecompress.methods.dense_stats import collect_dense_stats
from moecompress.models import MoEAdapter
from moecompress.testing import tiny_model

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- objectives
def test_kd_losses_known_answers():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    fwd = (p * (p.log() - q.log())).sum(-1).mean()
    rev = (q * (q.log() - p.log())).sum(-1).mean()
    torch.testing.assert_close(kd_loss(s, t, "forward_kl"), fwd)
    torch.testing.assert_close(kd_loss(s, t, "reverse_kl"), rev)
    assert float(kd_loss(t, t)) == pytest.approx(0.0, abs=1e-7)
    pT, qT = torch.softmax(t / 2, -1), torch.softmax(s / 2, -1)
    torch.testing.assert_close(
        kd_loss(s, t, "forward_kl", 2.0), 4 * (pT * (pT.log() - qT.log())).sum(-1).mean()
    )
    hs = [torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3)]
    ht = [torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)]
    assert float(hidden_mse(hs, ht)) == pytest.approx(0.5)  # layer outputs only: (1 + 0) / 2
    with pytest.raises(MoECompressError, match="Temperature"):
        kd_loss(s, t, temperature=0)


def test_expanded_teacher():
    """k' = k reproduces the teacher; k' = E on a renormalising router is the full softmax mixture."""
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    adapter = MoEAdapter(model)
    with torch.no_grad():
        ref = model(ids).logits
        with expanded_teacher(model, adapter.top_k(adapter.moe_layers[0])):
            same = model(ids).logits
        with expanded_teacher(model, 8):
            wide = model(ids).logits
            i = adapter.moe_layers[0]
            h = torch.randn(5, adapter.hidden_size)
            p = torch.softmax(torch.nn.functional.linear(h, adapter.router_params(i)[0]), -1)
            mix = sum(p[:, e, None] * adapter.expert_forward(i, e, h) for e in range(8))
            torch.testing.assert_close(adapter.decoder_layers[i].mlp(h), mix, atol=1e-5, rtol=1e-5)
        after = model(ids).logits
    torch.testing.assert_close(same, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(wide, ref) and torch.equal(after, ref)
    with pytest.raises(MoECompressError, match="outside 2..8"), expanded_teacher(model, 9):
        pass


# ----------------------------------------------------------------------------- training
def _pair():
    teacher = tiny_model("qwen3_moe")
    ids = torch.randint(3, 90, (2, 32), generator=torch.Generator().manual_seed(0))
    stats = collect_dense_stats(teacher, ids, progress=False)
    from moecompress.distill.student import build_student

    return teacher, lambda: build_student(
        teacher, convert(teacher, stats, DenseConfig(criterion="cp"), progress=False)
    )


def test_killed_run_resumes_to_the_same_student(tmp_path):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from moecompress.distill import distill

    teacher, fresh = _pair()
    data = torch.randint(3, 90, (3000,), generator=torch.Generator().manual_seed(1))
    kw = dict(
        tokens=8 * 32 * 8, seq_len=32, batch_size=8, eval_every=4, save_every=4, lr=1e-3, progress=False
    )

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 6:
                raise KeyboardInterrupt  # the run dies between checkpoints 4 and 8

    full = distill(teacher, fresh(), data, out=tmp_path / "full", **kw)
    with pytest.raises(KeyboardInterrupt):
        distill(teacher, fresh(), data, out=tmp_path / "cut", callbacks=[Kill()], **kw)
    assert not (tmp_path / "cut" / "student").exists()
    partial = tmp_path / "cut" / "checkpoints" / "checkpoint-7"  # as if killed while saving step 7
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    resumed = distill(teacher, fresh(), data, out=tmp_path / "cut", **kw)
    assert resumed.metrics["resumed_from"].endswith("checkpoint-4") and resumed.metrics["steps"] == 8
    assert not partial.exists()
    a = load_file(tmp_path / "full" / "student" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "student" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m = full.metrics
    assert (
        m["after"]["eval_kl"] < m["before"]["eval_kl"] and m["after"]["eval_loss"] < m["before"]["eval_loss"]
    )
    assert full.curve.stat().st_size > 10_000
    report = json.loads(full.report.read_text())
    assert report["metrics"]["steps"] == 8 and any("eval_ppl" in h for h in report["log_history"])
    with pytest.raises(MoECompressError, match="already exists"):
        distill(teacher, fresh(), data, out=tmp_path / "full", **kw)


def test_options_bf16_checkpointing_hidden_expanded(tmp_path):
    from transformers import AutoModelForCausalLM

    from moecompress.distill import distill

    teacher, fresh = _pair()
    data = torch.randint(3, 90, (1200,), generator=torch.Generator().manual_seed(2))
    r = distill(
        teacher,
        fresh(),
        data,
        tokens=2 * 4 * 32,
        out=tmp_path / "o",
        seq_len=32,
        batch_size=4,
        loss="kl_hidden",
        temperature=2.0,
        expanded_top_k=4,
        bf16=True,
        gradient_checkpointing=True,
        eval_every=1,
        save_every=1,
        progress=False,
    )
    assert r.metrics["steps"] == 2
    student = AutoModelForCausalLM.from_pretrained(r.student_dir)
    assert type(student).__name__ == "Qwen3ForCausalLM"
    assert not (r.student_dir / "training_args.bin").exists()  # no pickles in the student
    assert MoEAdapter(teacher).layer(1).block.__class__.__name__ != "ExpandedMoEBlock"  # teacher restored


# ----------------------------------------------------------------------------- accelerate configs
@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "configs" / "accelerate" / "*.yaml"))))
def test_accelerate_configs_parse(path, monkeypatch):
    """Each shipped config loads with accelerate's own parser and `accelerate launch` accepts it."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.chdir(ROOT)
    cfg = load_config_from_file(path)
    want = {"single_gpu": "NO", "multi_gpu": "MULTI_GPU", "fsdp2": "FSDP", "deepspeed_zero3": "DEEPSPEED"}
    assert str(cfg.distributed_type).split(".")[-1] == want[Path(path).stem]
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", path, "-m", "moecompress.cli", "distill"])
    args, _, _ = _validate_launch_command(args)
    known = vars(parser.parse_args(["x"]))
    for key in cfg.fsdp_config or {}:
        assert key in known, f"unknown FSDP option {key}"
    if cfg.distributed_type == "FSDP":
        assert args.use_fsdp and int(args.fsdp_version) == 2
    if cfg.distributed_type == "DEEPSPEED":
        ds = json.loads((ROOT / cfg.deepspeed_config["deepspeed_config_file"]).read_text())
        assert args.use_deepspeed and ds["zero_optimization"]["stage"] == 3


def test_cli_distill_bad_option(capsys):
    from moecompress.cli import main

    with pytest.raises(SystemExit) as exc:
        main(
            [
                "distill",
                "--teacher",
                "t",
                "--student",
                "s",
                "--data",
                "d",
                "--tokens",
                "10",
                "--out",
                "o",
                "--loss",
                "kl_sideways",
            ]
        )
    assert exc.value.code == 2
    assert "--loss is invalid" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkilled_cli_run_resumes(tmp_path):
    """`moecompress distill` killed with SIGKILL after its first checkpoint resumes from it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from moecompress.data import char_tokenizer

    teacher, fresh = _pair()
    for name, model in (("t", teacher), ("s", fresh())):
        model.save_pretrained(tmp_path / name)
        char_tokenizer().save_pretrained(tmp_path / name)
    (tmp_path / "d.txt").write_text(" ".join(f"sentence {i} about foxes and dogs." for i in range(3000)))
    cmd = [
        sys.executable,
        "-m",
        "moecompress.cli",
        "distill",
        "--teacher",
        str(tmp_path / "t"),
        "--student",
        str(tmp_path / "s"),
        "--data",
        str(tmp_path / "d.txt"),
        "--tokens",
        str(40 * 8 * 32),
        "--seq-len",
        "32",
        "--out",
        str(tmp_path / "run"),
        "--save-every",
        "5",
        "--eval-every",
        "20",
        "--lr",
        "1e-3",
    ]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not any(
        (p / "trainer_state.json").exists() for p in ck.glob("checkpoint-*")
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "run" / "student").exists()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "run" / "distill.json").read_text())
    assert report["metrics"]["resumed_from"] is not None and report["metrics"]["steps"] == 40
