"""Pruning: criteria equal a full-forward reference; every operator builds a runnable plan."""

import pytest
import torch

from moecompress.api import apply_plan
from moecompress.calibrate import calibrate
from moecompress.data import CalibrationData
from moecompress.errors import MoECompressError
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.operators import fit_tilt
from moecompress.methods.prune import PruneConfig, build_prune, layer_scores, select_experts
from moecompress.models import MoEAdapter, load_model
from moecompress.scoring import criteria as C
from moecompress.testing import block_inputs, calibrated_tiny, save_tiny

STATS = [
    "counts",
    "tokens",
    "routing_mass",
    "pp",
    "cp",
    "reap",
    "ean",
    "out_norm_sq_mean",
    "out_mean",
    "out_var",
    "gram",
    "moment_experts",
    "moment_count",
    "moment_in_mean",
    "moment_out_mean",
    "input_moment",
    "cross_moment",
    "mid_channel_norm",
    "mid_mean",
    "remap_error",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tiny OLMoE, its stats, and (reference) every MoE block's input on the calibration tokens."""
    return calibrated_tiny(tmp_path_factory.mktemp("prune"), "olmoe", seed=3, stats=STATS)


def _reference_scores(adapter, layer, h):
    r = adapter.route(layer, h)
    e_all = adapter.num_experts(layer)
    out = {
        k: torch.zeros(e_all, dtype=torch.float64) for k in ("count", "mass", "psel", "gnorm", "norm", "sq")
    }
    outs = {}
    for e in range(e_all):
        tok, slot = torch.where(r.index == e)
        y = adapter.expert_forward(layer, e, h[tok]).double()
        norm = y.norm(dim=-1)
        g = r.weight[tok, slot].double()
        out["count"][e], out["mass"][e] = len(tok), g.sum()
        out["psel"][e] = r.probs[tok, e].double().sum()
        out["gnorm"][e], out["norm"][e], out["sq"][e] = (g * norm).sum(), norm.sum(), (norm * norm).sum()
        outs[e] = y
    n = len(h)
    cnt = out["count"]
    std = torch.stack(
        [
            outs[e].std(0, unbiased=False).norm() if len(outs[e]) else torch.tensor(0.0, dtype=torch.float64)
            for e in range(e_all)
        ]
    )
    return {
        "frequency": cnt,
        "mass": out["mass"],
        "pp": r.probs.double().mean(0),
        "ps": out["psel"] / n,
        "cp": C.safe_div(out["psel"], cnt),
        "acp": C.safe_div(out["psel"], cnt) * C.safe_div(out["sq"], cnt).sqrt(),
        "reap": C.safe_div(out["gnorm"], cnt),
        "ean": out["norm"],
        "mone": std * out["mass"] / n,
    }


@pytest.mark.parametrize("criterion", ["frequency", "mass", "pp", "ps", "cp", "acp", "reap", "ean", "mone"])
def test_criterion_equals_full_forward_reference(setup, criterion):
    _, store, adapter, inputs = setup
    for i in adapter.moe_layers:
        ours = layer_scores(criterion, store, i)
        ref = _reference_scores(adapter, i, inputs[i])[criterion]
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("criterion", ["random", "reap", "do-cp", "do-acp", "mone"])
def test_selection_budget(setup, criterion):
    _, store, adapter, _ = setup
    keep = select_experts(PruneConfig(criterion=criterion, ratio=0.5), adapter, store)
    assert all(len(v) == 4 and v == sorted(set(v)) for v in keep.values())
    again = select_experts(PruneConfig(criterion=criterion, ratio=0.5), adapter, store)
    assert keep == again


@pytest.mark.parametrize(
    "operator", ["reroute", "drop", "constant", "tilt", "partial", "remap", "remap-functional"]
)
def test_every_operator_builds_a_runnable_plan(setup, operator):
    path, store, adapter, inputs = setup
    extra = {"remap": "functional"} if operator == "remap-functional" else {}
    operator = operator.split("-")[0]
    config = parse_config("prune", dict(criterion="reap", ratio=0.5, operator=operator, rank=4, **extra))
    plan, tensors = get_method("prune").build(config, MethodContext(adapter, store))
    plan.check_tensors(tensors)
    model = load_model(str(path), dtype="float32")
    apply_plan(model, plan, tensors)
    with torch.no_grad():
        logits = model(torch.randint(3, 96, (2, 10))).logits
    assert torch.isfinite(logits).all()
    if operator != "reroute":
        assert {lp.gate for lp in plan.layers} == ({"aggregate"} if operator == "remap" else {"replace"})


def test_constant_and_tilt_slots_compute_their_fits(setup):
    path, store, adapter, inputs = setup
    layer = adapter.moe_layers[0]
    h = inputs[layer]
    for operator, rank in (("constant", 0), ("tilt", 3)):
        config = PruneConfig(criterion="frequency", ratio=0.5, operator=operator, rank=rank)
        plan, tensors = build_prune(config, MethodContext(adapter, store))
        kept = [e for e, s in enumerate(plan.layer(layer).slots) if isinstance(s, int)]
        model = load_model(str(path), dtype="float32")
        ref = MoEAdapter(model)
        r = ref.route(layer, h)
        expected = torch.zeros_like(h)
        for e in range(8):
            tok, slot = torch.where(r.index == e)
            if e in kept:
                y = ref.expert_forward(layer, e, h[tok])
            else:
                all_tok = torch.where((r.index == e).any(-1))[0]
                x_e = h[all_tok].double()
                y_e = ref.expert_forward(layer, e, h[all_tok]).double()
                tilt = fit_tilt(len(x_e), x_e.sum(0), y_e.sum(0), x_e.T @ x_e, x_e.T @ y_e, rank=rank)
                y = tilt(h[tok].double()).float()
            expected.index_add_(0, tok, y * r.weight[tok, slot, None])
        apply_plan(model, plan, tensors)
        with torch.no_grad():
            got = getattr(ref.decoder_layers[layer], ref.layer(layer).block_attr)(h[None])[0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-3)


def test_bad_prune_config_is_one_sentence():
    # the ratio is validated once, by the config (scoring's budgets trust it)
    for bad in (1.5, 1.0, -0.1, float("nan")):
        with pytest.raises(MoECompressError, match="Recipe field 'ratio' for method 'prune' is invalid"):
            parse_config("prune", {"ratio": bad})
    with pytest.raises(MoECompressError, match="Unknown method 'prun'; did you mean prune"):
        get_method("prun")


def test_functional_remap_picks_best_output_match_when_folds_agree():
    from moecompress.methods.prune import remap_target

    distance = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 0.5]]).repeat(6, 1)
    err = torch.ones(2, 6, 6)
    err[:, 0, 3] = 0.1  # both folds prefer expert 3 for removed slot 0
    assert remap_target(0, [1, 2, 3, 4, 5], distance) == 1  # nearest
    assert remap_target(0, [1, 2, 3, 4, 5], distance, err) == 3
    err[1, 0, 3], err[1, 0, 2] = 1.0, 0.05  # folds disagree: fall back to nearest
    assert remap_target(0, [1, 2, 3, 4, 5], distance, err) == 1
    err[:, 0, 5] = 0.0  # expert 5 is not among the 4 nearest: never chosen
    err[1, 0, 2], err[1, 0, 3] = 1.0, 0.1
    assert remap_target(0, [1, 2, 3, 4, 5], distance, err) == 3


def test_remap_error_statistic_equals_direct_computation(tmp_path):
    path = save_tiny("olmoe", tmp_path / "m", seed=5)
    ids = torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    store = calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=12,
        out=tmp_path / "s",
        stats=["remap_error"],
        batch_size=4,
        dtype="float32",
        progress=False,
    )
    model = load_model(str(path), dtype="float32")
    adapter = MoEAdapter(model)
    layer = adapter.moe_layers[0]
    h = block_inputs(adapter, ids)[layer]
    r = adapter.route(layer, h)
    outs = torch.stack([adapter.expert_forward(layer, p, h) for p in range(8)]).double()
    parity = torch.arange(len(h)) % 2
    got = store.get(layer, "remap_error")
    for e in range(8):
        for k in (0, 1):
            toks = (r.index == e).any(-1) & (parity == k)
            if toks.any():
                ref = (outs[:, toks] - outs[e, toks]).square().sum(-1).mean(-1)
                torch.testing.assert_close(got[k, e], ref, atol=1e-6, rtol=1e-5)


def test_a_data_free_criterion_is_one_registry_call(tmp_path, monkeypatch):
    """docs/architecture.md's worked example: a criterion that scores the experts' weights (here ‖W‖_F² of
    gate, up and down) is one `register_criterion(..., weights=True)` call; prune serves it by name, with no
    statistics at all, and keeps each layer's largest-norm experts."""
    from moecompress.scoring import registry
    from moecompress.workflows.pipeline import build_plan

    def weight_norm(g, layer, seed):
        ws = [g.weights(e) for e in range(g.num_experts)]
        return torch.tensor(
            [sum(float(getattr(w, p).double().square().sum()) for p in ("gate", "up", "down")) for w in ws],
            dtype=torch.float64,
        )

    monkeypatch.setattr(registry, "CRITERIA", dict(registry.CRITERIA))  # the test's entry goes with the test
    registry.register_criterion("weight-norm", (), weight_norm, weights=True)
    adapter = MoEAdapter(load_model(str(save_tiny("qwen3_moe", tmp_path / "m")), dtype="float32"))
    params = {"criterion": "weight-norm", "ratio": 0.5, "gate": "renorm", "protect_super_experts": False}
    plan, _ = build_plan(adapter, "prune", params, None)
    for lp in plan.layers:
        g = registry.LayerInputs(
            None, lambda e, i=lp.layer: adapter.get_expert(i, e), adapter.num_experts(lp.layer)
        )
        norms = weight_norm(g, lp.layer, 0)
        kept = sorted(e for e, t in enumerate(lp.slots) if isinstance(t, int))
        assert kept == sorted(torch.argsort(norms, descending=True)[: len(kept)].tolist()), lp.layer
    with pytest.raises(MoECompressError, match="unknown criterion 'weight-norms'"):
        parse_config("prune", dict(params, criterion="weight-norms"))


def test_budget_is_auto_only_and_prune_names_allocation():
    """--budget means one thing (issue 34): prune given a budget is refused in one sentence naming allocation."""
    from moecompress.errors import MoECompressError
    from moecompress.methods import parse_config

    with pytest.raises(MoECompressError, match="prune takes no budget .*allocation: uniform or nonuniform"):
        parse_config("prune", {"budget": "nonuniform"})
    assert parse_config("prune", {"allocation": "nonuniform"}).allocation == "nonuniform"
