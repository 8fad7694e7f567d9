"""PuzzleMoE end to end: method -> plan with packed merges -> packed runtime -> `packed` export -> load."""

import copy
import json
import struct

import pytest
import torch

from moecompress import apply_plan, export, load
from moecompress.errors import MoECompressError
from moecompress.methods.puzzle import (
    PuzzleConfig,
    build_puzzle,
    group_layout,
    layer_with_merges,
    pair_candidate,
)
from moecompress.methods.registry import MethodContext
from moecompress.models import MoEAdapter
from moecompress.plan import CompressionPlan, ModelInfo
from moecompress.puzzle import InputNorms, merge_expert_group, merge_expert_pair
from moecompress.puzzle.merge import GroupMerge, reconstruct_pair
from moecompress.puzzle.quant import dequantize_magnitudes, quantize_magnitudes
from moecompress.runtime.packed import PackedScopeExperts
from moecompress.testing import tiny_model
from moecompress.workflows.pipeline import choose_format

IDS = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))


class FakeStats:
    """Per-expert channel norms (what calibration's channel_norms collector stores), deterministic."""

    def __init__(self, adapter, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.data = {}
        for i in adapter.moe_layers:
            e, h, w = adapter.num_experts(i), adapter.hidden_size, adapter.intermediate_size(i)
            self.data[i] = {
                "in_channel_norm": torch.rand(e, h, generator=g) + 0.1,
                "mid_channel_norm": torch.rand(e, w, generator=g) + 0.1,
                "counts": torch.ones(e),
                "tokens": torch.tensor(10.0),
            }

    def require(self, *names, method=None):
        pass

    def get(self, layer, name):
        return self.data[layer][name]


def puzzle(model, **params):
    adapter = MoEAdapter(model)
    config = PuzzleConfig(**params)
    return build_puzzle(config, MethodContext(adapter, FakeStats(adapter)))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def dense_reference(model, plan, quant_bits=None, underflow="nearest"):
    """The original model with every merged slot's expert replaced by the reconstruction formula, computed
    densely from the original weights (merge -> bf16 round + clamp, or quantize -> Ŵ_e = (−1)^S ⊙ M ⊙ W_merged)."""
    ref = copy.deepcopy(model)
    adapter = MoEAdapter(ref)
    stats = FakeStats(adapter)
    for sc in plan.scopes:
        for s in sc.stored:
            if s.packing is None:
                continue
            members = [e for _, e in s.sources]
            layer = s.sources[0][0]
            ws = [adapter.get_expert(layer, e) for e in members]
            norms = [
                InputNorms(stats.get(layer, "in_channel_norm")[e], stats.get(layer, "mid_channel_norm")[e])
                for e in members
            ]
            if len(members) == 2:
                merge = merge_expert_pair(ws[0], ws[1], norms[0], norms[1], plan.params["tau"])
                if quant_bits is None:
                    recs = merge.rounded(underflow).reconstruct(torch.float32)
                else:
                    recs = []
                    parts = {}
                    for name in ("gate_up", "down"):
                        pm = getattr(merge, name)
                        q, scales = quantize_magnitudes(pm.w_merged, quant_bits, 128)
                        parts[name] = reconstruct_pair(
                            dequantize_magnitudes(q, scales, 128), pm.m_i, pm.m_j, pm.s_i, pm.s_j
                        )
                    i_size = ws[0].gate.shape[0]
                    for k in range(2):
                        gu = parts["gate_up"][k]
                        recs.append(type(ws[0])(gate=gu[:i_size], up=gu[i_size:], down=parts["down"][k]))
            else:
                groups = merge_expert_group(ws, norms, plan.params["tau"])
                gu, dn = (
                    GroupMerge(g.w_merged.bfloat16().float(), g.masks, g.signs).reconstruct()
                    for g in (groups["gate_up"], groups["down"])
                )
                i_size = ws[0].gate.shape[0]
                recs = [type(ws[0])(gate=g[:i_size], up=g[i_size:], down=d) for g, d in zip(gu, dn)]
            for e, w, orig in zip(members, recs, ws):
                w = type(orig)(
                    gate=w.gate,
                    up=w.up,
                    down=w.down,
                    gate_bias=orig.gate_bias,
                    up_bias=orig.up_bias,
                    down_bias=orig.down_bias,
                )
                dt = orig.gate.dtype
                adapter.set_expert(layer, e, w.map(lambda t, dt=dt: t.to(dt)))
    return ref


# ----------------------------------------------------------------------------------------- plan
def test_plan_pairs_are_one_packed_stored_expert_per_pair_and_validate():
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    plan, tensors = puzzle(model, ratio=0.5)
    for lp in plan.layers:
        sc = plan.scope(lp.scope)
        assert lp.gate == "replace" and len(sc.stored) == 4
        for s in sc.stored:
            assert s.construction == "elementwise_merge" and s.packing == "pair-bf16" and len(s.sources) == 2
            assert [lp.slots[e] for _, e in s.sources] == [s.id, s.id]  # both members' slots map to the pair
            assert tensors[f"{s.tensor}.gate_up.packed"].dtype == torch.int16
    again = CompressionPlan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    plan.check_tensors(tensors)
    # bytes: exactly half the original routed experts (bf16 pairs), declared and counted from tensors
    assert plan.logical_bytes(tensors).stored_experts == plan.model.expert_bytes // 2
    assert plan.logical_bytes().stored_experts == plan.model.expert_bytes // 2
    # quarter: half the experts paired, the others copies
    plan25, _ = puzzle(model, ratio=0.25)
    assert [len(plan25.scope(lp.scope).stored) for lp in plan25.layers] == [6, 6]
    assert (
        group_layout(16, 0.667) == (3, 5)
        and group_layout(16, 0.75) == (4, 4)
        and group_layout(8, 0.25) == (2, 2)
    )


def test_plan_refuses_inconsistent_packed_experts():
    model = tiny_model("qwen3_moe")
    plan, tensors = puzzle(model, ratio=0.5)
    data = json.loads(plan.to_json())
    slots = data["layers"][0]["slots"]
    a, b = 0, next(e for e in range(8) if slots[e] != slots[0])
    slots[a], slots[b] = slots[b], slots[a]  # slot a now maps to a pair it is not a member of
    with pytest.raises(MoECompressError, match="can only compute its own member"):
        CompressionPlan.model_validate(data)
    data = json.loads(plan.to_json())
    data["scopes"][0]["stored"][0]["packing"] = "pair-q5-g128"
    with pytest.raises(MoECompressError, match="use 3 or 4"):
        CompressionPlan.model_validate(data)
    bad = dict(tensors)
    key = next(k for k in bad if k.endswith("gate_up.packed"))
    bad[key] = bad[key][:-1]
    with pytest.raises(MoECompressError, match="do not belong to this plan"):
        plan.check_tensors(bad)
    with pytest.raises(MoECompressError, match="use --format packed"):
        choose_format(plan, "compact")
    with pytest.raises(MoECompressError, match="packed element-wise merges"):
        choose_format(plan, "hf")
    assert choose_format(plan) == "packed"
    # old plans (no packing field) stay valid and choose their old formats
    info = ModelInfo.from_model(model)
    old = CompressionPlan.prune(info, {li.layer: [0, 1, 2, 3] for li in info.layers})
    assert "packing" not in old.to_json() and choose_format(old) == "hf"


# ----------------------------------------------------------------------------------------- runtime
@pytest.mark.parametrize(
    "family, dtype, params",
    [
        ("qwen3_moe", torch.float32, dict(ratio=0.5)),
        ("qwen3_moe", torch.bfloat16, dict(ratio=0.5)),
        ("olmoe", torch.float32, dict(ratio=0.25, underflow="clamp")),
        ("gpt_oss", torch.float32, dict(ratio=0.5)),
        ("qwen3_moe", torch.float32, dict(ratio=0.5, quant_bits=3)),
        ("mixtral", torch.float32, dict(ratio=0.75)),
    ],
)
def test_packed_runtime_equals_dense_reconstruction(family, dtype, params):
    model = tiny_model(family, dtype=dtype)
    plan, tensors = puzzle(model, **params)
    ref = dense_reference(model, plan, params.get("quant_bits"), params.get("underflow", "nearest"))
    runtime = apply_plan(copy.deepcopy(model), plan, tensors)
    scopes = [m for m in runtime.modules() if isinstance(m, PackedScopeExperts)]
    # packed in memory, not decoded at build time: the merges hold only their packed tensors
    assert len(scopes) == len(plan.layers) and all(len(sc.merged) for sc in scopes)
    dense_elems = sum(0 if sc.dense is None else sc.dense.gate_up_proj.numel() for sc in scopes)
    n_copies = sum(1 for sc in plan.scopes for s in sc.stored if s.packing is None)
    assert dense_elems == n_copies * 2 * plan.model.layers[0].intermediate_size * plan.model.hidden_size
    # block level: every MoE layer on the same hidden states
    r_ad = MoEAdapter(ref)
    h = torch.randn(40, r_ad.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    for i in r_ad.moe_layers:
        with torch.no_grad():
            want = r_ad.moe_forward(i, h)
            blk = getattr(runtime.model.layers[i], r_ad.layer(i).block_attr)
            got = blk(h[None])
            got = (got[0] if isinstance(got, tuple) else got).reshape(want.shape)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
    if dtype == torch.float32:
        torch.testing.assert_close(logits(runtime), logits(ref), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------- export / load
def _header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n])


def _scope_bytes(directory):
    head = _header(directory / "model.safetensors")
    return sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in head.items()
        if k.startswith("moecompress.scopes.")
    )


def test_packed_export_is_exactly_half_the_bf16_pairs_and_loads_back(tmp_path):
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    plan, tensors = puzzle(model, ratio=0.5)
    res = export(model, plan, tmp_path / "p50", format=choose_format(plan), tensors=tensors, quiet=True)
    assert res.format == "packed" and not res.evaluation_only
    assert (
        _scope_bytes(tmp_path / "p50") == plan.model.expert_bytes // 2
    )  # every packed tensor once: 2 B/element
    head = _header(tmp_path / "p50" / "model.safetensors")
    assert {v["dtype"] for k, v in head.items() if k.endswith(".packed")} == {"I16"}
    assert json.loads((tmp_path / "p50" / "moecompress.json").read_text())["format"] == "packed"
    expected = logits(apply_plan(copy.deepcopy(model), plan, tensors))
    back = load(tmp_path / "p50")
    assert torch.equal(logits(back), expected)
    assert any(type(m).__name__ == "PackedPairExperts" for m in back.modules())
    # 25 %: four copies at full size plus two packed pairs at half
    plan25, t25 = puzzle(model, ratio=0.25)
    export(model, plan25, tmp_path / "p25", format="packed", tensors=t25, quiet=True)
    per = plan.model.layers[0].bytes_per_expert
    assert _scope_bytes(tmp_path / "p25") == 2 * (4 * per + 2 * per)
    assert torch.equal(logits(load(tmp_path / "p25")), logits(apply_plan(copy.deepcopy(model), plan25, t25)))


@pytest.mark.parametrize("params", [dict(ratio=0.5, quant_bits=3), dict(ratio=0.667)])
def test_quantized_and_group_merges_round_trip_in_float32(tmp_path, params):
    model = tiny_model("qwen3_moe")
    plan, tensors = puzzle(model, **params)
    export(model, plan, tmp_path / "q", format="packed", tensors=tensors, quiet=True)
    expected = logits(apply_plan(copy.deepcopy(model), plan, tensors))
    back = load(tmp_path / "q", dtype="float32")
    assert torch.equal(logits(back), expected)
    # the materialized export writes every member's own reconstruction into its slot
    export(model, plan, tmp_path / "m", format="materialized", tensors=tensors, quiet=True)
    torch.testing.assert_close(logits(load(tmp_path / "m")), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(MoECompressError, match="format='packed'"):
        export(model, plan, tmp_path / "c", format="compact", tensors=tensors, quiet=True)


# ----------------------------------------------------------------------------------------- integration API
def test_pair_candidate_api_for_auto():
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    adapter = MoEAdapter(model)
    stats = FakeStats(adapter)
    c = pair_candidate(adapter, 1, 2, 5, stats=stats)
    assert c.members == (2, 5) and c.packing == "pair-bf16"
    assert c.nbytes == adapter.layer(1).storage.read(0).gate.numel() * 3 * 2  # half of two bf16 experts
    assert 0 < c.rel_error < 1 and c.est_error == pytest.approx(sum(c.member_errors))
    x = torch.randn(3, adapter.hidden_size, dtype=torch.bfloat16)
    y_i, y_j = c.forward([x, None])
    assert y_j is None and y_i.shape == x.shape
    # identical experts merge losslessly (up to the exponent clamp of values below 2^-15)
    adapter.set_expert(1, 5, adapter.get_expert(1, 2))
    same = pair_candidate(adapter, 1, 2, 5, stats=stats)
    assert same.rel_error < 1e-6
    sc, lp, tensors = layer_with_merges(1, 8, [c])
    assert [s.packing for s in sc.stored].count("pair-bf16") == 1 and lp.slots[2] == lp.slots[5]
    assert sorted(tensors) == ["layer1.merge0.down.packed", "layer1.merge0.gate_up.packed"]


# ----------------------------------------------------------------------------------------- CLI
def test_compress_cli_writes_a_packed_checkpoint(tmp_path, capsys):
    from moecompress.calibrate import calibrate
    from moecompress.cli import main
    from moecompress.data import CalibrationData
    from moecompress.testing import save_tiny

    path = save_tiny("qwen3_moe", tmp_path / "model", seed=1)
    ids = torch.randint(3, 96, (6, 16), generator=torch.Generator().manual_seed(0))
    calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=16,
        out=tmp_path / "stats",
        stats=["counts", "tokens", "in_channel_norm", "mid_channel_norm"],
        dtype="float32",
        progress=False,
    )
    out = tmp_path / "puzzle"
    try:
        main(
            [
                "compress",
                str(path),
                "--method",
                "puzzlemoe",
                "--ratio",
                "0.5",
                "--param",
                "quant_bits=3",
                "--calib",
                str(tmp_path / "stats"),
                "--out",
                str(out),
            ]
        )
        code = 0
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "packed checkpoint" in captured.out
    plan = json.loads((out / "plan.json").read_text())
    assert plan["method"] == "puzzlemoe" and plan["params"]["quant_bits"] == 3
    assert {s.get("packing") for sc in plan["scopes"] for s in sc["stored"]} == {"pair-q3-g128"}
    assert torch.isfinite(logits(load(out))).all()


def test_evolve_pairing_scores_its_proxy_and_never_loses_to_random():
    plan, _ = puzzle(tiny_model("qwen3_moe"), ratio=0.5, pairing="evolve", population=6, generations=4)
    for row in plan.params["puzzle"]["layers"]:
        assert row["proxy_loss"] <= row["random_proxy_loss"]
        assert row["est_error"] == pytest.approx(
            row["proxy_loss"], rel=1e-5
        )  # the chosen groups' summed error
