"""`auto`'s fast search (issue 32): quantized keeps priced from round-to-nearest codes scaled by one GPTQ chunk
per layer, GPTQ run only for the widths a plan keeps, and one noise sensitivity for every layer."""

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.auto import quant
from moecompress.methods.auto.config import ALL_CANDIDATES, AutoConfig, needs_stats, routed_budget
from moecompress.methods.auto.measure import calibration_ids
from moecompress.methods.auto.moments import LayerMoments
from moecompress.methods.auto.quant import gptq_codes, quant_candidates
from moecompress.methods.auto.sensitivity import global_sensitivity, layer_sensitivity, output_energy
from moecompress.plan import ModelInfo
from moecompress.testing import calibrated_tiny

WIDTHS = [8, 4, 2]


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return calibrated_tiny(
        tmp_path_factory.mktemp("auto_fast"), "olmoe", 3, needs_stats(AutoConfig(search="full"))
    )


def _candidates(olmoe, algo: str, **kw):
    _, store, adapter, _ = olmoe
    i = adapter.moe_layers[0]
    return quant_candidates(adapter, store, LayerMoments.load(store, i), WIDTHS, 32, algo, "gate2", 2, **kw)


def _proxy(olmoe, chunk: int):
    _, store, adapter, _ = olmoe
    i = adapter.moe_layers[0]
    return quant.proxy_candidates(adapter, store, LayerMoments.load(store, i), WIDTHS, 32, "gate2", 2, chunk)


def test_fast_search_fills_in_its_defaults_only_where_not_given():
    fast = AutoConfig(search="fast")
    assert fast.candidates == ["reroute", "drop"] and fast.sensitivity == "global" and fast.proxy_pricing
    given = AutoConfig(search="fast", candidates=["drop", "tilt"], sensitivity="noise")
    assert given.candidates == ["drop", "tilt"] and given.sensitivity == "noise"
    assert not AutoConfig(search="fast", quant_algo="rtn").proxy_pricing  # nothing to price by proxy
    assert AutoConfig().search == "fast" and AutoConfig().candidates == fast.candidates  # the default
    full = AutoConfig(search="full")
    assert full.candidates == list(ALL_CANDIDATES) and full.sensitivity == "kind" and not full.proxy_pricing
    with pytest.raises(MoECompressError, match="search"):
        parse_config("auto", {"search": "quick"})


def test_proxy_prices_a_few_experts_by_gptq_and_the_rest_by_rtn_times_their_ratio(olmoe, monkeypatch):
    n = 3  # of the tiny model's 8 experts
    monkeypatch.setattr(quant, "RATIO_EXPERTS", n)
    _, store, adapter, _ = olmoe
    i = adapter.moe_layers[0]
    exact = _candidates(olmoe, "gptq", chunk=3, keep_codes=False)
    rtn = _candidates(olmoe, "rtn", chunk=3)
    proxy = _proxy(olmoe, chunk=3)
    assert len(proxy) > n  # some experts are priced by the ratio
    tokens = float(store.get(i, "tokens").double().sum())
    down, h_mid = adapter.experts(i).down.detach().double(), store.get(i, "hessian_mid_g2").double()
    for k, b in enumerate(WIDTHS):
        diag = []  # the RTN estimate with its down part's diagonal estimate Σ_j H_jj Σ_i ΔW_ij²
        for e, slot in enumerate(rtn):
            d = down[e] - slot[k].op.parts["down"].dequantize(torch.float64)
            full = float(((d @ h_mid[e]) * d).sum()) / tokens
            diagonal = float((d.square().sum(0) * h_mid[e].diagonal()).sum()) / tokens
            assert diagonal == pytest.approx(full, rel=0.5)  # cross terms of rounding errors are small
            diag.append(slot[k].loss - full + diagonal)
        ratio = sum(exact[e][k].loss for e in range(n)) / sum(diag[:n])
        # GPTQ's codes are no worse than rounding's, give or take the estimate's gate/up part
        assert 0 < ratio < 1.5, (b, ratio)
        for e, slot in enumerate(proxy):
            c = slot[k]
            assert (c.kind, c.param, c.bytes, c.op) == ("quant", b, exact[e][k].bytes, None)
            want = exact[e][k].loss if e < n else ratio * diag[e]
            assert c.loss == pytest.approx(want, rel=1e-5), (e, b)
    # the same prices whatever the chunk the statistics are read in (a streamed store reads 4 experts at a time)
    for chunk in (2, 8):
        other = _proxy(olmoe, chunk=chunk)
        assert [[c.loss for c in slot] for slot in other] == [[c.loss for c in slot] for slot in proxy]


def test_gptq_codes_of_the_chosen_widths_are_the_full_searchs_codes(olmoe):
    _, store, adapter, _ = olmoe
    i = adapter.moe_layers[0]
    n = adapter.num_experts(i)
    full = _candidates(olmoe, "gptq", chunk=n)
    width = {0: 8, 2: 4, 5: 4, n - 1: 2}
    codes = gptq_codes(adapter, store, i, width, 32, "gate2", chunk=2)
    assert sorted(codes) == sorted(width)
    for e, b in width.items():
        want = full[e][WIDTHS.index(b)].op
        assert codes[e].spec == want.spec
        for part in ("gate", "up", "down"):
            got, ref = codes[e].parts[part], want.parts[part]
            assert torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale), (e, part)


def test_global_sensitivity_is_one_factor_near_the_energy_weighted_per_layer_ones(olmoe):
    _, store, adapter, _ = olmoe
    ids, _ = calibration_ids(store, adapter, 8, 24, 0)
    glob = global_sensitivity(adapter, ids)
    per_layer = layer_sensitivity(adapter, ids, seeds=1)
    assert sorted(glob) == sorted(per_layer) and len(set(glob.values())) == 1
    s = next(iter(glob.values()))
    # small independent perturbations add up in KL: the joint probe is the per-layer factors' mean weighted by
    # each layer's noise energy (ε_l ∝ its output energy), up to the cross terms of one draw
    energy, _ = output_energy(adapter, ids)
    mean = sum(per_layer[i] * energy[i] for i in energy) / sum(energy.values())
    assert max(per_layer.values()) > 2 * min(per_layer.values())  # the layers differ: the weighting matters
    assert s == pytest.approx(mean, rel=0.2)


@torch.no_grad()
def test_global_noise_probe_beside_the_class_probes_measures_what_it_measures_alone(olmoe):
    """With a whole-file budget the global noise probe runs in the class probes' forward, in its own rows."""
    from moecompress.methods.auto.sensitivity import noise_energies, noise_installed
    from moecompress.methods.auto.tensors import class_sensitivity, tensor_items

    _, store, adapter, _ = olmoe
    ids, _ = calibration_ids(store, adapter, 4, 24, 0)
    energy, ref = output_energy(adapter, ids)
    alone = global_sensitivity(adapter, ids, ref=ref, energy=energy)
    eps = noise_energies(adapter, energy, 0.05)
    items = tensor_items(adapter, store, ["attention"], [4], 32, "gptq", ids, None)
    sens, kl = class_sensitivity(
        adapter, items, [4], 32, ids, ref, extra=lambda rows: noise_installed(adapter, eps, rows)
    )
    assert sorted(sens) == ["attention"] and kl > 0
    s = kl / sum(eps.values())
    assert all(v == pytest.approx(s, rel=1e-4) for v in alone.values())


def test_fast_search_plan_fits_its_budget_and_stores_gptq_codes(olmoe):
    _, store, adapter, _ = olmoe
    config = parse_config("auto", dict(budget=0.35, search="fast", budget_scope="routed", quant_group=32))
    plan, tensors = get_method("auto").build(config, MethodContext(adapter, store))
    info = ModelInfo.from_model(adapter)
    assert plan.logical_bytes(tensors, accounting="stored").routed <= routed_budget(config, info)
    a = plan.params["auto"]
    labels = {k for row in a["layers"] for k in row["choices"]}
    assert labels <= {"keep", "reroute", "drop", "keep-w8", "keep-w4", "keep-w3", "keep-w2"}
    assert any(k.startswith("keep-w") for k in labels) and a["measured_kl"] > 0
    stored = [(sc.layers[0], s) for sc in plan.scopes for s in sc.stored if s.quant is not None]
    layer, s = stored[0]
    expert = s.sources[0][1]
    want = gptq_codes(adapter, store, layer, {expert: s.quant.bits}, 32, "gate2")[expert]
    for part, q in want.parts.items():
        for k, v in q.packed().items():
            assert torch.equal(tensors[f"{s.tensor}.{part}.{k}"], v), (part, k)
