"""The adapter reproduces every family's HF MoE block, router and expert storage exactly."""

import pytest
import torch
import torch.nn as nn

from moecompress.errors import MoECompressError
from moecompress.models import ExpertStorage, ExpertWeights, MoEAdapter, RouterSpec, route
from moecompress.testing import FAMILY_NAMES, tiny_model


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    model = tiny_model(request.param, experts_implementation="eager")
    return request.param, model, MoEAdapter(model)


def _hf_block(adapter, i, h):
    out = adapter.layer(i).block(h)
    return out[0] if isinstance(out, tuple) else out


def test_moe_forward_equals_hf_block(family):
    name, model, adapter = family
    assert adapter.moe_layers
    gen = torch.Generator().manual_seed(1)
    for i in adapter.moe_layers:
        h = torch.randn(2, 9, adapter.hidden_size, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(
                adapter.moe_forward(i, h), _hf_block(adapter, i, h), atol=1e-5, rtol=1e-5
            )


def test_route_equals_hf_router(family):
    name, model, adapter = family
    for i in adapter.moe_layers:
        h = torch.randn(40, adapter.hidden_size, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            _, hf_w, hf_i = adapter.layer(i).router(h)
            ours = adapter.route(i, h)
        hf_sorted, hf_order = hf_i.sort(dim=-1)
        our_sorted, our_order = ours.index.sort(dim=-1)
        assert torch.equal(hf_sorted, our_sorted)
        torch.testing.assert_close(
            ours.weight.float().gather(1, our_order), hf_w.float().gather(1, hf_order), atol=1e-6, rtol=1e-5
        )


def test_expert_write_read_round_trip_and_changes_model_as_predicted(family):
    name, model, adapter = family
    i = adapter.moe_layers[-1]
    e = 3
    original = adapter.get_expert(i, e)
    gen = torch.Generator().manual_seed(7)
    new = original.map(lambda t: torch.randn(t.shape, generator=gen) * 0.1)
    h = torch.randn(64, adapter.hidden_size, generator=gen)
    with torch.no_grad():
        before = _hf_block(adapter, i, h[None])[0]
        r = adapter.route(i, h)
        adapter.set_expert(i, e, new)
        for key, t in adapter.get_expert(i, e).tensors().items():
            assert torch.equal(t, getattr(new, key)), key
        after = _hf_block(adapter, i, h[None])[0]
        # predicted change: gate-weighted difference of expert e's outputs on the tokens that route to it
        tok, slot = torch.where(r.index == e)
        predicted = torch.zeros_like(before)
        delta = adapter.expert_forward(i, e, h[tok])
        adapter.set_expert(i, e, original)
        delta = delta - adapter.expert_forward(i, e, h[tok])
        predicted.index_add_(0, tok, delta * r.weight[tok, slot, None])
    assert len(tok) > 0
    torch.testing.assert_close(after - before, predicted, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(_hf_block(adapter, i, h[None])[0], before, atol=0, rtol=0)


def test_structure_is_reported(family):
    name, model, adapter = family
    for i in adapter.moe_layers:
        assert adapter.num_experts(i) == 8 and adapter.top_k(i) == 2
        w = adapter.experts(i)
        e, inter, hdim = w.gate.shape
        assert (e, hdim) == (8, adapter.hidden_size) and w.down.shape == (8, hdim, inter)
    if name.startswith("deepseek"):
        assert adapter.dense_layers == [0]
        assert adapter.layer(adapter.moe_layers[0]).shared is not None
    if name == "gpt_oss":
        assert adapter.get_expert(adapter.moe_layers[0], 0).has_bias


def test_keep_and_renorm_masks_follow_their_definitions():
    spec = RouterSpec(num_experts=6, top_k=2, norm_topk_prob=False)
    gen = torch.Generator().manual_seed(0)
    w, h = torch.randn(6, 5, generator=gen), torch.randn(30, 5, generator=gen)
    mask = torch.tensor([True, False, True, True, False, True])
    keep, renorm = route(spec, h, w, allowed=mask), route(spec, h, w, present=mask)
    assert mask[keep.index].all() and mask[renorm.index].all()
    full = torch.softmax(h @ w.T, -1)
    torch.testing.assert_close(keep.weight, full.gather(1, keep.index))  # trained scale
    sub = torch.softmax((h @ w.T).masked_fill(~mask, float("-inf")), -1)
    torch.testing.assert_close(renorm.weight, sub.gather(1, renorm.index))  # as if never present
    assert torch.equal(keep.index.sort(-1)[0], renorm.index.sort(-1)[0])
    normed = RouterSpec(num_experts=6, top_k=2, norm_topk_prob=True)
    torch.testing.assert_close(
        route(normed, h, w, allowed=mask).weight, route(normed, h, w, present=mask).weight
    )


def test_modulelist_storage_round_trip():
    experts = nn.ModuleList(
        nn.ModuleDict(
            dict(
                gate_proj=nn.Linear(4, 3, bias=False),
                up_proj=nn.Linear(4, 3, bias=False),
                down_proj=nn.Linear(3, 4, bias=False),
            )
        )
        for _ in range(5)
    )
    storage = ExpertStorage.detect(experts)
    assert storage.layout == "modulelist" and storage.num_experts == 5 and storage.intermediate_size == 3
    w = ExpertWeights(torch.ones(3, 4), torch.full((3, 4), 2.0), torch.full((4, 3), 3.0))
    storage.write(2, w)
    assert torch.equal(storage.read_all().up[2], w.up) and torch.equal(experts[2]["down_proj"].weight, w.down)


def test_dense_model_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    with pytest.raises(MoECompressError, match="dense model or an unsupported MoE"):
        MoEAdapter(LlamaForCausalLM(cfg))


def test_fallback_detects_and_verifies_an_undeclared_family(monkeypatch):
    from moecompress.models import families

    model = tiny_model("deepseek_v3")
    monkeypatch.delitem(families.FAMILIES, "deepseek_v3")
    adapter = MoEAdapter(model)
    assert adapter.family is None
    layer = adapter.layer(adapter.moe_layers[0])
    assert layer.verified and layer.spec.scoring == "sigmoid" and layer.spec.has_correction_bias
    h = torch.randn(2, 5, adapter.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(adapter.moe_forward(layer.index, h), layer.block(h), atol=1e-5, rtol=1e-5)
