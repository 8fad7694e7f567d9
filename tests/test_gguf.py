"""The `gguf` export format (issue 31): llama.cpp's file written with llama.cpp's own writer, read back with its reader.

Pure Python: `gguf.GGUFReader` and `gguf.quants.dequantize` check what llama.cpp would read. Loading the file
inside llama.cpp itself is not done here (docs/export.md, "GGUF")."""

import json
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from moecompress.api import export
from moecompress.errors import MoECompressError
from moecompress.export import gguf as G
from moecompress.export import gguf_tokenizer as T
from moecompress.export.formats import FORMATS, GGUFFormat
from moecompress.methods.quantize import QuantConfig, quantize_plan
from moecompress.models import MoEAdapter
from moecompress.plan import CompressionPlan, ModelInfo
from moecompress.quant.rtn import rtn
from moecompress.quant.spec import QuantSpec
from moecompress.testing import fixture_dir, run_cli, tiny_model

FIXTURES = {"olmoe-tiny": "olmoe", "qwen3-moe-tiny": "qwen3moe"}
_EXP = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


_MODELS = {}


def _model(name):
    if name not in _MODELS:
        from moecompress.models import load_model

        _MODELS[name] = load_model(str(fixture_dir(name)))
    return _MODELS[name]


def _half_keep(info):
    """A 50 % prune that keeps a different set in every layer (so the stacks' order is checked)."""
    return {
        li.layer: sorted({(3 * j + li.layer) % li.num_experts for j in range(li.num_experts // 2)})
        for li in info.layers
    }


def _read(path):
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    return reader, fields, {t.name: t for t in reader.tensors}


def _checkpoint(name):
    with safe_open(fixture_dir(name) / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Both fixtures, identity and a 50 % renorm prune, exported once."""
    out = {}
    for name in FIXTURES:
        info = ModelInfo.from_model(_model(name), checkpoint=fixture_dir(name))
        for kind, plan in (
            ("identity", CompressionPlan.identity(_model(name))),
            ("half", CompressionPlan.prune(info, _half_keep(info), gate="renorm")),
        ):
            d = tmp_path_factory.mktemp(f"{name}-{kind}")
            result = export(str(fixture_dir(name)), plan, d / "out", format="gguf", quiet=True)
            out[name, kind] = (plan, d / "out", result)
    return out


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("kind", ["identity", "half"])
def test_the_gguf_holds_the_checkpoint_in_llamacpp_names_layouts_and_types(written, name, kind):
    plan, d, result = written[name, kind]
    assert sorted(p.name for p in d.iterdir() if p.suffix in (".gguf", ".safetensors")) == ["model.gguf"]
    assert result.shards == ["model.gguf"] and result.weight_bytes == (d / "model.gguf").stat().st_size
    _, fields, tensors = _read(d / "model.gguf")
    arch = FIXTURES[name]
    config = _model(name).config
    kept = {lp.layer: [e for e, t in enumerate(lp.slots) if isinstance(t, int)] for lp in plan.layers}
    k = len(kept[0])
    assert k == (16 if kind == "identity" else 8)
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.block_count"] == 4 and fields[f"{arch}.context_length"] == 1024
    assert fields[f"{arch}.embedding_length"] == 192
    assert (
        fields[f"{arch}.expert_count"] == k
        and fields[f"{arch}.expert_used_count"] == config.num_experts_per_tok
    )
    assert fields[f"{arch}.attention.head_count"] == 6
    assert fields[f"{arch}.attention.head_count_kv"] == config.num_key_value_heads
    assert fields[f"{arch}.rope.freq_base"] == 10000.0
    width = 96 if arch == "olmoe" else 128
    assert (
        fields[f"{arch}.expert_feed_forward_length" if arch == "qwen3moe" else f"{arch}.feed_forward_length"]
        == width
    )
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert len(fields["tokenizer.ggml.tokens"]) == 4096 and fields["tokenizer.ggml.tokens"][:2] == [
        "<|endoftext|>",
        "<|pad|>",
    ]
    assert list(fields["tokenizer.ggml.token_type"][:3]) == [
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.NORMAL,
    ]
    assert fields["tokenizer.ggml.merges"][0] == "Ġ t" and len(fields["tokenizer.ggml.merges"]) == 3838
    assert (
        fields["tokenizer.ggml.bos_token_id"],
        fields["tokenizer.ggml.eos_token_id"],
        fields["tokenizer.ggml.padding_token_id"],
    ) == (0, 0, 1)
    assert fields["tokenizer.ggml.add_bos_token"] is False

    # every tensor: its name from gguf's own map, its shape, its type, and its values (experts in slot order)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), 4)
    expected = {}
    experts = {}
    for key, t in _checkpoint(name).items():
        m = _EXP.fullmatch(key)
        if m:
            experts[int(m[1]), int(m[2]), m[3]] = t
            continue
        gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if gname.endswith("ffn_gate_inp.weight"):
            t = t[kept[int(key.split(".")[2])]]
        expected[gname] = t
    for i in range(4):
        for part in ("gate", "up", "down"):
            expected[f"blk.{i}.ffn_{part}_exps.weight"] = torch.stack([experts[i, e, part] for e in kept[i]])
    assert set(tensors) == set(expected)
    for gname, t in expected.items():
        found = tensors[gname]
        f32 = t.ndim == 1 or "ffn_gate_inp" in gname
        assert found.tensor_type == (
            gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.BF16
        ), gname
        assert [int(x) for x in found.shape] == list(reversed(t.shape)), (
            gname
        )  # GGML's ne: PyTorch's reversed
        values = gguf.quants.dequantize(found.data, found.tensor_type)
        assert np.array_equal(values, t.float().numpy()), gname


@pytest.mark.parametrize("name", FIXTURES)
def test_file_bytes_against_the_plans(written, name, capsys):
    """The tensors' bytes against `CompressionPlan.logical_bytes`: within 1 % (norms and routers are F32 in GGUF); the
    metadata bytes the export reports are exactly where the file's tensor infos start, and the whole file is within
    1 % of the plan's bytes plus them."""
    for kind in ("identity", "half"):
        plan, d, result = written[name, kind]
        data = G.tensor_bytes(d / "model.gguf")
        logical = plan.logical_bytes().total
        reader = gguf.GGUFReader(d / "model.gguf")
        assert (
            result.container_bytes == min(t.field.offset for t in reader.tensors) > 100_000
        )  # the tokenizer
        assert abs((d / "model.gguf").stat().st_size / (logical + result.container_bytes) - 1) < 0.01
        with capsys.disabled():
            print(
                f"\n{name} {kind}: GGUF tensor bytes {data} / file {(d / 'model.gguf').stat().st_size} vs plan "
                f"{logical} ({100 * (data / logical - 1):+.2f} %)"
            )
        assert abs(data / logical - 1) < 0.01


@pytest.mark.parametrize("spec", ["w8g32", "w5g32", "w4g32"])
def test_q8_0_q5_0_and_q4_0_are_our_codes_exactly(spec):
    """Known answer: gguf's own dequantizer gives back exactly our dequantized weights (float32), including scales of
    every magnitude fp16 holds exactly; a scale below 2^-17 is counted as rounded."""
    spec = QuantSpec.parse(spec, algo="rtn")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 16, 128, generator=g)
    w = w * torch.logspace(-2, 1.5, 16).reshape(
        1, 16, 1
    )  # rows from 0.01 to ~30: scales down to ~2e-5 (8-bit)
    q = rtn(w.to(torch.bfloat16), spec)
    data, kind, inexact = G.encode_quantized(q)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block = {8: 34, 5: 22, 4: 18}[spec.bits]  # fp16 d + 32 codes of 8 bits, 4 + 16 bytes of 5, 16 bytes of 4
    assert kind == f"Q{spec.bits}_0" and data.shape == (3, 16, 4 * block)
    ours = q.dequantize(torch.float32).numpy()
    assert inexact == 0 and (q.scale.float() >= 2.0**-17).all()
    assert np.array_equal(gguf.quants.dequantize(data, qtype), ours)
    assert np.array_equal(gguf.quants.dequantize(data, qtype), q.dequantize(torch.float32).numpy())
    # gguf's quantizer, by contrast, picks its own codes (Q4_0: d = max/-8, Q5_0: max/-16), so its weights are not ours
    if spec.bits in (4, 5):
        assert not np.array_equal(
            gguf.quants.dequantize(gguf.quants.quantize(ours.reshape(-1, 128), qtype), qtype),
            ours.reshape(-1, 128),
        )
    tiny = rtn((w[:1, :1] * 1e-4).to(torch.bfloat16), spec)  # |w| ~ 3e-8: scales below fp16's exact range
    assert G.encode_quantized(tiny)[2] > 0


@pytest.mark.parametrize("spec", ["w8g32", "w5g32", "w4g32"])
def test_a_quantized_plan_writes_q_blocks_that_dequantize_to_the_runtimes_weights(tmp_path, spec):
    name = "olmoe-tiny"
    model = _model(name)
    adapter = MoEAdapter(model)
    info = ModelInfo.from_model(model, checkpoint=fixture_dir(name))
    plan = CompressionPlan.prune(info, _half_keep(info), gate="renorm")
    plan, tensors = quantize_plan(
        plan, {}, lambda l, e: adapter.layer(l).storage.read(e), QuantConfig(quant=spec, algo="rtn")
    )
    assert GGUFFormat.reason(plan) is None
    result = export(str(fixture_dir(name)), plan, tmp_path / "q", format="gguf", quiet=True, tensors=tensors)
    _, fields, found = _read(tmp_path / "q" / "model.gguf")
    qtype = getattr(gguf.GGMLQuantizationType, f"Q{spec[1]}_0")
    assert fields["general.file_type"] == getattr(gguf.LlamaFileType, f"MOSTLY_Q{spec[1]}_0")
    assert "moecompress.inexact_fp16_scales" not in fields  # every scale of the fixture is an fp16 value
    from moecompress.quant.tensor import QuantizedTensor

    for lp in plan.layers:
        sc = plan.scope(lp.scope)
        stored = [sc.stored[t] for t in lp.slots if isinstance(t, int)]
        for part in ("gate", "up", "down"):
            t = found[f"blk.{lp.layer}.ffn_{part}_exps.weight"]
            assert t.tensor_type == qtype
            ours = [
                QuantizedTensor.from_packed(
                    {
                        k.rsplit(".", 1)[1]: v
                        for k, v in tensors.items()
                        if k.startswith(f"{s.tensor}.{part}.")
                    },
                    plan.scope(lp.scope).stored[s.id].quant,
                )
                for s in stored
            ]
            theirs = gguf.quants.dequantize(t.data, qtype)
            assert np.array_equal(
                theirs, torch.stack([q.dequantize(torch.float32) for q in ours]).detach().numpy()
            )
            # what the runtime computes with (bf16, rounded once from the float32 product) is theirs rounded to bf16
            assert torch.equal(
                torch.from_numpy(theirs).to(torch.bfloat16),
                torch.stack([q.dequantize(torch.bfloat16) for q in ours]),
            )
    data, logical = G.tensor_bytes(tmp_path / "q" / "model.gguf"), plan.logical_bytes(tensors).total
    print(f"{spec}: GGUF tensor bytes {data} vs plan {logical} ({100 * (data / logical - 1):+.2f} %)")
    assert abs(data / logical - 1) < 0.01 and result.format == "gguf"


def _with_constant(plan):
    """`plan` with layer 0's first dropped slot computing a constant vector (a replacement operator)."""
    data = plan.model_dump(mode="json")
    slots = data["layers"][0]["slots"]
    slots[slots.index("drop")] = {"op": "constant", "tensor": "ops.c"}
    return CompressionPlan.model_validate(data)


def test_refusals_are_one_sentence_naming_a_format_that_can(tmp_path):
    info = ModelInfo.from_model(_model("olmoe-tiny"), checkpoint=fixture_dir("olmoe-tiny"))
    qinfo = ModelInfo.from_model(_model("qwen3-moe-tiny"), checkpoint=fixture_dir("qwen3-moe-tiny"))
    uneven = CompressionPlan.prune(
        info, {0: list(range(8)), 1: list(range(8)), 2: list(range(8)), 3: list(range(6))}
    )
    cases = {
        "different numbers of experts": uneven,
        "several slots to one stored expert": CompressionPlan.remap(
            info, {li.layer: [e // 2 * 2 for e in range(16)] for li in info.layers}
        ),
        "uses gate 'keep'": CompressionPlan.prune(
            info, _half_keep(info), gate="keep"
        ),  # OLMoE: not renormalised
        "uses gate 'replace'": CompressionPlan.prune(info, _half_keep(info), gate="replace"),
        "replacement operators": _with_constant(
            CompressionPlan.prune(info, _half_keep(info), gate="replace")
        ),
        "covers the olmoe, qwen3_moe, qwen2_moe, mixtral, granitemoe, deepseek_v2 and gpt_oss families, not "
        "deepseek_v3": CompressionPlan.identity(tiny_model("deepseek_v3")),
    }
    for why, plan in cases.items():
        refusal = GGUFFormat.refusal(plan)
        assert (
            why in refusal
            and "\n" not in refusal
            and re.search(r"export it with format='\w+' instead\.$", refusal)
        )
    # keep == renorm where the router renormalises (Qwen3-MoE): llama.cpp holds it
    assert GGUFFormat.reason(CompressionPlan.prune(qinfo, _half_keep(qinfo), gate="keep")) is None
    adapter = MoEAdapter(_model("olmoe-tiny"))
    for spec, why in (("w4g128", "w4g128 experts match no GGUF type exactly"), ("w8g32a", "only symmetric")):
        plan, _ = quantize_plan(
            CompressionPlan.identity(adapter),
            {},
            lambda l, e: adapter.layer(l).storage.read(e),
            QuantConfig(quant=spec, algo="rtn"),
        )
        assert why in GGUFFormat.refusal(plan)
    with pytest.raises(MoECompressError, match=r"^The 'gguf' format cannot express this plan \(.*compact"):
        export(str(fixture_dir("olmoe-tiny")), cases["uses gate 'replace'"], tmp_path / "x", format="gguf")
    assert not (tmp_path / "x").exists()
    with pytest.raises(MoECompressError, match="needs the model's tokenizer.json"):
        export(
            tiny_model("olmoe"), CompressionPlan.identity(tiny_model("olmoe")), tmp_path / "y", format="gguf"
        )
    clipped = tmp_path / "clipped"
    shutil.copytree(fixture_dir("olmoe-tiny"), clipped)
    cfg = json.loads((clipped / "config.json").read_text())
    (clipped / "config.json").write_text(json.dumps({**cfg, "clip_qkv": 8.0}))
    with pytest.raises(MoECompressError, match=r"clips its q/k/v activations \(clip_qkv\).*format='hf'"):
        export(str(clipped), CompressionPlan.identity(_model("olmoe-tiny")), tmp_path / "z", format="gguf")
    with pytest.raises(MoECompressError, match="does not load"):
        from moecompress.api import load

        load(_export_identity(tmp_path))


def _export_identity(tmp_path):
    d = tmp_path / "id"
    export(
        str(fixture_dir("olmoe-tiny")),
        CompressionPlan.identity(_model("olmoe-tiny")),
        d,
        format="gguf",
        quiet=True,
    )
    return d


def test_the_cli_writes_gguf_and_refuses_in_one_sentence(tmp_path, capsys):
    assert "gguf" in FORMATS
    base = ["compress", "fixture:olmoe-tiny", "--method", "quant", "--quant-algo", "rtn", "--format", "gguf"]
    code, out, err = run_cli([*base, "--quant", "w8g32", "--out", str(tmp_path / "ok")], capsys)
    assert code == 0, err
    assert "gguf checkpoint" in out
    found = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "ok" / "model.gguf").tensors}
    assert found["blk.3.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    code, out, err = run_cli([*base, "--quant", "w4g128", "--out", str(tmp_path / "no")], capsys)
    assert code == 2 and not (tmp_path / "no").exists()
    line = err.strip()
    assert (
        "\n" not in line and "The 'gguf' format cannot express this plan" in line and "use --format" in line
    )


@pytest.mark.parametrize(
    "family,arch", [("qwen2_moe", "qwen2moe"), ("mixtral", "llama"), ("granitemoe", "granitemoe")]
)
def test_qwen2_moe_and_mixtral_map_every_tensor(tmp_path, family, arch):
    """Shared experts (Qwen2-MoE) and llama's q/k rope permutation (Mixtral, Granite-MoE, whose multipliers are
    metadata): every tensor gets a llama.cpp name."""
    model = tiny_model(family, dtype=torch.bfloat16, vocab_size=4096, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture_dir("olmoe-tiny") / f, tmp_path / "m" / f)
    info = ModelInfo.from_model(model, checkpoint=tmp_path / "m")
    plan = CompressionPlan.prune(info, {li.layer: [0, 2, 5, 7] for li in info.layers})
    export(str(tmp_path / "m"), plan, tmp_path / "g", format="gguf", quiet=True)
    _, fields, found = _read(tmp_path / "g" / "model.gguf")
    assert fields["general.architecture"] == arch and fields[f"{arch}.expert_count"] == 4
    assert found["blk.1.ffn_gate_exps.weight"].shape.tolist() == [32, 16, 4]
    assert ("output.weight" in found) == (
        family == "qwen2_moe"
    )  # tied: written only where llama.cpp needs it
    if family == "qwen2_moe":
        assert {"blk.0.ffn_gate_shexp.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.attn_q.bias"} <= set(
            found
        )
        assert found["blk.0.ffn_gate_inp_shexp.weight"].shape.tolist() == [
            32
        ]  # {n_embd}, as llama.cpp reads it
        # transformers' GGUF loader reads it back to the hf export's logits, shared expert and tied head included
        from transformers import AutoConfig, AutoModelForCausalLM

        export(str(tmp_path / "m"), plan, tmp_path / "h", format="hf", quiet=True)
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "h", dtype=torch.float32)
        back = AutoModelForCausalLM.from_pretrained(
            tmp_path / "g",
            gguf_file=G.GGUF_FILE,
            dtype=torch.float32,
            config=AutoConfig.from_pretrained(tmp_path / "h"),
        )
        ids = torch.randint(2, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(ref(ids).logits, back(ids).logits)
    else:
        if family == "granitemoe":
            assert fields["granitemoe.logit_scale"] == model.config.logits_scaling
            assert fields["granitemoe.attention.scale"] == pytest.approx(model.config.attention_multiplier)
        for proj, heads in (("q", model.config.num_attention_heads), ("k", model.config.num_key_value_heads)):
            w = getattr(model.model.layers[0].self_attn, f"{proj}_proj").weight.detach().float()
            t = found[f"blk.0.attn_{proj}.weight"]
            got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            # rows permuted within each head to GGML's interleaved rope pairs, as llama.cpp's converter writes them
            d = w.shape[0] // heads
            order = torch.arange(w.shape[0]).reshape(heads, 2, d // 2).transpose(1, 2).reshape(-1)
            assert torch.equal(got, w[order]) and not torch.equal(got, w)


def test_the_pre_tokenizer_is_named_after_the_tokenizers_splitting_rule():
    """GPT-2's regex is llama.cpp's `gpt-2` (not `default`, which splits punctuation and digits differently); the
    Qwen2/Qwen3 Split regex is `qwen2`; Llama-3's (digits in runs of 1-3) is not named, so it is refused."""
    fixture = json.loads((fixture_dir("olmoe-tiny") / "tokenizer.json").read_text())
    assert T.pre_tokenizer(fixture) == "gpt-2"
    assert T.pre_tokenizer({**fixture, "normalizer": {"type": "NFC"}}) is None

    def split(regex):
        return {
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": False,
                        "use_regex": False,
                    },
                ],
            }
        }

    assert T.pre_tokenizer(split(T._QWEN2_SPLIT)) == "qwen2"
    assert T.pre_tokenizer(split(T._QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|"))) is None


def test_transformers_gguf_loader_reads_back_the_same_qwen3_moe(written, tmp_path):
    """A second reader: transformers' own GGUF loader (which un-stacks the experts by llama.cpp's names) gives the
    original's logits bit for bit from the identity GGUF, and the hf export's from the pruned one; the tokenizer it
    rebuilds from the GGUF tokenises like the original. Its GGUF config mapping ignores expert_feed_forward_length
    (it would build 768-wide experts), so the config is passed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name = "qwen3-moe-tiny"
    ids = torch.randint(2, 4096, (1, 48), generator=torch.Generator().manual_seed(0))
    for kind in ("identity", "half"):
        plan, d, _ = written[name, kind]
        ref_dir = fixture_dir(name)
        if kind == "half":
            ref_dir = tmp_path / "hf"
            export(str(fixture_dir(name)), plan, ref_dir, format="hf", quiet=True)
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
        back = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=G.GGUF_FILE, config=AutoConfig.from_pretrained(ref_dir), dtype=torch.float32
        )
        with torch.no_grad():
            assert torch.equal(ref(ids).logits, back(ids).logits), kind
    text = "The cat sat on the mat, 12345 times!! Don't   stop.\n\nNew line"
    plan, d, _ = written[name, "identity"]
    assert (
        AutoTokenizer.from_pretrained(d, gguf_file=G.GGUF_FILE)(text).input_ids
        == AutoTokenizer.from_pretrained(fixture_dir(name))(text).input_ids
    )


def test_quantized_non_expert_weights_are_q_blocks_too(tmp_path):
    """Issue 30's non-expert precisions on the same grids (attention w4g32; embeddings, lm_head and router w8g32):
    Q4_0 / Q8_0 from our codes, routers with the kept rows; any other grid is refused naming the weight."""
    from moecompress.methods.tensor_quant import quantize_tensors
    from moecompress.quant.tensor import QuantizedTensor
    from moecompress.runtime.tensor_quant import packed_of

    name = "qwen3-moe-tiny"
    model, adapter = _model(name), MoEAdapter(_model(name))
    info = ModelInfo.from_model(model, checkpoint=fixture_dir(name))
    plan = CompressionPlan.prune(info, _half_keep(info), gate="renorm")
    specs = {"attention": "w4g32", "embeddings": "w8g32", "lm_head": "w8g32", "router": "w8g32"}
    plan, tensors = quantize_tensors(
        plan, {}, adapter, {k: QuantSpec.parse(v, algo="rtn") for k, v in specs.items()}
    )
    plan, tensors = quantize_plan(
        plan, tensors, lambda l, e: adapter.layer(l).storage.read(e), QuantConfig(quant="w4g32", algo="rtn")
    )
    export(str(fixture_dir(name)), plan, tmp_path / "g", format="gguf", quiet=True, tensors=tensors)
    _, _, found = _read(tmp_path / "g" / "model.gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, 4)
    kept = {lp.layer: [e for e, t in enumerate(lp.slots) if isinstance(t, int)] for lp in plan.layers}
    for hf_name, tq in plan.tensor_quant.items():
        t = found[names.get_name(hf_name, try_suffixes=(".weight",))]
        assert t.tensor_type == getattr(gguf.GGMLQuantizationType, f"Q{tq.quant.bits}_0"), hf_name
        ours = (
            QuantizedTensor.from_packed(packed_of(tensors, hf_name), tq.quant)
            .dequantize(torch.float32)
            .detach()
        )
        if tq.kind == "router":
            ours = ours[kept[int(hf_name.split(".")[2])]]
        assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type), ours.numpy()), hf_name
    assert {tq.kind for tq in plan.tensor_quant.values()} == set(specs)
    data, logical = G.tensor_bytes(tmp_path / "g" / "model.gguf"), plan.logical_bytes(tensors).total
    assert abs(data / logical - 1) < 0.01, (data, logical)
    coarse, _ = quantize_tensors(
        CompressionPlan.identity(model), {}, adapter, {"attention": QuantSpec.parse("w4g128", algo="rtn")}
    )
    assert "attention weight 'model.layers.0.self_attn.k_proj.weight' is w4g128" in GGUFFormat.refusal(coarse)


# ----------------------------------------------------------------------------- DeepSeek-V2 and GPT-OSS (issue 31)
def _tiny_checkpoint(tmp_path, family, **overrides):
    """A tiny bf16 `family` checkpoint with the OLMoE fixture's tokenizer (4096 tokens) and 4 of its 8 experts kept
    (slots 0, 2, 5, 7, renormalised) in every MoE layer: (model, checkpoint dir, plan, on-disk tensors)."""
    model = tiny_model(family, dtype=torch.bfloat16, vocab_size=4096, **overrides)
    model.save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture_dir("olmoe-tiny") / f, tmp_path / "m" / f)
    info = ModelInfo.from_model(model, checkpoint=tmp_path / "m")
    plan = CompressionPlan.prune(info, {li.layer: [0, 2, 5, 7] for li in info.layers}, gate="renorm")
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:
        disk = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return model, tmp_path / "m", plan, disk


_KEPT = [0, 2, 5, 7]


def _check_tensors(found, expected):
    """Every tensor llama.cpp's converter would write, and no other: its name, GGML shape (PyTorch's reversed), type
    (F32 for 1-D tensors, biases and routers, else the checkpoint's BF16) and values."""
    assert set(found) == set(expected), set(found) ^ set(expected)
    for gname, t in expected.items():
        got = found[gname]
        f32 = t.ndim == 1 or gname.endswith(".bias") or ".ffn_gate_inp." in gname
        assert got.tensor_type == (
            gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.BF16
        ), gname
        assert [int(x) for x in got.shape] == list(reversed(t.shape)), gname
        assert np.array_equal(gguf.quants.dequantize(got.data, got.tensor_type), t.float().numpy()), gname


def _deepseek_v2_expected(disk, cfg):
    """The GGUF tensors llama.cpp's converter (DeepseekV2Model) makes of a DeepSeek-V2 checkpoint, 4 experts kept."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, 3)
    expected, experts, nope, v = {}, {}, cfg.qk_nope_head_dim, cfg.v_head_dim
    for key, t in disk.items():
        i = key.split(".")[2] if key.startswith("model.layers.") else None
        if m := _EXP.fullmatch(key):  # one tensor per expert on disk: stacked in slot order
            experts[int(m[1]), int(m[2]), m[3]] = t
        elif key.endswith("kv_b_proj.weight"):  # the converter's split: per head [nope | v] rows
            k_b, v_b = t.view(cfg.num_attention_heads, nope + v, -1).split([nope, v], dim=1)
            expected[f"blk.{i}.attn_k_b.weight"], expected[f"blk.{i}.attn_v_b.weight"] = (
                k_b.transpose(1, 2),
                v_b,
            )
        elif key.endswith("mlp.gate.weight"):
            expected[f"blk.{i}.ffn_gate_inp.weight"] = t[_KEPT]
        else:
            expected[names.get_name(key, try_suffixes=(".weight", ".bias"))] = t
    for i, part in {(l, p) for l, _, p in experts}:
        expected[f"blk.{i}.ffn_{part}_exps.weight"] = torch.stack([experts[i, e, part] for e in _KEPT])
    return expected


def test_deepseek_v2_is_written_as_llamacpps_converter_writes_mla(tmp_path):
    """DeepSeek-V2 (greedy routing, q_proj, one leading dense layer, one shared expert) as llama.cpp's deepseek2
    reads it: kv_b_proj split per head into attn_k_b (transposed) and attn_v_b with no attn_kv_b, the dense layer's
    ffn_gate/up/down, the shared expert's *_shexp, the router with the kept rows, and MLA's metadata."""
    model, ckpt, plan, disk = _tiny_checkpoint(tmp_path, "deepseek_v2", topk_method="greedy")
    assert GGUFFormat.reason(plan) is None
    export(str(ckpt), plan, tmp_path / "g", format="gguf", quiet=True)
    _, fields, found = _read(tmp_path / "g" / "model.gguf")
    a = "deepseek2"
    assert fields["general.architecture"] == a
    expected_fields = {
        "block_count": 3,
        "leading_dense_block_count": 1,
        "feed_forward_length": 48,
        "expert_feed_forward_length": 16,
        "expert_count": 4,
        "expert_used_count": 2,
        "expert_shared_count": 1,
        "expert_weights_norm": False,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SOFTMAX),
        "attention.head_count": 4,
        "attention.head_count_kv": 1,  # MLA's absorbed attention: MQA over the compressed KV
        "attention.key_length": 16 + 8,  # kv_lora_rank + qk_rope_head_dim
        "attention.value_length": 16,
        "attention.key_length_mla": 8 + 8,  # qk_nope_head_dim + qk_rope_head_dim
        "attention.value_length_mla": 8,
        "attention.kv_lora_rank": 16,
        "attention.q_lora_rank": 0,  # q_proj: attn_q
        "rope.dimension_count": 8,
        "vocab_size": 4096,
    }
    assert {k: fields[f"{a}.{k}"] for k in expected_fields} == expected_fields
    assert fields[f"{a}.expert_weights_scale"] == pytest.approx(model.config.routed_scaling_factor)
    _check_tensors(found, _deepseek_v2_expected(disk, model.config))
    # what llama.cpp's deepseek2 loader creates (src/llama-model.cpp), no more: it refuses unused tensors
    attention = {
        "attn_norm",
        "attn_q",
        "attn_kv_a_mqa",
        "attn_kv_a_norm",
        "attn_k_b",
        "attn_v_b",
        "attn_output",
    }
    moe = {"ffn_gate_inp", *(f"ffn_{p}_{s}" for p in ("gate", "up", "down") for s in ("exps", "shexp"))}
    for i, ffn in ((0, {"ffn_gate", "ffn_up", "ffn_down"}), (1, moe), (2, moe)):
        assert {n.split(".")[2] for n in found if n.startswith(f"blk.{i}.")} == attention | ffn | {"ffn_norm"}


def _gpt_oss_expected(disk):
    """The GGUF tensors llama.cpp's converter (GptOssModel, unquantized experts) makes of a GPT-OSS checkpoint."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, 2)
    expected = {}
    for key, t in disk.items():
        i = key.split(".")[2] if key.startswith("model.layers.") else None
        if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):  # gate/up interleaved
            t, kind = t[_KEPT], "bias" if key.endswith("_bias") else "weight"
            t = (
                t.transpose(-1, -2) if kind == "weight" else t
            )  # [E, H, 2I] -> [E, 2I, H], as the converter does
            expected[f"blk.{i}.ffn_gate_exps.{kind}"], expected[f"blk.{i}.ffn_up_exps.{kind}"] = (
                t[:, ::2],
                t[:, 1::2],
            )
        elif key.endswith("experts.down_proj"):
            expected[f"blk.{i}.ffn_down_exps.weight"] = t[_KEPT].transpose(-1, -2)
        elif key.endswith("experts.down_proj_bias"):
            expected[f"blk.{i}.ffn_down_exps.bias"] = t[_KEPT]
        elif key.endswith("self_attn.sinks"):
            expected[f"blk.{i}.attn_sinks.weight"] = t
        else:
            expected[names.get_name(key, try_suffixes=(".weight", ".bias"))] = (
                t[_KEPT] if ".router." in key else t
            )
    return expected


def _gpt_oss_from_gguf(model, found) -> None:
    """Set `model`'s experts and sinks from the GGUF's tensors, inverting llama.cpp's layout (gate/up re-interleaved,
    re-transposed)."""
    t = {n: torch.tensor(gguf.quants.dequantize(x.data, x.tensor_type)) for n, x in found.items()}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            g, u, d = (t[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
            gb, ub = t[f"blk.{i}.ffn_gate_exps.bias"], t[f"blk.{i}.ffn_up_exps.bias"]
            layer.mlp.experts.gate_up_proj.copy_(torch.stack([g, u], dim=2).flatten(1, 2).transpose(1, 2))
            layer.mlp.experts.gate_up_proj_bias.copy_(torch.stack([gb, ub], dim=2).flatten(1, 2))
            layer.mlp.experts.down_proj.copy_(d.transpose(1, 2))
            layer.mlp.experts.down_proj_bias.copy_(t[f"blk.{i}.ffn_down_exps.bias"])
            layer.self_attn.sinks.copy_(t[f"blk.{i}.attn_sinks.weight"])


def test_gpt_oss_experts_are_unfused_with_their_biases_and_transformers_reads_the_rest(tmp_path):
    """GPT-OSS's fused, transposed, interleaved experts as llama.cpp's converter writes them (ffn_*_exps and their
    *_exps.bias), sinks, router bias and sliding window; then transformers' own GGUF loader for gpt_oss, which reads
    every tensor but the experts and sinks (it looks for ``ffn_*_projs``, not llama.cpp's names): what it reads
    equals the hf export, and with the experts and sinks taken from the GGUF by llama.cpp's layout the logits equal
    the hf export's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, ckpt, plan, disk = _tiny_checkpoint(tmp_path, "gpt_oss")
    assert GGUFFormat.reason(plan) is None
    export(str(ckpt), plan, tmp_path / "g", format="gguf", quiet=True)
    _, fields, found = _read(tmp_path / "g" / "model.gguf")
    a = "gpt-oss"
    assert fields["general.architecture"] == a
    assert fields[f"{a}.attention.sliding_window"] == 16 and fields[f"{a}.expert_feed_forward_length"] == 16
    assert (fields[f"{a}.expert_count"], fields[f"{a}.expert_used_count"]) == (4, 2)
    assert (fields[f"{a}.attention.head_count_kv"], fields[f"{a}.attention.key_length"]) == (2, 8)
    _check_tensors(found, _gpt_oss_expected(disk))

    export(str(ckpt), plan, tmp_path / "h", format="hf", quiet=True)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "h", dtype=torch.float32)
    back, loading = AutoModelForCausalLM.from_pretrained(
        tmp_path / "g",
        gguf_file=G.GGUF_FILE,
        config=AutoConfig.from_pretrained(tmp_path / "h"),
        dtype=torch.float32,
        output_loading_info=True,
    )
    missing = set(loading["missing_keys"])
    parts = ["self_attn.sinks", *(f"mlp.experts.{p}" for p in ("gate_up_proj", "down_proj"))]
    parts += [f"{p}_bias" for p in parts[1:]]
    assert missing <= {f"model.layers.{i}.{p}" for i in range(2) for p in parts}, missing
    theirs = back.state_dict()
    for k, t in ref.state_dict().items():
        if k not in missing:
            assert torch.equal(theirs[k], t), k
    _gpt_oss_from_gguf(back, found)
    ids = torch.randint(2, 4096, (1, 48), generator=torch.Generator().manual_seed(0))  # past the window (16)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)


def test_gpt_oss_q8_0_experts_keep_their_float_biases(tmp_path):
    """Quantized GPT-OSS experts: Q8_0 weights from our codes, their biases F32 from the plan's tensors."""
    model, ckpt, plan, _ = _tiny_checkpoint(tmp_path, "gpt_oss", intermediate_size=32)
    adapter = MoEAdapter(model)
    plan, tensors = quantize_plan(
        plan, {}, lambda l, e: adapter.layer(l).storage.read(e), QuantConfig(quant="w8g32", algo="rtn")
    )
    export(str(ckpt), plan, tmp_path / "q", format="gguf", quiet=True, tensors=tensors)
    _, _, found = _read(tmp_path / "q" / "model.gguf")
    for lp in plan.layers:
        sc = plan.scope(lp.scope)
        stored = [sc.stored[t] for t in lp.slots if isinstance(t, int)]
        for part in ("gate", "up", "down"):
            w, b = (
                found[f"blk.{lp.layer}.ffn_{part}_exps.weight"],
                found[f"blk.{lp.layer}.ffn_{part}_exps.bias"],
            )
            assert (w.tensor_type, b.tensor_type) == (
                gguf.GGMLQuantizationType.Q8_0,
                gguf.GGMLQuantizationType.F32,
            )
            bias = torch.stack([tensors[f"{s.tensor}.{part}_bias"] for s in stored]).float().numpy()
            assert np.array_equal(gguf.quants.dequantize(b.data, b.tensor_type), bias)
            read = [adapter.layer(lp.layer).storage.read(e) for e in _KEPT]
            assert np.array_equal(
                bias, torch.stack([getattr(r, f"{part}_bias") for r in read]).detach().float().numpy()
            )


def test_deepseek_v2_and_gpt_oss_refusals_name_what_llamacpp_lacks(tmp_path):
    """DeepSeek-V2's group-limited routing (groups scored by their max) and a quantized kv_b_proj (stored transposed
    as attn_k_b); GPT-OSS configs whose sliding pattern or SwiGLU clamp llama.cpp hard-codes otherwise."""
    from moecompress.methods.tensor_quant import quantize_tensors

    grouped = CompressionPlan.identity(
        tiny_model("deepseek_v2")
    )  # the tiny config routes group_limited_greedy
    assert "group-limited router (4 groups scored by their max)" in GGUFFormat.refusal(grouped)
    model = tiny_model("deepseek_v2", topk_method="greedy", kv_lora_rank=32)
    plan, _ = quantize_tensors(
        CompressionPlan.identity(model),
        {},
        MoEAdapter(model),
        {"attention": QuantSpec.parse("w8g32", algo="rtn")},
    )
    assert "'model.layers.0.self_attn.kv_b_proj.weight' is quantized" in GGUFFormat.refusal(plan)
    for overrides, why in (
        ({"layer_types": ["full_attention", "sliding_attention"]}, "not the even ones"),
        ({"swiglu_limit": 5.0}, "clamps its SwiGLU at 5.0"),
    ):
        model, ckpt, plan, _ = _tiny_checkpoint(tmp_path / why, "gpt_oss", **overrides)
        with pytest.raises(MoECompressError, match=f"{why}.*format='hf'"):
            export(str(ckpt), plan, tmp_path / why / "g", format="gguf", quiet=True)


def test_a_gguf_architecture_is_one_class_and_one_register_call(tmp_path, monkeypatch):
    """docs/architecture.md's worked example: an architecture with its own hyperparameter and config refusal is an
    `Arch` subclass and a `register_arch` line in export/gguf_arches.py; the writer calls its hooks, nothing else
    changes. Registered here at run time over OLMoE's entry."""
    from dataclasses import dataclass

    from moecompress.export import gguf_arches

    @dataclass(frozen=True)
    class Tagged(gguf_arches.Arch):
        def check_config(self, cfg) -> None:
            if cfg.num_hidden_layers > 64:
                raise MoECompressError("This model is too deep for the tagged architecture.")

        def add_family_hparams(self, w, cfg, leading_dense: int) -> None:
            w.add_uint32("olmoe.tagged_layers", cfg.num_hidden_layers)

    monkeypatch.setitem(gguf_arches.ARCHES, "olmoe", gguf_arches.ARCHES["olmoe"])  # restored after the test
    base = gguf_arches.ARCHES["olmoe"]
    gguf_arches.register_arch(
        "olmoe", Tagged(base.arch, base.renormalises, base.output_required, base.expert_width_key)
    )
    reader = gguf.GGUFReader(_export_identity(tmp_path) / "model.gguf")
    field = reader.fields["olmoe.tagged_layers"]
    assert int(field.parts[field.data[0]][0]) == _model("olmoe-tiny").config.num_hidden_layers
