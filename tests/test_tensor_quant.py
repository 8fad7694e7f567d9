"""Issue 30, first slice: every weight has a class, non-expert weights take a precision in the plan, bytes count
the whole file, and the compact format writes and loads them (RTN)."""

import json

import pytest
import torch

from moecompress import apply_plan, export, load
from moecompress.errors import MoECompressError
from moecompress.methods.quantize import QuantConfig
from moecompress.methods.tensor_quant import quantize_tensors, resolve_class_specs
from moecompress.models import MoEAdapter
from moecompress.models.tensor_classes import CLASSES, tensor_classes
from moecompress.plan import CompressionPlan
from moecompress.quant import QuantSpec
from moecompress.testing import FAMILY_NAMES, save_tiny, tiny_model

IDS = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


# ----------------------------------------------------------------------------- classes
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_tensor_has_exactly_one_class(family, tied):
    model = tiny_model(family, tie_word_embeddings=tied)
    classes = tensor_classes(MoEAdapter(model))
    names = [n for n, _ in model.named_parameters()]  # deduplicated: a tied lm_head appears once
    persistent = set(model.state_dict())
    names += [n for n, _ in model.named_buffers() if n in persistent]
    assert sorted(classes) == sorted(names)
    assert set(classes.values()) <= set(CLASSES)
    assert {"experts", "attention", "embeddings", "router", "norm"} <= set(classes.values())
    assert ("lm_head" in classes.values()) is not tied  # tied: counted once, as the embeddings
    assert ("lm_head.weight" in classes) is not tied
    assert classes["model.embed_tokens.weight"] == "embeddings"
    assert all(c == "experts" for n, c in classes.items() if ".experts." in n)
    assert all(c in ("attention", "norm") for n, c in classes.items() if ".self_attn." in n)
    assert all(c == "norm" for n, c in classes.items() if "layernorm" in n or n == "model.norm.weight")
    state = model.state_dict()
    info = CompressionPlan.identity(
        model
    ).model  # the plan's whole-file bytes count each class's tensors once
    assert (
        sum(state[n].numel() * state[n].element_size() for n in classes)
        == info.expert_bytes + info.other_bytes
    )


def test_families_with_shared_and_dense_layers():
    ds = tensor_classes(MoEAdapter(tiny_model("deepseek_v3")))
    assert ds["model.layers.0.mlp.gate_proj.weight"] == "dense_mlp"  # first_k_dense_replace
    assert ds["model.layers.1.mlp.shared_experts.up_proj.weight"] == "shared"
    assert ds["model.layers.1.mlp.gate.e_score_correction_bias"] == "router"
    assert ds["model.layers.1.self_attn.q_a_proj.weight"] == "attention"  # MLA's low-rank projections
    assert ds["model.layers.1.self_attn.kv_b_proj.weight"] == "attention"
    q2 = tensor_classes(MoEAdapter(tiny_model("qwen2_moe")))
    assert q2["model.layers.0.mlp.shared_expert.gate_proj.weight"] == "shared"
    assert q2["model.layers.0.mlp.shared_expert_gate.weight"] == "router"


# ----------------------------------------------------------------------------- settings
def test_recipe_form_and_scope_all():
    cfg = QuantConfig.model_validate({"experts": "w4g32", "attention": "w8g32", "embeddings": "w8c"})
    assert cfg.quant == "w4g32" and cfg.classes == {"attention": "w8g32", "embeddings": "w8c"}
    only = QuantConfig.model_validate({"attention": "w4g32"})
    assert only.quant is None and only.has_tensor_classes()
    adapter = MoEAdapter(tiny_model("deepseek_v3"))
    specs = resolve_class_specs(adapter, None, "all", "w4g32")
    assert {k: v.name() for k, v in specs.items()} == {
        "attention": "w4g32",
        "shared": "w4g32",
        "dense_mlp": "w4g32",
        "embeddings": "w8c",
        "lm_head": "w8c",
    }
    assert all(v.algo == "rtn" for v in specs.values())
    over = resolve_class_specs(adapter, {"attention": "w8g32"}, "all", "w4g32")
    assert over["attention"].name() == "w8g32" and over["shared"].name() == "w4g32"
    # plans without the new fields keep plan.json's params as before
    assert "classes" not in json.loads(CompressionPlan.identity(tiny_model("olmoe")).to_json())["params"]


@pytest.mark.parametrize(
    "classes, message",
    [
        ({"dense_mlp": "w4g32"}, "has no dense_mlp weights"),
        ({"lm_head": "w8c"}, "tied to its embeddings"),
        ({"router": "w4g32"}, "router cannot take w4g32"),
    ],
)
def test_bad_classes_are_one_sentence(classes, message):
    adapter = MoEAdapter(tiny_model("olmoe", tie_word_embeddings=True))
    with pytest.raises(MoECompressError, match=message):
        resolve_class_specs(adapter, classes, None, None)


def test_unknown_class_is_refused_by_the_config():
    with pytest.raises(Exception, match="not a tensor class"):
        QuantConfig.model_validate({"quant": "w4g32", "classes": {"mlp": "w4g32"}})


# ----------------------------------------------------------------------------- plan
def _quantized(model, specs, tensors=None):
    adapter = MoEAdapter(model)
    plan = CompressionPlan.identity(model)
    return quantize_tensors(
        plan, tensors, adapter, {k: QuantSpec.parse(v, algo="rtn") for k, v in specs.items()}
    )


def test_plan_records_serializes_and_counts_the_whole_file():
    model = tiny_model("qwen2_moe")
    base = CompressionPlan.identity(model)
    plan, tensors = _quantized(model, {"attention": "w4g32", "shared": "w8c", "embeddings": "w8c"})
    assert "model.layers.0.self_attn.q_proj.weight" in plan.tensor_quant
    assert "model.layers.0.self_attn.q_proj.bias" not in plan.tensor_quant  # only 2-D weights
    assert "lm_head.weight" not in plan.tensor_quant
    tq = plan.tensor_quant["model.layers.0.mlp.shared_expert.up_proj.weight"]
    assert (tq.kind, tuple(tq.shape), tq.dtype, tq.quant.name()) == ("shared", (24, 32), "float32", "w8c")
    again = CompressionPlan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json() and again.tensor_quant == plan.tensor_quant
    assert "tensor_quant" not in json.loads(base.to_json())  # old plans serialize byte-identically
    saved = sum(tq.original_bytes() - tq.quant.tensor_bytes(*tq.shape) for tq in plan.tensor_quant.values())
    assert saved > 0
    b0, b1 = base.logical_bytes(), plan.logical_bytes()
    assert b0.total - b1.total == saved and b1.original == b0.original
    assert b1.stored_experts == b0.stored_experts and b1.other == b0.other - saved
    plan.check_tensors(tensors)
    with pytest.raises(MoECompressError, match="lack"):
        plan.check_tensors({k: v for k, v in tensors.items() if "q_proj" not in k})


def test_plan_validation_is_one_sentence():
    model = tiny_model("olmoe")
    plan, _ = _quantized(model, {"attention": "w4g32"})
    data = json.loads(plan.to_json())
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = json.loads(json.dumps(data))
    bad["tensor_quant"][name]["shape"] = [32]
    with pytest.raises(MoECompressError, match="invalid at 'tensor_quant"):
        CompressionPlan.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(data))
    bad["tensor_quant"]["model.layers.0.self_attn.q_proj.bias"] = bad["tensor_quant"].pop(name)
    with pytest.raises(MoECompressError, match="not a '.weight' tensor"):
        CompressionPlan.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(data))
    bad["tensor_quant"][name]["shape"] = [32, 16]
    foreign = CompressionPlan.from_json(json.dumps(bad))
    with pytest.raises(MoECompressError, match="in the model it is"):
        foreign.check_model(MoEAdapter(model))


# ----------------------------------------------------------------------------- runtime, export, load
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_compact_round_trip_equals_apply_plan(family, tmp_path):
    tied = family == "qwen2_moe"
    src = save_tiny(family, tmp_path / "src", tie_word_embeddings=tied)
    model = tiny_model(family, tie_word_embeddings=tied)
    adapter = MoEAdapter(model)
    specs = resolve_class_specs(adapter, {"router": "w8c"}, "all", "w4g32")
    plan = CompressionPlan.identity(model)
    plan, tensors = quantize_tensors(plan, {}, adapter, specs)
    assert {tq.kind for tq in plan.tensor_quant.values()} >= {"attention", "embeddings", "router"}
    expected = logits(apply_plan(tiny_model(family, tie_word_embeddings=tied), plan, tensors))
    assert not torch.equal(
        expected, logits(tiny_model(family, tie_word_embeddings=tied))
    )  # it changed something
    result = export(str(src), plan, tmp_path / "c", format="compact", tensors=tensors, quiet=True)
    loaded = load(tmp_path / "c", device_map="cpu")
    assert torch.equal(logits(loaded), expected)
    keys = set(
        json.loads(
            (tmp_path / "c" / "model.safetensors").read_bytes()[
                8 : 8 + int.from_bytes((tmp_path / "c" / "model.safetensors").read_bytes()[:8], "little")
            ]
        )
    )
    assert "model.layers.0.self_attn.o_proj.weight_packed" in keys
    assert "model.layers.0.self_attn.o_proj.weight" not in keys
    assert result.logical_bytes == plan.logical_bytes(tensors).total
    with pytest.raises(MoECompressError, match="format='compact'"):
        export(str(src), plan, tmp_path / "hf", format="hf", tensors=tensors, quiet=True)


def test_compact_file_is_smaller_by_the_expected_bytes(tmp_path):
    kw = dict(hidden_size=256, head_dim=32, moe_intermediate_size=128, vocab_size=512)
    model = tiny_model("qwen3_moe", **kw)
    base = CompressionPlan.identity(model)
    plan, tensors = quantize_tensors(
        base, {}, MoEAdapter(model), resolve_class_specs(MoEAdapter(model), None, "all", "w4g128")
    )
    r0 = export(model, base, tmp_path / "base", format="compact", quiet=True)
    r1 = export(model, plan, tmp_path / "q", format="compact", tensors=tensors, quiet=True)
    want = plan.logical_bytes(tensors, accounting="stored").total
    assert abs(r1.weight_bytes - want) / want < 0.01, (r1.weight_bytes, want)
    expected_saving = base.logical_bytes().total - plan.logical_bytes(tensors).total
    assert abs((r0.weight_bytes - r1.weight_bytes) - expected_saving) / expected_saving < 0.01
    assert (
        "vs original" in r1.describe()
        and "other tensors" in r1.describe()
        and r1.weight_bytes < r0.weight_bytes
    )
    loaded = load(tmp_path / "q", device_map="cpu")
    assert torch.equal(logits(loaded), logits(apply_plan(tiny_model("qwen3_moe", **kw), plan, tensors)))


def test_materialized_writes_the_dequantized_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("olmoe")
    plan, tensors = _quantized(model, {"attention": "w4g32", "embeddings": "w8c", "lm_head": "w8c"})
    export(model, plan, tmp_path / "m", format="materialized", tensors=tensors, quiet=True)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    torch.testing.assert_close(
        logits(plain), logits(apply_plan(tiny_model("olmoe"), plan, tensors)), atol=1e-6, rtol=1e-6
    )


def _with_quantized_experts(model, specs):
    from moecompress.methods.quantize import quantize_plan

    adapter = MoEAdapter(model)
    plan, tensors = quantize_plan(
        CompressionPlan.identity(model),
        {},
        lambda l, e: adapter.layer(l).storage.read(e),
        QuantConfig(quant="w4c", algo="rtn"),
        None,
    )
    if not specs:
        return plan, tensors
    return quantize_tensors(
        plan, tensors, adapter, {k: QuantSpec.parse(v, algo="rtn") for k, v in specs.items()}
    )


def test_hf_export_has_one_config_group_per_precision_and_loads_in_transformers(tmp_path):
    """Issue 30 item 5: experts at w4c, attention at w4g32 and lm_head at w8c become three compressed-tensors
    config groups, the non-expert ones targeting their modules by name; plain transformers (compressed-tensors)
    loads the checkpoint and computes what our runtime computes (up to its bf16 dequantized weights)."""
    from transformers import AutoModelForCausalLM

    src = save_tiny("olmoe", tmp_path / "src")
    model = tiny_model("olmoe")
    plan, tensors = _with_quantized_experts(model, {"attention": "w4g32", "lm_head": "w8c"})
    export(str(src), plan, tmp_path / "hf", format="hf", tensors=tensors, quiet=True)
    qc = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    groups = {tuple(g["targets"])[0]: g["weights"] for g in qc["config_groups"].values()}
    assert len(groups) == 3 and "lm_head" not in qc["ignore"]
    assert groups["lm_head"]["num_bits"] == 8 and groups["lm_head"]["strategy"] == "channel"
    assert groups["model.layers.0.self_attn.k_proj"]["group_size"] == 32
    targets = next(g["targets"] for g in qc["config_groups"].values() if g["weights"].get("group_size") == 32)
    assert set(targets) == {
        n.removesuffix(".weight") for n, tq in plan.tensor_quant.items() if tq.kind == "attention"
    }
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours = apply_plan(tiny_model("olmoe"), plan, tensors)
    assert not torch.equal(logits(ours), logits(tiny_model("olmoe")))
    torch.testing.assert_close(logits(plain).float(), logits(ours), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "specs, message",
    [
        ({"embeddings": "w8c"}, "compressed-tensors stores quantized Linear layers only"),
        ({"attention": "w4g32"}, "keeps routed experts unquantized"),
    ],
)
def test_hf_export_refusals_are_one_sentence(tmp_path, specs, message):
    src = save_tiny("olmoe", tmp_path / "src")
    model = tiny_model("olmoe")
    plan, tensors = (
        _with_quantized_experts(model, specs) if "embeddings" in specs else _quantized(model, specs)
    )
    with pytest.raises(MoECompressError, match=message):
        export(str(src), plan, tmp_path / "hf", format="hf", tensors=tensors, quiet=True)
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- CLI, recipe
def test_cli_quant_scope_all_end_to_end(tmp_path, capsys):
    from moecompress.testing import fixture_dir, run_cli

    f = fixture_dir("olmoe-tiny")
    code, out, err = run_cli(
        [
            "compress",
            str(f),
            "--method",
            "quant",
            "--quant",
            "w4g32",
            "--quant-algo",
            "rtn",
            "--quant-scope",
            "all",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "compact checkpoint" in out and "other tensors" in out
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    kinds = {v["kind"]: v["quant"] for v in plan["tensor_quant"].values()}
    assert set(kinds) == {"attention", "embeddings", "lm_head"}  # the router is left out of `all`
    assert (kinds["attention"]["bits"], kinds["attention"]["group_size"], kinds["attention"]["algo"]) == (
        4,
        32,
        "rtn",
    )
    assert (kinds["embeddings"]["bits"], kinds["embeddings"]["group_size"]) == (8, None)
    weights = (tmp_path / "o" / "model.safetensors").stat().st_size
    assert weights < 0.40 * (f / "model.safetensors").stat().st_size  # experts-only w4g32 is 0.56 of the file


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quant-scope", "all"], "give --quant too"),
        (["--quant", "w4g32", "--quant-scope", "most"], "--quant-scope 'most' is not known"),
        (["--recipe", "RECIPE"], "has no dense_mlp weights"),
    ],
)
def test_cli_bad_quant_scope_is_one_sentence_exit_2(args, message, tmp_path, capsys):
    from moecompress.testing import fixture_dir, run_cli

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "method: prune\nparams: {criterion: frequency, ratio: 0.5}\n"
        "quant: {experts: w4g32, dense_mlp: w4g32, algo: rtn}\n"
    )
    args = [str(recipe) if a == "RECIPE" else a for a in args]
    code, out, err = run_cli(
        [
            "compress",
            str(fixture_dir("olmoe-tiny")),
            "--out",
            str(tmp_path / "o"),
            "--calib",
            "fixture-calib:4",
            *args,
        ],
        capsys,
    )
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o-calib").exists()


def test_recipe_arm_names_the_classes():
    from moecompress.recipe import ArmSpec

    arm = ArmSpec.model_validate(
        {
            "method": "prune",
            "params": {"criterion": "frequency", "ratio": 0.5},
            "quant": {"experts": "w4g32", "attention": "w8g32", "algo": "rtn"},
        }
    )
    assert arm.display_name() == "prune-frequency-50+w4g32-rtn-attention-w8g32"
    plain = ArmSpec.model_validate(
        {"method": "prune", "params": {"criterion": "frequency", "ratio": 0.5}, "quant": "w4g32"}
    )
    assert plain.display_name() == "prune-frequency-50+w4g32-gptq"


# ----------------------------------------------------------------------------- GPTQ of non-expert weights
def _reference_hessians(path, data, names):
    """Σ x xᵀ of each named module's input over the real tokens, from plain full-model forwards (float64 sums)."""
    from moecompress import load_model
    from moecompress.data import load_calibration, load_tokenizer

    model = load_model(str(path), dtype="auto")  # the checkpoint's own dtype, as the pass runs it
    calib = load_calibration(data["spec"], load_tokenizer(str(path)), data["seq_len"], data["seed"])
    acc, mask = {}, {}

    def hook(name):
        def fn(mod, args):
            x = args[0].reshape(-1, args[0].shape[-1])[mask["m"].reshape(-1).bool()].double()
            acc[name] = acc.get(name, 0) + x.T @ x

        return fn

    handles = [
        model.get_submodule(n.removesuffix(".weight")).register_forward_pre_hook(hook(n)) for n in names
    ]
    with torch.no_grad():
        for _, rows in calib.batches(8, 0, 1):
            mask["m"] = calib.attention_mask[rows]
            model(input_ids=calib.input_ids[rows], attention_mask=calib.attention_mask[rows], use_cache=False)
    for h in handles:
        h.remove()
    return model, acc


def test_linear_hessians_equal_sum_of_input_outer_products():
    from moecompress.calibrate.linear_hessian import linear_hessian_pass
    from moecompress.testing import fixture_dir

    path = fixture_dir("olmoe-tiny")
    data = {"spec": "fixture-calib:4", "seq_len": 32, "seed": 0}
    names = [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "lm_head.weight",
    ]
    got = {}
    order = []
    for layer, hs in linear_hessian_pass(str(path), data, names):
        order.append(layer)
        got.update(hs)
    assert order == [1, 3, None]  # decoder layers in order, lm_head last
    _, ref = _reference_hessians(path, data, names)
    assert set(got) == set(names)
    for n in names:
        assert got[n].dtype == torch.float64 and got[n].shape == (192, 192)
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-6)
    # 4 sequences x 32 tokens: the trace of H is the sum of squared inputs over exactly those 128 tokens
    assert got[names[0]].diagonal().gt(0).all()


def test_gptq_codes_of_non_expert_weights_equal_gptq_on_their_hessians():
    from moecompress.calibrate.linear_hessian import linear_hessian_pass
    from moecompress.quant import QuantizedTensor, gptq
    from moecompress.testing import fixture_dir

    path = fixture_dir("olmoe-tiny")
    data = {"spec": "fixture-calib:4", "seq_len": 32, "seed": 0}
    from moecompress import load_model

    model = load_model(str(path), dtype="auto")
    adapter = MoEAdapter(model)
    specs = resolve_class_specs(
        adapter,
        {"attention": "w4g32", "lm_head": "w8c", "embeddings": "w8c"},
        None,
        None,
        gptq=dict(actorder=True, damp=0.01),
    )
    assert specs["embeddings"].algo == "rtn" and specs["attention"].algo == "gptq"
    plan, tensors = quantize_tensors(
        CompressionPlan.identity(model),
        {},
        adapter,
        specs,
        lambda names: linear_hessian_pass(str(path), data, names),
    )
    _, ref = _reference_hessians(path, data, ["model.layers.2.self_attn.v_proj.weight", "lm_head.weight"])
    for name, spec in (
        ("model.layers.2.self_attn.v_proj.weight", specs["attention"]),
        ("lm_head.weight", specs["lm_head"]),
    ):
        assert plan.tensor_quant[name].quant.algo == "gptq"
        base = name.removesuffix(".weight")
        q = QuantizedTensor.from_packed(
            {s: tensors[f"{base}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}, spec
        )
        want = gptq(model.get_parameter(name).detach().float(), ref[name], spec)
        assert torch.equal(q.codes, want.codes) and torch.equal(q.scale, want.scale)
    assert plan.tensor_quant["model.embed_tokens.weight"].quant.algo == "rtn"


def test_gptq_of_non_expert_weights_without_calibration_is_one_sentence():
    model = tiny_model("olmoe")
    adapter = MoEAdapter(model)
    specs = resolve_class_specs(
        adapter, {"attention": "w4g32"}, None, None, gptq=dict(actorder=True, damp=0.01)
    )
    with pytest.raises(MoECompressError, match="needs calibration Hessians"):
        quantize_tensors(CompressionPlan.identity(model), {}, adapter, specs)


def test_compress_from_a_data_spec_gptqs_the_non_expert_weights(tmp_path):
    from moecompress import compress
    from moecompress.testing import fixture_dir

    result = compress(
        str(fixture_dir("olmoe-tiny")),
        "quant",
        {"quant": "w4g32", "scope": "all"},
        calib="fixture-calib:4",
        seq_len=32,
        out=tmp_path / "o",
        progress=False,
    )
    assert result.format == "compact"
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    algos = {(v["kind"], v["quant"]["algo"]) for v in plan["tensor_quant"].values()}
    assert algos == {("attention", "gptq"), ("lm_head", "gptq"), ("embeddings", "rtn")}
    assert all(s["quant"]["algo"] == "gptq" for sc in plan["scopes"] for s in sc["stored"])
