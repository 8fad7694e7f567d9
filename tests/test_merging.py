"""M-SMoE and HC-SMoE: groups and merges against hand-computed answers; router aggregation vs router merging."""

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.export.formats import HFFormat
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.merging import (
    agglomerative,
    feature_distance,
    hierarchical_clusters,
    install_merged_router,
    msmoe_groups,
    weighted_average,
)
from moecompress.models import ExpertWeights, MoEAdapter
from moecompress.testing import tiny_model


def _stats(model, counts, corr=None, feats=None):
    ad = MoEAdapter(model)
    out = {}
    for i in ad.moe_layers:
        e = ad.num_experts(i)
        out[i] = {
            "counts": torch.as_tensor(counts, dtype=torch.int64),
            "tokens": torch.tensor(100),
            "router_logit_corr": corr if corr is not None else torch.eye(e, dtype=torch.float64),
            "out_mean_all": feats
            if feats is not None
            else torch.zeros(e, ad.hidden_size, dtype=torch.float64),
        }
    return out


def _ids():
    return torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(7))


def _hand_merge(ad, layer, group, weights):
    """Σ w_e W_e / Σ w_e written out by hand for every tensor (float64)."""
    total = sum(weights)
    out = {}
    for name in ("gate", "up", "down"):
        acc = torch.zeros_like(getattr(ad.get_expert(layer, group[0]), name), dtype=torch.float64)
        for e, w in zip(group, weights):
            acc += (w / total) * getattr(ad.get_expert(layer, e), name).double()
        out[name] = acc
    return out


def test_weighted_average_small_example():
    stack = ExpertWeights(
        gate=torch.tensor([[[1.0]], [[3.0]], [[7.0]]]),
        up=torch.tensor([[[2.0]], [[0.0]], [[4.0]]]),
        down=torch.tensor([[[0.0]], [[4.0]], [[8.0]]]),
    )
    avg = weighted_average(stack, torch.tensor([3.0, 1.0, 0.0]))
    assert avg.gate.item() == pytest.approx((3 * 1 + 1 * 3) / 4)
    assert avg.up.item() == pytest.approx((3 * 2 + 0) / 4)
    assert avg.down.item() == pytest.approx((0 + 4) / 4)
    uniform = weighted_average(stack, torch.zeros(3))  # no calibration token: equal weights
    assert uniform.gate.item() == pytest.approx(11 / 3)


def test_msmoe_groups_and_merges_equal_hand_computed_averages():
    from moecompress.runtime.build import apply_plan, stored_weights

    counts = [10, 1, 5, 2, 0, 7, 3, 4]
    sim = torch.eye(8, dtype=torch.float64)
    # cores at ratio 0.5: the four most used, experts 0, 5, 2, 7; the rest pick their most similar core
    for e, core, s in ((1, 2, 0.9), (3, 0, 0.8), (4, 7, 0.3), (6, 2, 0.5)):
        sim[e, core] = sim[core, e] = s
    sim[6, 0] = sim[0, 6] = 0.4  # weaker than core 2
    assert msmoe_groups(torch.tensor(counts), sim, 4) == [[0, 3], [2, 1, 6], [5], [7, 4]]  # core first
    model = tiny_model("qwen3_moe", seed=1)
    ad = MoEAdapter(model)
    plan, tensors = get_method("m-smoe").build(
        parse_config("m-smoe", {"ratio": 0.5}), MethodContext(ad, _stats(model, counts, corr=sim))
    )
    source = lambda layer, e: ad.layer(layer).storage.read(e)
    for layer in ad.moe_layers:
        sc = plan.scope(f"layer{layer}")
        assert [[e for _, e in s.sources] for s in sc.stored] == [[0, 3], [2, 1, 6], [5], [7, 4]]
        assert plan.layer(layer).slots == [0, 1, 1, 0, 3, 2, 1, 3] and plan.layer(layer).gate == "aggregate"
        for s in sc.stored:
            group = [e for _, e in s.sources]
            w = stored_weights(plan, sc, s, source, tensors)
            hand = _hand_merge(ad, layer, group, [counts[e] for e in group])
            for name in ("gate", "up", "down"):
                torch.testing.assert_close(getattr(w, name).double(), hand[name], atol=1e-6, rtol=1e-5)
    # the runtime (router kept, gates of a group summed) equals the full-size model with merged weights per slot
    runtime = apply_plan(tiny_model("qwen3_moe", seed=1), plan, tensors)
    full = tiny_model("qwen3_moe", seed=1)
    fad = MoEAdapter(full)
    for layer in fad.moe_layers:
        sc = plan.scope(f"layer{layer}")
        merged = [stored_weights(plan, sc, s, source, tensors) for s in sc.stored]
        for e, j in enumerate(plan.layer(layer).slots):
            fad.set_expert(layer, e, merged[j])
    with torch.no_grad():
        torch.testing.assert_close(runtime(_ids()).logits, full(_ids()).logits, atol=2e-5, rtol=1e-4)


def test_hcsmoe_clusters_and_frequency_weighted_merge():
    from moecompress.runtime.build import stored_weights

    model = tiny_model("qwen3_moe", seed=2, num_experts=6)
    ad = MoEAdapter(model)
    feats = torch.zeros(6, ad.hidden_size, dtype=torch.float64)
    feats[:, 0] = torch.tensor([0.0, 0.1, 5.0, 5.2, 10.0, 30.0])
    # average linkage: {0,1} at 0.1, {2,3} at 0.2, then {2,3}+{4} at (5 + 4.8)/2 = 4.9 < 5.05 = d({0,1},{2,3})
    assert hierarchical_clusters(feats, 3) == [[0, 1], [2, 3, 4], [5]]
    counts = [3, 1, 2, 2, 4, 0]
    plan, tensors = get_method("hc-smoe").build(
        parse_config("hc-smoe", {"ratio": 0.5}), MethodContext(ad, _stats(model, counts, feats=feats))
    )
    source = lambda layer, e: ad.layer(layer).storage.read(e)
    for layer in ad.moe_layers:
        sc = plan.scope(f"layer{layer}")
        assert [[e for _, e in s.sources] for s in sc.stored] == [[0, 1], [2, 3, 4], [5]]
        assert sc.stored[2].construction == "copy"
        assert sc.stored[1].weights == pytest.approx([0.25, 0.25, 0.5])
        for s in sc.stored[:2]:
            group = [e for _, e in s.sources]
            w = stored_weights(plan, sc, s, source, tensors)
            hand = _hand_merge(ad, layer, group, [counts[e] for e in group])
            torch.testing.assert_close(w.down.double(), hand["down"], atol=1e-6, rtol=1e-5)


def test_linkages_match_scipy_and_differ_where_they_should():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        e = int(torch.randint(3, 24, (1,), generator=g))
        k = int(torch.randint(1, e + 1, (1,), generator=g))
        f = torch.randn(e, 4, generator=g, dtype=torch.float64)
        for linkage in ("average", "single", "complete"):
            for metric in ("euclidean", "cosine"):
                assert hierarchical_clusters(f, k, linkage, metric, "torch") == hierarchical_clusters(
                    f, k, linkage, metric, "scipy"
                )
    # a chain 0-1-2-3 (gaps 1.0, 1.1, 1.2) and a pair far away: single linkage chains, complete does not
    x = torch.tensor([[0.0], [1.0], [2.1], [3.3], [9.0], [9.5]], dtype=torch.float64)
    d = feature_distance(x)
    assert agglomerative(d, 2, "single") == [0, 0, 0, 0, 4, 4]
    assert agglomerative(d, 3, "single") == [0, 0, 0, 3, 4, 4]
    assert agglomerative(d, 3, "complete") == [0, 0, 2, 2, 4, 4]
    with pytest.raises(MoECompressError, match="linkage"):
        hierarchical_clusters(x, 2, "ward")


def _standard_k_expert_model(model_type, src, plan, seed, k, counts):
    """A vanilla K-expert model with the merged experts and merged router rows, built by hand."""
    from moecompress.runtime.build import stored_weights

    small = tiny_model(model_type, seed=seed, num_experts=k)
    sad, ad = MoEAdapter(small), MoEAdapter(src)
    state = {n: t for n, t in src.state_dict().items() if ".experts." not in n and ".gate.weight" not in n}
    small.load_state_dict(state, strict=False)
    source = lambda layer, e: ad.layer(layer).storage.read(e)
    for layer in ad.moe_layers:
        sc = plan.scope(f"layer{layer}")
        weight, _, _ = ad.router_params(layer)
        groups = [[e for _, e in s.sources] for s in sc.stored]
        rows = []
        for j, (s, group) in enumerate(zip(sc.stored, groups)):
            sad.set_expert(layer, j, stored_weights(plan, sc, s, source, {}))
            w = torch.tensor([counts[e] for e in group], dtype=torch.float64)
            rows.append((w[:, None] / w.sum() * weight[group].double()).sum(0))
        with torch.no_grad():
            sad.router_params(layer)[0].copy_(torch.stack(rows).float())
    return small


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_router_merge_equals_a_standard_checkpoint_with_fewer_experts(model_type):
    from moecompress.runtime.build import apply_plan

    counts = [5, 1, 4, 2, 3, 6, 2, 1]
    model = tiny_model(model_type, seed=4)
    ad = MoEAdapter(model)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(8, ad.hidden_size, generator=g, dtype=torch.float64)
    plan, tensors = get_method("hc-smoe").build(
        parse_config("hc-smoe", {"ratio": 0.5, "router": "merge"}),
        MethodContext(ad, _stats(model, counts, feats=feats)),
    )
    for lp in plan.layers:
        assert lp.gate == "renorm" and sum(s != "drop" for s in lp.slots) == 4
    assert HFFormat.reason(plan) is None
    fresh = tiny_model(model_type, seed=4)
    assert install_merged_router(fresh, plan, tensors) == len(ad.moe_layers)
    runtime = apply_plan(fresh, plan, tensors)
    reference = _standard_k_expert_model(model_type, tiny_model(model_type, seed=4), plan, 4, 4, counts)
    with torch.no_grad():
        torch.testing.assert_close(runtime(_ids()).logits, reference(_ids()).logits, atol=2e-5, rtol=1e-4)


def test_router_merge_exports_a_vanilla_checkpoint(tmp_path):
    pytest.importorskip("moecompress.export", reason="the plan developer's exporters are not installed")
    from transformers import AutoModelForCausalLM

    from moecompress.api import apply_plan, export

    counts = [5, 1, 4, 2, 3, 6, 2, 1]
    model = tiny_model("olmoe", seed=4)
    ad = MoEAdapter(model)
    sim = torch.corrcoef(torch.randn(8, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    plan, tensors = get_method("m-smoe").build(
        parse_config("m-smoe", {"ratio": 0.5, "router": "merge"}),
        MethodContext(ad, _stats(model, counts, corr=sim)),
    )
    install_merged_router(model, plan, tensors)
    result = export(model, plan, tmp_path / "hf", format="hf", tensors=tensors, quiet=True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_experts == 4 and not result.evaluation_only
    runtime = apply_plan(model, plan, tensors)
    with torch.no_grad():
        torch.testing.assert_close(hf(_ids()).logits, runtime(_ids()).logits, atol=2e-5, rtol=1e-4)


def test_router_merge_refuses_group_limited_routing_and_small_k():
    model = tiny_model("deepseek_v2", seed=0)
    ad = MoEAdapter(model)
    stats = _stats(model, [1] * 8)
    with pytest.raises(MoECompressError, match="group-limited"):
        get_method("m-smoe").build(parse_config("m-smoe", {"router": "merge"}), MethodContext(ad, stats))
    plan, _ = get_method("m-smoe").build(
        parse_config("m-smoe", {}), MethodContext(ad, stats)
    )  # aggregate is fine
    assert all(lp.gate == "aggregate" for lp in plan.layers)
    q = tiny_model("qwen3_moe", seed=0)
    with pytest.raises(MoECompressError, match="top-2"):
        get_method("m-smoe").build(
            parse_config("m-smoe", {"ratio": 0.9, "router": "merge"}),
            MethodContext(MoEAdapter(q), _stats(q, [1] * 8)),
        )
    with pytest.raises(MoECompressError, match="router"):
        parse_config("hc-smoe", {"router": "sum"})
