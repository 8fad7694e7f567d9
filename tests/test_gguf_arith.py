"""`load(..., arithmetic="llama.cpp")`: our runtime computing as llama.cpp's CPU kernels do on a plan's GGUF types
(export/gguf_arith.py). Checked here against hand computations of ggml's arithmetic; against llama.cpp itself in
BENCHMARKS.md ("GGUF inside llama.cpp")."""

import pytest
import torch

from moecompress.api import export, load
from moecompress.errors import MoECompressError
from moecompress.export.gguf_arith import attention, emulate_llama_cpp, q8_0
from moecompress.methods.quantize import QuantConfig, quantize_plan
from moecompress.methods.tensor_quant import quantize_tensors
from moecompress.models import MoEAdapter, load_model
from moecompress.plan import CompressionPlan
from moecompress.quant.spec import QuantSpec
from moecompress.runtime import CompressedMoEBlock, apply_plan
from moecompress.testing import fixture_dir

NAME = "qwen3-moe-tiny"


def test_q8_0_is_ggmls_activation_quantizer():
    """d = fp16(max|x| / 127), q = round-half-even(x · 127 / max|x|): a known block, and a zero block."""
    x = torch.zeros(2, 32)
    x[0, :6] = torch.tensor([254.0, -127.0, 1.0, 3.0, 4.8, -0.9])  # max 254: d = 2, x · 127/254 = x / 2
    want = torch.zeros(2, 32)
    want[0, :6] = (
        torch.tensor([127.0, -64.0, 0.0, 2.0, 2.0, 0.0]) * 2
    )  # -63.5 -> -64, 0.5 -> 0, 1.5 -> 2: to even
    assert torch.equal(q8_0(x), want)
    assert (
        q8_0(torch.full((32,), 0.1))[0] == torch.tensor(0.1 / 127).half().float() * 127
    )  # d is stored in fp16
    y = torch.randn(3, 5, 64)
    codes = (
        q8_0(y).reshape(3, 5, 2, 32)
        / (y.reshape(3, 5, 2, 32).abs().amax(-1, keepdim=True) / 127).half().float()
    )
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 127
    assert torch.equal(q8_0(q8_0(y)), q8_0(y))  # the grid is a fixed point


def _plan(spec="w8g32", classes=None):
    """A float32 model of the fixture and a plan with RTN experts (and `classes` non-expert specs)."""
    model = load_model(str(fixture_dir(NAME)), dtype="float32")
    adapter = MoEAdapter(model)
    plan, tensors = CompressionPlan.identity(model), {}
    if classes:
        plan, tensors = quantize_tensors(
            plan, tensors, adapter, {k: QuantSpec.parse(v, algo="rtn") for k, v in classes.items()}
        )
    plan, tensors = quantize_plan(
        plan, tensors, lambda l, e: adapter.layer(l).storage.read(e), QuantConfig(quant=spec, algo="rtn")
    )
    return model, plan, tensors


def test_quantized_experts_compute_ggmls_q8_0_dot_products():
    """Each expert: gate/up on Q8_0(x), down on Q8_0(act(gate)·up), weights exactly code·d (no bf16 rounding)."""
    model, plan, tensors = _plan()
    apply_plan(model, plan, tensors)
    emulate_llama_cpp(model)
    stored = next(m for m in model.modules() if isinstance(m, CompressedMoEBlock)).stored
    torch.manual_seed(0)
    x = torch.randn(6, plan.model.hidden_size)
    index = torch.stack([torch.randperm(stored.num_experts)[:2] for _ in range(6)])
    weight = torch.rand(6, 2)
    want = torch.zeros_like(x)
    for n in range(6):
        for j in range(2):
            slot = stored.experts[int(index[n, j])]
            w = {p: slot._quantized(p).dequantize(torch.float32) for p in ("gate", "up", "down")}
            xq = q8_0(x[n])
            h = torch.nn.functional.silu(w["gate"] @ xq) * (w["up"] @ xq)
            want[n] += weight[n, j] * (w["down"] @ q8_0(h))
    with torch.no_grad():
        got = stored(x, index, weight)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        stored.input_rounding = None  # the exact runtime computes something else
        assert not torch.allclose(stored(x, index, weight), want, atol=1e-5, rtol=1e-5)


def test_every_linear_input_is_rounded_by_its_weights_gguf_type():
    """Q8_0 attention weights see Q8_0 activations, the bf16 lm_head bf16 ones; attention reads an fp16 cache."""
    model, plan, tensors = _plan(classes={"attention": "w8g32"})
    apply_plan(model, plan, tensors)
    emulate_llama_cpp(model)
    seen = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj", "lm_head"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: seen.__setitem__(name, a[0])
        )
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.no_grad():
        logits = model(ids).logits
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"):
        assert torch.equal(seen[name], q8_0(seen[name])) and not torch.equal(
            seen[name], seen[name].bfloat16().float()
        )
    head = seen["lm_head"]
    assert torch.equal(head, head.bfloat16().float()) and not torch.equal(head, q8_0(head))
    # causal: a later token changes no earlier position's logits
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(model(other).logits[0, :-1], logits[0, :-1])


def test_attention_is_fp16_cache_arithmetic():
    """Scores from fp16 Q and K, softmax in float32, probabilities and V in fp16; GQA heads repeated."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.triu(torch.full((5, 5), float("-inf")), 1)[None, None]
    out, probs = attention(None, q, k, v, mask, 0.5)
    h = lambda t: t.half().float()  # noqa: E731
    kk, vv = h(k).repeat_interleave(2, 1), h(v).repeat_interleave(2, 1)
    p = torch.softmax(h(q) @ kk.transpose(2, 3) * 0.5 + mask, -1)
    assert torch.equal(probs, p) and torch.equal(out, (h(p) @ vv).transpose(1, 2))
    assert torch.equal(probs[..., 0, 1:], torch.zeros(1, 4, 4))


def test_refusals_are_one_sentence(tmp_path):
    model, plan, tensors = _plan(spec="w4g128")
    export(str(fixture_dir(NAME)), plan, tmp_path / "c", format="compact", tensors=tensors, quiet=True)
    with pytest.raises(MoECompressError, match=r"^llama\.cpp cannot run this plan \(.*w4g128.*\)"):
        load(tmp_path / "c", dtype="float32", arithmetic="llama.cpp")
    with pytest.raises(MoECompressError, match="^Arithmetic 'ggml' is not known; use exact or llama.cpp.$"):
        load(tmp_path / "c", arithmetic="ggml")
    model, plan, tensors = _plan()
    export(str(fixture_dir(NAME)), plan, tmp_path / "q", format="compact", tensors=tensors, quiet=True)
    with pytest.raises(MoECompressError, match=r"emulated in float32: load with dtype='float32'\.$"):
        load(tmp_path / "q", dtype="bfloat16", arithmetic="llama.cpp")
    with pytest.raises(MoECompressError, match=r"needs a model that runs a plan in moecompress's runtime"):
        load(fixture_dir(NAME), arithmetic="llama.cpp")


def test_eval_reads_the_quality_llama_cpp_will_have(tmp_path, capsys):
    """`eval --arithmetic llama.cpp`: the compact export's KL under llama.cpp's arithmetic, recorded in the results;
    anything but an export directory is refused in one sentence."""
    from moecompress.api import evaluate
    from moecompress.testing import run_cli

    _, plan, tensors = _plan()
    export(str(fixture_dir(NAME)), plan, tmp_path / "c", format="compact", tensors=tensors, quiet=True)
    kw = dict(
        ppl="fixture-heldout", reference=str(fixture_dir(NAME)), max_tokens=256, window=128, dtype="float32"
    )
    kl = {}
    for arithmetic in ("exact", "llama.cpp"):
        res = evaluate(str(tmp_path / "c"), arithmetic=arithmetic, progress=False, **kw)
        assert res["settings"]["arithmetic"] == arithmetic
        kl[arithmetic] = res["arms"][0]["metrics"]["ppl:fixture-heldout"]["aggregate"]["kl"]
    # exact weights with 8-bit activations, against bf16-rounded weights: another KL, neither zero
    assert kl["llama.cpp"] != kl["exact"] and min(kl.values()) > 0
    code, _, err = run_cli(
        ["eval", str(fixture_dir(NAME)), "--ppl", "fixture-heldout", "--arithmetic", "llama.cpp"], capsys
    )
    assert (
        code == 2
        and "needs a model that runs a plan in moecompress's runtime" in err
        and "Traceback" not in err
    )
    code, _, err = run_cli(
        ["eval", str(tmp_path / "c"), "--ppl", "fixture-heldout", "--arithmetic", "ggml"], capsys
    )
    assert code == 2 and "Arithmetic 'ggml' is not known" in err


def test_shared_experts_are_rounded_and_their_gate_is_not():
    """Qwen2-MoE: the shared experts' BF16 linears see bf16 inputs; the shared-expert gate (F32 in a GGUF, as
    routers are) and the router see the exact hidden state."""
    from moecompress.testing import tiny_model

    model = tiny_model("qwen2_moe", dtype=torch.bfloat16, vocab_size=4096)
    plan = CompressionPlan.identity(model)  # a bf16 checkpoint: BF16 linears in its GGUF
    model = model.float()
    apply_plan(model, plan)
    emulate_llama_cpp(model)
    block = next(m for m in model.modules() if isinstance(m, CompressedMoEBlock))
    seen = {}
    for name in ("shared_expert.gate_proj", "shared_expert_gate"):
        block.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: seen.__setitem__(name, a[0])
        )
    with torch.no_grad():
        model(torch.randint(0, 4096, (1, 12)))
    shared, gate = seen["shared_expert.gate_proj"], seen["shared_expert_gate"]
    assert torch.equal(shared, shared.bfloat16().float()) and not torch.equal(gate, gate.bfloat16().float())
