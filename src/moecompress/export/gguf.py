"""GGUF, llama.cpp's file format, written with llama.cpp's own writer (the `gguf` package): the `gguf` export format.

One ``model.gguf`` per export (docs/export.md). Tensor names come from gguf's own tensor-name map for the
architecture (`gguf.get_tensor_name_map`), metadata keys from its writer, types from its constants:

* each MoE layer's kept experts (in slot order, as a sliced `hf` checkpoint keeps them) stacked into
  ``blk.N.ffn_{gate,up,down}_exps`` ([E, I, H], [E, I, H], [E, H, I]: GGML's ne reversed), the router
  ``blk.N.ffn_gate_inp`` with the kept rows only, ``expert_count`` = the kept count;
* float weights in the checkpoint's own dtype (BF16, F16 or F32: nothing is rounded), 1-D tensors, norms, biases
  and routers in F32, as llama.cpp's converter writes them;
* stored experts and non-expert weights (``plan.tensor_quant``) quantized symmetric 8- or 4-bit with group 32
  (``w8g32`` / ``w4g32``) as ``Q8_0`` / ``Q4_0``, written from our codes and scales (not quantized again);
  ``Q8_0``/``Q4_0`` hold each group's scale in fp16;
* the tokenizer as llama.cpp's byte-level BPE (``gpt2``: tokens, token types, merges, special ids) with the
  pre-tokenizer named after the tokenizer's own splitting rule;
* ``output.weight`` written from the embedding when the model ties them and llama.cpp's architecture has no
  fallback (OLMoE, Qwen2-MoE, GPT-OSS); Qwen3-MoE, Mixtral (llama), Granite-MoE and DeepSeek-V2 fall back to
  ``token_embd`` themselves;
* DeepSeek-V2 (``deepseek2``: MLA split into ``attn_k_b`` / ``attn_v_b``, leading dense layers, shared experts)
  and GPT-OSS (``gpt-oss``: un-fused experts with ``*_exps.bias``, sinks, sliding window): `gguf_arches`.

Which plans a GGUF holds is `reason`; what llama.cpp computes for each architecture is `ARCHES` (`gguf_arches`).
Verified (tests/test_gguf.py) by gguf's own reader and dequantizer and by transformers' GGUF loader (Qwen3-MoE,
Qwen2-MoE; GPT-OSS but its experts and sinks, which that loader does not read); OLMoE and Qwen3-MoE files were also
run inside llama.cpp (docs/export.md). DeepSeek-V2 and GPT-OSS files were not run inside llama.cpp here: they are
checked against llama.cpp's converter and loader sources only.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import MoECompressError
from ..plan import CompressionPlan
from ..quant.spec import QuantSpec
from ..quant.tensor import QuantizedTensor
from .gguf_arches import ARCHES, SCALES, Arch, dense_reason, full_name
from .gguf_tokenizer import add_tokenizer

GGUF_FILE = "model.gguf"


BLOCK = 32  # Q8_0 / Q5_0 / Q4_0: 32 weights a block, one fp16 scale
EXACT_BITS = (8, 5, 4)  # the symmetric group-32 widths a GGUF type holds exactly


def exact_type(spec: QuantSpec | None) -> str | None:
    """The GGUF type whose grid is exactly `spec`'s (``Q8_0`` / ``Q5_0`` / ``Q4_0``), ``"float"`` for unquantized, or
    None."""
    if spec is None:
        return "float"
    if spec.symmetric and spec.group_size == BLOCK and spec.bits in EXACT_BITS:
        return f"Q{spec.bits}_0"
    return None


def reason(plan: CompressionPlan) -> str | None:
    """Why llama.cpp cannot run `plan` from a GGUF (a clause), or None when it can."""
    info = plan.model
    arch = ARCHES.get(info.model_type)
    if arch is None:
        *first, last = ARCHES
        return f"this GGUF writer covers the {', '.join(first)} and {last} families, not {info.model_type}"
    if plan.has_packed():
        return "it stores packed element-wise merges"
    for name, tq in plan.tensor_quant.items():
        if exact_type(tq.quant) is None:
            return (
                f"its {tq.kind} weight '{name}' is {tq.quant.name()}, which matches no GGUF type exactly: only "
                "symmetric w8g32, w5g32 and w4g32 do, as Q8_0, Q5_0 and Q4_0"
            )
        if tq.shape[1] % BLOCK:
            return f"its {tq.kind} weight '{name}' is {tq.shape[1]} wide, not a multiple of the {BLOCK}-weight block"
        if (why := arch.tensor_reason(name)) is not None:
            return why
    if (why := dense_reason(plan, arch)) is not None:
        return why
    counts, widths = set(), set()
    for lp in sorted(plan.layers, key=lambda x: x.layer):
        why = _layer_reason(plan, lp, arch)
        if why is not None:
            return why
        counts.add(len(lp.stored_ids()))
        widths.add(info.layer(lp.layer).intermediate_size)
    if len(counts) != 1:
        return f"its layers keep different numbers of experts ({sorted(counts)}), and llama.cpp has one expert count"
    if len(widths) != 1:
        return "its layers have experts of different widths"
    return None


def _layer_reason(plan: CompressionPlan, lp, arch: Arch) -> str | None:
    """Why llama.cpp's `arch` cannot run MoE layer `lp` of `plan` (a clause), or None when it can."""
    info = plan.model
    sc, li = plan.scope(lp.scope), info.layer(lp.layer)
    if li.keep_equals_renorm != arch.renormalises:
        return (
            f"layer {lp.layer}'s router {'does not renormalise' if arch.renormalises else 'renormalises'} "
            f"its top-k weights and llama.cpp's {arch.arch.lower()} always "
            f"{'does' if arch.renormalises else 'does not'}"
        )
    if sc.layers != [lp.layer]:
        return f"layer {lp.layer} shares the cross-layer scope '{sc.id}'"
    if lp.operators():
        return f"layer {lp.layer} has replacement operators"
    if not (lp.gate == "renorm" or (lp.gate == "keep" and li.keep_equals_renorm) or not lp.dropped()):
        return f"layer {lp.layer} uses gate '{lp.gate}', which llama.cpp's router cannot express"
    ids = lp.stored_ids()
    if len(set(ids)) != len(ids):
        return f"layer {lp.layer} maps several slots to one stored expert"
    if li.n_group > 1:
        return (
            f"layer {lp.layer} has a group-limited router ({li.n_group} groups scored by their {li.group_score}), "
            f"which llama.cpp's {arch.arch.lower()} does not compute"
        )
    if info.expert_bias and not arch.expert_bias:
        return f"layer {lp.layer}'s experts carry biases, which llama.cpp's {arch.arch.lower()} does not read"
    stored = [sc.stored[s] for s in ids]
    if any(plan.stored_width(sc, s) != li.intermediate_size for s in stored):
        return f"layer {lp.layer} stores an expert of a different width"
    specs = {s.quant for s in stored}
    if len(specs) > 1:
        return f"layer {lp.layer}'s experts have different precisions, and one GGUF tensor holds them all"
    (spec,) = specs
    if exact_type(spec) is None:
        return (
            f"its {spec.name()} experts match no GGUF type exactly: only symmetric w8g32, w5g32 and w4g32 do, "
            "as Q8_0, Q5_0 and Q4_0, and llama.cpp's K-quants are not written yet"
        )
    if spec is not None and (info.hidden_size % BLOCK or li.intermediate_size % BLOCK):
        return f"layer {lp.layer}'s dimensions are not multiples of {BLOCK}, the Q8_0/Q5_0/Q4_0 block"
    if len(ids) < li.top_k:
        return f"layer {lp.layer} keeps fewer experts ({len(ids)}) than it routes to ({li.top_k})"
    return None


# ----------------------------------------------------------------------------- tensor encodings
def fp16_scales(scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Our bf16 group scales as the fp16 that Q8_0/Q5_0/Q4_0 store, and how many of them fp16 does not hold exactly.

    bf16 has 8 significant bits, fp16 11: every bf16 scale from 2^-17 (fp16's subnormals still carry the 8 bits)
    up to 65504 is exact. A smaller one (a group whose largest |w| is below about 1e-3 at 8 bits) is rounded."""
    half = scale.to(torch.float16)
    return half, int((half.float() != scale.float()).sum())


def encode_quantized(q: QuantizedTensor) -> tuple[np.ndarray, str, int]:
    """Our codes and scales of [..., out, in] as GGUF blocks: (uint8 [..., out, in/32 · block bytes], type name,
    inexact scales), in ggml's block layouts (`ggml-common.h`), every block starting with its fp16 scale d:

    * Q8_0: 32 int8 codes, w = d·q;
    * Q4_0: 16 bytes, code j + 8 in the low nibble of byte j and code j + 16 (+ 8) in its high nibble,
      w = d·(nibble − 8);
    * Q5_0: a little-endian uint32 qh whose bit j is bit 4 of element j's value code + 16, then Q4_0's 16 bytes
      holding the values' low four bits, w = d·(value − 16)."""
    kind = exact_type(q.spec)
    if kind not in ("Q8_0", "Q5_0", "Q4_0"):
        raise MoECompressError(f"No GGUF type holds {q.spec.name()} codes exactly.")
    codes = q.codes.detach().to(torch.int8)
    *lead, out, n = codes.shape
    groups = n // BLOCK
    half, inexact = fp16_scales(q.scale.detach())
    d = half.contiguous().view(torch.uint8).reshape(*lead, out, groups, 2)
    blocks = codes.reshape(*lead, out, groups, BLOCK)
    if kind == "Q8_0":
        parts = [blocks.view(torch.uint8)]
    else:
        offset = 1 << (q.spec.bits - 1)
        v = (blocks.to(torch.int32) + offset).to(torch.uint8)
        low = v & 0x0F
        parts = [low[..., : BLOCK // 2] | (low[..., BLOCK // 2 :] << 4)]
        if kind == "Q5_0":
            # qh: element j's fifth bit at bit j, stored little-endian
            qh = ((v >> 4).to(torch.int64) << torch.arange(BLOCK)).sum(-1, keepdim=True)
            parts.insert(0, torch.cat([(qh >> (8 * k)) & 0xFF for k in range(4)], dim=-1).to(torch.uint8))
    data = torch.cat([d, *parts], dim=-1).reshape(*lead, out, -1)
    return data.numpy(), kind, inexact


# ----------------------------------------------------------------------------- the file
def _rows(t, fn):
    """`fn` (a function of a tensor's rows) applied to a float tensor, or to a quantized one's codes and scales."""
    return (
        QuantizedTensor(fn(t.codes), fn(t.scale), None, t.spec) if isinstance(t, QuantizedTensor) else fn(t)
    )


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> GGML's interleaved rope pairs (llama.cpp's converter, LlamaModel.permute)."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


class GGUFFile:
    """One plan's GGUF, built while the export streams: metadata and tokenizer first, tensors as they come
    (spooled to a temporary file by gguf's writer), the file itself in `write`."""

    def __init__(self, plan: CompressionPlan, tensors, source):
        import gguf

        self.plan, self.tensors, self.config = plan, tensors or {}, source.config
        self.arch = ARCHES[plan.model.model_type]
        arch = getattr(gguf.MODEL_ARCH, self.arch.arch)
        cfg, info = self.config, plan.model
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        self._check_config(rope)
        self.names = gguf.get_tensor_name_map(arch, info.num_hidden_layers)
        self.kept = {
            lp.layer: [e for e, t in enumerate(lp.slots) if isinstance(t, int)] for lp in plan.layers
        }
        self.gate_inp = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].split(".")[-1]
        self.exps = {
            part: gguf.TENSOR_NAMES[t]
            for part, t in (
                ("gate", gguf.MODEL_TENSOR.FFN_GATE_EXP),
                ("up", gguf.MODEL_TENSOR.FFN_UP_EXP),
                ("down", gguf.MODEL_TENSOR.FFN_DOWN_EXP),
            )
        }
        self.inexact = 0
        self.written: set[str] = set()

        w = self.w = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch], use_temp_file=True)
        self._add_hparams(w, rope)
        w.add_file_type(self._file_type())
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(w, source.source_dir, cfg.vocab_size)

    def _check_config(self, rope: dict) -> None:
        """Refuse a model config this writer does not express: a rope type but the default, clipped q/k/v."""
        cfg = self.config
        if rope.get("rope_type", "default") != "default":
            raise MoECompressError(
                f"This model's rope type '{rope.get('rope_type')}' is not written by this GGUF "
                "writer; export with format='hf' and convert with llama.cpp's convert_hf_to_gguf.py."
            )
        if getattr(cfg, "clip_qkv", None) is not None:  # llama.cpp's olmoe graph never clamps q/k/v
            raise MoECompressError(
                "This model clips its q/k/v activations (clip_qkv), which llama.cpp's "
                f"{self.arch.arch.lower()} does not; export it with format='hf' instead."
            )
        self.arch.check_config(cfg)

    def _add_hparams(self, w, rope: dict) -> None:
        """Write the model's hyperparameters (sizes, heads, rope, norm epsilon, scales, expert counts) to `w`."""
        cfg, info = self.config, self.plan.model
        li = info.layers[0]
        width, k = li.intermediate_size, len(next(iter(self.kept.values())))
        w.add_block_count(info.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(info.hidden_size)
        if self.arch.expert_width_key:
            w.add_feed_forward_length(cfg.intermediate_size)
            w.add_expert_feed_forward_length(width)
        else:
            w.add_feed_forward_length(width)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        self.arch.add_attention_hparams(w, cfg)  # KV heads, key/value lengths (DeepSeek-V2's MLA)
        if "rope_theta" in rope:
            w.add_rope_freq_base(float(rope["rope_theta"]))
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        for key, add in SCALES:
            if getattr(cfg, key, None) is not None:
                getattr(w, add)(float(getattr(cfg, key)))
        w.add_expert_count(k)
        w.add_expert_used_count(li.top_k)
        self.arch.add_family_hparams(w, cfg, info.num_hidden_layers - len(self.plan.layers))

    def _file_type(self):
        """The GGUF file type: the experts' type when they all have one, else the model's float dtype."""
        import gguf

        specs = self.plan.quant_specs()  # the file type names the experts' type when they all have one
        kind = exact_type(next(iter(specs))) if len(specs) == 1 else None
        files = {k: getattr(gguf.LlamaFileType, f"MOSTLY_{k}") for k in ("Q8_0", "Q5_0", "Q4_0")}
        return files.get(
            kind,
            {"bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "float16": gguf.LlamaFileType.MOSTLY_F16}.get(
                self.plan.model.dtype, gguf.LlamaFileType.ALL_F32
            ),
        )

    # ---- tensors
    def _put(self, name: str, t: torch.Tensor | QuantizedTensor) -> None:
        """Write one tensor: quantized ones as their Q8_0/Q5_0/Q4_0 blocks; float ones F32 for 1-D, norms, biases and
        routers (llama.cpp's converter), else as stored."""
        import gguf

        if isinstance(t, QuantizedTensor):
            data, kind, inexact = encode_quantized(t)
            self.inexact += inexact
            self.w.add_tensor(name, data, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
            self.written.add(name)
            return
        t = t.detach().cpu().contiguous()
        kind = name.split(".")[-2]
        if (
            t.ndim <= 1
            or kind.endswith("_norm")
            or not name.endswith(".weight")
            or kind.startswith(self.gate_inp)
        ):
            self.w.add_tensor(name, t.float().numpy())
        elif t.dtype == torch.bfloat16:
            self.w.add_tensor(name, t.view(torch.uint8).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif t.dtype == torch.float16:
            self.w.add_tensor(name, t.numpy())
        else:
            self.w.add_tensor(name, t.float().numpy())
        self.written.add(name)

    def add_all(self, state: dict, layer: int | None = None, outside: bool = False) -> None:
        """Non-expert tensors under their native names (`layer`: a MoE layer's, whose router keeps the kept rows
        only; `outside`: the tensors outside the decoder layers, which come last)."""
        from ..runtime.tensor_quant import packed_of

        embedding = None
        for name, t in sorted(self.arch.native_state(state, self.config).items()):
            gname = self.names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise MoECompressError(
                    f"Tensor '{name}' has no llama.cpp name for {self.arch.arch.lower()}; export "
                    "with format='hf' and convert with llama.cpp's convert_hf_to_gguf.py."
                )
            if (
                name in self.plan.tensor_quant
            ):  # a quantized non-expert weight: its codes, rows moved alike below
                t = QuantizedTensor.from_packed(
                    packed_of(self.tensors, name), self.plan.tensor_quant[name].quant
                )
            if layer is not None and gname.split(".")[-2] == self.gate_inp:
                t = _rows(t, lambda x: x.index_select(0, torch.tensor(self.kept[layer], device=x.device)))
            if gname.split(".")[-2] == self.gate_inp + "_shexp" and torch.is_tensor(t):
                t = t.reshape(-1)  # Qwen2-MoE's [1, H] gate: llama.cpp declares it {H}
            if self.arch.rope_permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                t = _rows(t, lambda x: _permute(x, self.config.num_attention_heads))
            elif self.arch.rope_permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                t = _rows(t, lambda x: _permute(x, self.config.num_key_value_heads))
            gname = full_name(gname)  # GPT-OSS's sinks: attn_sinks.weight
            self._put(gname, t)
            if gname == "token_embd.weight":
                embedding = t
        if outside and self.arch.output_required and "output.weight" not in self.written:
            self._put("output.weight", embedding)  # a tied head, which this architecture wants written out

    def experts(self, layer: int, stored: list, weights: list, dtype: torch.dtype) -> None:
        """Layer `layer`'s kept experts (slot order) stacked into ffn_{gate,up,down}_exps.

        stored: the plan's StoredExpert of each kept slot; weights: their ExpertWeights (None when quantized)."""
        spec = stored[0].quant
        for part in ("gate", "up", "down"):
            name = self.exps[part].format(bid=layer) + ".weight"
            # GPT-OSS: ffn_*_exps.bias [E, I] / [E, H] in F32 (quantized experts keep their float biases)
            if self.arch.expert_bias:
                self._put(
                    self.exps[part].format(bid=layer) + ".bias",
                    torch.stack(
                        [getattr(w, f"{part}_bias") for w in weights]
                        if spec is None
                        else [self.tensors[f"{s.tensor}.{part}_bias"] for s in stored]
                    ),
                )
            if spec is None:
                self._put(name, torch.stack([getattr(w, part).to(dtype) for w in weights]))
                continue
            qs = [
                QuantizedTensor.from_packed(
                    {
                        k.rsplit(".", 1)[1]: self.tensors[k]  # keys first: a spilled store reads per lookup
                        for k in self.tensors
                        if k.startswith(f"{s.tensor}.{part}.")
                    },
                    spec,
                )
                for s in stored
            ]
            self._put(
                name,
                QuantizedTensor(
                    torch.stack([x.codes for x in qs]), torch.stack([x.scale for x in qs]), None, spec
                ),
            )

    def metadata_bytes(self) -> int:
        """Bytes the file holds before its tensor infos (header, hyperparameters, tokenizer), known before any tensor
        is added: measured by writing the same key-values through a second writer of gguf's own."""
        import gguf

        probe = gguf.GGUFWriter(None, self.arch.arch.lower())
        probe.kv_data = [dict(d) for d in self.w.kv_data]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / GGUF_FILE
            probe.write_header_to_file(path)
            probe.write_kv_data_to_file()
            probe.close()
            return path.stat().st_size

    def write(self, directory: Path) -> str:
        """The file itself (header, metadata, tensor infos, then the spooled tensors); returns its name."""
        if self.inexact:
            self.w.add_uint64("moecompress.inexact_fp16_scales", self.inexact)
            warnings.warn(
                f"{self.inexact} group scales lie below fp16's exact range (2^-17) and were rounded in the "
                "GGUF's Q8_0/Q5_0/Q4_0 blocks.",
                stacklevel=2,
            )
        path = Path(directory) / GGUF_FILE
        self.w.write_header_to_file(path)
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return GGUF_FILE


def tensor_bytes(path: str | Path) -> int:
    """Bytes of every tensor's data in a GGUF file, without header or padding, as our bounded header reader
    (`gguf_guard`, which agrees with gguf's reader on a valid file) finds them."""
    from .gguf_guard import read_header

    return read_header(path).tensor_bytes
