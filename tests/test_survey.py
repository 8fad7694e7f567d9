"""The model survey's tiny configs, the Beam family and the fallback's whole-block check."""

import importlib.util
from pathlib import Path

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.models import MoEAdapter
from moecompress.testing import tiny_model

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "survey_models.py"


@pytest.fixture(scope="module")
def survey():
    spec = importlib.util.spec_from_file_location("survey_models", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_config_shrinks_sizes_and_keeps_experts(survey):
    config, _ = survey.tiny_config("qwen3_moe")
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok) == (32, 8, 2)
    assert config.num_hidden_layers == 4 and config.vocab_size == 128 and config.mlp_only_layers == []
    # a default left as None (DeepSeek-V2's num_experts_per_tok) still gets a usable value
    assert survey.tiny_config("deepseek_v2")[0].num_experts_per_tok == 2


def test_beam_declared_family_reproduces_the_block(survey):
    from transformers import AutoModelForCausalLM

    config, _ = survey.tiny_config("beam")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    survey._randomise(model)
    rec = survey._check_adapter(model, declared=True)
    assert rec["status"] == "supported-declared", rec
    assert "scaled x2.5" in rec["router"]


def test_fallback_refuses_a_block_it_cannot_reproduce(monkeypatch):
    from moecompress.models import families

    model = tiny_model("qwen3_moe", experts_implementation="eager")
    monkeypatch.delitem(families.FAMILIES, "qwen3_moe")
    assert MoEAdapter(model).family is None  # the plain block is accepted by the fallback
    block = model.model.layers[1].mlp
    plain = block.forward
    monkeypatch.setattr(block, "forward", lambda h: plain(h) * 1.5)  # an extra term the adapter cannot see
    with pytest.raises(MoECompressError, match="MoE block of model_type 'qwen3_moe' \\(layer 1\\)"):
        MoEAdapter(model)
