"""Statistics streamed per layer and never stored (`calibrate.streamed`, issue 19): the same values as a
store, square statistics gathered a few experts at a time, and `auto` plans identical to a store's."""

import weakref
from pathlib import Path

import pytest
import torch

from moecompress.calibrate import calibrate
from moecompress.calibrate.streamed import StreamedStats
from moecompress.errors import MoECompressError
from moecompress.models import resolve_source
from moecompress.workflows import pipeline

MODEL = "fixture:olmoe-tiny"
SPEC, SEQ = "fixture-calib:4", 32
PARAMS = {
    "budget": 0.5,
    "ranks": [4],
    "bits": [16, 4],
    "sensitivity_sequences": 2,
    "sensitivity_seq_len": 16,
    "search": "full",  # every statistic the full search reads; the fast one's are a subset
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed-stats")
    model = str(resolve_source(MODEL))
    needs = pipeline.needs_for("auto", PARAMS)
    store = calibrate(model, SPEC, seq_len=SEQ, out=root / "stats", stats=needs, progress=False)
    return root, model, needs, store


def test_streamed_statistics_equal_the_store_bit_for_bit(setup):
    _, model, needs, store = setup
    streamed = StreamedStats(
        model, SPEC, needs, seq_len=SEQ, chunk=3
    )  # 16 experts: chunks of 3 and a tail of 1
    assert {"auto_g2_xx", "auto_g2_xy_f1", "auto_g2_aa", "hessian_in_g2", "hessian_mid_g2"} <= streamed.square
    seen = []
    for view in streamed.layers():
        i = view.layer
        square = sorted(set(needs) & streamed.square)
        for e in range(16):  # expert by expert, as auto's slots read them
            for name in square:
                assert torch.equal(view.get_row(i, name, e), store.get_row(i, name, e)), (i, name, e)
        assert view.passes == 6  # ceil(16 / 3) chunk passes, each chunk gathered once for every square name
        for name in needs:
            if name in streamed.square:
                with pytest.raises(RuntimeError, match="one expert at a time"):
                    view.get(i, name)
            else:
                assert torch.equal(view.get(i, name), store.get(i, name)), (i, name)
        assert torch.equal(view.get_rows(i, "hessian_in_g2", [15, 2]), store.get(i, "hessian_in_g2")[[15, 2]])
        assert torch.equal(
            store.get_rows(i, "hessian_in_g2", [15, 2]), store.get(i, "hessian_in_g2")[[15, 2]]
        )
        seen.append(view)
    assert [v.layer for v in seen] == store.layers
    with pytest.raises(RuntimeError, match="was current"):  # a view read after its pass moved on is a bug
        seen[0].get_row(seen[0].layer, "auto_g2_xx", 0)


def test_a_pass_restricted_to_some_statistics_gathers_those_alone_and_equal(setup):
    _, model, needs, store = setup
    streamed = StreamedStats(model, SPEC, needs, seq_len=SEQ, chunk=8)
    only = {"hessian_in_g2", "hessian_mid_g2"}  # what `auto`'s fast search reads again for its codes
    for view in streamed.layers(only):
        i = view.layer
        assert sorted(view.meta["stats"]) == sorted(only) and not view.has("auto_sample")
        for name in only:
            assert torch.equal(view.get_rows(i, name, [9, 1]), store.get(i, name)[[9, 1]]), (i, name)
        with pytest.raises(MoECompressError, match="lack 'auto_g2_yy'"):  # the other collectors did not run
            view.get(i, "auto_g2_yy")


# the full search takes most of a minute here: with the slow tests (the fast search, the default, stays in the run)
@pytest.mark.parametrize("search", [pytest.param("full", marks=pytest.mark.slow), "fast"])
def test_auto_on_streamed_statistics_writes_the_store_path_checkpoint(setup, search):
    root, model, _, store = setup
    # every statistic and candidate as PARAMS has them; the sensitivity forwards and the measured KL (what made this
    # test take 90 s) read no statistic, so they are left out. The fast search reads the Hessians of the experts it
    # keeps quantized a few at a time, in another order than the full one (`quant.gptq_codes`)
    params = dict(PARAMS, sensitivity="uniform", measure=False, search=search)
    a, a_tensors = pipeline.make_plan(model, "auto", params, store)
    stats = pipeline.calibrate_for(model, SPEC, "auto", params, seq_len=SEQ, work_dir=root / "unused")
    assert isinstance(stats, StreamedStats)
    b, b_tensors = pipeline.make_plan(model, "auto", params, stats)
    assert a.model_dump() == b.model_dump()
    assert sorted(a_tensors) == sorted(b_tensors)
    assert all(torch.equal(a_tensors[k], b_tensors[k]) for k in a_tensors)
    assert not (root / "unused").exists()  # nothing was stored (compress passes <out>-calib as work_dir)
    assert any(s.quant is not None for sc in a.scopes for s in sc.stored)  # something was quantized


def test_dry_run_counts_streamed_statistics_in_memory_not_on_disk(setup):
    from moecompress.workflows.compress_dryrun import estimate_compress

    _, model, needs, _ = setup
    # GPTQ's Hessians alone come 16 experts at a time (the fast search's default candidates), operators' moments 4
    assert (
        pipeline.streamed_chunk("auto", SPEC) == 16
        and pipeline.streamed_chunk("auto", SPEC, "w4g128") is None
    )
    assert pipeline.streamed_chunk("auto", SPEC, None, PARAMS) == 4
    stored = estimate_compress(model, "auto", PARAMS, SPEC, SEQ, stats=needs)
    streamed = estimate_compress(model, "auto", PARAMS, SPEC, SEQ, stats=needs, streamed_chunk=4)
    assert stored.disk_bytes > stored.checkpoint_bytes == streamed.disk_bytes == streamed.checkpoint_bytes
    assert streamed.calibration_bytes < stored.calibration_bytes  # square rows of 4 of the 16 experts
    # gathered while the plan is built: the two phases add up
    assert streamed.peak_memory_bytes >= streamed.calibration_bytes + streamed.plan_bytes


def test_the_pass_lends_its_layer_to_the_method_view(setup):
    """`each_layer` lends the pass's loaded layer to a streamed view: reads of that layer touch no disk and share
    the pass's tensors (the layer is in memory once), and equal what the view reads from disk."""
    from moecompress.calibrate.streamed import each_layer

    _, model, needs, _ = setup
    view, disk = pipeline.open_view(model), pipeline.open_view(model)
    streamed = StreamedStats(model, SPEC, needs, seq_len=SEQ)
    seen, previous = [], None
    for i, layer_stats in each_layer(streamed, view.moe_layers, view):
        assert previous is None or previous() is None  # the last layer's tensors went when the pass moved on
        fused = layer_stats.weights[1][f"{view.reader.layers_prefix}.{i}.mlp.experts.gate_up_proj"]
        previous = weakref.ref(fused)
        w = view.experts_at_rest(i)
        assert w.gate.data_ptr() == fused.data_ptr()
        del w, fused
        for e in (0, 7):
            got, ref = view.get_expert(i, e), disk.get_expert(i, e)
            assert (
                got.gate.dtype == torch.float32
                and torch.equal(got.gate, ref.gate)
                and torch.equal(got.down, ref.down)
            )
        assert torch.equal(view.router_params(i)[0], disk.router_params(i)[0])
        assert view.layer_loads == {}  # nothing read from disk for the view while the pass holds the layer
        seen.append(i)
    assert seen == view.moe_layers and view.resident is None and view._lent is None
    assert set(view.layer_lends) == set(seen)
    other = pipeline.open_view(str(resolve_source("fixture:qwen3-moe-tiny")))
    assert not other.lend(0, {}, model)  # another checkpoint's (or an incomplete) layer is not taken


def test_streamed_statistics_refuse_several_ranks(setup, monkeypatch):
    from moecompress.calibrate import distributed
    from moecompress.errors import MoECompressError

    _, model, needs, _ = setup
    monkeypatch.setattr(distributed, "world", lambda: (0, 2))  # as under torchrun --nproc_per_node 2
    with pytest.raises(MoECompressError, match="run in one process; calibrate into a store"):
        StreamedStats(model, SPEC, needs, seq_len=SEQ)


@pytest.mark.parametrize("chunk", [None, 3])
def test_gptq_on_streamed_hessians_equals_the_store_and_stores_nothing(setup, tmp_path, monkeypatch, chunk):
    """`compress --method quant` from a data spec quantizes each layer while its Hessians are in memory, a chunk of
    experts at a time, writes no per-expert H×H statistic, and gives the store path's plan and codes (also with
    a chunk of 3: several per layer and a ragged last one)."""
    from dataclasses import replace

    from moecompress.calibrate import streamed
    from moecompress.methods.registry import METHODS, get_method
    from moecompress.workflows.compress_dryrun import estimate_compress

    if chunk is not None:
        monkeypatch.setitem(METHODS, "quant", replace(get_method("quant"), streamed_chunk=chunk))
    CHUNK = get_method("quant").streamed_chunk or streamed.CHUNK

    _, model, _, _ = setup
    params = {"quant": "w3g64"}
    needs = pipeline.needs_for("quant", params)
    store = calibrate(model, SPEC, seq_len=SEQ, out=tmp_path / "stats", stats=needs, progress=False)
    a, a_tensors = pipeline.make_plan(model, "quant", params, store)
    assert pipeline.streamed_chunk("quant", SPEC) == CHUNK
    stats = pipeline.calibrate_for(model, SPEC, "quant", params, seq_len=SEQ, work_dir=tmp_path / "unused")
    assert isinstance(stats, StreamedStats) and stats.chunk == CHUNK
    b, b_tensors = pipeline.make_plan(model, "quant", params, stats)
    assert a.model_dump() == b.model_dump() and all(s.quant.actorder for sc in b.scopes for s in sc.stored)
    assert sorted(a_tensors) == sorted(b_tensors) and all(
        torch.equal(a_tensors[k], b_tensors[k]) for k in a_tensors
    )
    assert not (tmp_path / "unused").exists()
    for view in stats.layers():  # the layer's Hessians come a chunk of experts per extra pass
        n = int(view.get(view.layer, "counts").numel())
        for e in range(n):
            h = view.get_row(view.layer, "hessian_in", e)
            assert torch.equal(h, store.get(view.layer, "hessian_in")[e])
        assert view.passes == -(-n // CHUNK)
    streamed = estimate_compress(model, "quant", params, SPEC, SEQ, stats=needs, streamed_chunk=CHUNK)
    stored = estimate_compress(model, "quant", params, SPEC, SEQ, stats=needs)
    assert streamed.disk_bytes == streamed.checkpoint_bytes < stored.disk_bytes


def _with_layer_replaced(model: str, layer: int, weights: dict, dest: Path) -> str:
    """A copy of checkpoint `model` (bf16, with its tokenizer) whose MoE `layer` holds `weights` {expert: ExpertWeights}."""
    import shutil

    from moecompress.models import MoEAdapter, load_model

    m = load_model(model, dtype="bfloat16")
    ad = MoEAdapter(m)
    for e, w in weights.items():
        with torch.no_grad():
            ad.layer(layer).storage.write(e, w)
    m.save_pretrained(dest)
    for f in Path(model).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dest / f.name)
    return str(dest)


def test_sequential_gptq_quantizes_each_layer_on_the_quantized_layers_before_it(setup, tmp_path):
    """compress --method quant --calib-mode sequential (known answer): layer 0's codes are one-pass's; layer 1's equal
    one-pass GPTQ of a checkpoint whose layer 0 holds layer 0's dequantized codes (and differ from one-pass's)."""
    from moecompress.models import MoEAdapter, load_model
    from moecompress.runtime.build import stored_weights

    _, model, _, _ = setup
    params = {"quant": "w2g64"}
    plans = {
        mode: pipeline.make_plan(
            model,
            "quant",
            params,
            pipeline.calibrate_for(model, SPEC, "quant", params, seq_len=SEQ, calib_mode=mode),
        )
        for mode in ("one-pass", "sequential")
    }
    (plan, t_seq), (_, t_one) = plans["sequential"], plans["one-pass"]
    first, second = MoEAdapter(load_model(model, dtype="float32")).moe_layers[:2]
    layer0 = {k: v for k, v in t_seq.items() if k.startswith(f"q.layer{first}.")}
    assert all(torch.equal(v, t_one[k]) for k, v in layer0.items())
    sc = plan.scope_of(first)
    codes = {s.sources[0][1]: stored_weights(plan, sc, s, None, t_seq) for s in sc.stored}
    edited = _with_layer_replaced(model, first, codes, tmp_path / "edited")
    _, t_want = pipeline.make_plan(
        edited, "quant", params, pipeline.calibrate_for(edited, SPEC, "quant", params, seq_len=SEQ)
    )
    layer1 = [k for k in t_seq if k.startswith(f"q.layer{second}.")]
    assert layer1 and all(torch.equal(t_seq[k], t_want[k]) for k in layer1)
    assert any(not torch.equal(t_seq[k], t_one[k]) for k in layer1)


def test_sequential_statistics_are_those_of_the_model_with_the_earlier_layers_replaced(setup, tmp_path):
    """--calib-mode sequential (known answer): a layer's statistics, after the reader replaced layer 0's experts,
    equal a one-pass calibration of a checkpoint whose layer 0 holds those experts; layer 0's own are unchanged;
    without replacements the pass is the one-pass store bit for bit."""
    from moecompress.models import MoEAdapter, load_model

    _, model, _, _ = setup
    names = ["counts", "tokens", "hessian_in", "hessian_mid"]
    plain = calibrate(model, SPEC, seq_len=SEQ, out=tmp_path / "plain", stats=names, progress=False)
    ad = MoEAdapter(load_model(model, dtype="bfloat16"))
    first = ad.moe_layers[0]  # layer 0's experts scaled by 1/2 (exact in bf16)
    halves = {e: ad.get_expert(first, e).map(lambda t: t / 2) for e in range(ad.num_experts(first))}
    edited = _with_layer_replaced(model, first, halves, tmp_path / "edited")
    want = calibrate(edited, SPEC, seq_len=SEQ, out=tmp_path / "want", stats=names, progress=False)
    for replace, ref_first, ref_rest in ((False, plain, plain), (True, plain, want)):
        for view in StreamedStats(model, SPEC, names, seq_len=SEQ, sequential=True, chunk=1 << 20).layers():
            i = view.layer
            ref = ref_first if i == first else ref_rest
            for name in ("hessian_in", "hessian_mid"):
                assert torch.equal(view.get(i, name), ref.get(i, name)), (replace, i, name)
            if replace and i == first:
                for e, w in halves.items():
                    view.replace_expert(e, w)
