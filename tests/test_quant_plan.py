"""Quantization as a plan precision: bytes, runtime, compact and compressed-tensors exports, composition."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moecompress.api import export, load
from moecompress.errors import MoECompressError
from moecompress.export.formats import HFFormat
from moecompress.methods.quantize import QuantConfig, quantize_plan
from moecompress.models import MoEAdapter, load_model
from moecompress.plan import CompressionPlan
from moecompress.runtime import CompressedMoEBlock, apply_plan
from moecompress.testing import calibrated_tiny, run_cli, save_tiny, tiny_model
from moecompress.workflows.pipeline import build_plan

IDS = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(1))


def _source(adapter):
    return lambda l, e: adapter.layer(l).storage.read(e)


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits.float()


def _routed_weight_bytes(path) -> int:
    """Bytes of the routed-expert tensors in an export's safetensors (quantized codes and scales included)."""
    total = 0
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                if ".experts." in key or key.startswith("moecompress.scopes."):
                    t = f.get_tensor(key)
                    total += t.numel() * t.element_size()
    return total


COMPOSED = [
    ("prune", {"criterion": "reap", "ratio": 0.5, "gate": "renorm"}, "w4g32", "gptq"),
    ("conmoe", {"ratio": 0.5, "scope_size": 2}, "w3g32", "gptq"),
    ("puzzlemoe", {"ratio": 0.25, "quant_bits": 3, "quant_group": 32}, "w4g32a", "rtn"),
]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from moecompress.workflows.pipeline import needs_for

    needs = {
        s
        for method, params, spec, algo in COMPOSED
        for s in needs_for(method, params, {"quant": spec, "algo": "gptq"})
    }
    needs |= {"hessian_in_g2", "hessian_mid_g2"}  # the gate²-weighted variant (weighting="gate2")
    return calibrated_tiny(tmp_path_factory.mktemp("qplan"), "qwen3_moe", 0, sorted(needs))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("qtiny") / "model")
    return path, MoEAdapter(load_model(str(path), dtype="float32"))


@pytest.mark.parametrize("spec", ["w4g32", "w3g32", "w2c", "w8g32a"])
def test_quant_method_bytes_and_compact_roundtrip(tmp_path, calibrated, spec):
    path, store, adapter, _ = calibrated
    plan, tensors = build_plan(adapter, "quant", {"quant": spec, "algo": "gptq"}, store)
    assert all(s.quant is not None and s.quant.name() == spec for sc in plan.scopes for s in sc.stored)
    res = export(str(path), plan, tmp_path / "c", format="compact", tensors=tensors, quiet=True)
    # the plan's byte count is the stored bytes: codes, scales (and zero points) only
    stored = plan.logical_bytes(tensors).stored_experts
    assert abs(_routed_weight_bytes(tmp_path / "c") - stored) <= 0.01 * stored
    assert res.weight_bytes < res.original_bytes
    model = load(tmp_path / "c")
    runtime = apply_plan(load_model(str(path), dtype="float32"), plan, tensors)
    assert torch.equal(_logits(model), _logits(runtime))


def test_gptq_beats_rtn_on_the_calibration_tokens(calibrated):
    path, store, adapter, _ = calibrated
    ref = _logits(load_model(str(path), dtype="float32"))
    kl = {}
    for algo in ("rtn", "gptq"):
        plan, tensors = build_plan(adapter, "quant", {"quant": "w2g32", "algo": algo}, store)
        out = _logits(apply_plan(load_model(str(path), dtype="float32"), plan, tensors))
        kl[algo] = torch.nn.functional.kl_div(
            out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
        ).item()
    assert 0 < kl["gptq"] < kl["rtn"]


def test_hf_export_is_compressed_tensors_and_loads(tmp_path, calibrated):
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, convert_checkpoint

    path, store, adapter, _ = calibrated
    plan, tensors = build_plan(adapter, "prune", {"criterion": "reap", "ratio": 0.5, "gate": "renorm"}, store)
    plan, tensors = quantize_plan(plan, tensors, _source(adapter), QuantConfig(quant="w4c"), store)
    assert HFFormat.reason(plan) is None
    export(str(path), plan, tmp_path / "hf", format="hf", tensors=tensors, quiet=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.endswith("experts.0.gate_proj.weight_packed") for k in keys)
    assert not any(".experts." in k and k.endswith("proj.weight") for k in keys)
    # compressed-tensors' own decompression equals the runtime's dequantized weights
    convert_checkpoint(
        str(tmp_path / "hf"),
        str(tmp_path / "dq"),
        converter=CompressedTensorsDequantizer(str(tmp_path / "hf"), dtype=torch.bfloat16),
        max_workers=1,
        device="cpu",
    )
    runtime = apply_plan(load_model(str(path), dtype="float32"), plan, tensors)
    blocks = {m.layer_index: m for m in runtime.modules() if isinstance(m, CompressedMoEBlock)}
    with safe_open(str(tmp_path / "dq" / "model.safetensors"), "pt") as f:
        for i, block in blocks.items():
            stored = block.stored.fused()
            lp = plan.layer(i)
            for j, e in enumerate([e for e, t in enumerate(lp.slots) if isinstance(t, int)]):
                k = lp.slots[e]
                gate = f.get_tensor(f"model.layers.{i}.mlp.experts.{j}.gate_proj.weight")
                down = f.get_tensor(f"model.layers.{i}.mlp.experts.{j}.down_proj.weight")
                width = gate.shape[0]
                assert torch.equal(gate.float(), stored["gate_up_proj"][k][:width].float())
                assert torch.equal(down.float(), stored["down_proj"][k].float())
    # plain transformers (with compressed-tensors) loads it and computes what the runtime computes
    hf = load_model(str(tmp_path / "hf"), dtype="float32")
    for p in hf.parameters():  # CT dequantizes the experts to bf16; compare the arithmetic in float32
        p.data = p.data.float()
    torch.testing.assert_close(_logits(hf), _logits(runtime), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("method", "params", "spec", "algo"), COMPOSED, ids=[c[0] for c in COMPOSED])
def test_composed_plans_reload_equal(tmp_path, calibrated, method, params, spec, algo):
    path, store, adapter, _ = calibrated
    plan, tensors = build_plan(adapter, method, params, store)
    plan, tensors = quantize_plan(plan, tensors, _source(adapter), QuantConfig(quant=spec, algo=algo), store)
    stored = [s for sc in plan.scopes for s in sc.stored]
    assert all((s.quant is None) == (s.packing is not None) for s in stored)  # PuzzleMoE pairs keep their q3
    fmt = "packed" if plan.has_packed() else "compact"
    res = export(str(path), plan, tmp_path / "c", format=fmt, tensors=tensors, quiet=True)
    stored_bytes = plan.logical_bytes(tensors).stored_experts
    assert abs(_routed_weight_bytes(tmp_path / "c") - stored_bytes) <= 0.01 * stored_bytes
    runtime = apply_plan(load_model(str(path), dtype="float32"), plan, tensors)
    assert torch.equal(_logits(load(tmp_path / "c")), _logits(runtime))
    assert res.weight_bytes < res.original_bytes


def test_quantized_scope_stays_packed_in_memory(tiny):
    path, adapter = tiny
    plan, tensors = build_plan(adapter, "quant", {"quant": "w4g32", "algo": "rtn"}, None)
    model = apply_plan(load_model(str(path), dtype="bfloat16"), plan, tensors)
    resident = sum(m.stored.resident_bytes() for m in model.modules() if isinstance(m, CompressedMoEBlock))
    assert resident == plan.logical_bytes(tensors).stored_experts
    bf16_bytes = 2 * plan.model.expert_bytes // plan.model.element_size
    assert resident < 0.4 * bf16_bytes  # 4 bits + a bf16 scale per 32 weights, vs 16 bits


def test_bad_quant_spec_is_one_sentence(tmp_path, capsys):
    path = save_tiny("olmoe", tmp_path / "m")
    code, out, err = run_cli(
        ["compress", str(path), "--method", "quant", "--param", "quant=w5g7", "--out", str(tmp_path / "o")],
        capsys,
    )
    assert code == 2 and "Traceback" not in err and "w5g7" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(MoECompressError, match="w4g100"):
        QuantConfig(quant="w4g100")


def test_gpt_oss_quantized_compact_roundtrip(tmp_path):
    model = tiny_model("gpt_oss")
    model.save_pretrained(tmp_path / "m")
    adapter = MoEAdapter(load_model(str(tmp_path / "m"), dtype="float32"))
    plan, tensors = quantize_plan(
        CompressionPlan.identity(adapter), {}, _source(adapter), QuantConfig(quant="w4c", algo="rtn")
    )
    export(str(tmp_path / "m"), plan, tmp_path / "c", format="compact", tensors=tensors, quiet=True)
    runtime = apply_plan(load_model(str(tmp_path / "m"), dtype="float32"), plan, tensors)
    assert torch.equal(_logits(load(tmp_path / "c")), _logits(runtime))


def test_ragged_groups_stay_compact(tiny):
    path, adapter = tiny
    plan, _ = build_plan(adapter, "quant", {"quant": "w4g32", "algo": "rtn"}, None)
    why = HFFormat.reason(plan)  # down's input is 16 wide: a 32-group is ragged there
    assert why is not None and "group 32" in why
    plan, _ = build_plan(adapter, "quant", {"quant": "w4c", "algo": "rtn"}, None)
    assert HFFormat.reason(plan) is None


@pytest.mark.parametrize("actorder,weighting", [(False, "uniform"), (True, "uniform"), (True, "gate2")])
def test_plan_codes_equal_per_expert_gptq(calibrated, actorder, weighting):
    """The method's batched quantization (its actorder field, and the Hessians its weighting names) gives each
    expert's own GPTQ codes."""
    from moecompress.quant import gptq
    from moecompress.quant.spec import QuantSpec

    _, store, adapter, _ = calibrated
    suffix = "_g2" if weighting == "gate2" else ""
    plan, tensors = build_plan(
        adapter,
        "quant",
        {"quant": "w2g32", "algo": "gptq", "actorder": actorder, "weighting": weighting},
        store,
    )
    spec = QuantSpec.parse("w2g32", actorder=actorder)
    assert all(s.quant.actorder is actorder for sc in plan.scopes for s in sc.stored)
    i = adapter.moe_layers[0]
    sc = plan.scope_of(i)
    for s in sc.stored[:3]:
        w = adapter.layer(i).storage.read(s.id)
        for part, name in (("gate", "hessian_in" + suffix), ("down", "hessian_mid" + suffix)):
            want = gptq(getattr(w, part).float(), store.get(i, name)[s.id].double(), spec).packed()
            for k, v in want.items():
                assert torch.equal(tensors[f"{s.tensor}.{part}.{k}"], v), (s.id, part, k)
    if weighting == "gate2":  # the weighting is visible: the uniform Hessians give other codes
        _, uniform = build_plan(adapter, "quant", {"quant": "w2g32", "actorder": actorder}, store)
        assert any(not torch.equal(uniform[k], tensors[k]) for k in tensors)


def test_gptq_plans_order_columns_by_default(calibrated):
    """`quant` and `auto`'s quantized candidates use act order unless asked not to (llm-compressor's default)."""
    from moecompress.methods.auto.quant import quant_spec

    _, store, adapter, _ = calibrated
    for params, want in (({"quant": "w2g32"}, True), ({"quant": "w2g32", "algo": "rtn"}, False)):
        plan, _ = build_plan(adapter, "quant", params, store if want else None)
        assert {s.quant.actorder for sc in plan.scopes for s in sc.stored} == {want}
    assert quant_spec(3, 128, "gptq").actorder and not quant_spec(3, 128, "rtn").actorder


def test_an_expert_no_token_reached_is_rounded_not_zeroed(calibrated):
    from moecompress.methods.quantize import _hessian

    path, store, adapter, _ = calibrated
    h = store.get(adapter.moe_layers[0], "hessian_in")

    class Zeroed:  # the store with expert 0 of the first layer unreached
        def get(self, layer, name):
            t = store.get(layer, name).clone()
            t[0] = 0
            return t

    assert _hessian(Zeroed(), "hessian_in", [(adapter.moe_layers[0], 0)], h.shape[-1]) is None
    assert _hessian(store, "hessian_in", [(adapter.moe_layers[0], 1)], h.shape[-1]) is not None


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_a_quantized_scope_dequantized_a_range_at_a_time_computes_the_same(
    tmp_path, monkeypatch, family, impl
):
    from moecompress.runtime import quantized

    model = tiny_model(family)
    model.save_pretrained(tmp_path / "m")
    adapter = MoEAdapter(load_model(str(tmp_path / "m"), dtype="float32"))
    plan, tensors = quantize_plan(
        CompressionPlan.identity(adapter), {}, _source(adapter), QuantConfig(quant="w4c", algo="rtn")
    )

    def logits_and_widest():
        runtime = apply_plan(load_model(str(tmp_path / "m"), dtype="float32"), plan, tensors)
        runtime.set_experts_implementation(impl)
        widest = []
        for m in runtime.modules():
            if isinstance(m, quantized.QuantizedStoredExperts):
                real = m.fused_range
                m.fused_range = lambda lo, hi, real=real: widest.append(hi - lo) or real(lo, hi)
        return _logits(runtime), max(widest)

    whole, widest = logits_and_widest()
    experts = plan.model.layers[0].num_experts
    assert widest == experts  # under DEQUANT_BYTES: the scope is one range, exactly the fused kernel
    per_expert = 3 * plan.model.hidden_size * plan.scope_width(plan.scopes[0]) * 4
    monkeypatch.setattr(quantized, "DEQUANT_BYTES", 3 * per_expert)
    ranged, widest = logits_and_widest()
    assert widest == 3 < experts
    # each range's pairs run alone; each token's top-k outputs are summed in the same order
    assert torch.equal(ranged, whole)


def test_quantized_biased_experts_count_their_biases(tmp_path):
    """GPT-OSS experts keep gate/up/down biases beside the codes: the plan's bytes, `auto`'s per-expert price and
    the tensors stored all count them."""
    from moecompress.methods.auto.quant import expert_quant_bytes
    from moecompress.quant.spec import QuantSpec

    adapter = MoEAdapter(load_model(str(save_tiny("gpt_oss", tmp_path / "m")), dtype="float32"))
    plan, tensors = build_plan(adapter, "quant", {"quant": "w4c", "algo": "rtn"}, None)
    biases = [k for k in tensors if k.endswith("_bias")]
    assert plan.model.expert_bias and biases
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert plan.logical_bytes(tensors).stored_experts == stored
    w = adapter.get_expert(adapter.moe_layers[0], 0)
    per_expert = expert_quant_bytes(
        QuantSpec.parse("w4c", algo="rtn"), *w.gate.shape, True, plan.model.element_size
    )
    n = sum(adapter.num_experts(i) for i in adapter.moe_layers)
    assert per_expert * n == stored
