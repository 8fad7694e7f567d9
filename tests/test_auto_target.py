"""`auto --target llama.cpp` (issue 31, item 3): the plan is one llama.cpp runs — one expert count in every layer,
one Q8_0 / Q4_0 / 16-bit type per layer tensor, non-expert weights at those types — within a whole-file budget;
`compress --target` writes the runtime's format and refuses, in one sentence, a plan the runtime cannot run."""

import pytest
import torch

from moecompress.calibrate import calibrate
from moecompress.data import CalibrationData
from moecompress.errors import MoECompressError
from moecompress.export.gguf import exact_type
from moecompress.export.gguf import reason as gguf_reason
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods import auto as A
from moecompress.models import MoEAdapter, load_model
from moecompress.testing import fixture_dir, run_cli, tiny_model

FAST = dict(sensitivity="uniform", measure=False)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny Qwen3-MoE whose widths are multiples of llama.cpp's 32-weight blocks, calibrated for auto."""
    import shutil

    root = tmp_path_factory.mktemp("auto_target")
    path = root / "model"
    tiny_model("qwen3_moe", seed=2, hidden_size=64, head_dim=32, moe_intermediate_size=32, num_experts=8,
               vocab_size=4096).to(torch.bfloat16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # GGUF carries the tokenizer: the fixture's
        shutil.copyfile(fixture_dir("qwen3-moe-tiny") / name, path / name)
    ids = torch.randint(3, 4096, (16, 24), generator=torch.Generator().manual_seed(0))
    store = calibrate(str(path), CalibrationData.from_tokens(ids), seq_len=24, out=root / "stats",
                      stats=A.needs_stats(parse_config("auto", dict(target="llama.cpp"))), batch_size=4,
                      dtype="float32", progress=False)
    return path, store, MoEAdapter(load_model(str(path), dtype="float32"))


@pytest.mark.parametrize("budget", [0.6, 0.3])
def test_plan_is_one_llama_cpp_runs_within_the_whole_file_budget(calibrated, budget):
    _, store, adapter = calibrated
    plan, tensors = get_method("auto").build(parse_config("auto", dict(budget=budget, target="llama.cpp", **FAST)),
                                             MethodContext(adapter, store))
    assert gguf_reason(plan) is None
    kept = {len(lp.stored_ids()) for lp in plan.layers}
    assert len(kept) == 1  # one expert count in every layer
    for sc in plan.scopes:
        assert len({s.quant for s in sc.stored}) == 1 and exact_type(sc.stored[0].quant) is not None
    assert all(exact_type(tq.quant) in ("Q8_0", "Q4_0") for tq in plan.tensor_quant.values())
    a = plan.params["auto"]
    assert plan.logical_bytes(tensors, accounting="stored").total == a["whole_bytes"] <= a["budget_bytes"]
    if budget == 0.3:
        assert plan.tensor_quant  # the non-expert weights share the budget


def test_target_fills_the_search_space_and_refuses_what_llama_cpp_cannot_run():
    config = parse_config("auto", dict(target="llama.cpp"))
    assert (config.candidates, config.gates, config.bits, config.quant_group) == (["reroute"], ["renorm"],
                                                                                 [16, 8, 4], 32)
    with pytest.raises(MoECompressError, match="llama.cpp cannot use bits="):
        parse_config("auto", dict(target="llama.cpp", bits=[16, 2]))
    with pytest.raises(MoECompressError, match="cannot use candidates="):
        parse_config("auto", dict(target="llama.cpp", candidates=["tilt"]))


def test_cli_target_writes_gguf_and_refuses_a_plan_llama_cpp_cannot_run(calibrated, tmp_path, capsys):
    import gguf

    path, store, _ = calibrated
    args = ["compress", str(path), "--method", "auto", "--budget", "0.4", "--target", "llama.cpp", "--calib",
            str(store.path), "--param", "sensitivity=uniform", "--param", "measure=false", "--out",
            str(tmp_path / "g")]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    assert any(t.name == "blk.0.ffn_gate_exps.weight" for t in reader.tensors)
    bad = ["compress", str(path), "--method", "quant", "--quant", "w3g32", "--quant-algo", "rtn", "--target",
           "llama.cpp", "--out", str(tmp_path / "p")]
    code, _, err = run_cli(bad, capsys)
    assert code == 2 and "This plan cannot run in llama.cpp: its w3g32 experts" in err and "Traceback" not in err
    assert not (tmp_path / "p").exists()
    code, _, err = run_cli([*args[:-1], str(tmp_path / "x"), "--target", "tensorrt"], capsys)
    assert code == 2 and "Target 'tensorrt' is not known" in err
