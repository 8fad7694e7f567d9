"""`compress` builds plans through the streamed checkpoint view (issue 19).

A no-weights plan (REAP pruning) never materialises an expert tensor; plans that read weights hold one
decoder layer at a time and give byte-identical checkpoints to the former float32 whole-model path.
"""

import filecmp
import json
import shutil

import pytest
import torch

import moecompress
from moecompress.api import export
from moecompress.calibrate import calibrate
from moecompress.checkpoint import view as streamed
from moecompress.data import CalibrationData
from moecompress.errors import MoECompressError
from moecompress.methods.merging import install_merged_router
from moecompress.models import MoEAdapter, load_model
from moecompress.testing import save_tiny
from moecompress.workflows import pipeline

ARMS = [
    ("prune", {"criterion": "mone", "ratio": 0.5, "operator": "tilt", "rank": 4}),
    ("conmoe", {"ratio": 0.5, "scope_size": 2}),
    (
        "m-smoe",
        {"ratio": 0.5, "router": "merge"},
    ),  # merged router rows: applied by the exporter while streaming
    (
        "puzzlemoe",
        {"ratio": 0.5},
    ),  # packed merges of every layer: plan tensors spilled to disk layer by layer
    (
        "dense",
        {"criterion": "frequency", "grouping": "wc", "K": 4},
    ),  # a dense FFN per layer, spilled likewise
    # per-kind probes and pair candidates read layers at rest, then route: the view's meta dtypes must not follow
    ("auto", {"budget": 0.5, "ranks": [4], "sensitivity_sequences": 2, "sensitivity_seq_len": 16}),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    path = save_tiny("qwen3_moe", root / "model", seed=3)
    model = load_model(str(path), dtype="float32").to(torch.bfloat16)  # a bf16 checkpoint, like real ones
    model.save_pretrained(path)
    ids = torch.randint(3, 96, (6, 16), generator=torch.Generator().manual_seed(0))
    calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=16,
        out=root / "stats",
        stats=sorted({"reap"}.union(*[pipeline.needs_for(m, p) for m, p in ARMS])),
        dtype="float32",
        progress=False,
    )
    return root, path


@pytest.fixture
def views(monkeypatch):
    """Every StreamedAdapter `compress` opens, for inspecting its load counters afterwards."""
    made = []

    class Recording(streamed.StreamedAdapter):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(streamed, "StreamedAdapter", Recording)
    return made


def test_reap_pruning_never_materialises_an_expert(tiny, views):
    root, path = tiny
    moecompress.compress(
        str(path),
        "prune",
        {"criterion": "reap", "ratio": 0.5, "gate": "renorm"},
        calib=root / "stats",
        out=root / "reap",
        progress=False,
    )
    (view,) = views
    assert view.layer_loads == {} and view.forward_loads == {}
    assert all(
        p.is_meta for p in view.model.parameters()
    )  # nothing of the checkpoint was ever read for the plan


@pytest.mark.parametrize("operator", ["reroute", "drop", "constant", "tilt", "remap", "partial"])
def test_what_prune_declares_it_holds_of_the_view_is_what_it_reads(tiny, tmp_path, operator):
    from moecompress.methods.registry import WEIGHTLESS, get_method, parse_config

    _, path = tiny
    params = {"criterion": "reap", "ratio": 0.5, "operator": operator, "rank": 4}
    needs = pipeline.needs_for("prune", params)
    ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    stats = calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=16,
        out=tmp_path / "stats",
        stats=needs,
        dtype="float32",
        progress=False,
    )
    view = pipeline.open_view(str(path))
    pipeline.build_plan(view, "prune", params, stats)
    declared = get_method("prune").view_for(parse_config("prune", params))
    assert (declared == WEIGHTLESS) == (view.layer_loads == {}), (declared, view.layer_loads)


def test_a_weight_reading_plan_holds_one_layer_at_a_time(tiny):
    root, path = tiny
    view = pipeline.open_view(str(path))
    layers = view.moe_layers
    for i in layers:
        view.layer(i).storage.read(0)
        resident = {n.split(".")[2] for n, p in view.model.named_parameters() if not p.is_meta}
        assert resident == {str(i)}
        # an expert read brings the layer in as stored: the routed experts stay bf16, the rest is upcast so the
        # layer's own router (and shared experts) run on float32 inputs (auto's sampled layer error)
        layer = view.layer(i)
        assert layer.storage.module.gate_up_proj.dtype == torch.bfloat16
        assert layer.router.weight.dtype == torch.float32
        view.hold_layer(i)
        assert (
            layer.storage.module.gate_up_proj.dtype == torch.bfloat16
        )  # no float32 copy of the experts for it
    assert view.layer_loads == dict.fromkeys(layers, 1)
    view.experts(layers[-1])  # every expert at once: the layer in float32
    assert view.layer(layers[-1]).storage.module.gate_up_proj.dtype == torch.float32
    w = view.get_expert(layers[0], 1)  # a copy in float32 that outlives eviction
    assert w.gate.dtype == torch.float32 and not w.gate.is_meta
    ref = MoEAdapter(load_model(str(path), dtype="float32")).get_expert(layers[0], 1)
    assert torch.equal(w.gate, ref.gate) and torch.equal(w.down, ref.down)
    with pytest.raises(MoECompressError, match="read-only"):
        view.set_expert(layers[0], 0, w)
    view.release()
    assert all(p.is_meta for p in view.model.parameters())


@pytest.mark.parametrize("method, params", ARMS)
def test_streamed_outputs_equal_the_float32_in_memory_path(tiny, method, params):
    root, path = tiny
    stats = pipeline.resolve_calibration(str(path), root / "stats", pipeline.needs_for(method, params))
    old_plan, old_tensors = pipeline.build_plan(
        MoEAdapter(load_model(str(path), dtype="float32")), method, params, stats
    )
    source = str(path)
    if any(k.startswith("router.") for k in old_tensors):  # what compress did before: install, cast, export
        source = load_model(str(path), dtype="float32")
        install_merged_router(source, old_plan, old_tensors)
        source.to(torch.bfloat16)
    fmt = pipeline.choose_format(old_plan)
    old = export(
        source, old_plan, root / f"{method}-old", format=fmt, tensors=old_tensors, quiet=True, overwrite=True
    )
    new_out = root / f"{method}-new"
    new = moecompress.compress(
        str(path),
        method,
        params,
        calib=root / "stats",
        out=new_out,
        format=fmt,
        progress=False,
        overwrite=True,
    )
    assert new.format == old.format
    names = sorted(p.name for p in (root / f"{method}-old").iterdir() if p.name != "recipe.yaml")
    assert names == sorted(p.name for p in new_out.iterdir() if p.name != "recipe.yaml")
    for name in names:
        if name == "config.json":  # the former path wrote the float32 load's dtype over bf16 weights
            old_cfg, new_cfg = (json.loads((d / name).read_text()) for d in (root / f"{method}-old", new_out))
            assert new_cfg.pop("dtype") == "bfloat16" and {**old_cfg, "dtype": None} == {
                **new_cfg,
                "dtype": None,
            }
            continue
        assert filecmp.cmp(root / f"{method}-old" / name, new_out / name, shallow=False), name


def test_dry_run_estimates_and_max_memory_refuses(tiny, capsys):
    from moecompress.testing import run_cli

    root, path = tiny
    out = root / "dry"
    base = [
        "compress",
        str(path),
        "--method",
        "conmoe",
        "--ratio",
        "0.5",
        "--param",
        "scope_size=2",
        "--calib",
        str(root / "stats"),
        "--out",
        str(out),
    ]
    code, stdout, err = run_cli(base + ["--dry-run"], capsys)
    assert code == 0, err
    assert "peak memory:" in stdout and "disk needed" in stdout and not out.exists()
    code, stdout, err = run_cli(base + ["--max-memory", "1MiB"], capsys)
    assert code == 2 and not out.exists()
    assert (
        "Compressing needs about" in err and "--max-memory allows 1.00 MiB" in err and "Traceback" not in err
    )


def test_dry_run_counts_what_the_method_holds_of_the_view(tiny, capsys):
    from moecompress.testing import run_cli
    from moecompress.workflows.compress_dryrun import estimate_compress

    root, path = tiny
    view = pipeline.open_view(str(path))
    layer = max(
        view.reader.layer_bytes(i) for i in range(view.reader.num_layers)
    )  # bf16 on disk, float32 to compute
    est = lambda method, params: estimate_compress(str(path), method, params, root / "stats", 16)
    assert est("prune", {"criterion": "reap", "ratio": 0.5}).plan_bytes == 0  # statistics only
    assert est("prune", {"criterion": "reap", "ratio": 0.5, "operator": "remap"}).plan_bytes == 3 * layer
    assert est("m-smoe", {"ratio": 0.5}).plan_bytes == 5 * layer  # the default: as stored + 2 float32 copies
    assert est("conmoe-local", {"ratio": 0.5}).plan_bytes == 5 * layer  # the variant's own scope (1)
    assert est("conmoe", {"ratio": 0.5, "scope_size": 2}).plan_bytes == 7 * layer
    code, stdout, err = run_cli(
        [
            "compress",
            str(path),
            "--method",
            "prune",
            "--criterion",
            "reap",
            "--ratio",
            "0.5",
            "--calib",
            str(root / "stats"),
            "--out",
            str(root / "j"),
            "--dry-run",
            "--json",
        ],
        capsys,
    )
    got = json.loads(stdout)
    assert code == 0 and got["plan_bytes"] == 0 and got["peak_memory_bytes"] > got["export_bytes"] > 0, err
    assert 0 < got["disk_available_bytes"] <= shutil.disk_usage(root).total
    assert not (root / "j").exists()


def test_dry_run_counts_the_statistics_a_data_spec_calibration_gathers(tiny):
    from moecompress.workflows.compress_dryrun import estimate_compress

    root, path = tiny
    params = {"criterion": "mone", "ratio": 0.5, "operator": "tilt", "rank": 4}
    needs = pipeline.needs_for("prune", params)
    bare = estimate_compress(str(path), "prune", params, "fixture-calib:8", 16)
    every = estimate_compress(str(path), "prune", params, "fixture-calib:8", 16, stats=needs)
    staged = estimate_compress(
        str(path),
        "prune",
        params,
        "fixture-calib:8",
        16,
        stats=needs,
        moment_fraction=pipeline.moment_fraction("prune", params),
    )
    view = pipeline.open_view(str(path))
    h, layers = view.hidden_size, len(view.moe_layers)
    # float32 [E, H, H] x 2: the input moment (symmetric) stored as upper triangles, the cross moment whole
    moments_all = sum(view.num_experts(i) * (h * (h + 1) // 2 + h * h) * 4 for i in view.moe_layers)
    assert pipeline.moment_fraction("prune", params) == 0.5 and layers
    assert every.disk_bytes - bare.disk_bytes >= moments_all
    assert moments_all // 2 <= staged.disk_bytes - bare.disk_bytes < every.disk_bytes - bare.disk_bytes
    assert bare.calibration_bytes < staged.calibration_bytes < every.calibration_bytes


def test_a_conmoe_scope_is_read_one_projection_at_a_time_at_stored_precision(tiny, monkeypatch):
    root, path = tiny
    view = pipeline.open_view(str(path))
    i = view.moe_layers[0]
    w = view.experts_at_rest(i)
    assert (
        w.gate.dtype == torch.bfloat16 and view.resident is None
    )  # a bf16 checkpoint; the float32 layer evicted
    ref = MoEAdapter(load_model(str(path), dtype="float32")).experts(i)
    for name in ("gate", "up", "down"):  # exact: the float32 values were upcast from these
        assert torch.equal(getattr(w, name).float(), getattr(ref, name)), name
    import weakref

    reads, alive = [], []  # (layer, projection) in read order; weak references to what was handed out
    real = streamed.StreamedAdapter.expert_part_at_rest

    def spy(self, j, name):
        t = real(self, j, name)
        assert (
            t.dtype == torch.bfloat16 and t._base is None
        )  # stored precision, not a view pinning gate_up_proj
        # the scope is read one projection at a time: every earlier projection's tensors are gone
        assert all(r() is None for (_, n), r in zip(reads, alive) if n != name), (j, name)
        reads.append((j, name))
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(streamed.StreamedAdapter, "expert_part_at_rest", spy)
    params = {"ratio": 0.5, "scope_size": 2}
    stats = pipeline.resolve_calibration(str(path), root / "stats", pipeline.needs_for("conmoe", params))
    plan, _ = pipeline.build_plan(pipeline.open_view(str(path)), "conmoe", params, stats)
    layers = view.moe_layers
    assert reads == [
        (j, n)
        for g in (layers[k : k + 2] for k in range(0, len(layers), 2))
        for n in ("gate", "up", "down")
        for j in g
    ]
    ref_plan, _ = pipeline.build_plan(
        MoEAdapter(load_model(str(path), dtype="float32")), "conmoe", params, stats
    )
    assert plan.to_json() == ref_plan.to_json()


def test_puzzlemoe_plan_tensors_stay_on_disk_until_read(tiny):
    import gc

    root, path = tiny
    params = {"ratio": 0.5}
    stats = pipeline.resolve_calibration(str(path), root / "stats", pipeline.needs_for("puzzlemoe", params))
    _, ref = pipeline.build_plan(
        MoEAdapter(load_model(str(path), dtype="float32")), "puzzlemoe", params, stats
    )
    _, spilled = pipeline.build_plan(pipeline.open_view(str(path)), "puzzlemoe", params, stats)
    assert isinstance(spilled, streamed.SpilledTensors) and sorted(spilled) == sorted(ref) and ref
    files = sorted(spilled.dir.glob("*.safetensors"))
    assert len(files) == len(pipeline.open_view(str(path)).moe_layers)  # one file per layer, nothing held
    for k, t in ref.items():
        got = spilled[k]
        assert got.dtype == t.dtype and torch.equal(got, t), k
    where = spilled.dir
    del spilled
    gc.collect()
    assert not where.exists()  # the temporary files go with the mapping


def test_tilt_gathers_moments_of_the_removed_experts_only_and_equals_one_pass(tmp_path):
    from moecompress.calibrate import StatsStore
    from moecompress.methods.prune import PruneConfig, select_experts
    from moecompress.models import resolve_source

    params = {"criterion": "mone", "ratio": 0.5, "operator": "tilt", "rank": 4}
    model = str(resolve_source("fixture:qwen3-moe-tiny"))
    one = calibrate(
        model,
        "fixture-calib:4",
        seq_len=32,
        out=tmp_path / "one",
        stats=pipeline.needs_for("prune", params),
        progress=False,
    )  # moments of every expert
    moecompress.compress(model, "prune", params, calib=tmp_path / "one", out=tmp_path / "ref", progress=False)
    moecompress.compress(
        model, "prune", params, calib="fixture-calib:4", seq_len=32, out=tmp_path / "two", progress=False
    )
    first = StatsStore.load(tmp_path / "two-calib" / "stats")
    moments = StatsStore.load(tmp_path / "two-calib" / "stats-moments")
    assert not first.has("input_moment") and moments.has("input_moment", "cross_moment")
    keep = select_experts(PruneConfig(**params), pipeline.open_view(model), one)
    for i in moments.layers:
        removed = sorted(set(range(len(one.get(i, "counts")))) - set(keep[i]))
        assert moments.get(i, "moment_experts").tolist() == removed
        assert torch.equal(moments.get(i, "input_moment"), one.get(i, "input_moment")[removed])
        assert torch.equal(moments.get_row(i, "cross_moment", 1), one.get(i, "cross_moment")[removed[1]])
    shards = sorted(p.name for p in (tmp_path / "ref").iterdir() if p.suffix == ".safetensors")
    assert shards
    for name in shards:
        assert filecmp.cmp(tmp_path / "ref" / name, tmp_path / "two" / name, shallow=False), name


def test_auto_reference_log_probs_on_the_streamed_view_equal_the_loaded_model(tiny):
    """auto's first forward on the view (its reference for every KL) ran on ids moved to the meta device."""
    from moecompress.methods.auto.measure import logprobs

    root, path = tiny
    ids = torch.randint(3, 96, (6, 16), generator=torch.Generator().manual_seed(1))
    want = logprobs(load_model(str(path), dtype="float32").eval(), ids)
    view = pipeline.open_view(str(path))
    assert all(p.is_meta for p in view.model.parameters())
    first, second = logprobs(view.model, ids), logprobs(view.model, ids)
    assert torch.equal(first, want) and torch.equal(second, want)


def test_shared_experts_run_on_a_layer_read_as_stored(tmp_path):
    """A family with shared experts: the view's MoE block (routed experts read one at a time as stored, the
    shared expert upcast in either residency) equals the float32 model's, and never upcasts the routed experts."""
    path = save_tiny("qwen2_moe", tmp_path / "m", seed=1)
    model = load_model(str(path), dtype="float32").to(torch.bfloat16)
    model.save_pretrained(path)
    view, ref = pipeline.open_view(str(path)), MoEAdapter(load_model(str(path), dtype="float32"))
    i = view.moe_layers[0]
    x = torch.randn(5, view.hidden_size, generator=torch.Generator().manual_seed(0))
    assert view.layer(i).shared is not None
    assert torch.equal(view.moe_forward(i, x), ref.moe_forward(i, x))
    assert view.layer(i).storage.module.gate_up_proj.dtype == torch.bfloat16


def test_spilled_tensors_survive_deletions_and_later_batches():
    """A batch written after a deletion does not overwrite an earlier batch's file (the part name was once the
    live file count), and reads through the kept-open part file return each tensor as written."""
    from moecompress.checkpoint.view import SpilledTensors

    store = SpilledTensors()
    a, b, c = torch.arange(6.0).view(2, 3), torch.ones(4), torch.full((2,), 7.0)
    store.update({"a": a})
    store.update({"b": b})
    del store["a"]
    store.update({"c": c})
    assert sorted(store) == ["b", "c"]
    assert torch.equal(store["b"], b) and torch.equal(store["c"], c) and torch.equal(store["b"], b)
    assert len(list(store.dir.glob("part*.safetensors"))) == 3  # beside them, only our marker (issue 51)
