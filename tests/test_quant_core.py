"""Quantization core (moecompress.quant): grid, RTN, GPTQ against a plain reference, CT packing and bytes."""

from __future__ import annotations

import math

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.quant import QuantizedTensor, QuantSpec, dequantize, gptq, gptq_loss, qparams, quantize, rtn

SPECS = [
    QuantSpec.parse(t)
    for t in ("w2g32", "w3g32", "w4g32", "w8g32", "w4g64a", "w3g32a", "w2g32a", "w8ca", "w4c", "w3c")
]


def _correlated_hessian(n: int, tokens: int = 512, seed: int = 0, dead: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) / math.sqrt(n) + torch.eye(n)
    X = torch.randn(tokens, n, generator=g) @ mix * torch.linspace(0.2, 3.0, n)
    X[:, list(dead)] = 0
    return X.T @ X


def _weight(out: int, n: int, seed: int = 1, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, n, generator=g) * 0.05).to(dtype)


# --- spec ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["w2g32", "w3g64", "w4g128", "w8c", "w4g128a", "w3ca", "w2g64a"])
def test_parse_name_round_trip(text):
    spec = QuantSpec.parse(text, algo="rtn")
    assert spec.name() == text and spec.algo == "rtn"
    assert QuantSpec.parse(spec.name(), algo="rtn") == spec


def test_gptq_orders_columns_by_default_as_llm_compressor_does():
    """Act order is llm-compressor's default ("static"); round-to-nearest has no column order."""
    assert QuantSpec.parse("w4g128").actorder is True
    assert QuantSpec(bits=4).actorder is True
    assert QuantSpec.parse("w4g128", algo="rtn").actorder is False
    assert QuantSpec.parse("w4g128", actorder=False).actorder is False
    assert QuantSpec.parse("w4g128").quantization_args().actorder == "static"
    assert QuantSpec.parse("w4g128", algo="rtn").quantization_args().actorder is None


def test_gptq_damping_and_block_defaults_are_llm_compressors():
    """dampening_frac 0.01 and block 128, as llm-compressor's GPTQModifier (docs/quantization.md, "Defaults")."""
    from moecompress.methods.quantize import QuantConfig

    spec = QuantSpec.parse("w4g128")
    assert (spec.damp, spec.block_size) == (0.01, 128)
    assert QuantConfig().spec() == spec


def test_parse_fields():
    s = QuantSpec.parse("w3g64a")
    assert (s.bits, s.group_size, s.symmetric, s.algo) == (3, 64, False, "gptq")
    assert QuantSpec.parse("w8c").group_size is None
    assert (QuantSpec.parse("w5g32").qmin, QuantSpec.parse("w5g32").qmax) == (
        -16,
        15,
    )  # llama.cpp's Q5_0 grid


@pytest.mark.parametrize("text", ["w6g128", "w4g100", "4g128", "w4g128x", "", "w4", "w16c", "w4g0"])
def test_bad_spec_is_one_sentence(text):
    with pytest.raises(MoECompressError) as e:
        QuantSpec.parse(text)
    msg = str(e.value)
    assert repr(text) in msg and "w4g128" in msg
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0


def test_bad_algo_and_ragged_last_group():
    with pytest.raises(MoECompressError, match="rtn or gptq"):
        QuantSpec.parse("w4g128", algo="awq")
    # a group that does not divide the input leaves a shorter last group (compressed-tensors' ceil)
    spec = QuantSpec.parse("w4g128", algo="rtn")
    assert spec.num_groups(96) == 1 and spec.num_groups(192) == 2
    w = torch.randn(8, 192, generator=torch.Generator().manual_seed(3))
    w[:, 128:] *= 10  # the short last group gets its own, larger scale
    q = rtn(w, spec)
    assert q.scale.shape == (8, 2)
    absmax = torch.stack([w[:, :128].abs().amax(1), w[:, 128:].abs().amax(1)], 1)
    torch.testing.assert_close(q.scale.float(), (absmax / 7.5).to(torch.bfloat16).float())
    assert spec.tensor_bytes(8, 192) == sum(t.numel() * t.element_size() for t in q.packed().values())


# --- grid and RTN known answers -----------------------------------------------------------------------


def test_rtn_known_answer_symmetric_4bit_and_2bit():
    # scales chosen exact in bf16: absmax 7.5 -> 4-bit scale 1; absmax 3 -> 2-bit scale 2
    w = torch.tensor([[7.5, -3.2, 0.49, -7.5], [0.0, 1.6, -0.5, 3.75]])
    q4 = rtn(w, QuantSpec.parse("w4c"))
    assert q4.scale.dtype == torch.bfloat16 and q4.zero is None
    assert q4.scale.float().flatten().tolist() == [1.0, 0.5]
    # 7.5 rounds half-to-even to 8 and clamps to 7; -7.5 -> -8; row 2: 1.6/0.5 = 3.2, -0.5/0.5 = -1, 7.5 -> 7
    assert q4.codes.tolist() == [[7, -3, 0, -8], [0, 3, -1, 7]]
    w2 = torch.tensor([[3.0, -3.0, 1.1, -0.9]])
    q2 = rtn(w2, QuantSpec.parse("w2c"))
    assert q2.scale.float().item() == 2.0  # absmax / 1.5
    assert q2.codes.tolist() == [[1, -2, 1, 0]]  # grid {-2,-1,0,1}·2: 1.5 -> 2 clamps to 1, -0.45 -> 0
    assert q2.dequantize(torch.float32).tolist() == [[2.0, -4.0, 2.0, 0.0]]


def test_rtn_known_answer_asymmetric_and_groups():
    w = torch.tensor([[0.0, 15.0, 6.4, 2.0], [-3.0, 12.0, 0.4, 5.0]])
    q = rtn(w, QuantSpec.parse("w4ca"))
    assert q.scale.float().flatten().tolist() == [1.0, 1.0]  # (max - min) / 15
    assert q.zero.tolist() == [[-8], [-5]]  # qmin - min / scale
    assert q.codes.tolist() == [[-8, 7, -2, -6], [-8, 7, -5, 0]]
    assert q.dequantize(torch.float32).tolist() == [[0.0, 15.0, 6.0, 2.0], [-3.0, 12.0, 0.0, 5.0]]
    # two groups of 32 with absmax 7.5 and 15 -> scales 1 and 2
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1], w[0, 32], w[0, 33] = 7.5, 2.6, -15.0, 5.0
    q = rtn(w, QuantSpec.parse("w4g32"))
    assert q.scale.float().tolist() == [[1.0, 2.0]]
    assert q.codes[0, [0, 1, 32, 33]].tolist() == [7, 3, -8, 2]
    assert int(q.codes.abs().sum()) == 7 + 3 + 8 + 2


def test_qparams_equal_compressed_tensors_and_grid_formula():
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize

    w = _weight(24, 128, seed=3)
    for spec in SPECS:
        scale, zero = qparams(w, spec)
        groups = 1 if spec.group_size is None else 128 // spec.group_size
        wg = w.unflatten(-1, (groups, -1))  # bf16: the observer works in the weight's dtype, as CT's
        mn, mx = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        if spec.symmetric:
            expect = torch.maximum(-mn, mx) / ((spec.qmax - spec.qmin) / 2)
            assert zero is None
        else:
            expect = (mx - mn) / (spec.qmax - spec.qmin)
            assert zero.dtype == torch.int8
            assert torch.equal(
                zero, (spec.qmin - mn / scale).round().clamp(spec.qmin, spec.qmax).to(torch.int8)
            )
        assert scale.dtype == torch.bfloat16 and torch.equal(scale, expect), spec.name()
        # codes equal CT's own quantize on the float32 weight with the same grid
        ct_codes = ct_quantize(w.float(), scale, zero, spec.quantization_args(), dtype=torch.int8)
        assert torch.equal(quantize(w, scale, zero, spec), ct_codes), spec.name()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name())
def test_quantized_weights_lie_on_the_grid(spec):
    w = _weight(16, 128, seed=4)
    H = _correlated_hessian(128, seed=5)
    for q in (rtn(w, spec), gptq(w, H, spec)):
        assert q.codes.dtype == torch.int8
        assert int(q.codes.min()) >= spec.qmin and int(q.codes.max()) <= spec.qmax
        groups = q.scale.shape[-1]
        s = q.scale.double().repeat_interleave(128 // groups, -1)
        z = 0 if q.zero is None else q.zero.double().repeat_interleave(128 // groups, -1)
        exact = (q.codes.double() - z) * s  # exact in float64
        assert torch.equal(q.dequantize(torch.float64), exact)
        assert torch.equal(q.dequantize(torch.bfloat16), exact.to(torch.bfloat16))
        assert torch.equal(dequantize(q.codes, q.scale, q.zero, spec, torch.float64), exact)


# --- GPTQ -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gptq_identity_hessian_equals_rtn(spec, dtype):
    w = _weight(12, 128, seed=6, dtype=dtype)
    H = torch.eye(128) * 3.0
    for s in (spec, spec.model_copy(update={"actorder": True, "block_size": 32})):
        g, r = gptq(w, H, s), rtn(w, s)
        assert torch.equal(g.codes, r.codes) and torch.equal(g.scale, r.scale)
        assert (g.zero is None and r.zero is None) or torch.equal(g.zero, r.zero)


def _naive_gptq(w: torch.Tensor, H: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Algorithm 1 written plainly: one column at a time, every later column updated at once, no blocks."""
    out, n = w.shape
    scale, zero = qparams(w, spec)  # llm-compressor: group parameters from the original weight
    gs = n if spec.group_size is None else spec.group_size
    W, H = w.float().clone(), H.float().clone()
    order = list(range(n))
    if spec.actorder:
        order = torch.argsort(torch.diag(H), descending=True).tolist()
    W, H = W[:, order], H[order][:, order]
    for j in range(n):
        if H[j, j] == 0:
            H[j, j] = 1.0
            W[:, j] = 0.0
    H += spec.damp * torch.diag(H).mean() * torch.eye(n)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(out, n, dtype=torch.int8)
    for j in range(n):
        g = order[j] // gs
        s = scale[:, g].float()
        z = torch.zeros(out) if zero is None else zero[:, g].float()
        c = torch.clamp(torch.round(W[:, j] / s + z), spec.qmin, spec.qmax)
        q = ((c - z) * s).to(torch.bfloat16).float()
        codes[:, order[j]] = c.to(torch.int8)
        err = (W[:, j] - q) / U[j, j]
        for k in range(j + 1, n):
            W[:, k] -= err * U[j, k]
    return codes


@pytest.mark.parametrize("text", ["w4g32", "w3g32a", "w2g32", "w4ca"])
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_equals_naive_reference(text, actorder):
    spec = QuantSpec.parse(text).model_copy(update={"block_size": 48, "actorder": actorder})
    w = _weight(8, 96, seed=7)
    H = _correlated_hessian(96, seed=8, dead=(5,))
    q = gptq(w, H, spec)
    ref = _naive_gptq(w, H, spec)
    assert torch.equal(q.codes, ref)
    assert (q.codes[:, 5] == (0 if q.zero is None else q.zero[:, 0])).all()  # dead column -> zero
    assert not torch.equal(q.codes, rtn(w, spec).codes)  # the updates did change codes


@pytest.mark.parametrize("text", ["w2g32", "w3g32", "w4g32", "w4g64a", "w8c"])
def test_gptq_loss_not_above_rtn(text):
    spec = QuantSpec.parse(text)
    w = _weight(32, 128, seed=9)
    H = _correlated_hessian(128, seed=10)
    lg, lr = gptq_loss(w, gptq(w, H, spec), H), gptq_loss(w, rtn(w, spec), H)
    assert lg <= lr
    if spec.bits <= 4:
        assert lg < 0.9 * lr  # a clear gain, not a tie
    d = w.double() - rtn(w, spec).dequantize(torch.float64)
    assert lr == pytest.approx(float(torch.trace(d @ H.double() @ d.T)), rel=1e-9)


def test_gptq_batched_equals_per_matrix():
    spec = QuantSpec.parse("w3g32a").model_copy(update={"actorder": True, "block_size": 64})
    w = torch.stack([_weight(8, 96, seed=s) for s in (11, 12, 13)])
    H = torch.stack([_correlated_hessian(96, seed=s, dead=(s,)) for s in (14, 15, 16)])
    qb = gptq(w, H, spec)
    for e in range(3):
        qe = gptq(w[e], H[e], spec)
        assert torch.equal(qb.codes[e], qe.codes) and torch.equal(qb.scale[e], qe.scale)
        assert torch.equal(qb.zero[e], qe.zero)


@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_on_a_shared_hessian_factor_equals_gptq_on_the_hessian(actorder):
    # one factorisation serves every weight and bit width quantized against the same Hessian (auto's keeps)
    from moecompress.quant.gptq import factor

    w = torch.stack([_weight(8, 96, seed=s) for s in (21, 22)])
    H = torch.stack([_correlated_hessian(96, seed=s, dead=(s,)) for s in (23, 24)])
    specs = [QuantSpec.parse(t).model_copy(update={"actorder": actorder}) for t in ("w4g32", "w2g32a")]
    hf = factor(H, specs[0])
    for spec in specs:
        a, b = gptq(w, H, spec), gptq(w, None, spec, hf)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    with pytest.raises(RuntimeError, match="another damping"):
        gptq(w, None, specs[0].model_copy(update={"damp": 0.1}), hf)


def test_gptq_bad_hessian_shape():
    with pytest.raises(MoECompressError, match="Hessian of shape"):
        gptq(torch.zeros(4, 64), torch.eye(32), QuantSpec.parse("w4g32"))


# --- packing and bytes --------------------------------------------------------------------------------


def _random_q(shape, spec, seed=0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    groups = 1 if spec.group_size is None else n // spec.group_size
    codes = torch.randint(spec.qmin, spec.qmax + 1, shape, generator=g).to(torch.int8)
    scale = (torch.rand(*shape[:-1], groups, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    zero = None
    if not spec.symmetric:
        zero = torch.randint(spec.qmin, spec.qmax + 1, (*shape[:-1], groups), generator=g).to(torch.int8)
    return QuantizedTensor(codes=codes, scale=scale, zero=zero, spec=spec)


PACK_CASES = [
    (spec_text, shape)
    for spec_text in ("w2c", "w3c", "w4c", "w8c", "w2ca", "w3ca", "w4ca", "w8ca")
    for shape in ((5, 37), (7, 1), (33, 70))
] + [
    (t, shape)
    for t in ("w2g32", "w3g32a", "w4g64", "w8g128a", "w3g64")
    for shape in ((7, 128), (2, 5, 128), (1, 256))
]


@pytest.mark.parametrize(("text", "shape"), PACK_CASES)
def test_pack_unpack_exact_and_bytes(text, shape):
    spec = QuantSpec.parse(text)
    q = _random_q(shape, spec)
    p = q.packed()
    assert p["weight_packed"].dtype == torch.int32 and p["weight_scale"].dtype == torch.bfloat16
    assert p["weight_packed"].shape[-1] == math.ceil(shape[-1] * spec.bits / 32)
    assert ("weight_zero_point" in p) == (not spec.symmetric)
    back = QuantizedTensor.from_packed(p, spec)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scale, q.scale)
    assert (back.zero is None) == (q.zero is None) and (q.zero is None or torch.equal(back.zero, q.zero))
    stored = sum(t.numel() * t.element_size() for t in p.values())
    batch = math.prod(shape[:-2])
    assert stored == batch * spec.tensor_bytes(*shape[-2:]) == q.nbytes()
    assert spec.bits_per_weight(*shape[-2:]) == pytest.approx(8 * stored / math.prod(shape))


def test_packing_is_compressed_tensors_layout():
    # CT's documented 4-bit layout: code j stored as code + 8 in bits 4·(j % 8) of word j // 8
    spec = QuantSpec.parse("w4c")
    codes = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7, 5]], dtype=torch.int8)
    q = QuantizedTensor(codes=codes, scale=torch.ones(1, 1, dtype=torch.bfloat16), zero=None, spec=spec)
    words = q.packed()["weight_packed"]
    expect0 = sum((int(c) + 8) << (4 * j) for j, c in enumerate(codes[0, :8].tolist()))
    assert words.shape == (1, 2)
    assert int(words[0, 0]) & 0xFFFFFFFF == expect0 and int(words[0, 1]) == 5 + 8


def test_from_packed_missing_tensor():
    spec = QuantSpec.parse("w4ca")
    p = _random_q((4, 32), spec).packed()
    del p["weight_zero_point"]
    with pytest.raises(MoECompressError, match="lacks weight_zero_point"):
        QuantizedTensor.from_packed(p, spec)


@pytest.mark.parametrize(
    ("text", "cols"),
    [
        ("w2g32", 128),
        ("w3g32", 128),
        ("w4g128", 128),
        ("w8g64", 128),
        ("w4c", 128),
        ("w3ca", 128),
        ("w4g32a", 128),
        ("w2ca", 128),
        ("w8g32a", 128),
        ("w4g64", 192),
        ("w3g32a", 96),
    ],
)
def test_compressed_tensors_decompress_equals_dequantize(text, cols):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    spec = QuantSpec.parse(text)
    w = _weight(40, cols, seed=17)
    q = gptq(w, _correlated_hessian(cols, seed=18), spec)
    scheme = QuantizationScheme(targets=["Linear"], weights=spec.quantization_args())
    dec = PackedQuantizationCompressor.decompress(q.packed(), scheme)
    assert dec["weight"].dtype == torch.bfloat16
    assert torch.equal(dec["weight"], q.dequantize(torch.bfloat16))
    # and CT's compressor packs our dequantized weight back into the same words
    dense = {"weight": q.dequantize(torch.bfloat16), "weight_scale": q.scale}
    if q.zero is not None:
        dense["weight_zero_point"] = q.zero
    comp = PackedQuantizationCompressor.compress(dense, scheme)
    if spec.bits < 8:  # at 8 bits CT's bf16 re-division can tip a code by one (see docs/quantization.md)
        assert torch.equal(comp["weight_packed"], q.packed()["weight_packed"])
