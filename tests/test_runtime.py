"""CompressedMoEBlock executes every gate semantics and slot target exactly as defined."""

import copy

import pytest
import torch
import torch.nn.functional as F

from moecompress import apply_plan
from moecompress.errors import MoECompressError
from moecompress.models import ExpertWeights, MoEAdapter, expert_apply
from moecompress.plan import (
    CompressionPlan,
    ConstantOp,
    LayerPlan,
    ModelInfo,
    PartialOp,
    Scope,
    StoredExpert,
    TiltOp,
)
from moecompress.runtime import CompressedMoEBlock, StoredExperts, aggregate_slots, stored_weights
from moecompress.testing import FAMILY_NAMES, tiny_config, tiny_model

IDS = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(0))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def prune_keep(info, keep_by_layer):
    return {li.layer: keep_by_layer for li in info.layers}


# ----------------------------------------------------------------------------- identity
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_identity_plan_reproduces_original_logits_exactly(family):
    model = tiny_model(family)
    ref = logits(model)
    apply_plan(model, CompressionPlan.identity(model))
    assert any(isinstance(m, CompressedMoEBlock) for m in model.modules())
    assert torch.equal(logits(model), ref)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_identity_plan_is_exact_with_eager_experts_too(family):
    model = tiny_model(family, experts_implementation="eager")
    ref = logits(model)
    apply_plan(model, CompressionPlan.identity(model))
    assert torch.equal(logits(model), ref)


# ----------------------------------------------------------------------------- keep / renorm
def _masked_selection_router(router, allowed, norm):
    """Independent reference for `keep`: the HF softmax router with pruned logits masked from selection only."""

    def forward(h):
        h = h.reshape(-1, router.weight.shape[1])
        logit = F.linear(h, router.weight)
        probs = torch.softmax(logit, dim=-1, dtype=torch.float)
        index = torch.topk(probs.masked_fill(~allowed, float("-inf")), router.top_k, dim=-1).indices
        weight = probs.gather(1, index)
        if norm:
            weight = weight / weight.sum(-1, keepdim=True)
        return logit, weight.to(logit.dtype), index

    router.forward = forward


def _physically_pruned(family, keep, **overrides):
    """Independent reference for `renorm`: a model with fewer experts whose router rows were deleted."""
    model = tiny_model(family, **overrides)
    k = len(keep)
    cfg = tiny_config(
        family,
        **{
            **overrides,
            **{
                key: k
                for key in ("num_experts", "num_local_experts", "n_routed_experts")
                if key in tiny_config(family).to_dict()
            },
        },
    )
    from transformers import AutoModelForCausalLM

    small = AutoModelForCausalLM.from_config(cfg).eval()
    idx = torch.tensor(keep)
    state = {
        n: (t[idx] if ".mlp." in n and t.dim() >= 1 and t.shape[0] == 8 else t)
        for n, t in model.state_dict().items()
    }
    small.load_state_dict(state)
    return small


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_keep_plan_equals_router_masking_of_the_original(family):
    keep = [0, 2, 3, 5, 6]
    model = tiny_model(family)
    plan = CompressionPlan.prune(model, prune_keep(ModelInfo.from_model(model), keep), gate="keep")
    reference = tiny_model(family)
    allowed = torch.zeros(8, dtype=torch.bool)
    allowed[keep] = True
    adapter = MoEAdapter(reference)
    for i in adapter.moe_layers:
        _masked_selection_router(adapter.layer(i).router, allowed, reference.config.norm_topk_prob)
    torch.testing.assert_close(logits(apply_plan(model, plan)), logits(reference), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family, keep, overrides",
    [
        ("qwen3_moe", [0, 2, 3, 5, 6], {}),
        ("olmoe", [1, 2, 4, 7], {}),
        ("deepseek_v2", [0, 3, 5, 6], {}),  # one expert per router group: group-limited routing survives
    ],
)
def test_renorm_plan_equals_deleting_router_rows(family, keep, overrides):
    model = tiny_model(family, **overrides)
    plan = CompressionPlan.prune(model, prune_keep(ModelInfo.from_model(model), keep), gate="renorm")
    torch.testing.assert_close(
        logits(apply_plan(model, plan)),
        logits(_physically_pruned(family, keep, **overrides)),
        atol=1e-5,
        rtol=1e-5,
    )


def test_keep_and_renorm_coincide_iff_the_router_renormalises():
    keep = [0, 2, 3, 5]
    out = {}
    for family in ("qwen3_moe", "olmoe"):  # norm_topk_prob True / False
        info = ModelInfo.from_model(tiny_model(family))
        for gate in ("keep", "renorm"):
            out[family, gate] = logits(
                apply_plan(tiny_model(family), CompressionPlan.prune(info, prune_keep(info, keep), gate=gate))
            )
    torch.testing.assert_close(out["qwen3_moe", "keep"], out["qwen3_moe", "renorm"], atol=1e-5, rtol=1e-5)
    assert (out["olmoe", "keep"] - out["olmoe", "renorm"]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- remap / replace
def _materialize_in_memory(model, plan, tensors=None):
    """Reference: every slot of the original model overwritten with the weights it computes (zeros if dropped)."""
    adapter = MoEAdapter(model)
    source_model = copy.deepcopy(model)
    src = MoEAdapter(source_model)
    with torch.no_grad():
        for lp in plan.layers:
            sc = plan.scope(lp.scope)
            weights = [
                stored_weights(plan, sc, s, lambda l, e: src.get_expert(l, e), tensors) for s in sc.stored
            ]
            for e, t in enumerate(lp.slots):
                w = (
                    weights[t]
                    if isinstance(t, int)
                    else adapter.get_expert(lp.layer, e).map(torch.zeros_like)
                )
                adapter.set_expert(lp.layer, e, w)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v3"])
@pytest.mark.parametrize("gate", ["aggregate", "replace"])
def test_remap_plan_equals_its_materialized_model(family, gate):
    model = tiny_model(family)
    info = ModelInfo.from_model(model)
    plan = CompressionPlan.remap(info, {li.layer: [0, 0, 2, 2, 4, 4, 6, 6] for li in info.layers}, gate=gate)
    reference = _materialize_in_memory(tiny_model(family), plan)
    torch.testing.assert_close(logits(apply_plan(model, plan)), logits(reference), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_replace_with_drop_equals_zeroed_experts(family):
    model = tiny_model(family)
    info = ModelInfo.from_model(model)
    plan = CompressionPlan.prune(info, prune_keep(info, [1, 2, 5]), gate="replace")
    reference = _materialize_in_memory(tiny_model(family), plan)
    torch.testing.assert_close(logits(apply_plan(model, plan)), logits(reference), atol=1e-5, rtol=1e-5)


def test_aggregate_sums_weights_of_slots_sharing_a_stored_expert():
    idx = torch.tensor([[3, 1, 3], [0, 0, 0], [2, 4, 1]])
    w = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.3], [0.6, 0.3, 0.1]])
    out_idx, out_w = aggregate_slots(idx, w, sentinel=4)
    assert out_idx.tolist() == [[3, 1, 4], [0, 4, 4], [2, 4, 1]]
    torch.testing.assert_close(out_w, torch.tensor([[0.7, 0.3, 0.0], [0.6, 0.0, 0.0], [0.6, 0.3, 0.1]]))


# ----------------------------------------------------------------------------- cross-layer scope + merges
def test_cross_layer_scope_stores_once_and_equals_materialized():
    model = tiny_model("qwen3_moe", num_hidden_layers=3)
    info = ModelInfo.from_model(model)
    scope = Scope(
        id="pool01",
        layers=[0, 1],
        stored=[
            StoredExpert(id=0, sources=[(0, 0)]),
            StoredExpert(id=1, sources=[(0, 5)]),
            StoredExpert(id=2, sources=[(1, 2)]),
            StoredExpert(id=3, sources=[(1, 3), (1, 6)], construction="weighted_merge", weights=[0.3, 0.7]),
        ],
    )
    layers = [
        LayerPlan(layer=0, scope="pool01", gate="aggregate", slots=[0, 0, 2, 3, 1, 1, 2, 3]),
        LayerPlan(layer=1, scope="pool01", gate="aggregate", slots=[2, 3, 2, 3, 0, 1, 3, 1]),
        LayerPlan(layer=2, scope="layer2", gate="renorm", slots=list(range(8))),
    ]
    plan = CompressionPlan(
        model=info,
        scopes=[
            scope,
            Scope(id="layer2", layers=[2], stored=[StoredExpert(id=e, sources=[(2, e)]) for e in range(8)]),
        ],
        layers=layers,
    )
    reference = _materialize_in_memory(tiny_model("qwen3_moe", num_hidden_layers=3), plan)
    runtime = apply_plan(model, plan)
    torch.testing.assert_close(logits(runtime), logits(reference), atol=1e-5, rtol=1e-5)
    blocks = [layer.mlp for layer in runtime.model.layers]
    assert blocks[0].stored is blocks[1].stored and blocks[0].stored.num_experts == 4
    n_stored = sum(p.numel() for n, p in runtime.named_parameters() if ".stored." in n)
    assert n_stored == (4 + 8) * 3 * 16 * 32  # shared pool counted once


def test_weighted_merge_and_dense_group_known_answers():
    model = tiny_model("olmoe")
    adapter = MoEAdapter(model)
    info = ModelInfo.from_model(model)
    plan = CompressionPlan.identity(model)
    sc = plan.scopes[0]
    src = lambda l, e: adapter.get_expert(l, e)
    merge = StoredExpert(id=0, sources=[(0, 1), (0, 4)], construction="weighted_merge", weights=[0.25, 0.75])
    w = stored_weights(plan, sc, merge, src, None)
    for name, t in w.tensors().items():
        torch.testing.assert_close(t, 0.25 * getattr(src(0, 1), name) + 0.75 * getattr(src(0, 4), name))
    group = StoredExpert(id=0, sources=[(0, 1), (0, 4)], construction="dense_group", weights=[0.5, 2.0])
    g = stored_weights(plan, sc, group, src, None)
    assert g.gate.shape == (2 * info.layer(0).intermediate_size, 32)
    x = torch.randn(7, 32)
    act = adapter.layer(0).act
    torch.testing.assert_close(
        expert_apply(g, x, act),
        0.5 * adapter.expert_forward(0, 1, x) + 2.0 * adapter.expert_forward(0, 4, x),
        atol=1e-6,
        rtol=1e-5,
    )


# ----------------------------------------------------------------------------- operators
def _operator_plan(model, gate="replace"):
    info = ModelInfo.from_model(model)
    adapter = MoEAdapter(model)
    gen = torch.Generator().manual_seed(3)
    tensors, layers, scopes = {}, [], []
    neurons = torch.tensor([0, 3, 4, 9, 15])
    for li in info.layers:
        i = li.layer
        p = f"l{i}"
        tensors[f"{p}.c.value"] = torch.randn(32, generator=gen) * 0.1
        tensors[f"{p}.t.U"] = torch.randn(32, 3, generator=gen) * 0.1
        tensors[f"{p}.t.V"] = torch.randn(32, 3, generator=gen) * 0.1
        tensors[f"{p}.t.bias"] = torch.randn(32, generator=gen) * 0.1
        e = adapter.get_expert(i, 6)
        tensors[f"{p}.p.gate"], tensors[f"{p}.p.up"] = e.gate[neurons], e.up[neurons]
        tensors[f"{p}.p.down"] = e.down[:, neurons]
        tensors[f"{p}.p.bias"] = torch.randn(32, generator=gen) * 0.1
        if e.gate_bias is not None:
            tensors[f"{p}.p.gate_bias"], tensors[f"{p}.p.up_bias"] = e.gate_bias[neurons], e.up_bias[neurons]
        scopes.append(
            Scope(
                id=f"s{i}",
                layers=[i],
                stored=[StoredExpert(id=j, sources=[(i, e)]) for j, e in enumerate([0, 1, 2])],
            )
        )
        layers.append(
            LayerPlan(
                layer=i,
                scope=f"s{i}",
                gate=gate,
                slots=[
                    0,
                    1,
                    2,
                    ConstantOp(tensor=f"{p}.c"),
                    TiltOp(rank=3, tensor=f"{p}.t"),
                    "drop",
                    PartialOp(source=(i, 6), width=5, tensor=f"{p}.p"),
                    1,
                ],
            )
        )
    return CompressionPlan(model=info, scopes=scopes, layers=layers), tensors


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_operators_compute_their_definitions(family):
    model = tiny_model(family)
    original = MoEAdapter(tiny_model(family))
    plan, tensors = _operator_plan(model)
    apply_plan(model, plan, tensors)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    for i in original.moe_layers:
        lp, p = plan.layer(i), f"l{i}"
        r = original.route(i, x)
        ref = torch.zeros_like(x)
        act = original.layer(i).act
        for n in range(x.shape[0]):
            for pos in range(r.index.shape[1]):
                target, g = lp.slots[int(r.index[n, pos])], r.weight[n, pos]
                xn = x[n : n + 1]
                if isinstance(target, int):
                    y = original.expert_forward(i, [0, 1, 2][target], xn)
                elif target == "drop":
                    y = torch.zeros_like(xn)
                elif isinstance(target, ConstantOp):
                    y = tensors[f"{p}.c.value"][None]
                elif isinstance(target, TiltOp):
                    y = tensors[f"{p}.t.bias"] + (xn @ tensors[f"{p}.t.V"]) @ tensors[f"{p}.t.U"].T
                else:
                    w = ExpertWeights(
                        tensors[f"{p}.p.gate"],
                        tensors[f"{p}.p.up"],
                        tensors[f"{p}.p.down"],
                        tensors.get(f"{p}.p.gate_bias"),
                        tensors.get(f"{p}.p.up_bias"),
                    )
                    y = expert_apply(w, xn, act) + tensors[f"{p}.p.bias"]
                ref[n] += (g * y[0]).to(ref.dtype)
        shared = original.shared_forward(i, x)
        if shared is not None:
            ref = ref + shared
        with torch.no_grad():
            out = model.model.layers[i].mlp(x[None])
        out = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-4)


def test_full_width_partial_copy_without_bias_is_the_expert_itself():
    model = tiny_model("olmoe")
    adapter = MoEAdapter(model)
    info = ModelInfo.from_model(model)
    tensors, layers, scopes = {}, [], []
    for li in info.layers:
        i = li.layer
        e = adapter.get_expert(i, 4)
        tensors.update(
            {f"p{i}.gate": e.gate, f"p{i}.up": e.up, f"p{i}.down": e.down, f"p{i}.bias": torch.zeros(32)}
        )
        scopes.append(
            Scope(
                id=f"s{i}",
                layers=[i],
                stored=[StoredExpert(id=j, sources=[(i, j if j < 4 else j + 1)]) for j in range(7)],
            )
        )
        slots = [0, 1, 2, 3, PartialOp(source=(i, 4), width=16, tensor=f"p{i}"), 4, 5, 6]
        layers.append(LayerPlan(layer=i, scope=f"s{i}", gate="replace", slots=slots))
    plan = CompressionPlan(model=info, scopes=scopes, layers=layers)
    ref = logits(tiny_model("olmoe"))
    torch.testing.assert_close(logits(apply_plan(model, plan, tensors)), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- model-level behaviour
def test_gpt_oss_block_returns_a_tuple_like_hf():
    model = apply_plan(tiny_model("gpt_oss"), CompressionPlan.identity(tiny_model("gpt_oss")))
    out = model.model.layers[0].mlp(torch.randn(1, 5, 32))
    assert isinstance(out, tuple) and out[0].shape == (1, 5, 32) and out[1].shape == (5, 2)


def test_runtime_model_generates_like_the_original():
    model = tiny_model("qwen3_moe")
    with torch.no_grad():
        ref = model.generate(IDS[:1], max_new_tokens=5, do_sample=False)
        apply_plan(model, CompressionPlan.identity(model))
        out = model.generate(IDS[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    pruned = tiny_model("qwen3_moe")
    info = ModelInfo.from_model(pruned)
    apply_plan(pruned, CompressionPlan.prune(info, prune_keep(info, [0, 1, 2, 3])))
    with torch.no_grad():
        assert pruned.generate(IDS[:1], max_new_tokens=5, do_sample=False).shape == (1, 18)
    stored = sum(p.numel() for n, p in pruned.named_parameters() if ".stored." in n)
    assert stored == 2 * 4 * 3 * 16 * 32 and not any(".experts." in n for n, _ in pruned.named_parameters())


def test_refusals_are_one_sentence():
    model = tiny_model("qwen3_moe")
    apply_plan(model, CompressionPlan.identity(model))
    with pytest.raises(MoECompressError, match="already runs a compression plan"):
        apply_plan(model, CompressionPlan.identity(tiny_model("qwen3_moe")))
    with pytest.raises(MoECompressError, match="made for a qwen3_moe model"):
        apply_plan(tiny_model("olmoe"), CompressionPlan.identity(tiny_model("qwen3_moe")))
    plan, _ = _operator_plan(tiny_model("qwen3_moe"))
    with pytest.raises(MoECompressError, match="lack 'l0.c.value'"):
        apply_plan(tiny_model("qwen3_moe"), plan, {})


def test_stored_experts_skip_sentinel_pairs_in_both_implementations():
    model = tiny_model("qwen3_moe")
    block = StoredExperts.from_weights(
        [MoEAdapter(model).get_expert(0, e) for e in range(3)], "fused", MoEAdapter(model).layer(0).act
    )
    x = torch.randn(6, 32)
    index = torch.tensor([[0, 3], [3, 3], [2, 1], [1, 3], [0, 2], [3, 0]])
    weight = torch.rand(6, 2)
    ref = torch.zeros(6, 32)
    for n in range(6):
        for p in range(2):
            if index[n, p] < 3:
                ref[n] += (
                    weight[n, p] * MoEAdapter(model).expert_forward(0, int(index[n, p]), x[n : n + 1])[0]
                )
    for impl in ("grouped_mm", "eager"):
        block._config = type("C", (), {"_experts_implementation": impl})()
        torch.testing.assert_close(block(x, index, weight), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_lm_eval_hflm_wraps_a_runtime_model():
    from moecompress.testing import fixture_dir

    path = next(
        (
            fixture_dir(n)
            for n in ("qwen3-moe-tiny", "olmoe-tiny")
            if (fixture_dir(n) / "config.json").is_file()
        ),
        None,
    )
    if path is None:
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from moecompress.models import load_model

    model = load_model(str(path), dtype="float32")
    info = ModelInfo.from_model(model)
    apply_plan(
        model,
        CompressionPlan.prune(info, {li.layer: list(range(0, li.num_experts, 2)) for li in info.layers}),
    )
    from lm_eval.api.instance import Instance

    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(str(path)), batch_size=1)
    ((ll, _),) = lm.loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=("The cat", " sat"), idx=0)]
    )
    # the same log-likelihood from the runtime model's own logits (HFLM splits context and continuation this way)
    whole, ctx = lm.tok_encode("The cat sat"), lm.tok_encode("The cat")
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits.float().log_softmax(-1)[0]
    direct = sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
    assert cont and ll < 0 and abs(ll - direct) < 1e-4, (ll, direct)
