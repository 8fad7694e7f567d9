"""The shipped fixtures are stored like real MoE checkpoints (bf16), and byte accounting follows the
checkpoint's on-disk dtypes, not the dtype a model is loaded in."""

import json

import pytest

from moecompress.disk import read_header, stored_tensors
from moecompress.models import load_model
from moecompress.plan import ModelInfo
from moecompress.testing import fixture_dir, save_as

FIXTURES = ("qwen3-moe-tiny", "olmoe-tiny")
EXPERT_PARAMS = {"qwen3-moe-tiny": 4_718_592, "olmoe-tiny": 3_538_944}  # docs/fixtures.md


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_is_stored_in_bf16(name):
    d = fixture_dir(name)
    header = read_header(d / "model.safetensors")
    assert len(header) == 231
    assert {h["dtype"] for h in header.values()} == {"BF16"}, (
        f"{name} must ship bf16 weights (scripts/convert_fixtures_bf16.py)"
    )
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype, size", [("bfloat16", 2), ("float32", 4)])
def test_model_info_counts_on_disk_bytes_whatever_the_compute_dtype(tmp_path, dtype, size):
    src = fixture_dir("olmoe-tiny")
    path = src if dtype == "bfloat16" else save_as(src, tmp_path / "fp32", dtype)
    disk = stored_tensors(path)
    model = load_model(str(path), dtype="float32")  # computed in float32 either way
    info = ModelInfo.from_model(model)
    assert info.dtype == dtype and info.disk_dtypes == [dtype]
    assert info.expert_bytes == EXPERT_PARAMS["olmoe-tiny"] * size
    # every stored byte is either a routed expert or something else, exactly as in the file
    assert info.expert_bytes + info.other_bytes == sum(n for _, n in disk.values())
    assert info.expert_bytes == sum(n for k, (_, n) in disk.items() if ".mlp.experts." in k)
