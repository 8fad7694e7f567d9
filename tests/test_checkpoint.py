"""CheckpointReader materialises exactly what from_pretrained would, one layer at a time."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moecompress.checkpoint import CheckpointReader, checkpoint_fingerprint
from moecompress.errors import MoECompressError
from moecompress.models import MoEAdapter, load_model, skeleton
from moecompress.testing import FAMILY_NAMES, save_tiny, tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: save_tiny(f, root / f, seed=1) for f in FAMILY_NAMES}


def _materialise(path, dtype=None):
    reader = CheckpointReader(str(path))
    model = skeleton(reader.config)
    reader.load_non_layer(model, "cpu", dtype)
    for i in range(reader.num_layers):
        reader.load_layer(model, i, "cpu", dtype)
    return reader, model.eval()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_streamed_model_equals_from_pretrained(saved, family):
    reader, model = _materialise(saved[family])
    ref = load_model(str(saved[family]), dtype="float32")
    a, b = model.state_dict(), ref.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not [n for n, t in model.named_buffers() if t.is_meta]
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=0, rtol=0)
    assert reader.unexpected_keys == []


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_native_keys_file_loads_the_same(tmp_path, saved, family):
    """A safetensors file holding the model's own fused state_dict names needs no conversion."""
    ref = tiny_model(family, seed=1)
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text((saved[family] / "config.json").read_text())
    save_file(
        {
            k: v.contiguous()
            for k, v in ref.state_dict().items()
            if k != "lm_head.weight" or not ref.config.tie_word_embeddings
        },
        str(d / "model.safetensors"),
    )
    reader, model = _materialise(d)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    # native_state gives model.state_dict() names of one layer, in the on-disk dtype
    native = reader.native_state(1)
    assert native and all(k.startswith("model.layers.1.") for k in native)
    for k, v in native.items():
        assert torch.equal(v, ref.state_dict()[k])


def test_native_state_and_other_state_convert_per_expert_keys(saved):
    reader = CheckpointReader(str(saved["qwen2_moe"]))
    ref = load_model(str(saved["qwen2_moe"]), dtype="float32").state_dict()
    native = reader.native_state(1)
    assert "model.layers.1.mlp.experts.gate_up_proj" in native  # per-expert keys fused as in the model
    assert set(native) == {k for k in ref if k.startswith("model.layers.1.")}
    other = reader.other_state()
    assert set(other) == {k for k in ref if not k.startswith("model.layers.")}
    for k, v in {**native, **other}.items():
        assert torch.equal(v, ref[k]), k
    assert any(".experts.3.gate_proj." in k for k in reader.layer_keys(1))


def test_only_the_requested_layer_is_read(saved, monkeypatch):
    import safetensors

    reader = CheckpointReader(str(saved["deepseek_v3"]))
    touched = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def get_slice(self, key):
            touched.append(key)
            return self.inner.get_slice(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    model = skeleton(reader.config)
    reader.load_layer(model, 2)
    assert touched and all(k.startswith("model.layers.2.") for k in touched)
    assert sorted(touched) == sorted(reader.layer_keys(2))
    # the other layers stay on meta; free_layer sends layer 2 back
    assert all(p.is_meta for n, p in model.named_parameters() if not n.startswith("model.layers.2."))
    reader.free_layer(model, 2)
    assert all(p.is_meta for p in model.parameters())


def test_bf16_keeps_strict_fp32_params_and_router_bias(saved):
    reader = CheckpointReader(str(saved["deepseek_v3"]))
    model = skeleton(reader.config)
    layer = reader.load_layer(model, 1, "cpu", torch.bfloat16)
    assert (
        layer.mlp.gate.weight.dtype == torch.float32
    )  # _keep_in_fp32_modules_strict, as from_pretrained does
    assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    ref = load_model(str(saved["deepseek_v3"]), dtype="bfloat16")
    for n, t in layer.state_dict().items():
        r = ref.state_dict()[f"model.layers.1.{n}"]
        assert t.dtype == r.dtype and torch.equal(t, r), n


def test_sharded_checkpoint_with_index_and_tied_embeddings(tmp_path):
    model = tiny_model("olmoe", seed=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, streamed = _materialise(tmp_path)
    assert streamed.lm_head.weight.data_ptr() == streamed.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_fingerprint_tells_models_apart(saved, tmp_path):
    other = save_tiny("qwen3_moe", tmp_path / "other", seed=2)
    assert checkpoint_fingerprint(saved["qwen3_moe"]) == checkpoint_fingerprint(saved["qwen3_moe"])
    assert checkpoint_fingerprint(saved["qwen3_moe"]) != checkpoint_fingerprint(other)


def test_bad_checkpoints_give_sentences(tmp_path, saved):
    d = tmp_path / "nobin"
    d.mkdir()
    (d / "config.json").write_text((saved["olmoe"] / "config.json").read_text())
    with pytest.raises(MoECompressError, match="no .safetensors"):
        CheckpointReader(str(d))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(MoECompressError, match="missing shard"):
        CheckpointReader(str(d))
    # a layer lacking a tensor is refused, not silently left on meta
    (d / "model.safetensors.index.json").unlink()
    sd = tiny_model("olmoe").state_dict()
    save_file(
        {k: v.contiguous() for k, v in sd.items() if "layers.1.post_attention" not in k},
        str(d / "model.safetensors"),
    )
    reader = CheckpointReader(str(d))
    with pytest.raises(MoECompressError, match="no tensor for model.layers.1.post_attention_layernorm"):
        reader.load_layer(skeleton(reader.config), 1)
    with pytest.raises(MoECompressError, match="Layer 7 does not exist"):
        reader.native_state(7)


def test_adapter_works_on_streamed_layers(saved):
    reader = CheckpointReader(str(saved["gpt_oss"]))
    model = skeleton(reader.config)
    adapter = MoEAdapter(model)
    reader.load_layer(model, 1)
    ref = MoEAdapter(load_model(str(saved["gpt_oss"]), dtype="float32"))
    for name, t in adapter.get_expert(1, 5).tensors().items():
        assert torch.equal(t, getattr(ref.get_expert(1, 5), name))
