"""`auto` over structure × bits (issue 14): the quantized-keep loss estimate (its down part equals direct
evaluation exactly, the whole orders bit widths 2 > 3 > 4 > 8 > 16 = 0), bits=[16] is the structure-only
solver untouched, uniform quantization is always on the frontier, and a mixed-precision plan exports compact
and reloads equal to the in-memory runtime."""

import pytest
import torch

from moecompress.api import apply_plan, export, load
from moecompress.errors import MoECompressError
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.auto import build as auto_build
from moecompress.methods.auto.candidates import layer_problem
from moecompress.methods.auto.config import ALL_CANDIDATES, AutoConfig, needs_stats, routed_budget
from moecompress.methods.auto.frontier import kinds_of, layer_front, uniform_state
from moecompress.methods.auto.materialise import plan_from_points, plan_layer_by_layer, restore
from moecompress.methods.auto.moments import LayerMoments
from moecompress.methods.auto.quant import expert_quant_bytes, quant_candidates
from moecompress.methods.auto.setup import prepare
from moecompress.methods.auto.solver import Candidate, LayerPoint, allocate, uniform_bits_check
from moecompress.models import expert_intermediate, load_model
from moecompress.plan import ModelInfo
from moecompress.testing import calibrated_tiny
from moecompress.workflows.pipeline import choose_format

# the full search's experts' solver (tests/test_auto_fast.py tests the fast one)
FAST = dict(sensitivity="uniform", measure=False, ranks=[4], budget_scope="routed", search="full")


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return calibrated_tiny(
        tmp_path_factory.mktemp("auto_bits"), "olmoe", 3, needs_stats(AutoConfig(search="full"))
    )


def _build(setup, **params):
    _, store, adapter, _ = setup
    return get_method("auto").build(
        parse_config("auto", {"search": "full", **params}), MethodContext(adapter, store)
    )


@torch.no_grad()
def test_quantized_keep_loss_down_part_is_exact_and_bits_are_ordered(olmoe):
    _, store, adapter, inputs = olmoe
    i = adapter.moe_layers[1]
    h = inputs[i]
    n = len(h)
    r = adapter.route(i, h)
    info = ModelInfo.from_model(adapter)
    prob, m = layer_problem(
        AutoConfig(bits=[16, 8, 4, 3, 2], candidates=["drop"], search="full"), adapter, store, info, i, True
    )
    act = adapter.layer(i).act
    reached = 0
    for e in range(adapter.num_experts(i)):
        quant = {c.param: c for c in prob.options[e] if c.kind == "quant"}
        assert (
            sorted(quant) == [2, 3, 4, 8]
            and prob.options[e][0].kind == "keep"
            and prob.options[e][0].loss == 0
        )
        tok, slot = torch.where(r.index == e)
        if not len(tok):
            continue
        reached += 1
        w = adapter.get_expert(i, e)
        g2 = r.weight[tok, slot].double().square()
        a = expert_intermediate(w, h[tok], act)
        y = (a @ w.down.T).double()
        for _b, c in quant.items():
            q = c.op.parts
            # the down part: tr(ΔW_d H_mid_g2 ΔW_dᵀ)/N equals (1/N) Σ g² ‖(W_d − Q_d) a‖² over the calibration tokens
            d = w.down.double() - q["down"].dequantize(torch.float64)
            direct_down = float(g2 @ (a.double() @ d.T).square().sum(-1)) / n
            est_down = float(((d @ store.get(i, "hessian_mid_g2")[e].double()) * d).sum()) / n
            assert est_down == pytest.approx(direct_down, rel=1e-5)
            # the whole estimate is close to the real error of the fully quantized expert (the tiny model's sample
            # holds every calibration token, so only the dropped cross term separates them)
            wq = type(w)(*(q[p].dequantize(torch.float32) for p in ("gate", "up", "down")))
            yq = (expert_intermediate(wq, h[tok], act) @ wq.down.T).double()
            direct = float(g2 @ (y - yq).square().sum(-1)) / n
            assert c.loss == pytest.approx(direct, rel=0.3)
            assert c.bytes == expert_quant_bytes(c.op.spec, w.gate.shape[0], w.gate.shape[1], False, 4)
        losses = [quant[b].loss for b in (2, 3, 4, 8)]
        assert losses[0] > losses[1] > losses[2] > losses[3] > 0, (e, losses)
        sizes = [quant[b].bytes for b in (2, 3, 4, 8)]
        assert sizes == sorted(sizes) and sizes[-1] < prob.expert_bytes
    assert reached >= 4
    assert kinds_of(prob) == ["drop", "quant"]


def test_bits_16_is_the_structure_only_solver(olmoe):
    """bits=[16] asks for no Hessian, adds no candidate, and its plan is the one built with the quantized keeps
    removed from every slot of a default-bits problem (adding bits changes nothing else)."""
    _, store, adapter, _ = olmoe
    assert not {"hessian_mid_g2", "hessian_in_g2"} & set(needs_stats(AutoConfig(bits=[16])))
    assert {"hessian_mid_g2", "hessian_in_g2"} <= set(needs_stats(AutoConfig(search="full")))
    plan16, tensors16 = _build(olmoe, budget=0.4, bits=[16], **FAST)
    assert all(s.quant is None for sc in plan16.scopes for s in sc.stored)
    assert all(set(row["bits"]) <= {"16"} for row in plan16.params["auto"]["layers"])

    info = ModelInfo.from_model(adapter)
    config = AutoConfig(budget=0.4, **FAST)
    fronts = {}
    for i in adapter.moe_layers:
        prob, _ = layer_problem(config, adapter, store, info, i, True)
        prob.options = [[c for c in slot if c.kind != "quant"] for slot in prob.options]
        fronts[i] = layer_front(prob, config, info.layer(i))
    # the bytes plan16's solver allocated: the budget less what it reserved for the files' headers (issue 48)
    allowed = plan16.params["auto"]["tensor_budget_bytes"]
    assert allowed == routed_budget(config, info) - plan16.params["auto"]["reserved_bytes"]
    pick = allocate(fronts, {i: 1.0 for i in fronts}, allowed)
    plan, tensors = plan_from_points(info, {i: fronts[i][k] for i, k in pick.items()})
    assert [lp.model_dump() for lp in plan.layers] == [lp.model_dump() for lp in plan16.layers]
    assert plan.scopes == plan16.scopes
    assert sorted(tensors) == sorted(tensors16) and all(
        torch.equal(tensors[k], tensors16[k]) for k in tensors
    )


@pytest.fixture(scope="module")
def layer_fronts(olmoe):
    """Every layer's problem and frontier under FAST (the uniform-bits safeguard's inputs)."""
    _, store, adapter, _ = olmoe
    info = ModelInfo.from_model(adapter)
    config = AutoConfig(**FAST)
    probs = {i: layer_problem(config, adapter, store, info, i, True)[0] for i in adapter.moe_layers}
    return probs, {i: layer_front(p, config, info.layer(i)) for i, p in probs.items()}


def test_uniform_quantization_is_on_the_frontier_and_never_beaten_by_the_allocation(layer_fronts):
    probs, fronts = layer_fronts
    for b in (8, 4, 3, 2):
        uni = {i: uniform_state(p, b) for i, p in probs.items()}
        nbytes = {i: p.bytes_of(uni[i]) for i, p in probs.items()}
        loss = sum(sum(c.loss for c in s) for s in uni.values())
        # every layer's front holds a state at most as large and as lossy as its uniform-b state
        for i, front in fronts.items():
            assert any(p.bytes <= nbytes[i] and p.loss <= sum(c.loss for c in uni[i]) + 1e-18 for p in front)
        budget = sum(nbytes.values())
        pick = uniform_bits_check(
            fronts,
            {i: 1.0 for i in fronts},
            budget,
            allocate(fronts, {i: 1.0 for i in fronts}, budget),
            {b: nbytes},
        )
        assert sum(fronts[i][k].bytes for i, k in pick.items()) <= budget
        assert sum(fronts[i][k].loss for i, k in pick.items()) <= loss * (1 + 1e-9)


def test_uniform_bits_check_replaces_an_allocation_worse_than_uniform(layer_fronts):
    """The safeguard itself: handed the worst allocation that fits, it returns one no lossier than uniform b."""
    probs, fronts = layer_fronts
    uni = {i: uniform_state(p, 4) for i, p in probs.items()}
    nbytes = {i: p.bytes_of(uni[i]) for i, p in probs.items()}
    uniform_loss = sum(sum(c.loss for c in s) for s in uni.values())
    worst = {i: max(range(len(f)), key=lambda k: f[k].loss) for i, f in fronts.items()}
    assert sum(fronts[i][k].loss for i, k in worst.items()) > uniform_loss  # a bad allocation to replace
    pick = uniform_bits_check(fronts, {i: 1.0 for i in fronts}, sum(nbytes.values()), worst, {4: nbytes})
    assert sum(fronts[i][k].loss for i, k in pick.items()) <= uniform_loss * (1 + 1e-9)


def test_build_auto_runs_the_uniform_bits_check_on_its_allocation(olmoe, monkeypatch):
    """build_auto hands its allocation and the uniform-width byte counts to the safeguard and uses its answer."""
    seen = {}
    real = uniform_bits_check

    def spy(fronts, scale, budget, chosen, uniform):
        seen.update(uniform=uniform, chosen=dict(chosen))
        out = real(fronts, scale, budget, chosen, uniform)
        seen["out"] = dict(out)
        return out

    monkeypatch.setattr(auto_build, "uniform_bits_check", spy)
    plan, _ = _build(olmoe, budget=0.3, **FAST)
    assert seen and set(seen["uniform"]) >= {2, 3, 4}
    rows = {r["layer"]: r for r in plan.params["auto"]["layers"]}
    assert set(rows) == set(seen["out"])


def test_mixed_precision_plan_exports_compact_and_reloads_equal(olmoe, tmp_path):
    path = olmoe[0]
    # 0.45, not 0.2: on this toy model the header entries auto reserves for (issue 48) exceed 0.2's budget
    plan, tensors = _build(olmoe, budget=0.45, **FAST)
    specs = {s.quant.bits for sc in plan.scopes for s in sc.stored if s.quant is not None}
    assert len(specs) >= 2 or (specs and any(s.quant is None for sc in plan.scopes for s in sc.stored)), specs
    rows = plan.params["auto"]["layers"]
    assert all(
        sum(row["bits"].values())
        == sum(1 for s in plan.scope(f"layer{row['layer']}").stored if s.packing is None)
        for row in rows
    )
    assert (
        plan.logical_bytes(tensors, accounting="stored").routed
        == plan.params["auto"]["routed_bytes"]
        <= plan.params["auto"]["budget_bytes"]
    )
    assert choose_format(plan) == "compact"
    export(str(path), plan, tmp_path / "c", format="compact", tensors=tensors, quiet=True)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = apply_plan(load_model(str(path), dtype="float32"), plan, tensors)
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "c", dtype="float32")(ids).logits, ref(ids).logits)


def test_bits_must_include_16():
    with pytest.raises((MoECompressError, ValueError), match="bits must include 16"):
        parse_config("auto", dict(bits=[4, 2]))


@pytest.mark.parametrize(
    "budget, bits, candidates, rebuilt",
    [
        (0.3, [16, 8, 4, 3, 2], list(ALL_CANDIDATES), {"quant"}),
        (0.5, [16], ["drop", "constant", "tilt", "partial"], {"tilt", "constant", "partial"}),
    ],
)
def test_candidates_shed_their_tensors_and_the_plan_rebuilds_them_exactly(
    olmoe, budget, bits, candidates, rebuilt
):
    """`prepare` keeps (bytes, loss) per candidate, no tensors or codes; the layer-by-layer plan restores the chosen
    states' tensors and equals the plan of the states that kept theirs (all at once, as before)."""
    _, store, adapter, _ = olmoe
    config = AutoConfig(budget=budget, bits=bits, candidates=candidates, **{**FAST, "ranks": [2, 4]})
    lean = prepare(config, adapter, store)
    cands = [c for prob in lean.problems.values() for slot in prob.options for c in slot]
    assert {c.kind for c in cands} >= rebuilt
    assert not any(c.tensors for c in cands) and not any(c.op is not None for c in cands if c.kind == "quant")
    assert all(r._merge is None for prob in lean.problems.values() for r in prob.pairs)
    assert all(m.s_xx is None and m.fold1 is None and m.sample is not None for m in lean.moments.values())

    full = prepare(config, adapter, store, keep_tensors=True)
    assert [[(c.kind, c.param, c.error) for c in p.choice] for f in full.fronts.values() for p in f] == [
        [(c.kind, c.param, c.error) for c in p.choice] for f in lean.fronts.values() for p in f
    ]
    idx = allocate(full.fronts, full.sens, full.budget)
    chosen = {i: full.fronts[i][k] for i, k in idx.items()}
    kinds = {c.kind for pt in chosen.values() for c in pt.choice}
    assert kinds & rebuilt  # the rebuild has something to do
    source = lambda l, e: adapter.layer(l).storage.read(e)
    ref_plan, ref_tensors = plan_from_points(full.info, chosen, source=source)
    plan, tensors = plan_layer_by_layer(
        config, adapter, store, lean.info, {i: lean.fronts[i][k] for i, k in idx.items()}
    )
    assert plan.to_json() == ref_plan.to_json() and sorted(tensors) == sorted(ref_tensors)
    for k, t in ref_tensors.items():
        assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t), k


def test_a_rebuilt_candidate_that_differs_is_a_bug_not_a_plan(olmoe):
    _, store, adapter, _ = olmoe
    config = AutoConfig(budget=0.3, **FAST)
    setup = prepare(config, adapter, store)
    i = adapter.moe_layers[0]
    pt = next(p for p in setup.fronts[i] if any(c.kind == "quant" for c in p.choice))
    e = next(e for e, c in enumerate(pt.choice) if c.kind == "quant")
    tampered = list(pt.choice)
    tampered[e] = Candidate("quant", pt.choice[e].loss * 2 + 1, pt.choice[e].param, pt.choice[e].bytes)
    with pytest.raises(RuntimeError, match="came out differently"):
        restore(config, adapter, store, setup.info, i, LayerPoint(pt.mode, tampered, pt.bytes, pt.loss))


def test_quantized_keeps_do_not_depend_on_how_many_experts_are_quantized_together(olmoe):
    """A layer quantized in chunks (what bounds auto's memory) gives the codes and estimates of one batch."""
    _, store, adapter, _ = olmoe
    i = adapter.moe_layers[0]
    m = LayerMoments.load(store, i)
    n = adapter.num_experts(i)
    args = (adapter, store, m, [8, 4, 2], 128, "gptq", "gate2", 2)
    whole, chunked = quant_candidates(*args, chunk=n), quant_candidates(*args, chunk=3)
    some = quant_candidates(*args, experts=[1, n - 1], chunk=1)
    assert [e for e, c in enumerate(quant_candidates(*args, experts=[4], chunk=3)) if c] == [
        3,
        4,
        5,
    ]  # its chunk
    for e in range(n):
        assert [c.loss for c in whole[e]] == [c.loss for c in chunked[e]] and len(whole[e]) == 3
        assert [c.loss for c in some[e]] == ([c.loss for c in whole[e]] if e in (1, n - 1) else [])
        for a, b in zip(whole[e], chunked[e]):
            for part in ("gate", "up", "down"):
                qa, qb = a.op.parts[part], b.op.parts[part]
                assert torch.equal(qa.codes, qb.codes) and torch.equal(qa.scale, qb.scale), (e, part)
    assert all(c.op is None for c in quant_candidates(*args, keep_codes=False)[0])
