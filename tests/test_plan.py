"""CompressionPlan: JSON round trip, determinism, validation sentences, byte accounting (hf expressibility:
test_formats.py)."""

import json

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.models import MoEAdapter
from moecompress.plan import (
    CompressionPlan,
    ConstantOp,
    LayerPlan,
    ModelInfo,
    PartialOp,
    Scope,
    StoredExpert,
    TiltOp,
)
from moecompress.testing import tiny_model


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def info(qwen):
    return ModelInfo.from_model(qwen)


def _one_sentence(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.endswith(".") and len(msg) < 400, msg
    return msg


def _mixed_plan(info):
    """A plan using every kind of slot target and two scopes (one cross-layer)."""
    scope = Scope(
        id="pool",
        layers=[0, 1],
        stored=[
            StoredExpert(id=0, sources=[(0, 1)]),
            StoredExpert(id=1, sources=[(0, 2), (1, 3)], construction="weighted_merge", weights=[0.25, 0.75]),
            StoredExpert(id=2, sources=[(1, 4), (1, 5)], construction="dense_group"),
        ],
    )
    l0 = LayerPlan(
        layer=0,
        scope="pool",
        gate="replace",
        slots=[
            0,
            1,
            2,
            "drop",
            ConstantOp(tensor="c0"),
            TiltOp(rank=3, tensor="t0"),
            PartialOp(source=(0, 6), width=5, tensor="p0"),
            0,
        ],
    )
    l1 = LayerPlan(layer=1, scope="pool", gate="aggregate", slots=[0, 0, 1, 1, 2, 2, 1, 0])
    return CompressionPlan(
        model=info, scopes=[scope], layers=[l0, l1], method="hand", params={"b": 1, "a": [2]}
    )


def test_json_round_trip_is_exact_and_deterministic(info, tmp_path):
    plan = _mixed_plan(info)
    text = plan.to_json()
    back = CompressionPlan.from_json(text)
    assert back == plan and back.to_json() == text
    assert _mixed_plan(info).to_json() == text  # same inputs -> byte-identical JSON
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=1) + "\n"  # keys sorted
    data = json.loads(text)
    assert data["schema_version"] == 1 and data["layers"][0]["slots"][3] == "drop"
    assert data["layers"][0]["slots"][4] == {"op": "constant", "tensor": "c0"}
    tensors = {"c0.value": torch.randn(32)}
    plan.save(tmp_path, tensors)
    loaded, loaded_tensors = CompressionPlan.load(tmp_path)
    assert loaded == plan and torch.equal(loaded_tensors["c0.value"], tensors["c0.value"])


def test_builders_describe_pruning_and_remapping(qwen, info):
    ident = CompressionPlan.identity(qwen)
    assert all(lp.slots == list(range(8)) for lp in ident.layers)
    pruned = CompressionPlan.prune(info, {0: [1, 3, 5, 7], 1: [0, 1, 2, 3]}, gate="keep")
    assert pruned.layer(0).slots == ["drop", 0, "drop", 1, "drop", 2, "drop", 3]
    assert [s.sources for s in pruned.scope("layer0").stored] == [[(0, 1)], [(0, 3)], [(0, 5)], [(0, 7)]]
    remap = CompressionPlan.remap(info, {0: [0, 0, 2, 2, 4, 4, 6, 6]})
    assert remap.layer(0).slots == [0, 0, 1, 1, 2, 2, 3, 3] and remap.layer(0).gate == "aggregate"
    assert remap.summary()[0] == dict(
        layer=0, scope="layer0", stored=4, gate="aggregate", slots=8, to_stored=8, operators=0, dropped=0
    )


def test_byte_accounting(qwen, info):
    adapter = MoEAdapter(qwen)
    per_expert = sum(t.numel() * 4 for t in adapter.get_expert(0, 0).tensors().values())
    assert info.layer(0).bytes_per_expert == per_expert
    total_params = sum(p.numel() * 4 for p in qwen.parameters())
    ident = CompressionPlan.identity(qwen).logical_bytes()
    assert ident.total == ident.original == total_params
    half = CompressionPlan.prune(info, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}).logical_bytes()
    assert half.stored_experts == 8 * per_expert and half.operators == 0
    assert half.original - half.total == 8 * per_expert
    mixed = _mixed_plan(info).logical_bytes()
    h, width = 32, 16
    assert mixed.stored_experts == per_expert + per_expert + 3 * (2 * width) * h * 4
    assert mixed.operators == (h + (2 * h * 3 + h) + (3 * 5 * h + h)) * 4


def test_keep_equals_renorm_flag_follows_the_router(info):
    olmoe = ModelInfo.from_model(tiny_model("olmoe"))
    assert info.layer(0).keep_equals_renorm and not olmoe.layer(0).keep_equals_renorm


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d["layers"].pop(), "no entry for MoE layer 1"),
        (lambda d: d["layers"][0]["slots"].pop(), "maps 7 slots"),
        (lambda d: d["layers"][0].__setitem__("slots", [9] * 8), "maps to stored expert 9"),
        (lambda d: d["scopes"][0]["stored"].append({"id": 8, "sources": [[0, 1]]}), "never used"),
        (
            lambda d: d["scopes"][0]["stored"][0].__setitem__("sources", [[0, 1], [0, 2]]),
            "exactly one source",
        ),
        (lambda d: d["scopes"][0]["stored"][0].__setitem__("sources", [[1, 0]]), "outside the scope"),
        (
            lambda d: d["scopes"][0]["stored"][0].__setitem__("sources", [[0, 99]]),
            "not an expert of the model",
        ),
        (lambda d: d["layers"][0].__setitem__("scope", "nope"), "does not define"),
        (lambda d: d.__setitem__("schema_version", 7), "schema version 7"),
        (lambda d: d["layers"][0].__setitem__("gate", "sometimes"), "invalid at 'layers.0.gate'"),
    ],
)
def test_invalid_plans_are_refused_with_one_sentence(qwen, mutate, expected):
    data = json.loads(CompressionPlan.identity(qwen).to_json())
    mutate(data)
    with pytest.raises(MoECompressError) as exc:
        CompressionPlan.from_json(json.dumps(data))
    assert expected in _one_sentence(exc)


def test_not_json_is_refused(tmp_path):
    (tmp_path / "plan.json").write_text("{ nope")
    with pytest.raises(MoECompressError) as exc:
        CompressionPlan.load(tmp_path)
    assert "not valid JSON" in _one_sentence(exc)
    with pytest.raises(MoECompressError) as exc:
        CompressionPlan.load(tmp_path / "missing")
    assert "No plan" in _one_sentence(exc)


def test_top_k_larger_than_experts_left_is_refused(info):
    with pytest.raises(MoECompressError) as exc:
        CompressionPlan.prune(info, {0: [3], 1: [0, 1]}, gate="renorm")
    assert "leaves 1 routable experts but the router selects top-2" in _one_sentence(exc)
    # under `replace` nothing is removed from the router, so one stored expert is fine
    CompressionPlan.prune(info, {0: [3], 1: [0, 1]}, gate="replace")


def tiny_info_v3():
    return ModelInfo.from_model(tiny_model("deepseek_v3"))


def test_group_limited_feasibility_known_cases():
    # DeepSeek-V2 tiny: 8 experts in 4 groups of 2, the best 2 groups by max score; here top-3
    v2 = ModelInfo.from_model(tiny_model("deepseek_v2", num_experts_per_tok=3))
    assert (v2.layer(1).n_group, v2.layer(1).topk_group, v2.layer(1).top_k) == (4, 2, 3)
    # groups keep (2, 1, 0, 0): two live groups hold 3 >= top-3, feasible
    CompressionPlan.prune(v2, {1: [0, 1, 2], 2: list(range(8))})
    with pytest.raises(MoECompressError) as exc:  # groups keep (1, 1, 1, 0): any two live groups hold 2 < 3
        CompressionPlan.prune(v2, {1: [0, 2, 4], 2: list(range(8))})
    assert "group-limited routing infeasible" in _one_sentence(exc)
    with pytest.raises(MoECompressError) as exc:  # DeepSeek-V3 scores groups by their top-2 sum
        CompressionPlan.prune(tiny_info_v3(), {1: [0, 1, 2, 3, 4], 2: list(range(8))})
    assert "single expert" in _one_sentence(exc)


def test_missing_or_misshapen_tensors_are_refused(info):
    plan = _mixed_plan(info)
    with pytest.raises(MoECompressError) as exc:
        plan.check_tensors({})
    assert "lack 'c0.value'" in _one_sentence(exc)
    tensors = {
        "c0.value": torch.zeros(32),
        "t0.U": torch.zeros(32, 3),
        "t0.V": torch.zeros(32, 4),
        "t0.bias": torch.zeros(32),
    }
    with pytest.raises(MoECompressError) as exc:
        plan.check_tensors(tensors)
    assert "'t0.V' has shape (32, 4), expected (32, 3)" in _one_sentence(exc)


def test_plan_for_another_model_is_refused(info):
    plan = CompressionPlan.prune(info, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
    with pytest.raises(MoECompressError) as exc:
        plan.check_model(MoEAdapter(tiny_model("olmoe")))
    assert "made for a qwen3_moe model" in _one_sentence(exc)
