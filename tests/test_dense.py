"""MoE → dense conversion: known answers, every criterion × grouping × scaling, exported students."""

from __future__ import annotations

import json

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.methods.dense_convert import convert, convert_layer, dense_view
from moecompress.methods.dense_fit import (
    CRITERIA,
    GROUPINGS,
    SCALINGS,
    DenseConfig,
    average_linkage,
    group_experts,
    merge_group,
    select_experts,
)
from moecompress.methods.dense_stats import collect_dense_stats
from moecompress.models import MoEAdapter, expert_apply
from moecompress.testing import FAMILY_NAMES, fixture_dir, tiny_model

EXPECTED = {
    "qwen3_moe": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MistralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "granitemoe": "GraniteForCausalLM",
}

_CACHE: dict = {}


def _setup(family: str):
    """A tiny model of `family` and its dense statistics on random tokens (cached per module)."""
    if family not in _CACHE:
        model = tiny_model(family)
        ids = torch.randint(3, 90, (3, 24), generator=torch.Generator().manual_seed(1))
        _CACHE[family] = (model, collect_dense_stats(model, ids, progress=False), ids)
    return _CACHE[family]


def _student(family: str, **cfg):
    from moecompress.distill.student import build_student
    from moecompress.distill.student_config import student_target

    model, stats, _ = _setup(family)
    adapter = MoEAdapter(model)
    config = DenseConfig(**cfg)
    target = student_target(adapter, config)
    conv = convert(adapter, stats, config, fold_shared=target.fold_shared, progress=False)
    return build_student(adapter, conv, target), conv, target


# ----------------------------------------------------------------------------- known answers
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("scaling", ["uniform", "proportional", "gate"])
def test_concat_equals_weighted_sum_of_group_experts(family, scaling):
    """K = k: the dense FFN's output is Σ_g α_g f_g(x) of the selected experts (block concatenation)."""
    model, stats, _ = _setup(family)
    adapter = MoEAdapter(model)
    i = adapter.moe_layers[-1]
    layer = convert_layer(
        adapter, i, stats[i], DenseConfig(criterion="acp", scaling=scaling), fold_shared=False
    )
    x = torch.randn(20, adapter.hidden_size, generator=torch.Generator().manual_seed(2))
    want = sum(g["alpha"] * adapter.expert_forward(i, g["experts"][0], x) for g in layer.plan["groups"])
    got = expert_apply(layer.routed.map(lambda t: t.float()), x, layer.act)
    assert [len(g["experts"]) for g in layer.plan["groups"]] == [1] * adapter.top_k(i)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_concat_with_merged_groups_and_shared_expert():
    """K > k: each group is its score-weighted parameter average; the shared expert is appended unscaled."""
    model, stats, _ = _setup("deepseek_v2")
    adapter = MoEAdapter(model)
    i = adapter.moe_layers[0]
    layer = convert_layer(adapter, i, stats[i], DenseConfig(criterion="frequency", K=6, grouping="rr"))
    assert sorted(e for g in layer.plan["groups"] for e in g["experts"]) == sorted(layer.plan["selected"])
    x = torch.randn(20, adapter.hidden_size, generator=torch.Generator().manual_seed(3))
    experts = adapter.experts(i)
    want = sum(
        g["alpha"]
        * expert_apply(
            merge_group(experts, g["experts"], g["merge_weights"]).map(lambda t: t.float()), x, layer.act
        )
        for g in layer.plan["groups"]
    )
    want = want + adapter.shared_forward(i, x)
    got = expert_apply(layer.ffn(True).map(lambda t: t.float()), x, layer.act)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # α uniform = routed_scaling_factor / k for this non-renormalising router
    assert all(g["alpha"] == pytest.approx(1.5 / 2) for g in layer.plan["groups"])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_identical_experts_make_the_dense_student_exact(family):
    """Renormalising router + identical experts: Σ_g (1/k) f(x) = f(x) = MoE output, so logits agree."""
    model = tiny_model(family, seed=4)
    adapter = MoEAdapter(model)
    for i in adapter.moe_layers:
        w = adapter.get_expert(i, 0)
        for e in range(1, adapter.num_experts(i)):
            adapter.set_expert(i, e, w)
    ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(5))
    stats = collect_dense_stats(model, ids, gram=False, progress=False)
    from moecompress.distill.student import build_student

    student = build_student(adapter, convert(adapter, stats, DenseConfig(criterion="cp"), progress=False))
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_student_attention_path_reproduces_the_teacher(family):
    """With every FFN output zero, student and teacher compute the same hidden states at every layer."""
    model, _, ids = _setup(family)
    student, _, target = _student(family, criterion="frequency")
    assert type(student).__name__ == EXPECTED[family]
    assert target.kind == ("moe" if family in ("olmoe", "gpt_oss") else "dense")
    zero = {}
    with torch.no_grad():
        for m in (model, student):  # zero every FFN's down projection (and biases) through forward hooks
            for name, mod in m.named_modules():
                if name.endswith((".mlp", ".block_sparse_moe")):
                    zero[id(mod)] = mod.register_forward_hook(
                        lambda mod, a, out: (
                            (torch.zeros_like(out[0]), *out[1:])
                            if isinstance(out, tuple)
                            else torch.zeros_like(out)
                        )
                    )
        t = model(ids, output_hidden_states=True)
        s = student(ids, output_hidden_states=True)
        for h in zero.values():
            h.remove()
    for a, b in zip(t.hidden_states, s.hidden_states):
        assert torch.equal(a, b)
    assert torch.equal(t.logits, s.logits)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_in_place_view_equals_student(family):
    """The sweep's in-place dense view computes exactly what the student checkpoint computes."""
    model, _, ids = _setup(family)
    student, conv, _ = _student(family, criterion="ps", K=4, grouping="ab", scaling="proportional")
    with torch.no_grad():
        with dense_view(model, conv):
            v = model(ids).logits
        torch.testing.assert_close(student(ids).logits, v, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(ids).logits, v)  # the view was removed again


def test_qwen2_exact_shared_gate_is_a_one_expert_moe():
    student, conv, target = _student("qwen2_moe", criterion="cp", shared_gate="exact")
    assert (target.kind, type(student).__name__) == ("moe", "Qwen2MoeForCausalLM")
    assert student.config.num_experts == 1 and student.config.num_experts_per_tok == 1
    model, _, ids = _setup("qwen2_moe")
    with torch.no_grad(), dense_view(model, conv):
        torch.testing.assert_close(student(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- grouping, selection
def test_average_linkage_recovers_blocks():
    d = torch.full((6, 6), 1.0)
    for block in ([0, 3, 4], [1, 2, 5]):
        for a in block:
            for b in block:
                d[a, b] = 0.1
    d.fill_diagonal_(0)
    assert sorted(sorted(c) for c in average_linkage(d, 2)) == [[0, 3, 4], [1, 2, 5]]


def test_groupings_known_answers():
    selected = [5, 2, 7, 0, 1, 3]  # rank order
    assert group_experts(selected, 2, "rr") == [[5, 7, 1], [2, 0, 3]]
    router = torch.zeros(8, 4)
    router[[5, 7, 0], 0] = 1.0  # similar to anchor 5
    router[[2, 1, 3], 1] = 1.0  # similar to anchor 2
    assert group_experts(selected, 2, "ab", router=router) == [[5, 7, 0], [2, 1, 3]]
    assert group_experts(selected, 2, "rc", router=router) == [[5, 7, 0], [2, 1, 3]]
    f = torch.zeros(8, 2)
    f[[5, 7, 0], 0] = torch.tensor([1.0, 2.0, 0.5])  # outputs parallel to 5's, different norms
    f[[2, 1, 3], 1] = torch.tensor([1.0, 3.0, 0.2])
    gram = f @ f.T
    assert group_experts(selected, 2, "oc", gram=gram) == [[5, 7, 0], [2, 1, 3]]
    assert group_experts(selected[:2], 2, "wc") == [[5], [2]]  # K = k: pure pruning


def test_doptimal_selection_avoids_duplicates():
    """DO-* picks diverse experts: a duplicate of the best expert is skipped for the next distinct one."""
    E = 4
    f = torch.eye(E)
    f[1] = f[0]  # expert 1 duplicates expert 0
    stats = {
        "counts": torch.tensor([10, 10, 9, 1]),
        "tokens": torch.tensor(20),
        "cp": torch.tensor([0.5, 0.5, 0.4, 0.1]),
        "pp": torch.zeros(E),
        "routing_mass": torch.zeros(E),
        "gram": f @ f.T,
    }
    assert select_experts(stats, "cp", 2) == [0, 1]
    assert select_experts(stats, "do-cp", 2) == [0, 2]


@pytest.mark.parametrize("criterion", CRITERIA)
def test_every_grouping_and_scaling_runs(criterion):
    model, stats, ids = _setup("qwen3_moe")
    adapter = MoEAdapter(model)
    for grouping in GROUPINGS:
        for scaling in SCALINGS:
            conv = convert(
                adapter,
                stats,
                DenseConfig(
                    criterion=criterion,
                    K=5,
                    grouping=grouping,
                    scaling=scaling,
                    mass_scale=scaling == "uniform",
                ),
                progress=False,
            )
            for lp in conv.plan["layers"]:
                members = [e for g in lp["groups"] for e in g["experts"]]
                assert sorted(members) == sorted(lp["selected"]) and len(lp["groups"]) == 2
                assert all(abs(sum(g["merge_weights"]) - 1) < 1e-6 for g in lp["groups"])
                if scaling == "proportional":
                    assert sum(g["alpha"] for g in lp["groups"]) == pytest.approx(1.0)
    with torch.no_grad(), dense_view(adapter, conv):
        assert torch.isfinite(model(ids).logits).all()


def test_bad_input_sentences():
    model, stats, _ = _setup("qwen3_moe")
    adapter = MoEAdapter(model)
    i = adapter.moe_layers[0]
    with pytest.raises(MoECompressError, match="smaller than the router's top-k"):
        convert_layer(adapter, i, stats[i], DenseConfig(K=1))
    with pytest.raises(MoECompressError, match="exceeds the 8 experts"):
        convert_layer(adapter, i, stats[i], DenseConfig(K=9))
    with pytest.raises(MoECompressError, match="Unknown criterion 'reapx'"):
        select_experts(stats[i], "reapx", 2)
    no_gram = {k: v for k, v in stats[i].items() if k != "gram"}
    with pytest.raises(MoECompressError, match="lack 'gram'"):
        convert_layer(adapter, i, no_gram, DenseConfig(criterion="do-acp"))
    m2, s2, _ = _setup("qwen2_moe")
    no_gate = {k: {n: t for n, t in v.items() if n != "shared_gate_mean"} for k, v in s2.items()}
    with pytest.raises(MoECompressError, match="shared-gate exact"):
        convert(m2, no_gate, DenseConfig(criterion="cp"), progress=False)
    from moecompress.distill.student_config import student_target

    with pytest.raises(MoECompressError, match="always written dense"):
        student_target(MoEAdapter(_setup("deepseek_v2")[0]), DenseConfig(target="moe"))
    with pytest.raises(MoECompressError, match="not possible"):
        student_target(MoEAdapter(_setup("olmoe")[0]), DenseConfig(target="dense"))


# ----------------------------------------------------------------------------- export, CLI
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"])
def test_exported_student_loads_with_plain_from_pretrained(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from moecompress.distill.dense_export import PLAN_NAME, export_dense

    model, stats, ids = _setup(family)
    summary = export_dense(
        model,
        tmp_path / "student",
        DenseConfig(criterion="acp", K=4, grouping="oc"),
        calib=stats,
        progress=False,
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    assert type(loaded).__name__ == EXPECTED[family] == summary["student_class"]
    student, _, _ = _student(family, criterion="acp", K=4, grouping="oc")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student(ids).logits)
    plan = json.loads((tmp_path / "student" / PLAN_NAME).read_text())
    assert plan["student"]["class"] == EXPECTED[family] and len(plan["layers"]) == len(
        MoEAdapter(model).moe_layers
    )
    assert not list(tmp_path.glob(".student.tmp-*"))  # written atomically


def test_cli_dense_and_sweep(tmp_path):
    from typer.testing import CliRunner

    from moecompress.cli import app
    from moecompress.data import char_tokenizer

    model = tiny_model("qwen3_moe", seed=0)
    src = tmp_path / "moe"
    model.save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"the quick brown fox {i} jumps over the lazy dog." for i in range(200)))
    r = CliRunner().invoke(
        app,
        [
            "dense",
            str(src),
            "--out",
            str(tmp_path / "dense"),
            "--criterion",
            "DO-ACP",
            "--K",
            "4",
            "--grouping",
            "wc",
            "--scaling",
            "proportional",
            "--calib",
            f"{text}:4",
            "--seq-len",
            "64",
        ],
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "dense" / "tokenizer.json").is_file() and "Qwen3ForCausalLM" in r.output
    r = CliRunner().invoke(
        app,
        [
            "dense-sweep",
            str(src),
            "--out",
            str(tmp_path / "sweep.md"),
            "--calib",
            f"{text}:4",
            "--heldout",
            str(text),
            "--criteria",
            "cp,do-acp",
            "--groupings",
            "rr,oc",
            "--K",
            "2,4",
            "--scalings",
            "uniform,uniform+mass",
            "--heldout-tokens",
            "512",
            "--window",
            "64",
            "--seq-len",
            "64",
        ],
    )
    assert r.exit_code == 0, r.output
    table = (tmp_path / "sweep.md").read_text()
    assert "| do-acp | oc | uniform |" in table and "K=4" in table
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert len(rows) == 16 and all(r["ppl"] > 0 for r in rows)
    # K = k: grouping is irrelevant, so rr and oc share one evaluation
    k2 = {(r["criterion"], r["grouping"]): r["ppl"] for r in rows if r["K"] == 2}
    assert k2[("cp", "rr")] == k2[("cp", "oc")]


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "olmoe-tiny"])
def test_fixture_dense_student(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from moecompress.distill.dense_export import export_dense

    path = fixture_dir(name)
    if not (path / "config.json").exists():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    s = export_dense(str(path), tmp_path / "d", DenseConfig(), calib="fixture-calib:8", progress=False)
    assert s["bytes"] < 0.6 * s["teacher_bytes"]
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    assert (tmp_path / "d" / "tokenizer.json").is_file()
    with torch.no_grad():
        assert torch.isfinite(student(torch.tensor([[1, 2, 3, 4]])).logits).all()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_registry_plan_runs_in_the_runtime(family):
    """`compress --method dense`: the plan's aggregate-gate dense_group block equals the dense FFN on
    renormalising routers (Σ of the selected gates is the same on every token)."""
    import copy

    runtime = pytest.importorskip("moecompress.runtime")
    from moecompress.methods import MethodContext, get_method

    model, stats, ids = _setup(family)
    entry = get_method("dense")
    assert entry.family == "dense" and "gram" in entry.stats_for(DenseConfig(criterion="do-acp"))
    cfg = DenseConfig(criterion="cp", K=4, grouping="rc")
    plan, tensors = entry.build(cfg, MethodContext(MoEAdapter(model), stats))
    conv = convert(model, stats, cfg, fold_shared=False, progress=False)
    with torch.no_grad():
        with dense_view(model, conv):
            want = model(ids).logits
        got = runtime.apply_plan(copy.deepcopy(model), plan, tensors)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_collector_matches_the_calibration_engine(tmp_path):
    """`collect_dense_stats` and `moecompress calibrate --for-method dense` define the statistics alike,
    so `--calib` can be a text spec or a stats store interchangeably."""
    from moecompress.calibrate import calibrate
    from moecompress.calibrate.store import load_stats
    from moecompress.data import CalibrationData
    from moecompress.distill.dense_export import _read_store
    from moecompress.methods import stats_for_method

    model = tiny_model("deepseek_v2", seed=3)
    model.save_pretrained(tmp_path / "m")
    ids = torch.randint(3, 90, (4, 16), generator=torch.Generator().manual_seed(4))
    calibrate(
        str(tmp_path / "m"),
        CalibrationData.from_tokens(ids),
        stats=stats_for_method("dense"),
        out=tmp_path / "s",
        dtype="float32",
        progress=False,
    )
    store, ours = load_stats(tmp_path / "s"), collect_dense_stats(model, ids, progress=False)
    for i in store.layers:
        for name in ("counts", "tokens", "routing_mass", "pp", "cp", "out_norm_sq_mean", "gram"):
            torch.testing.assert_close(
                store.get(i, name).double(), ours[i][name].double(), atol=1e-6, rtol=1e-5
            )
    assert sorted(_read_store(tmp_path / "s")[0]) == store.layers
