"""Round-to-nearest baseline: error bound |w - q(w)| <= scale/2, exact bits accounting, adapter round trip."""

import math

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.eval.quant import quant_arm, quantize_experts, rtn_quantize, storage_bits
from moecompress.models import MoEAdapter
from moecompress.testing import tiny_model


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("shape,group", [((8, 300), 128), ((5, 64), 128), ((4, 256), 128), ((3, 10), 4)])
def test_error_bound_and_codes(bits, shape, group):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(bits)) * 0.05
    w[0, :3] = 0.0
    deq, scale, codes = rtn_quantize(w, bits, group)
    g = min(group, shape[1])
    n_groups = math.ceil(shape[1] / g)
    assert scale.shape == (shape[0], n_groups) and codes.shape == shape and codes.dtype == torch.int8
    qmax = 2 ** (bits - 1) - 1
    assert codes.abs().max() <= qmax
    # scales are exactly representable in fp16 and never below absmax/qmax (no clipping)
    assert torch.equal(scale, scale.half().float())
    per_col_scale = scale.repeat_interleave(g, dim=1)[:, : shape[1]]
    assert ((w - deq).abs() <= per_col_scale / 2 + 1e-12).all()
    assert torch.allclose(deq, codes.float() * per_col_scale)
    # the largest-magnitude weight of each group is (almost) exactly representable
    assert ((w.abs().amax(1) - deq.abs().amax(1)).abs() <= scale.amax(1) / 2).all()


def test_zero_group_and_bad_shapes():
    deq, scale, codes = rtn_quantize(torch.zeros(2, 8), 4, 4)
    assert torch.equal(deq, torch.zeros(2, 8)) and torch.equal(scale, torch.zeros(2, 2))
    with pytest.raises(MoECompressError, match="2-D"):
        rtn_quantize(torch.zeros(8), 4)
    with pytest.raises(MoECompressError, match="bits"):
        rtn_quantize(torch.zeros(2, 2), 1)


def test_storage_bits():
    assert storage_bits((16, 256), 4, 128) == 16 * 256 * 4 + 16 * 2 * 16  # 4.125 bits/weight
    assert storage_bits((16, 256), 3, 128) / (16 * 256) == 3.125
    assert storage_bits((2, 64), 4, 128) == 2 * 64 * 4 + 2 * 1 * 16  # whole row is one group
    assert storage_bits((1, 300), 4, 128) == 300 * 4 + 3 * 16  # last group partial


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_quantize_experts_round_trip_and_accounting(family):
    model = tiny_model(family, seed=0)
    ad = MoEAdapter(model)
    before = {(i, e): ad.get_expert(i, e) for i in ad.moe_layers for e in range(ad.num_experts(i))}
    x = torch.randint(3, 96, (1, 12))
    with torch.no_grad():
        ref = model(input_ids=x).logits
    rep = quantize_experts(model, bits=4, group_size=8, progress=False)
    n_weights = bits = bias_bytes = routed = 0
    for (i, e), w in before.items():
        got = ad.get_expert(i, e)
        for name, t in w.tensors().items():
            routed += t.numel() * t.element_size()
            if name.endswith("_bias"):
                assert torch.equal(getattr(got, name), t)  # biases untouched
                bias_bytes += t.numel() * t.element_size()
                continue
            assert torch.equal(getattr(got, name), rtn_quantize(t, 4, 8)[0])
            n_weights += t.numel()
            bits += storage_bits(tuple(t.shape), 4, 8)
    assert rep["weights"] == n_weights and rep["weight_bits"] + rep["scale_bits"] == bits
    assert rep["bits_per_weight"] == pytest.approx(bits / n_weights)
    assert rep["routed_bytes_before"] == routed
    assert rep["routed_bytes_after"] == math.ceil(bits / 8) + bias_bytes
    assert rep["model_bytes_after"] == rep["model_bytes_before"] - routed + rep["routed_bytes_after"]
    assert 0 < rep["rel_fro_error"] < 0.2 and len(rep["per_layer"]) == len(ad.moe_layers)
    with torch.no_grad():
        out = model(input_ids=x).logits
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    arm = quant_arm(rep)
    assert arm["kind"] == "quant_baseline" and arm["bytes"]["model"] == rep["model_bytes_after"]


def test_three_bits_lose_more_than_four():
    errs = {b: quantize_experts(tiny_model("olmoe", seed=2), bits=b, progress=False)["rel_fro_error"] for b in (3, 4)}
    assert errs[3] > errs[4] > 0
