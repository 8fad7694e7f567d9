"""PuzzleMoE: known answers (Lemma 3.1), merge formulas, exact bit packing, packed runtime = dense formula,
pairing search, quantization bounds and bits accounting, Triton kernel (interpreter / CUDA)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moecompress.errors import MoECompressError
from moecompress.models import ExpertActivation, ExpertWeights, expert_apply
from moecompress.puzzle import (
    EXP_BIAS,
    MAX_PACKABLE,
    MIN_NORMAL,
    PackedPairExperts,
    QuantPairLinear,
    channel_norms,
    clamp_exponent,
    clamp_report,
    decode_pair,
    evolve_grouping,
    expert_input_norms,
    gaussian_similarity_rate,
    groups_for_ratio,
    layout_bits_per_weight,
    merge_expert_group,
    merge_expert_pair,
    merge_group,
    merge_pair,
    pack_pair,
    packed_pair_linear,
    paper_bits_per_weight,
    random_grouping,
    random_pairing,
    reconstruct_pair,
    similarity_fraction,
    unpack_pair,
    unpack_quantized_pair,
    validate_grouping,
)
from moecompress.puzzle.quant import pack_codes, quantize_magnitudes, unpack_codes

ROOT = Path(__file__).resolve().parents[1]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pair(out_f=48, in_f=80, seed=0, scale=0.02):
    g = _gen(seed)
    return torch.randn(out_f, in_f, generator=g) * scale, torch.randn(out_f, in_f, generator=g) * scale


def _all_bf16() -> torch.Tensor:
    """Every one of the 2^16 bfloat16 bit patterns."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


# ------------------------------------------------------------------------------------ merge


@pytest.mark.parametrize("tau", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
def test_gaussian_similarity_rate_matches_lemma(tau):
    """Lemma 3.1: equal-σ Gaussians have P(Δ < τ) = 2/π(arctan((1+τ)/(1−τ)) − arctan((1−τ)/(1+τ)))."""
    w_i, w_j = _pair(1024, 1024, seed=7, scale=0.013)
    assert abs(similarity_fraction(w_i, w_j, tau) - gaussian_similarity_rate(tau)) < 0.005


def test_gaussian_rate_closed_form_values():
    assert gaussian_similarity_rate(0.5) == pytest.approx(2 / math.pi * (math.atan(3) - math.atan(1 / 3)))
    assert gaussian_similarity_rate(1e-9) == pytest.approx(0.0, abs=1e-8)
    assert gaussian_similarity_rate(1 - 1e-9) == pytest.approx(1.0, abs=1e-4)


def test_merge_pair_matches_the_paper_formulas():
    w_i, w_j = _pair(seed=1)
    w_i[0, :4] = torch.tensor([0.0, 0.0, 0.01, -0.01])
    w_j[0, :4] = torch.tensor(
        [0.0, 0.02, 0.011, 0.01]
    )  # 0/0, one zero, similar, equal magnitude opposite sign
    n_i, n_j = torch.rand(80, generator=_gen(2)) + 0.5, torch.rand(80, generator=_gen(3)) + 0.5
    tau = 0.4
    m = merge_pair(w_i, w_j, n_i, n_j, tau)
    # Independent transcription of §3.2 in arithmetic form.
    a_i, a_j = w_i.abs(), w_j.abs()
    delta = torch.nan_to_num((a_i - a_j).abs() / (a_i + a_j), nan=0.0)
    m_sim = (delta <= tau).float()
    sal_i = (a_i * n_i >= a_j * n_j).float()
    sal_j = 1 - sal_i
    merged = m_sim * (a_i + a_j) / 2 + (1 - m_sim) * (sal_i * a_i + sal_j * a_j)
    assert torch.equal(m.m_sim, m_sim.bool())
    assert torch.equal(m.w_merged, merged)
    assert torch.equal(m.m_i, (sal_i + m_sim).clamp(max=1).bool())
    assert torch.equal(m.m_j, (sal_j + m_sim).clamp(max=1).bool())
    assert torch.equal(m.s_i, w_i < 0) and torch.equal(m.s_j, w_j < 0)
    assert bool((m.m_i | m.m_j).all()), "every element belongs to at least one expert"
    assert bool(m.m_sim[0, 0]) and m.w_merged[0, 0] == 0  # 0/0 := 0 -> similar, merged 0
    assert bool(m.m_sim[0, 3]) and m.w_merged[0, 3] == pytest.approx(0.01)  # magnitude-only similarity
    r_i, r_j = m.reconstruct()
    assert torch.equal(r_i, (-1.0) ** m.s_i.float() * m.m_i.float() * merged)
    assert torch.equal(r_j, (-1.0) ** m.s_j.float() * m.m_j.float() * merged)
    # Where both experts agree closely the reconstruction is near both; where only one is kept it is exact.
    only_i = m.m_i & ~m.m_j
    assert torch.equal(r_i[only_i], w_i[only_i]) and bool((r_j[only_i] == 0).all())


def test_saliency_follows_input_norms():
    w_i = torch.tensor([[1.0, 1.0]])
    w_j = torch.tensor([[3.0, 3.0]])  # Δ = 0.5 > τ: not similar, saliency decides
    m = merge_pair(w_i, w_j, torch.tensor([10.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert m.m_i.tolist() == [[True, False]] and m.m_j.tolist() == [[False, True]]
    assert m.w_merged.tolist() == [[1.0, 3.0]]
    tie = merge_pair(torch.tensor([[2.0]]), torch.tensor([[-0.5]]))  # no norms: |W| alone, ties -> i
    assert tie.m_i.item() and not tie.m_j.item() and tie.w_merged.item() == 2.0


def test_channel_norms_and_expert_input_norms():
    x = torch.randn(30, 8, generator=_gen(4))
    assert torch.allclose(channel_norms(x), x.pow(2).sum(0).sqrt())
    e = ExpertWeights(gate=torch.randn(6, 8), up=torch.randn(6, 8), down=torch.randn(8, 6))
    norms = expert_input_norms(e, x, ExpertActivation())
    inter = F.silu(x @ e.gate.T) * (x @ e.up.T)
    assert torch.allclose(norms.hidden, x.pow(2).sum(0).sqrt())
    assert torch.allclose(norms.intermediate, inter.pow(2).sum(0).sqrt(), rtol=1e-5)


def test_group_merge_reduces_to_pair_merge():
    w_i, w_j = _pair(seed=5)
    n_i, n_j = torch.rand(80, generator=_gen(6)), torch.rand(80, generator=_gen(7))
    p, g = merge_pair(w_i, w_j, n_i, n_j), merge_group([w_i, w_j], [n_i, n_j])
    assert torch.equal(g.w_merged, p.w_merged)
    assert torch.equal(g.masks[0], p.m_i) and torch.equal(g.masks[1], p.m_j)
    assert torch.equal(g.signs[0], p.s_i) and torch.equal(g.signs[1], p.s_j)


@pytest.mark.parametrize("size", [3, 4])
def test_group_merge_of_three_and_four(size):
    g_ = _gen(size)
    ws = [torch.randn(32, 40, generator=g_) * 0.02 for _ in range(size)]
    norms = [torch.rand(40, generator=g_) + 0.1 for _ in range(size)]
    gm = merge_group(ws, norms, tau=0.4)
    mags = torch.stack([w.abs() for w in ws])
    sal = mags * torch.stack(norms)[:, None, :]
    anchor = sal.argmax(0)
    assert bool(gm.masks.gather(0, anchor[None]).all()), "the most salient member is always kept"
    assert bool(gm.masks.any(0).all())
    expect = (mags * gm.masks).sum(0) / gm.masks.sum(0)
    assert torch.allclose(gm.w_merged, expect)
    for k, r in enumerate(gm.reconstruct()):
        assert torch.equal(r[gm.masks[k]].abs(), gm.w_merged[gm.masks[k]])
        assert torch.equal(
            torch.sign(r[gm.masks[k] & (gm.w_merged > 0)]), torch.sign(ws[k][gm.masks[k] & (gm.w_merged > 0)])
        )
    a_anchor = mags.gather(0, anchor[None])
    d = (mags - a_anchor).abs() / (mags + a_anchor)
    assert torch.equal(gm.masks, (d <= 0.4) | (torch.arange(size)[:, None, None] == anchor[None]))
    assert gm.storage_bits() == ws[0].numel() * (16 + 2 * size)
    experts = [ExpertWeights(gate=w[:16], up=w[16:], down=w.T.contiguous()) for w in ws]
    groups = merge_expert_group(experts, tau=0.4)
    assert groups["gate_up"].w_merged.shape == (32, 40) and groups["down"].masks.shape == (size, 40, 32)


# ------------------------------------------------------------------------------------ packing


def test_pack_unpack_exhaustive_over_packable_values_and_masks():
    """Every bf16 value with exponent 112..143 (non-negative) × all 16 mask/sign combinations."""
    mags = torch.arange((EXP_BIAS << 7), (EXP_BIAS + 32) << 7, dtype=torch.int32)  # 4096 bit patterns
    w = mags.to(torch.int16).view(torch.bfloat16)
    assert float(w.float().min()) == MIN_NORMAL and float(w.float().max()) == MAX_PACKABLE
    combos = torch.arange(16)
    w = w[:, None].expand(-1, 16).contiguous()
    m_i, m_j = (combos & 8).bool().expand_as(w), (combos & 4).bool().expand_as(w)
    s_i, s_j = (combos & 2).bool().expand_as(w), (combos & 1).bool().expand_as(w)
    packed = pack_pair(w, m_i, m_j, s_i, s_j)
    assert packed.dtype == torch.int16 and packed.shape == w.shape
    assert packed.unique().numel() == 4096 * 12 + 4, (
        "distinct codes for all valid inputs; zero code per sign pair"
    )
    u_w, u_mi, u_mj, u_si, u_sj = unpack_pair(packed)
    valid = m_i | m_j
    assert torch.equal(u_w.view(torch.int16)[valid], w.view(torch.int16)[valid])  # bit-exact
    assert torch.equal(u_mi[valid], m_i[valid]) and torch.equal(u_mj[valid], m_j[valid])
    assert torch.equal(u_si, s_i) and torch.equal(u_sj, s_j)
    assert bool((u_w[~valid] == 0).all()) and not bool((u_mi | u_mj)[~valid].any())
    d_i, d_j = decode_pair(packed)
    r_i, r_j = reconstruct_pair(w, m_i, m_j, s_i, s_j)
    assert torch.equal(d_i.float(), r_i.float()) and torch.equal(d_j.float(), r_j.float())


def test_zero_stays_zero_and_the_clamp_on_every_bf16_pattern():
    allw = _all_bf16()
    v = allw.float()
    ok = torch.isfinite(v) & (v >= 0) & (v <= MAX_PACKABLE) & (allw.view(torch.int16) >= 0)
    w = allw[ok]
    x = w.float()
    for rule in ("nearest", "clamp", "flush"):
        c = clamp_exponent(w, underflow=rule).float()
        big = x >= MIN_NORMAL
        assert torch.equal(c[big], x[big]), "exponent ≥ 112 is untouched"
        assert c[x == 0].eq(0).all(), "zero stays zero"
        small = (x > 0) & ~big
        expect = {
            "nearest": torch.where(x[small] >= MIN_NORMAL / 2, MIN_NORMAL, 0.0),
            "clamp": torch.full_like(x[small], MIN_NORMAL),
            "flush": torch.zeros_like(x[small]),
        }[rule]
        assert torch.equal(c[small], expect)
        ones = torch.ones_like(w, dtype=torch.bool)
        d_i, _ = decode_pair(pack_pair(w, ones, ones, ~ones, ~ones, underflow=rule))
        assert torch.equal(d_i.float(), c)
        rep = clamp_report(w, underflow=rule)
        assert rep.total == w.numel() and rep.changed == int(small.sum()) and rep.zeros == 1
        assert rep.max_abs_change == pytest.approx(float((c - x).abs().max()))
    assert clamp_report(w, "nearest").max_abs_change <= MIN_NORMAL / 2
    # Signed tensors keep their sign through clamp_exponent.
    assert clamp_exponent(torch.tensor([-1e-7, -0.5]).bfloat16()).tolist() == [0.0, -0.5]


def test_pack_rejects_what_it_cannot_hold():
    one = torch.ones(2, dtype=torch.bool)
    with pytest.raises(MoECompressError, match="negative"):
        pack_pair(torch.tensor([0.5, -0.5]), one, one, one, one)
    with pytest.raises(MoECompressError, match="2\\^17"):
        pack_pair(torch.tensor([0.5, 2.0**17]), one, one, one, one)
    with pytest.raises(MoECompressError, match="inf or NaN"):
        pack_pair(torch.tensor([0.5, float("inf")]), one, one, one, one)
    with pytest.raises(MoECompressError, match="shape"):
        pack_pair(torch.tensor([0.5, 1.0]), one[:1], one, one, one)
    with pytest.raises(MoECompressError, match="int16"):
        unpack_pair(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(MoECompressError, match="underflow"):
        clamp_exponent(torch.ones(2).bfloat16(), underflow="round")
    with pytest.raises(MoECompressError, match="tau"):
        merge_pair(torch.ones(2, 2), torch.ones(2, 2), tau=1.5)
    with pytest.raises(MoECompressError, match="same shape"):
        merge_pair(torch.ones(2, 2), torch.ones(2, 3))
    with pytest.raises(MoECompressError, match="input channels"):
        merge_pair(torch.ones(2, 3), torch.ones(2, 3), torch.ones(4), None)


def test_clamp_report_on_gaussian_weights_and_aggregation():
    w_i, w_j = _pair(512, 512, seed=9)  # σ = 0.02: P(|w| < 2^-15) ≈ 0.12 %
    rep = clamp_report([w_i, w_j])
    one = clamp_report(w_i)
    assert rep.total == 2 * one.total and rep.changed >= one.changed
    assert 0.0005 < one.changed_fraction < 0.002
    assert one.to_zero + one.to_min == one.changed and one.max_abs_change <= MIN_NORMAL / 2
    assert one.relative_l1_change < 1e-5
    assert set(one.to_dict()) >= {"changed_fraction", "relative_l1_change", "max_abs_change"}
    m = merge_pair(w_i, w_j)  # merged magnitudes are larger: the clamp touches fewer of them
    assert clamp_report(m.w_merged).changed < one.changed


# ------------------------------------------------------------------------------------ runtime


def test_packed_pair_linear_equals_the_dense_reconstruction():
    w_i, w_j = _pair(40, 72, seed=11)
    m = merge_pair(w_i, w_j, torch.rand(72, generator=_gen(1)), torch.rand(72, generator=_gen(2)))
    packed = pack_pair(m.w_merged, m.m_i, m.m_j, m.s_i, m.s_j)
    r_i, r_j = m.rounded().reconstruct()  # W_merged as stored: bf16-rounded, exponent-clamped
    x_i, x_j = (
        torch.randn(3, 72, generator=_gen(3)),
        torch.randn(7, 2, 72, generator=_gen(4)),
    )  # different tokens
    b_i, b_j = torch.randn(40), torch.randn(40)
    y_i, y_j = packed_pair_linear(x_i, x_j, packed, b_i, b_j, backend="torch")
    assert torch.equal(y_i, F.linear(x_i, r_i, b_i)) and torch.equal(y_j, F.linear(x_j, r_j, b_j))
    assert y_j.shape == (7, 2, 40)
    y_i2, none = packed_pair_linear(x_i, None, packed)
    assert none is None and torch.equal(y_i2, F.linear(x_i, r_i))
    yb_i, _ = packed_pair_linear(x_i.bfloat16(), None, packed)
    assert yb_i.dtype == torch.bfloat16


def _experts(h=32, i=24, seed=0, bias=False):
    g = _gen(seed)
    mk = lambda *s: torch.randn(*s, generator=g) * 0.05
    return [
        ExpertWeights(
            gate=mk(i, h),
            up=mk(i, h),
            down=mk(h, i),
            gate_bias=mk(i) if bias else None,
            up_bias=mk(i) if bias else None,
            down_bias=mk(h) if bias else None,
        )
        for _ in range(2)
    ]


@pytest.mark.parametrize("act,bias", [(ExpertActivation(), False), (ExpertActivation(kind="gpt_oss"), True)])
def test_packed_pair_experts_equal_dense_formula_and_halve_the_bytes(act, bias):
    e_i, e_j = _experts(bias=bias)
    x_i, x_j = torch.randn(5, 32, generator=_gen(8)), torch.randn(2, 32, generator=_gen(9))
    n_i = expert_input_norms(e_i, x_i, act)
    n_j = expert_input_norms(e_j, x_j, act)
    merge = merge_expert_pair(e_i, e_j, n_i, n_j)
    separate = [merge_pair(getattr(e_i, p), getattr(e_j, p), n_i.hidden, n_j.hidden) for p in ("gate", "up")]
    assert torch.equal(merge.gate_up.w_merged, torch.cat([m.w_merged for m in separate]))
    assert torch.equal(merge.gate_up.m_j, torch.cat([m.m_j for m in separate]))
    pair = PackedPairExperts.from_merge(merge, act)
    dense_i, dense_j = merge.rounded().reconstruct()
    y_i, y_j = pair(x_i, x_j)
    torch.testing.assert_close(y_i, expert_apply(dense_i, x_i, act), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(y_j, expert_apply(dense_j, x_j, act), rtol=1e-6, atol=1e-7)
    dec_i, dec_j = pair.decode(torch.float32)
    assert torch.equal(dec_i.gate, dense_i.gate) and torch.equal(dec_j.down, dense_j.down)
    if bias:
        assert torch.equal(dec_j.up_bias, e_j.up_bias) and torch.equal(dec_i.down_bias, e_i.down_bias)
    pair_bf16_bytes = 2 * sum(t.numel() for t in (e_i.gate, e_i.up, e_i.down)) * 2
    assert pair.nbytes() * 2 == pair_bf16_bytes, "packed bytes are exactly half of the pair's bf16 bytes"
    # Round trip through meta + state_dict (what a checkpoint stores).
    again = PackedPairExperts.from_state(pair.meta(), pair.state_dict())
    z_i, z_j = again(x_i, x_j)
    assert torch.equal(z_i, y_i) and torch.equal(z_j, y_j)
    only_j = pair(None, x_j)
    assert only_j[0] is None and torch.equal(only_j[1], y_j)


def test_quantized_pair_experts_and_state_round_trip():
    e_i, e_j = _experts(h=128, i=128, seed=3)
    merge = merge_expert_pair(e_i, e_j)
    x = torch.randn(4, 128, generator=_gen(5))
    for bits in (3, 4):
        pair = PackedPairExperts.from_merge(merge, quant_bits=bits)
        assert isinstance(pair.gate_up, QuantPairLinear)
        dec_i, _ = pair.decode(torch.float32)
        y_i, _ = pair(x, None)
        torch.testing.assert_close(y_i, expert_apply(dec_i, x, ExpertActivation()), rtol=1e-5, atol=1e-6)
        again = PackedPairExperts.from_state(pair.meta(), pair.state_dict())
        assert torch.equal(again(x, None)[0], y_i)
        n_weights = 2 * 3 * 128 * 128
        assert pair.nbytes() * 8 / n_weights == pytest.approx(layout_bits_per_weight(bits))


# ------------------------------------------------------------------------------------ pairing


@pytest.mark.parametrize("num_experts", [2, 8, 16, 60])
def test_random_pairing_is_a_seeded_perfect_matching(num_experts):
    p = random_pairing(num_experts, seed=3)
    assert validate_grouping(p, num_experts, 2) == p
    assert sorted(e for pair in p for e in pair) == list(range(num_experts))
    assert random_pairing(num_experts, seed=3) == p
    if num_experts >= 8:
        assert any(random_pairing(num_experts, seed=s) != p for s in range(4, 8))


def test_partial_groupings_and_ratios():
    assert groups_for_ratio(8, 0.25) == 2 and groups_for_ratio(8, 0.5) == 4
    assert groups_for_ratio(12, 2 / 3, group_size=3) == 4 and groups_for_ratio(8, 0.75, group_size=4) == 2
    p = random_pairing(8, num_pairs=2, seed=1)
    assert len(p) == 2 and len({e for pair in p for e in pair}) == 4
    t = random_grouping(9, group_size=3, seed=2)
    assert sorted(e for g in t for e in g) == list(range(9))
    with pytest.raises(MoECompressError, match="groups"):
        random_pairing(5, num_pairs=3)
    with pytest.raises(MoECompressError, match="two groups"):
        validate_grouping([(0, 1), (1, 2)], 4)
    with pytest.raises(MoECompressError, match="outside"):
        groups_for_ratio(8, 1.0)


def test_evolutionary_search_is_valid_deterministic_and_improves():
    num_experts = 12
    target = {frozenset((2 * k, 2 * k + 1)) for k in range(6)}
    seen = []

    def loss(groups):
        validate_grouping(groups, num_experts, 2, 6)  # raises on any invalid matching
        seen.append(groups)
        return float(sum(frozenset(g) not in target for g in groups))

    start = loss(random_pairing(num_experts, seed=5))
    res = evolve_grouping(num_experts, loss, population=12, generations=25, seed=5)
    assert validate_grouping(res.groups, num_experts, 2, 6) == res.groups
    assert res.loss < start and res.loss == loss(res.groups)
    assert all(a >= b for a, b in zip(res.history, res.history[1:])), "best loss never gets worse"
    assert res.history[0] <= start, "the default random pairing is in the first population"
    again = evolve_grouping(num_experts, loss, population=12, generations=25, seed=5)
    assert again.groups == res.groups and again.history == res.history
    # Partial groupings of three: still valid every time.
    part = evolve_grouping(
        10,
        lambda g: float(sum(max(x) - min(x) for x in g)),
        group_size=3,
        num_groups=2,
        population=6,
        generations=5,
        seed=1,
    )
    assert validate_grouping(part.groups, 10, 3, 2) == part.groups


# ------------------------------------------------------------------------------------ quantization


@pytest.mark.parametrize("bits", [3, 4])
def test_quantization_error_is_at_most_half_a_step(bits):
    w_i, w_j = _pair(16, 200, seed=bits)  # 200: a partial last group of 72
    m = merge_pair(w_i, w_j)
    q, scales = quantize_magnitudes(m.w_merged, bits, 128)
    assert scales.shape == (16, 2) and scales.dtype == torch.bfloat16 and int(q.max()) <= 2**bits - 1
    s = scales.float().repeat_interleave(128, 1)[:, :200]
    err = (q.float() * s - m.w_merged).abs()
    assert bool((err <= s / 2 * (1 + 1e-6)).all())
    assert int(q.max()) == 2**bits - 1  # the unsigned range is used in full
    from moecompress.puzzle import quantize_pair

    data, sc = quantize_pair(m.w_merged, m.m_i, m.m_j, m.s_i, m.s_j, bits)
    w, mi, mj, si, sj = unpack_quantized_pair(data, sc, (16, 200), bits)
    assert (
        torch.equal(mi, m.m_i)
        and torch.equal(mj, m.m_j)
        and torch.equal(si, m.s_i)
        and torch.equal(sj, m.s_j)
    )
    assert torch.equal(w, q.float() * s)
    assert data.numel() == math.ceil(16 * 200 / 8) * (bits + 4)


def test_code_packing_round_trip():
    g = _gen(0)
    for width in range(1, 9):
        codes = torch.randint(0, 2**width, (1003,), generator=g)
        data = pack_codes(codes, width)
        assert data.dtype == torch.uint8 and data.numel() == math.ceil(1003 / 8) * width
        assert torch.equal(unpack_codes(data, width, 1003), codes)


def test_bits_accounting_reproduces_the_paper():
    assert round(paper_bits_per_weight(3), 2) == 3.35
    assert paper_bits_per_weight(3, mask_bits=1.58) == pytest.approx((2 + 1.58 + 3 + 0.125) / 2)
    assert paper_bits_per_weight(4) == pytest.approx((2 + math.log2(3) + 4 + 0.125) / 2)
    assert layout_bits_per_weight() == 8.0
    assert layout_bits_per_weight(3) == 3.5625 and layout_bits_per_weight(4) == 4.0625
    assert layout_bits_per_weight(members=3) == pytest.approx(22 / 3)
    assert layout_bits_per_weight(members=4) == 6.0
    w_i, w_j = _pair(64, 256, seed=2)
    m = merge_pair(w_i, w_j)
    ql = QuantPairLinear.from_merge(m, bits=3)
    assert ql.nbytes() * 8 / (2 * 64 * 256) == layout_bits_per_weight(3)


# ------------------------------------------------------------------------------------ Triton


_INTERP_SCRIPT = textwrap.dedent("""
    import os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from moecompress.puzzle import merge_pair, pack_pair, packed_pair_linear, packed_pair_linear_triton
    g = torch.Generator().manual_seed(0)
    for (n, k, mi, mj, split, bk) in [(40, 72, 3, 5, 1, 32), (70, 96, 17, 0, 2, 32), (16, 40, 1, 33, 3, 16)]:
        w_i, w_j = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, k, generator=g) * 0.05
        m = merge_pair(w_i, w_j)
        packed = pack_pair(m.w_merged, m.m_i, m.m_j, m.s_i, m.s_j)
        x_i = torch.randn(mi, k, generator=g).bfloat16().float()
        x_j = torch.randn(mj, k, generator=g).bfloat16().float() if mj else None
        b_i = torch.randn(n, generator=g)
        ref = packed_pair_linear(x_i, x_j, packed, b_i, None, backend="torch")
        out = packed_pair_linear_triton(x_i, x_j, packed, b_i, None, block_k=bk, split_k=split)
        for r, o in zip(ref, out):
            if r is None:
                assert o is None
                continue
            assert o.shape == r.shape and o.dtype == r.dtype
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    print("OK")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_in_the_cpu_interpreter():
    """The kernel's decode + two dots, masks and split-K run in Triton's interpreter (fresh process:
    TRITON_INTERPRET must be set before triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    r = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs CUDA and triton",
)
@pytest.mark.parametrize("n,k,m", [(768, 2048, 1), (1536, 2048, 16), (2048, 768, 64), (4096, 1792, 7)])
def test_triton_kernel_on_cuda_matches_reference(n, k, m):
    from moecompress.puzzle import packed_pair_linear_triton

    g = torch.Generator().manual_seed(n + k + m)
    w_i, w_j = torch.randn(n, k, generator=g) * 0.02, torch.randn(n, k, generator=g) * 0.02
    mg = merge_pair(w_i, w_j)
    packed = pack_pair(mg.w_merged, mg.m_i, mg.m_j, mg.s_i, mg.s_j).cuda()
    x_i = torch.randn(m, k, generator=g).cuda().bfloat16()
    x_j = torch.randn(m + 3, k, generator=g).cuda().bfloat16()
    d_i, d_j = decode_pair(packed, torch.float32)
    y_i, y_j = packed_pair_linear_triton(x_i, x_j, packed)
    torch.testing.assert_close(y_i.float(), x_i.float() @ d_i.T, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y_j.float(), x_j.float() @ d_j.T, rtol=2e-2, atol=2e-2)
    a_i, _ = packed_pair_linear(x_i, x_j, packed)  # auto backend picks the kernel on CUDA
    torch.testing.assert_close(a_i, y_i)


def test_benchmark_exits_clearly_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the benchmark would run")
    spec = importlib.util.spec_from_file_location(
        "bench_puzzle_kernel", ROOT / "benchmarks" / "bench_puzzle_kernel.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as exc:
        mod.main([])
    assert exc.value.code == 2
    assert "CUDA" in capsys.readouterr().err
