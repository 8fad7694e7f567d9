"""Exporters write checkpoints that are really smaller, load back, and fail cleanly."""

import json
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM

from moecompress import apply_plan, export, load
from moecompress.errors import MoECompressError
from moecompress.export import ShardWriter
from moecompress.plan import CompressionPlan, ConstantOp, LayerPlan, ModelInfo, Scope, StoredExpert, TiltOp
from moecompress.testing import save_tiny, tiny_model

IDS = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
OVERRIDES = {"deepseek_v3": dict(n_group=2, topk_group=1)}  # 2 groups of 4: a half plan keeps 2 per group


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def half_plan(model, gate="renorm", keep=(0, 1, 4, 6)):
    info = ModelInfo.from_model(model)
    return CompressionPlan.prune(info, {li.layer: list(keep) for li in info.layers}, gate=gate)


def remap_plan(model, gate="aggregate"):
    info = ModelInfo.from_model(model)
    return CompressionPlan.remap(info, {li.layer: [0, 0, 2, 2, 4, 5, 5, 5] for li in info.layers}, gate=gate)


def header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n])


# ----------------------------------------------------------------------------- hf
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_hf_export_loads_with_plain_transformers_and_matches_runtime(family, tmp_path):
    kw = OVERRIDES.get(family, {})
    model = tiny_model(family, **kw)
    plan = half_plan(model, keep=(0, 1, 4, 5))
    result = export(model, plan, tmp_path / "hf", format="hf", quiet=True)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    torch.testing.assert_close(
        logits(plain), logits(apply_plan(tiny_model(family, **kw), plan)), atol=1e-6, rtol=1e-6
    )
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert 4 in [cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")]
    keys = set(header(tmp_path / "hf" / "model.safetensors"))
    if family in (
        "qwen3_moe",
        "olmoe",
        "deepseek_v3",
    ):  # the family's own per-expert on-disk names (vLLM reads them)
        layer = plan.layers[0].layer
        assert f"model.layers.{layer}.mlp.experts.3.gate_proj.weight" in keys
        assert not any(f"layers.{layer}.mlp.experts.4." in k for k in keys)
    assert result.weight_bytes < result.original_bytes  # (the 1% figure is asserted on a bigger model below)
    assert (
        abs(result.weight_bytes - result.logical_bytes) < 0.05 * result.logical_bytes
    )  # tiny: headers weigh
    assert not result.evaluation_only
    assert json.loads((tmp_path / "hf" / "moecompress.json").read_text())["format"] == "hf"
    assert CompressionPlan.from_json((tmp_path / "hf" / "plan.json").read_text()) == plan


def test_hf_refuses_plans_a_config_cannot_express(tmp_path):
    model = tiny_model("qwen3_moe")
    with pytest.raises(MoECompressError, match="'hf' format cannot express this plan .*several slots"):
        export(model, remap_plan(model), tmp_path / "x", format="hf", quiet=True)
    with pytest.raises(MoECompressError, match="'hf' format cannot express this plan .*gate 'replace'"):
        export(model, half_plan(model, gate="replace"), tmp_path / "x", format="hf", quiet=True)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- compact / materialized / load
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v2"])
def test_compact_remap_equals_materialized_and_every_format_round_trips(family, tmp_path):
    model = tiny_model(family)
    plan = remap_plan(model)
    compact = export(model, plan, tmp_path / "compact", format="compact", quiet=True)
    mat = export(model, plan, tmp_path / "mat", format="materialized", quiet=True)
    assert mat.evaluation_only and not compact.evaluation_only
    assert "NOT compressed" in mat.describe()
    from_compact = logits(load(tmp_path / "compact"))
    from_mat = logits(load(tmp_path / "mat"))
    torch.testing.assert_close(from_compact, from_mat, atol=1e-5, rtol=1e-5)
    assert torch.equal(
        from_compact, logits(apply_plan(tiny_model(family), plan))
    )  # load == in-memory runtime
    plain_mat = AutoModelForCausalLM.from_pretrained(tmp_path / "mat", dtype=torch.float32)
    assert torch.equal(logits(plain_mat), from_mat)
    assert compact.weight_bytes < 0.8 * mat.weight_bytes
    # hf round trip through moecompress.load too
    pruned = half_plan(model, keep=(0, 2, 4, 6))  # one per router group for deepseek_v2
    export(model, pruned, tmp_path / "hf", format="hf", quiet=True)
    loaded = load(tmp_path / "hf")
    assert loaded._moecompress_plan == pruned
    torch.testing.assert_close(
        logits(loaded), logits(apply_plan(tiny_model(family), pruned)), atol=1e-6, rtol=1e-6
    )


def test_compact_round_trips_operators_cross_layer_scopes_and_shared_experts(tmp_path):
    model = tiny_model("qwen2_moe", num_hidden_layers=3)  # shared expert + sigmoid shared gate
    info = ModelInfo.from_model(model)
    gen = torch.Generator().manual_seed(1)
    tensors = {
        "c.value": torch.randn(32, generator=gen),
        "t.U": torch.randn(32, 2, generator=gen),
        "t.V": torch.randn(32, 2, generator=gen),
        "t.bias": torch.randn(32, generator=gen),
    }
    pool = Scope(
        id="pool01",
        layers=[0, 1],
        stored=[
            StoredExpert(id=0, sources=[(0, 1)]),
            StoredExpert(id=1, sources=[(1, 2)]),
            StoredExpert(id=2, sources=[(0, 3), (1, 3)], construction="weighted_merge", weights=[0.5, 0.5]),
        ],
    )
    layers = [
        LayerPlan(
            layer=0,
            scope="pool01",
            gate="replace",
            slots=[0, 0, 1, 2, ConstantOp(tensor="c"), TiltOp(rank=2, tensor="t"), "drop", 2],
        ),
        LayerPlan(layer=1, scope="pool01", gate="aggregate", slots=[1, 0, 1, 2, 2, 0, 1, 2]),
        LayerPlan(layer=2, scope="layer2", gate="keep", slots=[0, 1, "drop", 2, 3, "drop", 4, 5]),
    ]
    plan = CompressionPlan(
        model=info,
        scopes=[
            pool,
            Scope(
                id="layer2",
                layers=[2],
                stored=[StoredExpert(id=j, sources=[(2, e)]) for j, e in enumerate([0, 1, 3, 4, 6, 7])],
            ),
        ],
        layers=layers,
    )
    export(
        model,
        plan,
        tmp_path / "c",
        tensors=tensors,
        quiet=True,
        recipe={"method": "hand", "params": {"a": 1}},
    )
    keys = header(tmp_path / "c" / "model.safetensors")
    assert [k for k in keys if k.startswith("moecompress.scopes.pool01.")] == [
        "moecompress.scopes.pool01.down_proj",
        "moecompress.scopes.pool01.gate_up_proj",
    ]
    assert (
        "model.layers.0.mlp.ops.constants" in keys and "model.layers.0.mlp.shared_expert_gate.weight" in keys
    )
    assert not any(".experts." in k for k in keys)
    assert "method: hand" in (tmp_path / "c" / "recipe.yaml").read_text()
    assert not (
        tmp_path / "c" / "config.json"
    ).exists()  # plain from_pretrained must not misread a compact dir
    expected = logits(apply_plan(tiny_model("qwen2_moe", num_hidden_layers=3), plan, tensors))
    loaded = load(tmp_path / "c", device_map="cpu")
    assert torch.equal(logits(loaded), expected)
    assert loaded.model.layers[0].mlp.stored is loaded.model.layers[1].mlp.stored


def test_bytes_on_disk_are_within_one_percent_of_the_plan(tmp_path):
    kw = dict(hidden_size=256, head_dim=32, moe_intermediate_size=128)
    model = tiny_model("qwen3_moe", **kw)
    for name, plan, fmt in [
        ("hf", half_plan(model), "hf"),
        ("compact", half_plan(model), "compact"),
        ("remap", remap_plan(model), "compact"),
    ]:
        result = export(model, plan, tmp_path / name, format=fmt, quiet=True)
        logical = plan.logical_bytes().total
        assert abs(result.bytes_on_disk - logical) / logical < 0.01, (name, result.bytes_on_disk, logical)
        assert result.logical_bytes == logical
        assert result.bytes_on_disk < 0.7 * plan.logical_bytes().original


def test_export_streams_from_a_checkpoint_directory(tmp_path, monkeypatch):
    src = save_tiny("olmoe", tmp_path / "src")
    (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    model = tiny_model("olmoe")
    plan = half_plan(model)
    from moecompress.export import source as source_mod

    loaded_layers = []
    real = source_mod.CheckpointSource.load_layer
    monkeypatch.setattr(
        source_mod.CheckpointSource, "load_layer", lambda self, i: (loaded_layers.append(i), real(self, i))[1]
    )
    for fmt in ("hf", "compact"):
        streamed = export(str(src), plan, tmp_path / f"s-{fmt}", format=fmt, quiet=True)
        in_memory = export(model, plan, tmp_path / f"m-{fmt}", format=fmt, quiet=True)
        assert (tmp_path / f"s-{fmt}" / "model.safetensors").read_bytes() == (
            tmp_path / f"m-{fmt}" / "model.safetensors"
        ).read_bytes()
        assert (tmp_path / f"s-{fmt}" / "tokenizer_config.json").is_file()
        assert streamed.original_bytes == sum(p.stat().st_size for p in src.glob("*.safetensors"))
        assert in_memory.weight_bytes == streamed.weight_bytes
    assert loaded_layers == [0, 1, 0, 1]


def test_sharded_output_has_an_index_and_loads(tmp_path):
    model = tiny_model("qwen3_moe")
    plan = half_plan(model)
    for fmt in ("hf", "compact"):
        result = export(model, plan, tmp_path / fmt, format=fmt, quiet=True, max_shard_size=20_000)
        assert len(result.shards) > 2 and (tmp_path / fmt / "model.safetensors.index.json").is_file()
        index = json.loads((tmp_path / fmt / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(result.shards)
    expected = logits(apply_plan(tiny_model("qwen3_moe"), plan))
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)),
        expected,
        atol=1e-6,
        rtol=1e-6,
    )
    assert torch.equal(logits(load(tmp_path / "compact")), expected)


def test_export_is_byte_deterministic(tmp_path):
    plan = remap_plan(tiny_model("gpt_oss"))
    for name in ("a", "b"):
        export(tiny_model("gpt_oss"), plan, tmp_path / name, quiet=True)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_crash_mid_export_leaves_no_output_directory(tmp_path, monkeypatch):
    calls = []
    real = ShardWriter.add

    def flaky(self, name, tensor):
        calls.append(name)
        if len(calls) == 6:
            raise RuntimeError("disk on fire")
        return real(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "add", flaky)
    model = tiny_model("qwen3_moe")
    with pytest.raises(RuntimeError, match="disk on fire"):
        export(model, half_plan(model), tmp_path / "out", quiet=True)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary sibling


def test_existing_output_and_unknown_format_are_refused(tmp_path):
    model = tiny_model("olmoe")
    plan = half_plan(model)
    export(model, plan, tmp_path / "out", quiet=True)
    with pytest.raises(MoECompressError, match="already exists"):
        export(model, plan, tmp_path / "out", quiet=True)
    export(model, plan, tmp_path / "out", quiet=True, overwrite=True)
    with pytest.raises(MoECompressError, match="Unknown export format 'onnx'"):
        export(model, plan, tmp_path / "x", format="onnx", quiet=True)
    with pytest.raises(MoECompressError, match="cannot express the replacement operators"):
        plan_ops = CompressionPlan(
            model=plan.model,
            scopes=plan.scopes,
            layers=[
                lp.model_copy(
                    update={
                        "gate": "replace",
                        "slots": [ConstantOp(tensor="c") if s == "drop" else s for s in lp.slots],
                    }
                )
                for lp in plan.layers
            ],
        )
        export(
            model,
            plan_ops,
            tmp_path / "x",
            format="materialized",
            tensors={"c.value": torch.zeros(32)},
            quiet=True,
        )
    with pytest.raises(MoECompressError, match="cannot delete or mask the dropped slots"):
        export(model, plan, tmp_path / "x", format="materialized", quiet=True)
    runtime = apply_plan(tiny_model("olmoe"), plan)
    with pytest.raises(MoECompressError, match="already runs a compression plan"):
        export(runtime, plan, tmp_path / "x", quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _one_sentence(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.endswith("."), msg
    return msg


def test_corrupted_and_foreign_checkpoints_give_one_sentence(tmp_path):
    model = tiny_model("qwen3_moe")
    plan = half_plan(model)
    export(model, plan, tmp_path / "good", quiet=True)
    with pytest.raises(MoECompressError) as exc:
        load(tmp_path / "nothing")
    assert "No checkpoint" in _one_sentence(exc)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("hi")
    with pytest.raises(MoECompressError) as exc:
        load(tmp_path / "foreign")
    assert "neither a moecompress export nor a HuggingFace checkpoint" in _one_sentence(exc)

    import shutil

    def variant(name):
        shutil.copytree(tmp_path / "good", tmp_path / name)
        return tmp_path / name

    d = variant("truncated")
    shard = d / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(MoECompressError) as exc:
        load(d)
    assert "corrupted" in _one_sentence(exc)

    d = variant("badmarker")
    (d / "moecompress.json").write_text('{"format": "zip"}')
    with pytest.raises(MoECompressError) as exc:
        load(d)
    assert "format 'zip'" in _one_sentence(exc)

    d = variant("badplan")
    (d / "plan.json").write_text('{"schema_version": 1, "model": 3}')
    with pytest.raises(MoECompressError) as exc:
        load(d)
    assert "plan.json is invalid" in _one_sentence(exc)

    d = variant("otherplan")  # weights of one plan, plan.json of another
    (d / "plan.json").write_text(CompressionPlan.identity(model).to_json())
    with pytest.raises(MoECompressError) as exc:
        load(d)
    assert "do not belong together" in _one_sentence(exc)

    from safetensors.torch import load_file, save_file

    d = variant("missing")
    state = load_file(str(d / "model.safetensors"))
    state.pop("model.layers.1.mlp.gate.weight")
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(MoECompressError) as exc:
        load(d)
    assert "lacks tensor 'model.layers.1.mlp.gate.weight'" in _one_sentence(exc)

    d = variant("extra")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.mlp.intruder"] = torch.zeros(3)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(MoECompressError) as exc:
        load(d)
    assert "foreign" in _one_sentence(exc)


def test_public_api_names(tmp_path):
    import moecompress.export.writer

    model = tiny_model("olmoe")
    result = moecompress.export(model, half_plan(model), tmp_path / "o", quiet=True)
    assert result.format == "compact" and moecompress.load(tmp_path / "o") is not None
    assert moecompress.CompressionPlan is CompressionPlan and moecompress.apply_plan is apply_plan
