"""The export-format registry: which format holds which plan, what `auto` picks, and loading by recorded format."""

import json

import pytest
import torch

from moecompress.api import export, load
from moecompress.errors import MoECompressError
from moecompress.export import formats
from moecompress.export.formats import AUTO_ORDER, FORMATS, CompactFormat, Format, HFFormat, auto_format
from moecompress.methods.puzzle import PuzzleConfig, build_puzzle
from moecompress.methods.quantize import QuantConfig, quantize_plan
from moecompress.methods.registry import MethodContext
from moecompress.models import MoEAdapter
from moecompress.plan import CompressionPlan, ModelInfo
from moecompress.runtime import CompressedMoEBlock
from moecompress.testing import tiny_model
from moecompress.workflows.pipeline import choose_format


@pytest.fixture(scope="module")
def info():
    return ModelInfo.from_model(tiny_model("qwen3_moe"))


class _ChannelNorms:
    """The statistics PuzzleMoE reads (channel norms), deterministic: enough to build a packed plan."""

    def __init__(self, adapter):
        g = torch.Generator().manual_seed(0)
        self.data = {
            i: {
                "in_channel_norm": torch.rand(adapter.num_experts(i), adapter.hidden_size, generator=g) + 0.1,
                "mid_channel_norm": torch.rand(
                    adapter.num_experts(i), adapter.intermediate_size(i), generator=g
                )
                + 0.1,
                "counts": torch.ones(adapter.num_experts(i)),
                "tokens": torch.tensor(10.0),
            }
            for i in adapter.moe_layers
        }

    def require(self, *names, method=None):
        pass

    def get(self, layer, name):
        return self.data[layer][name]


@pytest.fixture(scope="module")
def packed():
    adapter = MoEAdapter(tiny_model("qwen3_moe", dtype=torch.bfloat16))
    plan, _ = build_puzzle(PuzzleConfig(ratio=0.5), MethodContext(adapter, _ChannelNorms(adapter)))
    assert plan.has_packed()
    return plan


def _half(info, gate="renorm", keep=(0, 1, 4, 6)):
    return CompressionPlan.prune(info, {li.layer: list(keep) for li in info.layers}, gate=gate)


def _remap(info):
    return CompressionPlan.remap(info, {li.layer: [0, 0, 2, 2, 4, 5, 5, 5] for li in info.layers})


def test_hf_expressibility(info):
    assert HFFormat.reason(CompressionPlan.prune(info, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})) is None
    why = HFFormat.reason(CompressionPlan.prune(info, {0: [0, 1, 2, 3], 1: [4, 5, 6]}))
    assert "different numbers" in why
    why = HFFormat.reason(CompressionPlan.remap(info, {0: [0, 0, 2, 2, 4, 4, 6, 6]}))
    assert "several slots" in why
    olmoe = ModelInfo.from_model(tiny_model("olmoe"))
    assert (
        HFFormat.reason(CompressionPlan.prune(olmoe, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, gate="keep"))
        is not None
    )
    assert (
        HFFormat.reason(CompressionPlan.prune(info, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, gate="keep")) is None
    )


def test_registry_names_every_format_once_and_auto_ends_with_one_that_holds_everything(info):
    assert all(name == cls.name and issubclass(cls, Format) for name, cls in FORMATS.items())
    assert set(AUTO_ORDER) <= set(FORMATS) and not any(FORMATS[n].evaluation_only for n in AUTO_ORDER)
    for plan in (_half(info), _remap(info), _half(info, gate="replace")):
        assert FORMATS[AUTO_ORDER[-1]].reason(plan) is None


def test_auto_choice_is_todays(info, packed):
    """hf for a pruned renorm plan, compact for what a vanilla config cannot express, packed for PuzzleMoE."""
    assert choose_format(_half(info)) == auto_format(_half(info)) == "hf"
    assert choose_format(_remap(info)) == "compact"
    assert choose_format(_half(info, gate="replace")) == "compact"
    assert choose_format(packed) == "packed"
    # a named format that holds the plan is what was asked for
    assert choose_format(_half(info), "compact") == "compact" and choose_format(packed, "packed") == "packed"


def test_a_named_format_that_cannot_hold_the_plan_is_refused_in_one_sentence(info, packed):
    """choose_format (compress/compare) names the flag; export's own sentence names the argument."""
    with pytest.raises(
        MoECompressError,
        match=r"'hf' format cannot express this plan \(layer 0 maps several slots.*"
        r"use --format compact\.$",
    ):
        choose_format(_remap(info), "hf")
    with pytest.raises(MoECompressError, match=r"packed element-wise merges.*use --format packed"):
        choose_format(packed, "hf")
    with pytest.raises(
        MoECompressError, match=r"'compact' format cannot express this plan.*use --format packed"
    ):
        choose_format(packed, "compact")
    with pytest.raises(MoECompressError, match="cannot delete or mask the dropped slots.*use --format hf"):
        choose_format(_half(info), "materialized")
    with pytest.raises(MoECompressError, match="Unknown export format 'onnx'; use one of hf, compact"):
        choose_format(_half(info), "onnx")
    assert HFFormat.refusal(_remap(info)).endswith("export it with format='compact' instead.")
    assert HFFormat.refusal(packed).endswith("export it with format='packed' instead.")
    assert CompactFormat.refusal(packed).endswith("export it with format='packed' instead.")
    assert FORMATS["materialized"].refusal(_half(info)).endswith("use format='hf' or 'compact'.")
    for plan, name in ((_remap(info), "hf"), (packed, "compact"), (_half(info), "materialized")):
        assert "\n" not in FORMATS[name].refusal(plan) and FORMATS[name].reason(plan)
        assert FORMATS[name].refusal(_half(info, keep=range(8))) is None  # the identity holds everywhere


def test_quantized_hf_follows_the_family():
    """GPT-OSS stores its experts fused on disk: no quantized hf (FamilySpec.hf_quantized), so auto is compact."""
    for family, expected in (("qwen3_moe", "hf"), ("gpt_oss", "compact")):
        adapter = MoEAdapter(tiny_model(family))
        plan = CompressionPlan.identity(adapter)
        assert choose_format(plan) == "hf"
        plan, _ = quantize_plan(
            plan, {}, lambda l, e, a=adapter: a.layer(l).storage.read(e), QuantConfig(quant="w4c", algo="rtn")
        )
        assert choose_format(plan) == expected
    with pytest.raises(
        MoECompressError, match="the gpt_oss family's experts quantized.*use --format compact"
    ):
        choose_format(plan, "hf")


def test_load_dispatches_on_the_recorded_format(tmp_path, monkeypatch):
    model = tiny_model("qwen3_moe")
    plan = _half(ModelInfo.from_model(model))
    export(model, plan, tmp_path / "c", format="compact", quiet=True)
    export(model, plan, tmp_path / "h", format="hf", quiet=True)
    assert json.loads((tmp_path / "c" / "moecompress.json").read_text())["format"] == "compact"
    assert any(isinstance(m, CompressedMoEBlock) for m in load(tmp_path / "c").modules())
    assert not any(isinstance(m, CompressedMoEBlock) for m in load(tmp_path / "h").modules())
    # a format's reader is its class's `load`: a registered format is read by exactly that
    seen = []

    class Probe(CompactFormat):
        name = "probe"

        @staticmethod
        def load(d, *args, **kwargs):
            seen.append((d.name, args, kwargs))
            return "probe-model"

    monkeypatch.setitem(FORMATS, "probe", Probe)
    marker = json.loads((tmp_path / "c" / "moecompress.json").read_text())
    (tmp_path / "c" / "moecompress.json").write_text(json.dumps(dict(marker, format="probe")))
    assert load(tmp_path / "c", dtype="float32") == "probe-model"
    assert seen == [("c", (None, "float32", None, None), {"trust_remote_code": False})]  # never None
    (tmp_path / "c" / "moecompress.json").write_text(json.dumps(dict(marker, format=["compact"])))
    with pytest.raises(MoECompressError, match="names format"):
        load(tmp_path / "c")


def test_a_new_format_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    """The worked example of docs/architecture.md: `compact` under another name, refusing replacement operators."""

    class NoOpsFormat(formats.CompactFormat):
        name = "noops"

        @classmethod
        def reason(cls, plan):
            if any(lp.operators() for lp in plan.layers):
                return "it stores no replacement operators"
            return super().reason(plan)

    monkeypatch.setitem(FORMATS, NoOpsFormat.name, NoOpsFormat)
    model = tiny_model("olmoe")
    info = ModelInfo.from_model(model)
    plan = _remap(info)
    assert choose_format(plan, "noops") == "noops"
    result = export(model, plan, tmp_path / "n", format="noops", quiet=True)
    assert result.format == "noops" and not (tmp_path / "n" / "config.json").exists()
    reference = export(model, plan, tmp_path / "c", format="compact", quiet=True)
    assert result.weight_bytes == reference.weight_bytes
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "n")(ids).logits, load(tmp_path / "c")(ids).logits)
