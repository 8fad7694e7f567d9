"""`--target` is a registry (plan/targets.py): a new runtime is one entry, and no code switches on target names."""

import re
from pathlib import Path

import pytest

import moecompress
from moecompress.errors import MoECompressError
from moecompress.plan.targets import TARGETS, Target, register_target
from moecompress.testing import fixture_dir

SRC = Path(moecompress.__file__).resolve().parent


@pytest.fixture
def sglang():
    """A throwaway runtime that loads hf checkpoints and runs no quantized experts (docs/architecture.md's worked
    example), removed again after the test."""
    target = register_target(
        Target(
            "sglang-test",
            "hf",
            "writes hf, unquantized experts only",
            space=TARGETS["transformers"].space,
            reason=lambda plan: "its experts are quantized" if any(plan.quant_specs()) else None,
        )
    )
    yield target
    TARGETS.pop(target.name)


def test_a_target_is_one_registry_entry(sglang, tmp_path):
    model = str(fixture_dir("qwen3-moe-tiny"))
    params = {"criterion": "frequency", "ratio": 0.5, "gate": "renorm"}
    calib = dict(calib="fixture-calib:4", seq_len=32, progress=False)
    out = moecompress.compress(model, "prune", params, out=tmp_path / "a", target="sglang-test", **calib)
    assert out.format == "hf"
    with pytest.raises(MoECompressError, match="cannot run in sglang-test: its experts are quantized"):
        moecompress.compress(
            model, "prune", params, quant="w4g32", out=tmp_path / "b", target="sglang-test", **calib
        )
    with pytest.raises(MoECompressError, match="sglang-test loads --format hf, not gguf"):
        moecompress.compress(
            model, "prune", params, out=tmp_path / "c", target="sglang-test", format="gguf", **calib
        )
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_an_unknown_target_names_the_registered_ones():
    with pytest.raises(
        MoECompressError, match="Target 'tpu' is not known; use " + re.escape(", ".join(TARGETS))
    ):
        moecompress.compress("fixture:olmoe-tiny", "prune", {"ratio": 0.5}, out="never", target="tpu")


def test_no_code_switches_on_a_target_name():
    """Target names appear as data in plan/targets.py only; everywhere else a target is asked what it is."""
    names = "|".join(re.escape(t) for t in TARGETS)
    switch = re.compile(rf"target\w*\s*(?:==|!=)\s*\"(?:{names})\"|\"(?:{names})\"\s*(?:==|!=)\s*\w*target")
    found = [
        f"{p.relative_to(SRC)}:{i}"
        for p in sorted(SRC.rglob("*.py"))
        if p.name != "targets.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if switch.search(line)
    ]
    assert not found, found
