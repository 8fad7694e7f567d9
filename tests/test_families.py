"""FamilySpec holds every family fact: its tiny config builds, and each fact agrees with what the model really is."""

import re

import pytest
import torch
from safetensors import safe_open

from moecompress.distill import DENSE_TARGETS
from moecompress.export.ct import EXPERT_TARGET
from moecompress.models import FAMILIES, MoEAdapter
from moecompress.models import families as families_module
from moecompress.models.families import expert_count_keys
from moecompress.testing import FAMILY_NAMES, TINY_CONFIGS, save_tiny, tiny_config, tiny_model


def test_every_family_has_a_tiny_config_and_the_tests_build_them_all():
    assert (
        set(FAMILY_NAMES)
        == set(TINY_CONFIGS)
        == {f.model_type for f in FAMILIES.values() if f.tiny is not None}
    )
    missing = [name for name, f in FAMILIES.items() if f.tiny is None]
    assert missing == ["beam"]  # its tiny model is built (and checked) by the survey: tests/test_survey.py


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param, tiny_model(request.param)


def test_tiny_model_is_the_declared_family(family):
    name, model = family
    spec = FAMILIES[name]
    adapter = MoEAdapter(model)
    assert adapter.family is spec and model.config.model_type == name
    # the storage layout the family declares is what the shapes say (the fallback detects it the same way)
    for layer in adapter.layers.values():
        assert layer.storage.layout == spec.layout == layer.storage.fused_layout
    # the expert-count key holds the routed-expert count, and setting it changes what config.json says
    (key,) = expert_count_keys(model.config)
    e = adapter.num_experts(adapter.moe_layers[0])
    assert getattr(model.config, spec.expert_count_key) == e == model.config.to_dict()[key]
    config = tiny_config(name)
    setattr(config, key, 3)
    assert config.to_dict()[key] == 3


def test_undeclared_families_search_every_common_count_key(monkeypatch):
    config = tiny_config("mixtral")
    monkeypatch.delitem(families_module.FAMILIES, "mixtral")
    assert expert_count_keys(config) == ("num_local_experts",)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_hf_quantized_exactly_when_the_checkpoint_has_what_compressed_tensors_quantizes(name, tmp_path):
    path = save_tiny(name, tmp_path / name)
    target = re.compile(EXPERT_TARGET.removeprefix("re:"))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        per_expert = any(target.match(k.removesuffix(".weight")) for k in f.keys())  # noqa: SIM118
    assert FAMILIES[name].hf_quantized is per_expert


def test_dense_targets_are_the_family_dense_families():
    assert DENSE_TARGETS == {
        "qwen3_moe": "qwen3",
        "qwen2_moe": "qwen2",
        "mixtral": "mistral",
        "granitemoe": "granite",
        "deepseek_v2": "deepseek_v2",
        "deepseek_v3": "deepseek_v3",
    }
    assert all(FAMILIES[t].dense_family == d for t, d in DENSE_TARGETS.items())


def test_a_declared_layout_is_used_without_sniffing():
    from moecompress.models import ExpertStorage

    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    assert ExpertStorage.detect(experts).layout == "fused"
    assert ExpertStorage.detect(experts, "gpt_oss").layout == "gpt_oss"
    gpt = tiny_model("gpt_oss").model.layers[0].mlp.experts
    assert (
        ExpertStorage.detect(gpt).layout == "gpt_oss" and ExpertStorage.detect(torch.nn.Linear(2, 2)) is None
    )
