"""ConMoE: scores, prototypes and the map against a direct re-computation; scopes; variants; plans; fusion."""

import math

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.conmoe import ConMoEConfig, conmoe_plan, consolidate
from moecompress.methods.conmoe_distance import scope_distance
from moecompress.methods.conmoe_select import consolidate_scope, scopes
from moecompress.methods.merging import arcee_fusion
from moecompress.models import MoEAdapter
from moecompress.plan import ModelInfo
from moecompress.testing import tiny_model

N_TOKENS = 192


def synthetic_stats(model, n=N_TOKENS, seed=0):
    """A direct mini-calibration on random block inputs: the statistics ConMoE/M-SMoE/HC-SMoE read.

    reap_e = (1/|D_e|) Σ_{t∈D_e} g_e(t)‖f_e(h_t)‖₂ computed token by token (the a_e of the issue).
    """
    ad = MoEAdapter(model)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    with torch.no_grad():
        for i in ad.moe_layers:
            h = torch.randn(n, ad.hidden_size, generator=gen)
            r = ad.route(i, h)
            e_count = ad.num_experts(i)
            counts = torch.zeros(e_count, dtype=torch.int64)
            mass = torch.zeros(e_count, dtype=torch.float64)
            a = torch.zeros(e_count, dtype=torch.float64)
            means = []
            for e in range(e_count):
                f = ad.expert_forward(i, e, h).double()
                means.append(f.mean(0))
                tok, slot = torch.where(r.index == e)  # D_e: the tokens whose top-k holds e
                g = r.weight[tok, slot].double()
                counts[e] = len(tok)
                mass[e] = g.sum()
                a[e] = (g * f[tok].norm(dim=-1)).sum() / len(tok) if len(tok) else 0.0
            logits = r.logits.double()
            corr = torch.corrcoef(logits.T)
            out[i] = {
                "counts": counts,
                "tokens": torch.tensor(n),
                "routing_mass": mass,
                "reap": a,
                "out_mean_all": torch.stack(means),
                "router_logit_corr": corr,
            }
    return out


@pytest.fixture(scope="module")
def qwen():
    model = tiny_model("qwen3_moe", seed=3, num_hidden_layers=4)
    return model, synthetic_stats(model)


def _direct_distance(ad, members, eps=1e-8):
    """d(e, e') computed pair by pair from the formula (float64)."""
    w = [ad.get_expert(layer, e) for layer, e in members]
    n = len(members)
    d = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            terms = []
            for name in ("gate", "up", "down"):
                x, y = getattr(w[i], name).double(), getattr(w[j], name).double()
                terms.append(2 * (x - y).norm() / (x.norm() + y.norm() + 2 * eps))
            d[i, j] = sum(terms) / 3
    return d


def test_scores_prototypes_and_map_equal_a_direct_recomputation(qwen):
    model, stats = qwen
    ad = MoEAdapter(model)
    eps = 1e-8
    for ratio, scope_size in ((0.5, 2), (0.25, 4)):
        cfg = ConMoEConfig(ratio=ratio, scope_size=scope_size)
        results = consolidate(ad, stats, cfg)
        assert [r.layers for r in results] == scopes(ad.moe_layers, scope_size)
        for res in results:
            members = [(layer, e) for layer in res.layers for e in range(ad.num_experts(layer))]
            assert res.members == members
            d = _direct_distance(ad, members)
            torch.testing.assert_close(res.distance, d, atol=1e-10, rtol=1e-10)
            a = torch.tensor([float(stats[layer]["reap"][e]) for layer, e in members], dtype=torch.float64)
            b = torch.tensor(
                [min(float(d[i, j]) for j in range(len(members)) if j != i) for i in range(len(members))],
                dtype=torch.float64,
            )
            a_bar = (a - a.min()) / (a.max() - a.min() + eps)
            b_bar = (b - b.min()) / (b.max() - b.min() + eps)
            s = a_bar * b_bar
            torch.testing.assert_close(res.scores.a_bar, a_bar)
            torch.testing.assert_close(res.scores.b_bar, b_bar)
            torch.testing.assert_close(res.scores.score, s)
            k = max(1, round((1 - ratio) * len(members)))
            assert res.budget == k
            assert sorted(res.prototypes) == sorted(sorted(range(len(s)), key=lambda i: -float(s[i]))[:k])
            for i in range(len(members)):
                best = min(res.prototypes, key=lambda p: (float(d[i, p]), p))
                assert res.assignment[i] == (i if i in res.prototypes else best)


def test_every_prototype_maps_to_itself_in_every_variant(qwen):
    model, stats = qwen
    ad = MoEAdapter(model)
    info = ModelInfo.from_model(ad)
    for name in (
        "conmoe",
        "conmoe-local",
        "conmoe-fixed-k",
        "conmoe-usage",
        "conmoe-reap",
        "conmoe-distance",
    ):
        cfg = parse_config(name, {"ratio": 0.5})
        results = consolidate(ad, stats, cfg)
        plan, tensors = conmoe_plan(info, results, cfg)
        assert tensors == {}
        for res in results:
            for p in res.prototypes:
                assert res.assignment[p] == p
            sc = plan.scope(
                f"layer{res.layers[0]}" if len(res.layers) == 1 else f"layers{res.layers[0]}-{res.layers[-1]}"
            )
            assert [tuple(s.sources[0]) for s in sc.stored] == [res.members[p] for p in res.prototypes]
            for j, s in enumerate(sc.stored):
                layer, e = s.sources[0]
                assert s.construction == "copy"
                assert plan.layer(layer).slots[e] == j  # the prototype's own slot points at its stored copy
        assert all(lp.gate == "aggregate" for lp in plan.layers)


def test_scope_one_equals_per_layer_consolidation(qwen):
    model, stats = qwen
    ad = MoEAdapter(model)
    for selection in ("adaptive", "fixed_k"):
        results = consolidate(ad, stats, ConMoEConfig(ratio=0.5, scope_size=1, selection=selection))
        assert [r.layers for r in results] == [[i] for i in ad.moe_layers]
        for res, layer in zip(results, ad.moe_layers):
            alone = consolidate_scope(
                [layer],
                [ad.num_experts(layer)],
                scope_distance([ad.experts(layer)]),
                stats[layer]["reap"],
                0.5,
            )
            assert res.prototypes == alone.prototypes and res.assignment == alone.assignment
            assert len(res.prototypes) == round(0.5 * ad.num_experts(layer))
    local = get_method("conmoe-local")
    plan_a, _ = local.build(parse_config("conmoe-local", {"ratio": 0.5}), MethodContext(ad, stats))
    plan_b, _ = get_method("conmoe").build(
        parse_config("conmoe", {"ratio": 0.5, "scope_size": 1}), MethodContext(ad, stats)
    )
    assert plan_a.scopes == plan_b.scopes and plan_a.layers == plan_b.layers


def test_budgets_of_adaptive_and_fixed_k(qwen):
    model, stats = qwen
    ad = MoEAdapter(model)
    for ratio in (0.25, 0.5, 0.75):
        adaptive = consolidate(ad, stats, ConMoEConfig(ratio=ratio, scope_size=2))
        fixed = consolidate(ad, stats, ConMoEConfig(ratio=ratio, scope_size=2, selection="fixed_k"))
        for a, f in zip(adaptive, fixed):
            n = len(a.members)
            assert len(a.prototypes) == max(1, round((1 - ratio) * n))
            per_layer = [sum(1 for p in f.prototypes if f.members[p][0] == layer) for layer in f.layers]
            assert per_layer == [max(1, round((1 - ratio) * 8))] * len(f.layers)
            # fixed_k's prototypes are each layer's best by the same scope-normalised score
            for layer, k in zip(f.layers, per_layer):
                own = [i for i in range(n) if f.members[i][0] == layer]
                best = sorted(own, key=lambda i: -float(f.scores.score[i]))[:k]
                assert sorted(best) == [p for p in f.prototypes if f.members[p][0] == layer]


def test_selection_ablations_pick_by_their_signal(qwen):
    model, stats = qwen
    ad = MoEAdapter(model)
    for score, signal in (
        ("usage", lambda r: torch.cat([stats[i]["counts"].double() for i in r.layers])),
        ("reap", lambda r: r.scores.a_bar),
        ("distance", lambda r: r.scores.b_bar),
    ):
        for res in consolidate(ad, stats, ConMoEConfig(ratio=0.5, scope_size=4, score=score)):
            sig = signal(res)
            k = res.budget
            kth = sorted(sig.tolist(), reverse=True)[k - 1]
            assert all(float(sig[p]) >= kth for p in res.prototypes)
            assert all(float(sig[i]) <= kth for i in range(len(sig)) if i not in res.prototypes)


def test_deterministic_ties_and_degenerate_inputs():
    # four identical experts in pairs: b = 0 for everyone, so s = 0 everywhere; ties resolve by ā, then position
    d = torch.tensor(
        [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    a = torch.tensor([1.0, 2.0, 2.0, 0.5], dtype=torch.float64)
    res = consolidate_scope([0], [4], d, a, ratio=0.5)
    assert res.prototypes == [1, 2]  # highest ā first among equal s = 0
    assert res.assignment == [1, 1, 2, 2]
    again = consolidate_scope([0], [4], d, a, ratio=0.5)
    assert again.prototypes == res.prototypes and again.assignment == res.assignment
    # unreached experts (a = 0) never beat reached ones at equal b̄
    with pytest.raises(MoECompressError, match="ratio"):  # ρ is validated once, by the config
        parse_config("conmoe", {"ratio": 1.0})
    one = consolidate_scope([0], [4], d, a, ratio=0.99)
    assert one.budget == 1 and set(one.assignment) == {one.prototypes[0]}
    with pytest.raises(MoECompressError, match="scope_size"):
        scopes([1, 2, 3], 0)
    assert scopes([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def _materialize(model, plan):
    """The paper's evaluation checkpoint: every slot filled with its prototype's weights (full size)."""
    ad = MoEAdapter(model)
    copies = {(sc.id, s.id): ad.get_expert(*s.sources[0]) for sc in plan.scopes for s in sc.stored}
    for lp in plan.layers:
        for e, j in enumerate(lp.slots):
            ad.set_expert(lp.layer, e, copies[(lp.scope, j)])
    return model


def test_cross_layer_plan_in_the_runtime_equals_the_materialized_checkpoint(qwen):
    from moecompress.runtime.build import apply_plan

    model, stats = qwen
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(5))
    plan, tensors = get_method("conmoe").build(
        parse_config("conmoe", {"ratio": 0.5, "scope_size": 4}), MethodContext(MoEAdapter(model), stats)
    )
    sc = plan.scopes[0]
    assert sc.layers == [0, 1, 2, 3] and len(sc.stored) == 16
    assert len({s.sources[0][0] for s in sc.stored}) > 1
    cross = [
        (lp.layer, e)
        for lp in plan.layers
        for e, j in enumerate(lp.slots)
        if sc.stored[j].sources[0][0] != lp.layer
    ]
    assert cross, "a cross-layer scope on this model maps some slot to another layer's prototype"
    runtime = apply_plan(tiny_model("qwen3_moe", seed=3, num_hidden_layers=4), plan, tensors)
    materialized = _materialize(tiny_model("qwen3_moe", seed=3, num_hidden_layers=4), plan)
    with torch.no_grad():
        torch.testing.assert_close(runtime(ids).logits, materialized(ids).logits, atol=2e-5, rtol=1e-4)


def test_fusion_diagnostics_rebuild_each_cluster(qwen):
    from moecompress.runtime.build import stored_weights

    model, stats = qwen
    ad = MoEAdapter(model)
    avg_plan, avg_t = get_method("conmoe-average").build(
        parse_config("conmoe-average", {"ratio": 0.5}), MethodContext(ad, stats)
    )
    base_plan, _ = get_method("conmoe").build(
        parse_config("conmoe", {"ratio": 0.5}), MethodContext(ad, stats)
    )
    assert avg_t == {}
    assert [lp.slots for lp in avg_plan.layers] == [lp.slots for lp in base_plan.layers]  # map fixed first
    source = lambda layer, e: ad.layer(layer).storage.read(e)
    for sc in avg_plan.scopes:
        for s in sc.stored:
            if s.construction == "copy":
                continue
            mass = torch.tensor(
                [float(stats[layer]["routing_mass"][e]) for layer, e in s.sources], dtype=torch.float64
            )
            assert s.weights == pytest.approx((mass / mass.sum()).tolist(), rel=1e-12)
            w = stored_weights(avg_plan, sc, s, source, avg_t)
            expected = sum(wi * ad.get_expert(*src).down.double() for wi, src in zip(s.weights, s.sources))
            torch.testing.assert_close(w.down.double(), expected, atol=1e-6, rtol=1e-5)
    arcee_plan, arcee_t = get_method("conmoe-arcee").build(
        parse_config("conmoe-arcee", {"ratio": 0.5}), MethodContext(ad, stats)
    )
    fused_any = False
    for sc in arcee_plan.scopes:
        for s in sc.stored:
            if s.construction == "copy":
                continue
            fused_any = True
            proto, others = s.sources[0], s.sources[1:]
            mass = {tuple(src): float(stats[src[0]]["routing_mass"][src[1]]) for src in s.sources}
            others = sorted(others, key=lambda src: (-mass[tuple(src)], src[0], src[1]))
            for name in ("gate", "up", "down"):
                want = getattr(ad.get_expert(*proto), name)
                for src in others:
                    want = arcee_fusion(want, getattr(ad.get_expert(*src), name))
                assert torch.equal(arcee_t[f"{s.tensor}.{name}"], want)
    assert fused_any


def test_arcee_fusion_known_answer_and_mergekit():
    base = torch.zeros(2, 4)
    other = torch.zeros(2, 4)
    other[1, 2] = 3.0  # one large change in row 1; row 0 unchanged (KL = 0)
    fused = arcee_fusion(base, other)
    # importance is zero except at [1, 2]; median = Q1 = Q3 = 0, so τ = 0 and every element passes (I ≥ 0):
    assert torch.equal(fused, other)
    other = torch.tensor([[0.0, 0.1, 0.0, 0.0], [0.0, 0.0, 3.0, 0.2]])
    base = torch.zeros(2, 4)
    p = torch.softmax(other, -1) + 1e-8
    q = torch.softmax(base, -1) + 1e-8
    imp = (other - base).abs() * (p * (p / q).log()).sum(-1, keepdim=True)
    flat = imp.flatten().sort().values
    q1, med, q3 = flat[int(0.25 * 7)], flat[int(0.5 * 7)], flat[int(0.75 * 7)]
    expected = torch.where(imp >= med + 1.5 * (q3 - q1), other, base)
    assert torch.equal(arcee_fusion(base, other), expected)
    assert not torch.equal(expected, other) and not torch.equal(expected, base)
    mk = pytest.importorskip("mergekit.merge_methods.arcee_fusion")
    g = torch.Generator().manual_seed(0)
    for shape in ((16, 32), (7,), (40, 12)):
        b = torch.randn(shape, generator=g)
        o = b + 0.3 * torch.randn(shape, generator=g)
        mask, _ = mk.DynamicThresholdFusion().compute_fusion_mask(mk._compute_importance(o, b))
        assert torch.equal(arcee_fusion(b, o), b + (o - b) * mask)


def test_bad_input_is_one_sentence(qwen):
    model, stats = qwen
    ad = MoEAdapter(model)
    with pytest.raises(MoECompressError, match="calibrat"):
        consolidate(ad, None, ConMoEConfig())
    with pytest.raises(MoECompressError, match="reap"):
        consolidate(ad, {i: {"counts": stats[i]["counts"]} for i in stats}, ConMoEConfig())
    with pytest.raises(MoECompressError, match="Unknown method"):
        get_method("conmoe-adaptiv")


def test_plan_is_deterministic_and_round_trips(qwen, tmp_path):
    from moecompress.plan import CompressionPlan

    model, stats = qwen
    ad = MoEAdapter(model)
    cfg = parse_config("conmoe-arcee", {"ratio": 0.25, "scope_size": 2})
    p1, t1 = get_method("conmoe-arcee").build(cfg, MethodContext(ad, stats))
    p2, t2 = get_method("conmoe-arcee").build(cfg, MethodContext(ad, stats))
    assert p1.to_json() == p2.to_json() and t1.keys() == t2.keys()
    assert all(torch.equal(t1[k], t2[k]) for k in t1)
    p1.save(tmp_path, t1)
    back, tensors = CompressionPlan.load(tmp_path)
    assert back.to_json() == p1.to_json() and back.params["fusion"] == "arcee"
    assert math.isclose(back.logical_bytes(tensors).ratio, p1.logical_bytes(t1).ratio)


def _safetensors_bytes(directory):
    """Σ numel·element_size over every tensor of every shard (headers excluded)."""
    from safetensors import safe_open

    total, keys = 0, {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open handles are not iterable
                t = h.get_tensor(k)
                keys[k] = tuple(t.shape)
                total += t.numel() * t.element_size()
    return total, keys


def test_compact_export_stores_a_shared_prototype_once_and_matches_the_materialized_checkpoint(tmp_path):
    export_mod = pytest.importorskip(
        "moecompress.export", reason="the plan developer's exporters are not installed"
    )
    from moecompress.api import export, load

    model = tiny_model("qwen3_moe", seed=6, num_hidden_layers=2)
    ad = MoEAdapter(model)
    # plant a near-copy of layer 0's expert 5 in layer 1's slot 3, so the scope shares that prototype
    ad.set_expert(1, 3, ad.get_expert(0, 5).map(lambda t: t * 1.0001))
    model.save_pretrained(tmp_path / "src")
    stats = synthetic_stats(model)
    plan, tensors = get_method("conmoe").build(
        parse_config("conmoe", {"ratio": 0.5, "scope_size": 2}), MethodContext(ad, stats)
    )
    sc = plan.scopes[0]
    assert sc.layers == [0, 1] and len(sc.stored) == 8
    used_by = {j: {lp.layer for lp in plan.layers if j in lp.slots} for j in range(len(sc.stored))}
    shared = [j for j, layers in used_by.items() if layers == {0, 1}]
    assert shared, "some prototype serves slots of both layers"
    assert plan.layer(1).slots[3] == plan.layer(0).slots[5]  # the planted pair shares one stored expert
    compact = export(
        tmp_path / "src", plan, tmp_path / "compact", format="compact", tensors=tensors, quiet=True
    )
    materialized = export(
        tmp_path / "src", plan, tmp_path / "mat", format="materialized", tensors=tensors, quiet=True
    )
    info = plan.model
    per_expert = info.layer(0).bytes_per_expert
    stored_bytes, keys = _safetensors_bytes(tmp_path / "compact")
    # each prototype once: other tensors + |stored| experts, although the layers use Σ_l |P_l| > |stored|
    assert stored_bytes == info.other_bytes + len(sc.stored) * per_expert == plan.logical_bytes(tensors).total
    per_layer_storage = sum(len(set(lp.slots)) for lp in plan.layers)
    assert per_layer_storage > len(sc.stored)
    assert stored_bytes < info.other_bytes + per_layer_storage * per_expert
    assert stored_bytes < _safetensors_bytes(tmp_path / "mat")[0]
    assert compact.weight_bytes < materialized.weight_bytes and materialized.evaluation_only
    assert not any(".experts." in k for k in keys)  # no per-layer expert tensors in the compact checkpoint
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(9))
    from transformers import AutoModelForCausalLM

    loaded = load(tmp_path / "compact")
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "mat").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, full(ids).logits, atol=2e-5, rtol=1e-4)
    assert export_mod is not None


class _Store:
    """The StatsStore read interface (`get(layer, name)`) over in-memory statistics."""

    def __init__(self, stats):
        self.stats = stats

    def get(self, layer, name):
        if name not in self.stats[layer]:
            raise MoECompressError(f"The stats store lacks '{name}'; re-run moecompress calibrate.")
        return self.stats[layer][name]


def test_methods_take_a_method_context_with_a_stats_store(qwen):

    model, stats = qwen
    ad = MoEAdapter(model)
    for name in ("conmoe", "conmoe-fixed-k", "conmoe-arcee", "m-smoe", "hc-smoe"):
        entry = get_method(name)
        cfg = parse_config(name, {"ratio": 0.25})
        assert set(entry.stats_for(cfg)) <= set(stats[0])
        a, ta = entry.build(cfg, MethodContext(adapter=ad, stats=_Store(stats)))
        b, tb = entry.build(cfg, MethodContext(ad, stats))
        assert a.to_json() == b.to_json() and ta.keys() == tb.keys() and a.method == name


def test_blockwise_scope_distance_equals_pairwise_distance(qwen, monkeypatch):
    from moecompress.methods import conmoe_distance
    from moecompress.models import ExpertWeights
    from moecompress.scoring.distance import pairwise_distance

    model, _ = qwen
    ad = MoEAdapter(model)
    stacks = [ad.experts(i) for i in (0, 1, 2)]
    direct = pairwise_distance(
        ExpertWeights.stack([ad.get_expert(i, e) for i in (0, 1, 2) for e in range(8)])
    )
    # force the block-wise path (used for big experts)
    monkeypatch.setattr(conmoe_distance, "_DIRECT_LIMIT", 0)
    blocked = scope_distance(stacks, chunk=5)
    torch.testing.assert_close(blocked, direct, atol=1e-12, rtol=1e-12)
    assert torch.equal(blocked, blocked.T)
