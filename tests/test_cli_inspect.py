"""`moecompress inspect` and the one-sentence, exit-2 contract for bad input."""

import json
import subprocess
import sys

import pytest

from moecompress.testing import FAMILY_NAMES, fixture_dir, run_cli, save_tiny


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_inspect_tiny_model_of_each_family(family, tmp_path, capsys):
    path = save_tiny(family, tmp_path / family)
    code, out, _ = run_cli(["inspect", str(path), "--json"], capsys)
    assert code == 0
    info = json.loads(out)
    assert info["model_type"] == family and info["top_k"] == 2 and info["experts_per_layer"] == [8]
    b = info["bytes"]
    assert b["routed_experts"] + b["router"] + b["shared_experts"] + b["rest"] == b["total"]
    # parameters counted from the skeleton equal the tensor bytes written on disk (safetensors data section)
    data = 0
    for f in path.glob("*.safetensors"):
        raw = f.read_bytes()
        data += len(raw) - 8 - int.from_bytes(raw[:8], "little")
    assert data == b["total"]
    assert (b["shared_experts"] > 0) == (family in ("qwen2_moe", "deepseek_v2", "deepseek_v3"))


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "olmoe-tiny"])
def test_inspect_fixture(name, capsys):
    path = fixture_dir(name)
    if not (path / "config.json").exists():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    code, out, _ = run_cli(["inspect", str(path)], capsys)
    assert code == 0 and "routed experts" in out and "renormalised" in out


def test_missing_path(tmp_path, capsys):
    code, _, err = run_cli(["inspect", str(tmp_path / "nope")], capsys)
    assert code == 2 and "No model directory" in err and "Traceback" not in err


def test_dense_model(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path)
    code, _, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert code == 2 and "dense model" in err


def test_unknown_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_real_moe", "hidden_size": 8}))
    code, _, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert code == 2 and "Unknown architecture 'not_a_real_moe'" in err


def test_hub_id_offline(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(["inspect", "nobody/not-a-cached-model"], capsys)
    assert code == 2 and "offline" in err and "local directory" in err


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "moecompress.cli", "inspect", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") <= 3


def test_missing_argument_is_a_usage_error_not_a_traceback(capsys):
    code, _, err = run_cli(["compress"], capsys)
    assert code == 2 and "Missing argument" in err and "Traceback" not in err
