"""Safeguards no test held before issue 50 (item 4): each test here fails under one of the one-line mutations
`scripts/mutations.py` lists (run it to see each caught), and passes on the code as it is. Known answers are
worked out by hand in the comments, not by the expression under test."""

from __future__ import annotations

import contextlib
import os
import random
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.plan import CompressionPlan, ModelInfo
from moecompress.quant.spec import QuantSpec
from moecompress.testing import fixture_dir, tiny_model


def _seen_inputs(model, names):
    """Forward pre-hooks recording the input of each module in `names` (relative to `model`)."""
    seen = {}
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: seen.__setitem__(name, a[0])
        )
    return seen


# ----------------------------------------------------------------------------- export/gguf_arith.py
def test_arith_an_fp16_checkpoint_rounds_inputs_to_fp16():
    """An fp16 checkpoint's GGUF holds F16 linears, whose activations llama.cpp rounds to fp16: the shared
    experts' and the lm_head's inputs are on fp16's grid (11 significant bits), so most are not bf16 values."""
    from moecompress.export.gguf_arith import emulate_llama_cpp
    from moecompress.runtime import CompressedMoEBlock, apply_plan

    model = tiny_model("qwen2_moe", dtype=torch.float16, vocab_size=4096)
    plan = CompressionPlan.identity(model)
    assert plan.model.dtype == "float16"
    model = model.float()
    apply_plan(model, plan)
    emulate_llama_cpp(model)
    block = next(m for m in model.modules() if isinstance(m, CompressedMoEBlock))
    seen = _seen_inputs(block, ["shared_expert.gate_proj"])
    seen.update(_seen_inputs(model, ["lm_head"]))
    with torch.no_grad():
        model(torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(0)))
    for x in seen.values():
        assert torch.equal(x, x.half().float())
        assert not torch.equal(x, x.bfloat16().float())
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(block.stored.input_rounding(x), x.half().float())  # the experts' F16 stacks too


def test_arith_refuses_a_quantized_router():
    """A GGUF holds a w8g32 router as Q8_0, but the emulation keeps routers exact: refused in one sentence."""
    from moecompress.export.gguf import reason
    from moecompress.export.gguf_arith import emulate_llama_cpp
    from moecompress.methods.tensor_quant import quantize_tensors
    from moecompress.models import MoEAdapter, load_model
    from moecompress.runtime import apply_plan

    model = load_model(str(fixture_dir("qwen3-moe-tiny")), dtype="float32")
    adapter = MoEAdapter(model)
    plan, tensors = quantize_tensors(
        CompressionPlan.identity(model), {}, adapter, {"router": QuantSpec.parse("w8g32", algo="rtn")}
    )
    assert {tq.kind for tq in plan.tensor_quant.values()} == {"router"} and reason(plan) is None
    apply_plan(model, plan, tensors)
    with pytest.raises(
        MoECompressError, match=r"^arithmetic='llama.cpp' does not cover a quantized router; keep"
    ):
        emulate_llama_cpp(model)


def test_arith_refuses_latent_attention():
    """DeepSeek-V2's GGUF runs (`reason` is None), but llama.cpp attends in the latent space: refused."""
    from moecompress.export.gguf import reason
    from moecompress.export.gguf_arith import emulate_llama_cpp
    from moecompress.runtime import apply_plan

    model = tiny_model("deepseek_v2", n_group=1, topk_group=1)
    plan = CompressionPlan.identity(model)
    assert reason(plan) is None
    apply_plan(model, plan)
    with pytest.raises(MoECompressError, match=r"does not cover multi-head latent attention \(DeepSeek\)"):
        emulate_llama_cpp(model)


# ----------------------------------------------------------------------------- export/gguf.py (the writer)
def test_gguf_refuses_widths_that_are_not_whole_blocks():
    """Q8_0 blocks hold 32 weights of a row: a w8g32 weight 48 wide (one block and a half) has no GGUF type."""
    from moecompress.export.gguf import reason
    from moecompress.methods.quantize import QuantConfig, quantize_plan
    from moecompress.methods.tensor_quant import quantize_tensors
    from moecompress.models import MoEAdapter

    model = tiny_model("qwen3_moe", hidden_size=48, head_dim=16, moe_intermediate_size=32)
    adapter = MoEAdapter(model)
    plan = CompressionPlan.identity(model)
    assert reason(plan) is None  # 16-bit: any width
    q, _ = quantize_tensors(plan, {}, adapter, {"attention": QuantSpec.parse("w8g32", algo="rtn")})
    assert q.tensor_quant["model.layers.0.self_attn.q_proj.weight"].shape[1] == 48
    assert re.fullmatch(
        r"its attention weight 'model\.layers\.\d\.self_attn\.[qkv]_proj\.weight' is 48 wide, not a multiple of "
        r"the 32-weight block",
        reason(q),
    ), reason(q)
    q, _ = quantize_plan(
        plan, {}, lambda l, e: adapter.layer(l).storage.read(e), QuantConfig(quant="w8g32", algo="rtn")
    )
    assert "dimensions are not multiples of 32" in reason(q)


def test_gguf_holds_a_plan_keeping_exactly_top_k_experts():
    """llama.cpp routes to top_k of the experts a GGUF holds: keeping exactly top_k of them is a plan it runs."""
    from moecompress.export.gguf import reason

    info = ModelInfo.from_model(tiny_model("qwen3_moe"))
    top_k = info.layers[0].top_k
    assert top_k < info.layers[0].num_experts
    for k in (top_k, top_k + 1):
        plan = CompressionPlan.prune(info, {li.layer: list(range(k)) for li in info.layers}, gate="renorm")
        assert reason(plan) is None, k


def test_gguf_file_type_is_the_checkpoints_float_type(tmp_path):
    """`general.file_type` names the type the 2-D weights are written in: BF16 for a bf16 checkpoint, F16 for an
    fp16 one (llama.cpp's converter: MOSTLY_BF16 = 32, MOSTLY_F16 = 1)."""
    import gguf

    from moecompress.api import export
    from moecompress.models import load_model
    from moecompress.testing import save_as

    fp16 = save_as(fixture_dir("qwen3-moe-tiny"), tmp_path / "fp16", "float16")
    for source, kind, file_type in ((fixture_dir("qwen3-moe-tiny"), "BF16", 32), (fp16, "F16", 1)):
        plan = CompressionPlan.identity(load_model(str(source)))
        out = tmp_path / f"{kind}.out"
        export(str(source), plan, out, format="gguf", quiet=True)
        reader = gguf.GGUFReader(out / "model.gguf")
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.attn_q.weight"] == kind and types["blk.0.ffn_gate_exps.weight"] == kind
        assert reader.fields["general.file_type"].contents() == file_type
        assert gguf.LlamaFileType(file_type).name == f"MOSTLY_{kind}"


# ----------------------------------------------------------------------------- export/imatrix.py
class _Stats:
    """A statistics store of known values."""

    def __init__(self, values):
        self.values = values

    def require(self, *names, method=None):
        pass

    def get(self, layer, name):
        return torch.tensor(self.values[layer][name])


def test_imatrix_known_answer(tmp_path):
    """Worked by hand: experts 0 and 2 of 3 kept; in_sum2 of ffn_gate/up is each kept expert's input channel norms
    squared, of ffn_down its middle channel norms squared, counts its routed tokens; a linear's counts are the
    calibration tokens; chunk_count and chunk_size as given."""
    import gguf

    from moecompress.export.imatrix import expert_entries, linear_entries, write_imatrix

    plan = SimpleNamespace(layers=[SimpleNamespace(layer=1, slots=[0, "drop", 2])])
    stats = _Stats(
        {
            1: {
                "counts": [5.0, 7.0, 11.0],
                "in_channel_norm": [[1.0, 2.0], [3.0, 4.0], [0.5, 3.0]],
                "mid_channel_norm": [[1.0, 1.0, 2.0], [9.0, 9.0, 9.0], [2.0, 0.0, 1.0]],
            }
        }
    )
    entries = expert_entries(plan, stats)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, 2)
    diag = {"model.layers.0.self_attn.q_proj.weight": torch.tensor([1.0, 2.0, 3.0])}
    entries.update(linear_entries(diag, 10, name_map))
    path = write_imatrix(tmp_path / "imatrix.gguf", entries, ["fixture-calib:3"], 64, 3)

    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.type"] == "imatrix"
    assert (fields["imatrix.chunk_count"], fields["imatrix.chunk_size"]) == (3, 64)
    assert fields["imatrix.datasets"] == ["fixture-calib:3"]
    got = {t.name: t.data.tolist() for t in reader.tensors}
    want = {
        "blk.1.ffn_gate_exps.weight.in_sum2": [[1.0, 4.0], [0.25, 9.0]],
        "blk.1.ffn_up_exps.weight.in_sum2": [[1.0, 4.0], [0.25, 9.0]],
        "blk.1.ffn_down_exps.weight.in_sum2": [[1.0, 1.0, 4.0], [4.0, 0.0, 1.0]],
        "blk.0.attn_q.weight.in_sum2": [[1.0, 2.0, 3.0]],
    }
    for name, value in want.items():
        assert got[name] == value, name
    counts = {
        name: np.asarray(value).reshape(-1).tolist()
        for name, value in got.items()
        if name.endswith(".counts")
    }
    assert counts == {
        "blk.1.ffn_gate_exps.weight.counts": [5.0, 11.0],
        "blk.1.ffn_up_exps.weight.counts": [5.0, 11.0],
        "blk.1.ffn_down_exps.weight.counts": [5.0, 11.0],
        "blk.0.attn_q.weight.counts": [10.0],
    }
    assert len(got) == 8


# ----------------------------------------------------------------------------- methods/auto/target.py
def _target_problem(layer: int, reroute_losses: list[float]):
    """A layer of 4 experts (top-2), each 100 bytes at 16 bits, whose reroute losses are given."""
    from moecompress.methods.auto.frontier import LayerProblem
    from moecompress.methods.auto.solver import Candidate

    options = [
        [Candidate("keep", 0.0, 0, 100), Candidate("reroute", loss, gate="renorm")] for loss in reroute_losses
    ]
    return LayerProblem(
        layer=layer, num_experts=4, top_k=2, n_group=1, topk_group=1, group_score="", expert_bytes=100, h=8,
        el=2, options=options, remap=None, stored=False,
    )  # fmt: skip


def test_target_tries_k_equal_top_k_and_keeps_the_most_important():
    """400 bytes hold 2 experts in each of 2 layers (k = top_k = 2, 16 bits): the choice keeps, in each layer,
    the two whose rerouting costs most (layer 0: slots 2 and 0; layer 1: slots 1 and 3)."""
    from moecompress.methods.auto.target import allocate_for_target, kept_counts

    setup = SimpleNamespace(
        problems={0: _target_problem(0, [0.3, 0.1, 0.4, 0.2]), 1: _target_problem(1, [0.05, 0.9, 0.01, 0.5])},
        sens={0: 1.0, 1: 1.0},
    )
    assert kept_counts(setup) == [4, 3, 2]
    config = SimpleNamespace(quant_bits=[], target="llama.cpp")
    fronts, chosen, k = allocate_for_target(config, setup, {}, 400)
    assert k == 2
    kept = {i: {s for s, c in enumerate(fronts[i][j].choice) if c.kind == "keep"} for i, j in chosen.items()}
    assert kept == {0: {0, 2}, 1: {1, 3}}
    loss = sum(fronts[i][j].loss for i, j in chosen.items())
    assert loss == pytest.approx(0.1 + 0.2 + 0.05 + 0.01)
    with pytest.raises(MoECompressError, match="below the smallest file llama.cpp can run"):
        allocate_for_target(config, setup, {}, 399)


def test_target_refuses_a_single_value_it_cannot_run():
    """A field given as one value (quant_group) is checked as the list fields are."""
    from moecompress.methods import parse_config

    with pytest.raises(
        MoECompressError,
        match=r"^auto --target llama.cpp cannot use quant_group=128: llama.cpp runs quant_group \[32\]",
    ):
        parse_config("auto", dict(target="llama.cpp", quant_group=128))
    with pytest.raises(
        MoECompressError, match=r"cannot use quant_group=16: vllm runs quant_group \[32, 64, 128, None\]"
    ):
        parse_config("auto", dict(target="vllm", quant_group=16))
    assert parse_config("auto", dict(target="vllm", quant_group=64)).quant_group == 64
    assert parse_config("auto", dict(target="llama.cpp", quant_group=32)).quant_group == 32


# ----------------------------------------------------------------------------- methods/auto/divergence.py
def _front(*pts):
    from moecompress.methods.auto.solver import LayerPoint

    return [LayerPoint("replace", [], b, l) for b, l in pts]


class _Served:
    """An adapter stand-in: `computing_in` records the dtype."""

    def __init__(self):
        self.model, self.dtypes = (lambda ids: None), []

    def computing_in(self, dtype):
        self.dtypes.append(dtype)
        return contextlib.nullcontext()


def _choose(monkeypatch, found, fronts, budget, kl):
    from moecompress.methods.auto import divergence as dv
    from moecompress.methods.auto.solver import allocate

    scale = dict.fromkeys(fronts, 1.0)
    free = allocate(fronts, scale, budget)
    options = dv.prefix_allocations(fronts, scale, budget, free, found, lambda f, b: allocate(f, scale, b))
    monkeypatch.setattr(dv, "logprobs", lambda model, ids: None)
    monkeypatch.setattr(dv, "_kl", lambda a, b: 1.0)  # the rounding KL: every prefix is worth measuring
    monkeypatch.setattr(dv, "divergence_kl", lambda adapter, found, ids, dtype: kl)
    return dv.choose(_Served(), found, fronts, scale, options, (None, None, None, torch.bfloat16))


def test_divergence_ties_keep_the_smaller_prefix(monkeypatch):
    """Items 0 (stage a) and 1 (stage b), each 10 bytes exact or 5 bytes at loss 1; 15 bytes cut one. Cutting
    item 0 costs 1 + D_a, cutting item 1 costs 1 + D_b: with D_a = D_b a tie, which keeps nothing exact."""
    from moecompress.methods.auto import divergence as dv

    fronts = {0: _front((5, 1.0), (10, 0.0)), 1: _front((5, 1.0), (10, 0.0))}
    found = [dv.Stage("a", [0]), dv.Stage("b", [1])]
    chosen, report = _choose(monkeypatch, found, fronts, 15, [0.5, 0.5])
    assert report["exact_stages"] == 0 and chosen == {0: 0, 1: 1} and report["first_changed"] == "a"
    chosen, report = _choose(monkeypatch, found, fronts, 15, [0.5, 0.25])  # b cheaper: keep a exact
    assert report["exact_stages"] == 1 and chosen == {0: 1, 1: 0} and report["first_changed"] == "b"


def test_divergence_a_change_after_the_last_stage_costs_the_last_stages_kl(monkeypatch):
    """Stage a (item 0) is the only one measured; item 1 comes after it. Cutting item 0 costs 1.0 + D_a, cutting
    item 1 costs 1.2 + D_a (a first change after the last measured stage costs that stage's D): cut item 0."""
    from moecompress.methods.auto import divergence as dv

    fronts = {0: _front((5, 1.0), (10, 0.0)), 1: _front((5, 1.2), (10, 0.0))}
    chosen, report = _choose(monkeypatch, [dv.Stage("a", [0])], fronts, 15, [1.0])
    assert chosen == {0: 0, 1: 1} and report["exact_stages"] == 0 and report["first_changed"] == "a"


def test_divergence_is_the_mean_over_sequences_of_unequal_batches(monkeypatch):
    """D_s is the mean over sequences: sequence i contributes i (stage 0) and i / 2 (stage 1), so on 5 sequences
    D = (0 + 1 + 2 + 3 + 4) / 5 = 2 and 1, whatever the batches (2 + 2 + 1, or 3 + 2, or 5)."""
    from moecompress.methods.auto import divergence as dv

    def chunk_kl(adapter, found, ids):  # the mean over the chunk's sequences, as `kl_per_slice` averages
        per = ids[:, 0].double()
        return [float(per.mean()), float(per.mean()) / 2]

    monkeypatch.setattr(dv, "_chunk_kl", chunk_kl)
    ids = torch.arange(5).reshape(5, 1).repeat(1, 3)
    found = [dv.Stage("a"), dv.Stage("b")]
    adapter = _Served()
    for batch in (2, 3, 5):
        assert dv.divergence_kl(adapter, found, ids, torch.float16, batch=batch) == [2.0, 1.0]
    assert set(adapter.dtypes) == {torch.float16}


def test_divergence_an_fp16_checkpoint_is_probed_in_fp16(monkeypatch):
    """The exact-prefix choice measures in the dtype that serves the checkpoint: fp16 for an fp16 one, bf16 for a
    bf16 one; a float32 checkpoint has no served rounding to measure."""
    from moecompress.methods.auto import build as B
    from moecompress.methods.auto import divergence as dv

    probed = []
    monkeypatch.setattr(B, "stages", lambda adapter, whole, n: [dv.Stage("a", [0])])
    monkeypatch.setattr(
        B,
        "choose",
        lambda adapter, found, fronts, scale, options, probe: (probed.append(probe[3]), ({}, {}))[1],
    )
    fronts = {0: _front((5, 1.0), (10, 0.0))}
    ids = torch.zeros(2, 4, dtype=torch.long)
    config = SimpleNamespace(
        divergence_stages=1, target="moecompress", divergence_sequences=2, sensitivity_seq_len=4, seed=0
    )
    whole = SimpleNamespace(fronts=lambda: {}, fixed=0, ids=ids)
    adapter = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=50)))
    for dtype in ("float16", "bfloat16", "float32"):
        setup = SimpleNamespace(
            info=SimpleNamespace(dtype=dtype), sens={0: 1.0}, budget=10, ids=ids, ref=None
        )
        _, report = B.exact_stages(config, adapter, None, setup, whole, fronts, {0: 1})
        assert (report is None) == (dtype == "float32")
    assert probed == [torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------- methods/auto/solver.py
def test_solver_takes_an_upgrade_that_exactly_fills_the_budget():
    """One item: 1 byte at loss 10, 2 bytes at 9.9, 3 bytes at 0. The hull walk skips the 2-byte point (above
    the hull) and lands on 1 byte; within 2 bytes the best is the 2-byte point, which fills the budget exactly."""
    from moecompress.methods.auto.solver import allocate

    front = _front((1, 10.0), (2, 9.9), (3, 0.0))
    assert allocate({0: front}, {0: 1.0}, 2) == {0: 1}
    assert allocate({0: front}, {0: 1.0}, 3) == {0: 2}
    assert allocate({0: front}, {0: 1.0}, 1) == {0: 0}


def test_pareto_drops_points_of_equal_loss_and_more_bytes():
    """(1, 2.0) (2, 2.0) (3, 1.0) (4, 1.0) (5, 0.5), (3, 1.5): the front keeps 1, 3 and 5 bytes (at 3 bytes the
    lower loss)."""
    from moecompress.methods.auto.solver import pareto

    pts = _front((4, 1.0), (2, 2.0), (5, 0.5), (1, 2.0), (3, 1.5), (3, 1.0))
    assert [(p.bytes, p.loss) for p in pareto(pts)] == [(1, 2.0), (3, 1.0), (5, 0.5)]


# ----------------------------------------------------------------------------- methods/auto/frontier.py
def _problem(options, stored=False, e=4, top_k=2, n_group=1, topk_group=1):
    from moecompress.methods.auto.frontier import LayerProblem

    return LayerProblem(
        layer=0, num_experts=e, top_k=top_k, n_group=n_group, topk_group=topk_group, group_score="max",
        expert_bytes=1000, h=8, el=2, options=options, remap=None, stored=stored,
    )  # fmt: skip


def test_stored_tilts_and_partials_are_padded_to_the_largest_rank():
    """A compact layer stores its tilts (rank r: 2·h·r + h values) and partial copies (width w: 3·w·h + h) padded to
    the largest rank / width. h = 8, 2 bytes a value: tilts of rank 2 and 5 take 2 × (80 + 8) × 2 = 352 bytes,
    one partial of width 3 (72 + 8) × 2 = 160, one kept expert 1000: 1512."""
    from moecompress.methods.auto.solver import Candidate

    choice = [
        Candidate("keep", 0.0, 0, 1000),
        Candidate("tilt", 0.1, 2, 999),
        Candidate("tilt", 0.1, 5, 999),
        Candidate("partial", 0.1, 3, 999),
    ]
    assert _problem([], stored=True).bytes_of(choice) == 1512
    assert _problem([], stored=False).bytes_of(choice) == 1000 + 3 * 999  # unpadded: each its own bytes
    assert _problem([], stored=True).bytes_of(list(reversed(choice))) == 1512


def _random_layer(rng, e=6, top_k=2):
    """Each of e experts: kept (100 bytes), at 8 bits (50), at 4 bits (25), rerouted or dropped (0 bytes), with
    losses increasing in that order."""
    from moecompress.methods.auto.solver import Candidate

    options = []
    for _ in range(e):
        l8 = rng.random() * 0.2
        l4 = l8 + rng.random()
        options.append(
            [
                Candidate("keep", 0.0, 0, 100),
                Candidate("quant", l8, 8, 50),
                Candidate("quant", l4, 4, 25),
                Candidate("reroute", l4 + 3 * rng.random(), gate="renorm"),
                Candidate("drop", l4 + 3 * rng.random()),
            ]
        )
    return _problem(options, e=e, top_k=top_k)


def test_layer_front_holds_or_beats_every_uniform_quantization():
    """On seeded random layers, every uniform quantization (all experts at 8, or all at 4 bits) is on the layer's
    front or beaten by a point of it (no more bytes, no more loss): the greedy walks alone often miss it."""
    from moecompress.methods.auto.frontier import layer_front

    config = SimpleNamespace(candidates=["reroute", "drop"], gates=["renorm"])
    li = SimpleNamespace(keep_equals_renorm=True)
    for seed in range(30):
        prob = _random_layer(random.Random(seed))
        front = layer_front(prob, config, li)
        assert all(a.bytes < b.bytes and a.loss > b.loss for a, b in zip(front, front[1:]))
        for bits, nbytes in ((8, 300), (4, 150)):
            loss = sum(
                next(c.loss for c in slot if c.kind == "quant" and c.param == bits) for slot in prob.options
            )
            assert any(p.bytes <= nbytes and p.loss <= loss + 1e-12 for p in front), (seed, bits)


def test_router_needs_top_k_routable_experts():
    """A top-2 router needs 2 experts left to route to; a group-limited one (2 groups of 2, top-1 group) needs
    them in its best group."""
    prob = _problem([], top_k=2)
    assert not prob.routable_ok([True, False, False, False])
    assert not prob.routable_ok([False] * 4)
    assert prob.routable_ok([True, False, False, True])
    grouped = _problem([], top_k=2, n_group=2, topk_group=1)
    assert not grouped.routable_ok([True, False, True, False])  # one in each group: the top group has one
    assert grouped.routable_ok([True, True, False, False])
    # and every reroute state of a layer's walk leaves at least top_k experts routable
    from moecompress.methods.auto.frontier import layer_frontier

    for seed in range(5):
        prob = _random_layer(random.Random(seed), e=4, top_k=2)
        for point in layer_frontier(prob, "reroute:renorm"):
            assert sum(c.kind != "reroute" for c in point.choice) >= 2


# ----------------------------------------------------------------------------- methods/auto/tensors.py
def _item(name, cls, bits_bytes):
    from moecompress.methods.auto.tensors import TensorItem, TensorOption

    options = [TensorOption(None, bits_bytes[16], 0.0)]
    options += [
        TensorOption(QuantSpec.parse(f"w{b}g32"), n, 1.0 / b) for b, n in bits_bytes.items() if b != 16
    ]
    return TensorItem(name, cls, -1, (64, 64), options)


def test_uniform_baseline_keeps_embeddings_and_lm_head_at_8_bits():
    """Whole-model GPTQ at b bits (`--quant-scope all`) quantizes the embeddings and lm_head at 8 bits (at their
    dtype when 8 is not tried), everything else at b."""
    from moecompress.methods.auto.tensors import KEY_OFFSET, WholeFile

    items = [
        _item("model.embed_tokens.weight", "embeddings", {16: 1600, 8: 900, 4: 500}),
        _item("lm_head.weight", "lm_head", {16: 1601, 8: 901, 4: 501}),
        _item("model.layers.0.self_attn.q_proj.weight", "attention", {16: 160, 8: 90, 4: 50}),
        _item("model.layers.1.self_attn.q_proj.weight", "attention", {16: 161, 4: 51}),
    ]
    whole = WholeFile(items, {}, 0, torch.zeros(1, 1))
    k = KEY_OFFSET
    assert whole.uniform(4) == {k: 900, k + 1: 901, k + 2: 50, k + 3: 51}
    assert whole.uniform(8) == {k: 900, k + 1: 901, k + 2: 90, k + 3: 161}  # no 8-bit option: its dtype
    no8 = WholeFile(
        [_item("model.embed_tokens.weight", "embeddings", {16: 1600, 4: 500})], {}, 0, torch.zeros(1, 1)
    )
    assert no8.uniform(4) == {k: 1600}


def test_class_sensitivity_falls_back_to_the_median(monkeypatch):
    """s_c = KL / Σ L(probe): a 0.2 / 2 = 0.1, c 0.9 / 3 = 0.3, d 0.4 / 1 = 0.4; b moves nothing measurable and
    takes the median of the others, 0.3. With nothing measurable, every class takes 1."""
    from moecompress.methods.auto import tensors as T

    items = [
        _item("a.weight", "a", {16: 2, 4: 1}),
        _item("b.weight", "b", {16: 2, 4: 1}),
        _item("c.weight", "c", {16: 2, 4: 1}),
        _item("d.weight", "d", {16: 2, 4: 1}),
    ]
    for it, raw in zip(items, (2.0, 1.0, 3.0, 1.0)):
        it.probe_raw = raw
    kls = [0.2, 0.0, 0.9, 0.4]  # the probes of the classes in sorted order
    monkeypatch.setattr(T, "rounded_installed", lambda adapter, names, spec, rows: contextlib.nullcontext())
    monkeypatch.setattr(T, "kl_per_slice", lambda ref, model, ids, n: list(kls[:n]))
    adapter, ids = SimpleNamespace(model=None), torch.zeros(2, 3, dtype=torch.long)
    sens, extra = T.class_sensitivity(adapter, items, [4], 32, ids, None)
    assert sens == pytest.approx({"a": 0.1, "b": 0.3, "c": 0.3, "d": 0.4}) and extra is None
    kls = [0.0, 0.0, float("nan"), 0.0]
    sens, _ = T.class_sensitivity(adapter, items, [4], 32, ids, None)
    assert sens == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}


# ----------------------------------------------------------------------------- atomic/lock.py, durable.py
def test_lock_taken_on_a_file_unlinked_meanwhile_is_taken_again(tmp_path, monkeypatch):
    """The previous holder unlinks the lock file between this run's open and its flock: this run then holds a
    lock on a deleted file, which a third run would not see. It opens the path again and locks that."""
    import fcntl

    from moecompress.atomic import claim, lock_path
    from moecompress.atomic import lock as L

    out = tmp_path / "out"
    path = lock_path(out)
    calls = []

    def flock(fd, op):
        if not calls:  # the holder lets go: its unlink lands between our open and our flock
            os.unlink(path)
        calls.append(fd)
        return fcntl.flock(fd, op)

    monkeypatch.setattr(
        L, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB)
    )
    with claim(out):
        assert len(calls) == 2 and path.read_bytes() == f"moecompress pid {os.getpid()}\n".encode()
        refused = []

        def third_run():  # another thread opens the file anew: refused like another process
            try:
                with claim(out):
                    pass
            except MoECompressError as e:
                refused.append(str(e))

        t = threading.Thread(target=third_run)
        t.start()
        t.join()
        assert len(refused) == 1 and "Another moecompress run is writing" in refused[0]
    assert not path.exists()


def test_atomic_dir_fsyncs_the_parent_after_the_rename(tmp_path, monkeypatch):
    """The rename into place is durable only once the parent directory is fsynced, after the rename."""
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced descriptors")
    from moecompress.atomic import atomic_dir

    out, synced, real = tmp_path / "out", [], os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), out.is_dir()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with atomic_dir(out, kind="report") as tmp:
        (tmp / "a.txt").write_text("a")
    assert (str(tmp_path), True) in synced  # the parent, once `out` is in it
    assert any(Path(p).name == "a.txt" for p, _ in synced)


# ----------------------------------------------------------------------------- export/ct.py
def test_vllm_refuses_a_quantized_lm_head_and_asymmetric_specs():
    """vLLM's compressed-tensors loader runs symmetric WNA16 only, and an lm_head unquantized only."""
    from moecompress.export.ct import vllm_reason
    from moecompress.plan.schema import TensorQuant

    def plan(experts, tensors=None):
        tq = {
            name: TensorQuant(kind=kind, shape=(64, 64), dtype="bfloat16", quant=QuantSpec.parse(spec))
            for name, (kind, spec) in (tensors or {}).items()
        }
        return SimpleNamespace(
            quant_specs=lambda: {QuantSpec.parse(experts) if experts else None}, tensor_quant=tq
        )

    attn = "model.layers.0.self_attn.q_proj.weight"
    assert vllm_reason(plan("w4g128")) is None
    assert vllm_reason(plan("w8c", {attn: ("attention", "w4g32")})) is None
    assert vllm_reason(plan(None)) is None
    assert vllm_reason(plan("w4g128", {"lm_head.weight": ("lm_head", "w8c")})) == (
        "its lm_head weight 'lm_head.weight' is quantized, and vLLM loads a compressed-tensors lm_head unquantized only"
    )
    for experts, tensors in (("w4g128a", {}), ("w4g128", {attn: ("attention", "w8g32a")})):
        why = vllm_reason(plan(experts, tensors))
        assert why is not None and "a is not one of vLLM's WNA16 schemes (symmetric 4 or 8 bits" in why
