"""`moecompress.load` of a GGUF export (issue 31): transformers' own GGUF loader for the architectures it reads,
one sentence for the others; `moecompress eval DIR` on a GGUF directory goes the same way."""

import json
import re
import shutil

import pytest
import torch

from moecompress.api import export, load
from moecompress.errors import MoECompressError
from moecompress.export.gguf import GGUF_FILE
from moecompress.models import load_model
from moecompress.plan import CompressionPlan, ModelInfo
from moecompress.testing import fixture_dir, run_cli, tiny_model

QWEN = "qwen3-moe-tiny"
IDS = torch.randint(2, 4096, (1, 48), generator=torch.Generator().manual_seed(0))


def _half_keep(info):
    """A 50 % prune keeping a different set in every layer (so the kept count must come from the GGUF)."""
    return {
        li.layer: sorted({(3 * j + li.layer) % li.num_experts for j in range(li.num_experts // 2)})
        for li in info.layers
    }


def _sentence(msg: str) -> str:
    """One sentence: one line, ending in a full stop, no full stop followed by a new capitalised sentence."""
    assert "\n" not in msg and "Traceback" not in msg and msg.endswith("."), msg
    assert not re.search(r"\.\s+[A-Z]", msg), msg
    return msg


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """qwen3-moe-tiny identity and 50 % renorm prune as gguf, the prune as hf too; olmoe-tiny identity as gguf."""
    root = tmp_path_factory.mktemp("gguf-load")
    model = load_model(str(fixture_dir(QWEN)))
    info = ModelInfo.from_model(model, checkpoint=fixture_dir(QWEN))
    half = CompressionPlan.prune(info, _half_keep(info), gate="renorm")
    for name, plan, fmt in (
        ("identity", CompressionPlan.identity(model), "gguf"),
        ("half", half, "gguf"),
        ("half-hf", half, "hf"),
    ):
        export(str(fixture_dir(QWEN)), plan, root / name, format=fmt, quiet=True)
    olmoe = load_model(str(fixture_dir("olmoe-tiny")))
    export(
        str(fixture_dir("olmoe-tiny")),
        CompressionPlan.identity(olmoe),
        root / "olmoe",
        format="gguf",
        quiet=True,
    )
    return root


def test_a_qwen3_moe_gguf_loads_with_the_originals_logits(exports):
    """Identity GGUF = the original fixture, 50 % prune GGUF = the hf export of the same plan, bit for bit in
    float32 (the pruned export's config.json is the original's: the expert count comes from the GGUF)."""
    for name, ref_dir in (("identity", fixture_dir(QWEN)), ("half", exports / "half-hf")):
        back = load(exports / name, dtype="float32")
        ref = load(ref_dir, dtype="float32")
        assert type(back).__name__ == "Qwen3MoeForCausalLM"
        assert torch.equal(_logits(back), _logits(ref)), name
        assert isinstance(back._moecompress_plan, CompressionPlan)
        assert back.config.num_experts == ref.config.num_experts == (16 if name == "identity" else 8)


def test_a_gguf_with_its_config_but_no_marker_loads(exports, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in (GGUF_FILE, "config.json"):
        shutil.copy(exports / "identity" / f, plain / f)
    back, ref = load(plain, dtype="float32"), load(fixture_dir(QWEN), dtype="float32")
    assert torch.equal(_logits(back), _logits(ref)) and not hasattr(back, "_moecompress_plan")


def test_default_dtype_is_the_configs(exports):
    assert load(exports / "identity").dtype == torch.bfloat16


def test_a_q4_0_gguf_is_dequantized_to_the_hf_exports_weights(tmp_path, capsys):
    """w4g32 experts (Q4_0 in the GGUF, compressed-tensors in hf): transformers dequantizes both; the GGUF's
    float32 weights (code · scale, exact) rounded to bf16 are the hf export's, and the logits agree."""
    for fmt in ("gguf", "hf"):
        args = ["compress", f"fixture:{QWEN}", "--method", "quant", "--quant", "w4g32", "--quant-algo", "rtn"]
        code, _, err = run_cli([*args, "--format", fmt, "--out", str(tmp_path / fmt)], capsys)
        assert code == 0, err
    g, h = load(tmp_path / "gguf", dtype="float32"), load(tmp_path / "hf", dtype="float32")
    hp = dict(h.named_parameters())
    for n, p in g.named_parameters():
        assert torch.equal(p.to(hp[n].dtype).to(torch.float32), hp[n].to(torch.float32)), n
    lg, lh = _logits(g), _logits(h)
    torch.testing.assert_close(lg, lh, atol=0.1, rtol=0)
    assert torch.equal(lg.argmax(-1), lh.argmax(-1))


def _tiny_checkpoint(tmp_path, family, **overrides):
    model = tiny_model(family, dtype=torch.bfloat16, vocab_size=4096, **overrides)
    model.save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture_dir("olmoe-tiny") / f, tmp_path / "m" / f)
    return model


def test_a_pruned_tied_qwen2_moe_gguf_loads_with_its_hf_exports_logits(tmp_path):
    """Shared expert and its gate, a tied head, 4 of 8 experts kept: the GGUF loads as the hf export of the plan."""
    model = _tiny_checkpoint(tmp_path, "qwen2_moe", tie_word_embeddings=True)
    info = ModelInfo.from_model(model, checkpoint=tmp_path / "m")
    plan = CompressionPlan.prune(info, {li.layer: [0, 2, 5, 7] for li in info.layers}, gate="renorm")
    for fmt in ("gguf", "hf"):
        export(str(tmp_path / "m"), plan, tmp_path / fmt, format=fmt, quiet=True)
    g, h = load(tmp_path / "gguf", dtype="float32"), load(tmp_path / "hf", dtype="float32")
    assert g.config.num_experts == 4
    assert torch.equal(_logits(g), _logits(h))


def test_a_gpt_oss_gguf_whose_experts_transformers_skips_is_refused(tmp_path):
    """gpt_oss is among transformers' GGUF architectures, but its loader looks for the experts and sinks under other
    names than llama.cpp's and initialises them at random: refused in one sentence, not returned."""
    model = _tiny_checkpoint(tmp_path, "gpt_oss")
    export(str(tmp_path / "m"), CompressionPlan.identity(model), tmp_path / "g", format="gguf", quiet=True)
    with pytest.raises(MoECompressError) as exc:
        load(tmp_path / "g")
    msg = _sentence(str(exc.value))
    assert "weights of" in msg and "unread" in msg and "partly random" in msg and "llama-cli -m" in msg


def test_weights_the_gguf_loader_leaves_unread_are_refused(exports, monkeypatch):
    """The same guard for any architecture: whatever the loader reports missing is refused."""
    from transformers import AutoModelForCausalLM

    def partial(*args, **kwargs):
        return torch.nn.Linear(1, 1), {"missing_keys": {"model.layers.0.mlp.experts.down_proj", "b"}}

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", partial)
    with pytest.raises(MoECompressError) as exc:
        load(exports / "identity")
    msg = _sentence(str(exc.value))
    assert "left 2 weights" in msg and "(first: b)" in msg and "partly random" in msg and "--format hf" in msg


def test_an_olmoe_gguf_is_refused_in_one_sentence(exports):
    with pytest.raises(MoECompressError) as exc:
        load(exports / "olmoe")
    msg = _sentence(str(exc.value))
    assert "architecture 'olmoe'" in msg and "does not load" in msg
    assert f"llama-cli -m {exports / 'olmoe' / GGUF_FILE}" in msg and "--format hf" in msg


def test_broken_gguf_directories_are_one_sentence(exports, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(exports / "identity", bad)
    data = (bad / GGUF_FILE).read_bytes()
    (bad / GGUF_FILE).write_bytes(data[:1000])
    with pytest.raises(MoECompressError) as exc:
        load(bad)
    assert "is not a valid GGUF file" in _sentence(str(exc.value))  # our bounded reader (gguf_guard)
    bare = tmp_path / "bare"  # no marker, no config.json: a directory holding only model.gguf
    bare.mkdir()
    shutil.copy(exports / "identity" / GGUF_FILE, bare / GGUF_FILE)
    with pytest.raises(MoECompressError) as exc:
        load(bare)
    assert "no config.json beside it" in _sentence(str(exc.value))


def _eval(capsys, d, out):
    args = ["eval", str(d), "--ppl", "fixture-heldout", "--max-tokens", "256", "--dtype", "float32"]
    return run_cli([*args, "--out", str(out)], capsys)


def test_eval_of_a_gguf_directory(exports, tmp_path, capsys):
    """`moecompress eval DIR` loads a GGUF export through `load`: the pruned GGUF scores as its hf export; an
    OLMoE GGUF exits 2 with one sentence and no traceback."""
    scores = {}
    for name in ("half", "half-hf"):
        code, _, err = _eval(capsys, exports / name, tmp_path / f"{name}.json")
        assert code == 0, err
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
    metric = "ppl:fixture-heldout"
    got, ref = (scores[n]["arms"][0]["metrics"][metric] for n in ("half", "half-hf"))
    assert got["aggregate"] == ref["aggregate"] and got["items"] == ref["items"]
    code, _, err = _eval(capsys, exports / "olmoe", tmp_path / "olmoe.json")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err and "does not load" in lines[-1]
    assert not (tmp_path / "olmoe.json").exists()
