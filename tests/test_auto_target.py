"""`auto --target llama.cpp` (issue 31, item 3): the plan is one llama.cpp runs — one expert count in every layer,
one Q8_0 / Q5_0 / Q4_0 / 16-bit type per layer tensor, non-expert weights at those types — within a whole-file budget;
`compress --target` writes the runtime's format and refuses, in one sentence, a plan the runtime cannot run."""

import pytest
import torch

from moecompress.calibrate import calibrate
from moecompress.data import CalibrationData
from moecompress.errors import MoECompressError
from moecompress.export.gguf import exact_type
from moecompress.export.gguf import reason as gguf_reason
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.auto import config as A
from moecompress.models import MoEAdapter, load_model
from moecompress.testing import fixture_dir, run_cli, tiny_model

FAST = dict(sensitivity="uniform", measure=False)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny Qwen3-MoE whose widths are multiples of llama.cpp's 32-weight blocks, calibrated for auto."""
    import shutil

    root = tmp_path_factory.mktemp("auto_target")
    path = root / "model"
    tiny_model(
        "qwen3_moe",
        seed=2,
        hidden_size=64,
        head_dim=32,
        moe_intermediate_size=32,
        num_experts=8,
        vocab_size=4096,
    ).to(torch.bfloat16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # GGUF carries the tokenizer: the fixture's
        shutil.copyfile(fixture_dir("qwen3-moe-tiny") / name, path / name)
    ids = torch.randint(3, 4096, (16, 24), generator=torch.Generator().manual_seed(0))
    store = calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=24,
        out=root / "stats",
        stats=A.needs_stats(parse_config("auto", dict(target="llama.cpp"))),
        batch_size=4,
        dtype="float32",
        progress=False,
    )
    return path, store, MoEAdapter(load_model(str(path), dtype="float32"))


# not 0.3: the budget bounds model.gguf (issue 48), whose tokenizer alone (~128 kB) is a tenth of this toy model,
# and below 0.4 no llama.cpp file of it fits
@pytest.mark.parametrize("budget", [0.6, 0.4])
def test_plan_is_one_llama_cpp_runs_within_the_whole_file_budget(calibrated, budget):
    _, store, adapter = calibrated
    plan, tensors = get_method("auto").build(
        parse_config("auto", dict(budget=budget, target="llama.cpp", **FAST)), MethodContext(adapter, store)
    )
    assert gguf_reason(plan) is None
    kept = {len(lp.stored_ids()) for lp in plan.layers}
    assert len(kept) == 1  # one expert count in every layer
    for sc in plan.scopes:
        assert len({s.quant for s in sc.stored}) == 1 and exact_type(sc.stored[0].quant) is not None
    assert all(exact_type(tq.quant) in ("Q8_0", "Q5_0", "Q4_0") for tq in plan.tensor_quant.values())
    a = plan.params["auto"]
    assert (
        plan.logical_bytes(tensors, accounting="stored").total == a["whole_bytes"] <= a["tensor_budget_bytes"]
    )
    if budget == 0.4:
        assert plan.tensor_quant  # the non-expert weights share the budget


def test_five_bit_layers_are_written_as_q5_0(calibrated, tmp_path):
    """With 16 and 5 bits only, every quantized stack of the plan is w5g32 and the GGUF holds it as Q5_0."""
    import gguf

    from moecompress.api import export

    path, store, adapter = calibrated
    plan, tensors = get_method("auto").build(
        parse_config("auto", dict(budget=0.45, target="llama.cpp", bits=[16, 5], **FAST)),
        MethodContext(adapter, store),
    )
    specs = {s.quant for sc in plan.scopes for s in sc.stored} | {
        tq.quant for tq in plan.tensor_quant.values()
    }
    assert {exact_type(q) for q in specs} - {"float"} == {"Q5_0"}
    export(str(path), plan, tmp_path / "g", format="gguf", tensors=tensors, quiet=True)
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "g" / "model.gguf")).tensors}
    assert "Q5_0" in types and not types & {"Q8_0", "Q4_0"}


def test_target_fills_the_search_space_and_refuses_what_llama_cpp_cannot_run():
    config = parse_config("auto", dict(target="llama.cpp"))
    assert (config.candidates, config.gates, config.bits, config.quant_group) == (
        ["reroute"],
        ["renorm"],
        [16, 8, 5, 4],
        32,
    )
    with pytest.raises(MoECompressError, match="llama.cpp cannot use bits="):
        parse_config("auto", dict(target="llama.cpp", bits=[16, 2]))
    with pytest.raises(MoECompressError, match="cannot use candidates="):
        parse_config("auto", dict(target="llama.cpp", candidates=["tilt"]))


def test_cli_target_writes_gguf_and_refuses_a_plan_llama_cpp_cannot_run(calibrated, tmp_path, capsys):
    import gguf

    path, store, _ = calibrated
    args = [
        "compress",
        str(path),
        "--method",
        "auto",
        "--budget",
        "0.4",
        "--target",
        "llama.cpp",
        "--calib",
        str(store.path),
        "--param",
        "sensitivity=uniform",
        "--param",
        "measure=false",
        "--out",
        str(tmp_path / "g"),
    ]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    assert any(t.name == "blk.0.ffn_gate_exps.weight" for t in reader.tensors)
    bad = [
        "compress",
        str(path),
        "--method",
        "quant",
        "--quant",
        "w3g32",
        "--quant-algo",
        "rtn",
        "--target",
        "llama.cpp",
        "--out",
        str(tmp_path / "p"),
    ]
    code, _, err = run_cli(bad, capsys)
    assert (
        code == 2 and "This plan cannot run in llama.cpp: its w3g32 experts" in err and "Traceback" not in err
    )
    assert not (tmp_path / "p").exists()
    code, _, err = run_cli([*args[:-1], str(tmp_path / "x"), "--target", "tensorrt"], capsys)
    assert code == 2 and "Target 'tensorrt' is not known" in err
    code, _, err = run_cli(
        [*bad[:-1], str(tmp_path / "y"), "--quant", "w4g32", "--format", "compact"], capsys
    )
    assert code == 2 and "llama.cpp loads --format gguf, not compact" in err and not (tmp_path / "y").exists()


def test_imatrix_gguf_is_llama_cpps_format_from_our_statistics(tmp_path, capsys):
    """`--imatrix` writes imatrix.gguf beside model.gguf: per llama.cpp tensor of the GGUF, `in_sum2` [n_mat, n_in]
    and `counts` — the kept experts' squared channel norms and routed counts, the attention inputs' Σ x²."""
    import gguf

    from moecompress import calibrate as gather
    from moecompress.calibrate.linear_hessian import linear_hessian_pass
    from moecompress.export.imatrix import EXPERT_STATS

    model = fixture_dir("olmoe-tiny")
    store = gather(
        str(model),
        "fixture-calib:4",
        seq_len=64,
        out=tmp_path / "stats",
        stats=[*EXPERT_STATS, "out_norm_sq_mean"],
        batch_size=4,
        progress=False,
    )
    args = [
        "compress",
        str(model),
        "--method",
        "prune",
        "--criterion",
        "frequency",
        "--ratio",
        "0.5",
        "--gate",
        "renorm",
        "--format",
        "gguf",
        "--imatrix",
        "--calib",
        str(tmp_path / "stats"),
        "--out",
        str(tmp_path / "g"),
    ]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    im = gguf.GGUFReader(str(tmp_path / "g" / "imatrix.gguf"))
    weights = {t.name for t in gguf.GGUFReader(str(tmp_path / "g" / "model.gguf")).tensors}
    entries = {t.name: t for t in im.tensors}
    bases = {n.rsplit(".", 1)[0] for n in entries}
    assert (
        bases <= weights
        and {"blk.0.ffn_down_exps.weight", "blk.0.attn_q.weight", "blk.1.attn_output.weight"} <= bases
    )
    assert str(bytes(im.fields["general.type"].parts[-1]), "utf-8") == "imatrix"
    chunks = (im.fields["imatrix.chunk_count"].contents(), im.fields["imatrix.chunk_size"].contents())
    assert chunks == (4, 64)  # 4 calibration sequences of 64 tokens: 4 chunks of 64, as llama-imatrix counts
    plan = __import__("json").loads((tmp_path / "g" / "plan.json").read_text())
    kept = [e for e, t in enumerate(plan["layers"][0]["slots"]) if isinstance(t, int)]
    down = entries["blk.0.ffn_down_exps.weight.in_sum2"].data
    want = store.get(0, "mid_channel_norm").double()[kept].square().numpy()
    assert down.shape == want.shape and abs(down - want).max() <= 1e-5 * abs(want).max()
    counts = entries["blk.0.ffn_gate_exps.weight.counts"].data.reshape(-1)
    assert list(counts) == [float(c) for c in store.get(0, "counts")[kept]]
    ((_, hs),) = [
        x
        for x in linear_hessian_pass(
            str(model), store.meta["data"], ["model.layers.0.self_attn.q_proj.weight"]
        )
    ]
    q = entries["blk.0.attn_q.weight.in_sum2"].data.reshape(-1)
    ref = hs["model.layers.0.self_attn.q_proj.weight"].diagonal().numpy()
    assert abs(q - ref).max() <= 1e-5 * abs(ref).max()
    code, _, err = run_cli([*args[:-1], str(tmp_path / "h"), "--format", "compact"], capsys)
    assert code == 2 and "--imatrix belongs with a GGUF output" in err and not (tmp_path / "h").exists()


@pytest.mark.parametrize("target, budget", [("transformers", 0.7), ("vllm", 0.9)])
def test_hf_targets_search_one_expert_count_and_one_expert_precision(calibrated, target, budget):
    """transformers / vLLM load an hf checkpoint: the plan is one HFFormat holds (and, for vLLM, one its WNA16
    kernels run), within the whole-file budget. (This model's embeddings and lm_head are 78 % of it, and stay bf16
    for vLLM: the budgets are high.)"""
    from moecompress.export.ct import vllm_reason
    from moecompress.export.formats import HFFormat

    _, store, adapter = calibrated
    plan, tensors = get_method("auto").build(
        parse_config("auto", dict(budget=budget, target=target, quant_group=32, **FAST)),
        MethodContext(adapter, store),
    )
    assert HFFormat.reason(plan) is None and (target != "vllm" or vllm_reason(plan) is None)
    assert len({len(lp.stored_ids()) for lp in plan.layers}) == 1
    (spec,) = plan.quant_specs()
    assert spec is not None  # the budget needs quantized experts
    assert target != "vllm" or spec.bits in (4, 8)
    assert "embeddings" not in {tq.kind for tq in plan.tensor_quant.values()}
    a = plan.params["auto"]
    assert plan.logical_bytes(tensors, accounting="stored").total == a["whole_bytes"] <= a["budget_bytes"]


def test_hf_targets_refuse_what_their_runtime_cannot_load(calibrated, tmp_path, capsys):
    config = parse_config("auto", dict(target="vllm"))
    assert (config.candidates, config.gates, config.bits) == (["reroute"], ["renorm"], [16, 8, 4])
    assert (
        parse_config("auto", dict(target="vllm", quant_group=None)).quant_group is None
    )  # per channel, kept
    with pytest.raises(
        MoECompressError, match=r"vllm cannot use bits=\[16, 5\]: vllm runs bits \[16, 8, 4\] only"
    ):
        parse_config("auto", dict(target="vllm", bits=[16, 5]))
    _, store, adapter = calibrated
    with pytest.raises(
        MoECompressError, match=r"quant_group 128 leaves a shorter last group .* pass quant_group=32"
    ):
        get_method("auto").build(
            parse_config("auto", dict(budget=0.4, target="transformers", **FAST)),
            MethodContext(adapter, store),
        )
    path = str(calibrated[0])
    quant = "--method quant --quant w3g32 --quant-algo rtn --target vllm --out".split()
    code, _, err = run_cli(["compress", path, *quant, str(tmp_path / "v")], capsys)
    assert code == 2 and "This plan cannot run in vllm: its experts w3g32 is not one of vLLM's WNA16" in err
    assert not (tmp_path / "v").exists()
    fast = "--param sensitivity=uniform --param measure=false --param quant_group=32".split()
    auto = [
        "--method",
        "auto",
        "--budget",
        "0.7",
        "--target",
        "transformers",
        "--calib",
        str(store.path),
        *fast,
    ]
    code, _, err = run_cli(["compress", path, *auto, "--out", str(tmp_path / "t")], capsys)
    assert code == 0, err
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "t").config.quantization_config is not None


def test_a_group_the_target_cannot_load_is_refused_naming_one_it_can():
    from types import SimpleNamespace

    from moecompress.methods.auto.target import check_groups

    info = SimpleNamespace(hidden_size=192, layers=[SimpleNamespace(intermediate_size=64)])
    with pytest.raises(
        MoECompressError, match=r"quant_group 128 leaves .* \[64, 192\], .*; pass quant_group=64\.$"
    ):
        check_groups(parse_config("auto", dict(target="vllm")), info)
    check_groups(parse_config("auto", dict(target="llama.cpp")), info)  # 32 divides both
    odd = SimpleNamespace(hidden_size=192, layers=[SimpleNamespace(intermediate_size=48)])
    with pytest.raises(MoECompressError, match="no group it loads fits; use --target moecompress"):
        check_groups(parse_config("auto", dict(target="llama.cpp")), odd)
