"""`auto`'s served-precision divergence (issue 30, `methods/auto/divergence.py`): a forward `computing_in` bf16
is transformers' bf16 model bit for bit (streamed view and model in memory); the divergence probe's rows are
the reference's exactly when nothing moves; the non-increasing fit, the stages' order and the exact-prefix
choice have known answers; on a bf16 checkpoint a whole-file plan keeps exact the stages it reports."""

import pytest
import torch

from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.auto import divergence as dv
from moecompress.methods.auto.config import AutoConfig, needs_stats
from moecompress.methods.auto.solver import LayerPoint, allocate
from moecompress.methods.auto.tensors import KEY_OFFSET, tensor_items
from moecompress.models import MoEAdapter, load_model
from moecompress.plan import ModelInfo
from moecompress.testing import calibrated_tiny, fixture_dir, save_as
from moecompress.workflows.pipeline import open_view


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """A tiny OLMoE stored in bf16, its statistics, and an adapter over it in float32 (as compress computes)."""
    root = tmp_path_factory.mktemp("divergence")
    path, store, _, _ = calibrated_tiny(root, "olmoe", 5, needs_stats(AutoConfig()))
    copy = save_as(path, root / "bf16", "bfloat16")
    return copy, store, MoEAdapter(load_model(str(copy), dtype="float32"))


@torch.no_grad()
def test_computing_in_bf16_is_transformers_bf16_model():
    from transformers import AutoModelForCausalLM

    path = fixture_dir("qwen3-moe-tiny")
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids).logits
    view = open_view(str(path))
    before = view.model(ids).logits
    with view.computing_in(torch.bfloat16):
        assert torch.equal(view.model(ids).logits, served)
    assert torch.equal(view.model(ids).logits, before)  # float32 again afterwards
    adapter = MoEAdapter(load_model(str(path), dtype="float32"))
    with adapter.computing_in(torch.bfloat16):
        assert torch.equal(adapter.model(ids).logits, served)
    assert next(adapter.model.parameters()).dtype == torch.float32
    assert torch.equal(adapter.model(ids).logits, before)


def test_non_increasing_fit_known_answers():
    assert dv.non_increasing([3.0, 2.0, 1.0]) == [3.0, 2.0, 1.0]
    assert dv.non_increasing([1.0, 3.0, 2.0]) == [2.0, 2.0, 2.0]
    assert dv.non_increasing([3.0, 1.0, 2.0, 0.5]) == [3.0, 1.5, 1.5, 0.5]
    assert dv.non_increasing([]) == []


def test_stages_in_computation_order(bf16):
    path, store, adapter = bf16
    info = ModelInfo.from_model(adapter)
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    items = tensor_items(adapter, store, ["attention", "embeddings", "lm_head"], [8], 32, "gptq", ids, None)

    class Whole:  # the items are all `stages` reads of WholeFile
        pass

    whole = Whole()
    whole.items = items
    found = dv.stages(adapter, whole, 99)
    assert found[0].label == "embeddings"
    n = len(adapter.decoder_layers)
    assert [s.label for s in found[1:]] == [f"layer {i} {p}" for i in range(n) for p in ("attention", "mlp")]
    for i in adapter.moe_layers:
        assert i in found[2 + 2 * i].keys
    attention = {KEY_OFFSET + k for k, it in enumerate(items) if it.cls == "attention" and it.layer == 0}
    assert set(found[1].keys) == attention
    assert all(items[k - KEY_OFFSET].cls != "lm_head" for s in found for k in s.keys if k >= KEY_OFFSET)
    assert len(dv.stages(adapter, whole, 2)) == 2 and info.dtype == "bfloat16"


def test_probe_rows_equal_the_reference_when_nothing_moves(bf16, monkeypatch):
    _, _, adapter = bf16
    ids = torch.randint(3, 96, (3, 16), generator=torch.Generator().manual_seed(2))
    found = [dv.Stage("layer 0 mlp", [0], [adapter.layer(0).block])]
    moved = dv.divergence_kl(adapter, found, ids, torch.bfloat16, batch=2)
    assert moved[0] > 0
    monkeypatch.setattr(dv, "STEP", 0.0)
    assert dv.divergence_kl(adapter, found, ids, torch.bfloat16, batch=2) == [0.0]


@torch.no_grad()
def test_each_stage_moves_its_own_rows_only(bf16):
    """Stage s is moved in its own rows of the probe's batch, beside the reference's: a stage with nothing to
    move measures exactly 0 beside one that moves the first layer's MoE output; the moving stage measures what
    it measures alone; and that is KL(reference ‖ moved) as two separate served forwards compute it."""
    _, _, adapter = bf16
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    block = adapter.layer(0).block
    moving, still = dv.Stage("layer 0 mlp", [0], [block]), dv.Stage("nothing", [], [])
    moved, nothing = dv.divergence_kl(adapter, [moving, still], ids, torch.bfloat16, batch=2)
    assert moved > 0 and nothing == 0.0
    assert dv.divergence_kl(adapter, [moving], ids, torch.bfloat16, batch=2) == [moved]
    from moecompress.methods.auto.measure import _kl, logprobs

    with adapter.computing_in(torch.bfloat16):
        ref = logprobs(adapter.model, ids)
        handle = block.register_forward_hook(dv._moved(slice(0, 2), seed=0))  # stage 0's signs, on all rows
        try:
            alone = logprobs(adapter.model, ids)
        finally:
            handle.remove()
    assert moved == pytest.approx(_kl(ref, alone), rel=0.02)


def _front(*pts):
    return [LayerPoint("replace", [], b, l) for b, l in pts]


class _Rows:
    """An adapter stand-in for `choose`'s rounding forward (its KL is what `logprobs` returns)."""

    def __init__(self):
        self.model = lambda ids: None

    def computing_in(self, dtype):
        import contextlib

        return contextlib.nullcontext()


def _choose(monkeypatch, fronts, scale, budget, kl, rounding=1.0):
    found = [dv.Stage("a", [0]), dv.Stage("b", [1])]
    free = allocate(fronts, scale, budget)
    options = dv.prefix_allocations(fronts, scale, budget, free, found, lambda f, b: allocate(f, scale, b))
    ref = torch.zeros(1, 1, 2)
    monkeypatch.setattr(dv, "logprobs", lambda model, ids: ref)
    monkeypatch.setattr(dv, "_kl", lambda a, b: rounding)
    monkeypatch.setattr(dv, "divergence_kl", lambda adapter, found, ids, dtype: kl)
    return dv.choose(_Rows(), found, fronts, scale, options, (None, ref, None, torch.bfloat16))


def test_exact_prefix_keeps_a_stage_exact_when_its_divergence_outweighs_the_loss(monkeypatch):
    # item 0 (stage a) and item 1 (stage b): each 10 bytes exact, 5 bytes at a loss; the budget forces one cut
    fronts = {0: _front((5, 1.0), (10, 0.0)), 1: _front((5, 1.5), (10, 0.0))}
    scale = {0: 1.0, 1: 1.0}
    assert allocate(fronts, scale, 15) == {0: 0, 1: 1}  # without divergence: cut item 0, the first stage
    # a change in stage a costs 1.0 more than one in stage b: keeping a exact wins (1.5 + 0 < 1.0 + 1.0)
    chosen, report = _choose(monkeypatch, fronts, scale, 15, [1.0, 0.0])
    assert chosen == {0: 1, 1: 0} and report["exact_stages"] == 1 and report["first_changed"] == "b"
    assert [s["kl"] for s in report["stages"]] == [1.0, 0.0]
    # a small difference does not pay the higher loss
    chosen, report = _choose(monkeypatch, fronts, scale, 15, [0.2, 0.0])
    assert chosen == {0: 0, 1: 1} and report["exact_stages"] == 0 and report["first_changed"] == "a"
    # both stages exact does not fit: p stops at 1
    chosen, report = _choose(monkeypatch, fronts, scale, 15, [9.0, 0.5])
    assert report["exact_stages"] == 1
    # every prefix costs more than BOUND x the rounding KL: the stages are not measured, nothing is kept exact
    chosen, report = _choose(monkeypatch, fronts, scale, 15, [9.0, 0.0], rounding=0.1)
    assert chosen == {0: 0, 1: 1} and report["stages"] == [] and report["rounding_kl"] == 0.1


def test_whole_plan_keeps_its_exact_stages_exact(bf16, monkeypatch):
    path, store, adapter = bf16
    # 0.75: on this toy model auto reserves ~21 kB of the budget for the files' headers (issue 48); what is left for
    # tensors is about what 0.5 left before
    params = dict(budget=0.75, quant_group=32, divergence_sequences=2, sensitivity_sequences=2)
    build = lambda **extra: get_method("auto").build(  # noqa: E731
        parse_config("auto", {**params, **extra}), MethodContext(adapter, store)
    )[0]
    div = build().params["auto"]["divergence"]
    assert div["rounding_kl"] > 0
    assert "divergence" not in build(divergence_stages=0).params["auto"]
    assert "divergence" not in build(budget_scope="routed").params["auto"]
    monkeypatch.setattr(dv, "BOUND", float("inf"))  # always measure the stages
    div = build().params["auto"]["divergence"]
    labels = [s["stage"] for s in div["stages"]]
    assert labels[0] == "embeddings" and len(labels) == 5
    kls = [s["kl"] for s in div["stages"]]
    assert kls == sorted(kls, reverse=True) and kls[-1] > 0
    # a change in the embeddings or the first attention made costly: the plan keeps both exact
    monkeypatch.setattr(dv, "divergence_kl", lambda a, found, *_: [1e6, 1e6, 0.0, 0.0, 0.0])
    plan = build()
    div = plan.params["auto"]["divergence"]
    assert div["exact_stages"] == 2 and div["first_changed"] not in labels[:2]
    assert not any("embed_tokens" in n or ".layers.0.self_attn" in n for n in plan.tensor_quant)
    assert plan.params["auto"]["whole_bytes"] <= plan.params["auto"]["budget_bytes"]
    # every stage exact does not fit this budget (the first layer's experts are a third of the file)
    monkeypatch.setattr(dv, "divergence_kl", lambda a, found, *_: [1e6] * 4 + [0.0])
    assert build().params["auto"]["divergence"]["exact_stages"] < 3
