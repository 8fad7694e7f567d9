"""Survey every MoE causal-LM class of the installed transformers against `MoEAdapter`.

For each model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose modeling file defines routed
experts, a subprocess (1 thread, timeout) builds a TINY random model from the type's default
config with common fields shrunk, then checks that

1. `MoEAdapter(model)` finds MoE layers (as many as the model has expert modules);
2. the router is declared or fallback-verified (reproduces the HF router on random tokens);
3. ``adapter.moe_forward(i, h)`` equals the HF block output (float32, atol 1e-5) on every MoE layer;
4. an expert write/read round trip is exact and changes the HF block exactly as predicted.

Declared families are additionally run through the fallback alone (their FamilySpec hidden),
which shows whether the fallback would have handled them.

Usage::

    OMP_WAIT_POLICY=PASSIVE python scripts/survey_models.py            # survey + write docs/models.md
    OMP_WAIT_POLICY=PASSIVE python scripts/survey_models.py --only mixtral,dbrx
    python scripts/survey_models.py --render-only                      # docs from build/survey.json

Results: build/survey.json (gitignored) and docs/models.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON_OUT = ROOT / "build" / "survey.json"
DOC_OUT = ROOT / "docs" / "models.md"

STATUSES = (
    "supported-declared",
    "supported-fallback-verified",
    "detected-but-router-unverifiable",
    "detected-but-block-mismatch",
    "structure-not-recognised",
    "could-not-build-tiny-config",
)

_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k", "top_k", "top_k_experts")
_EXPERTS_CLASS = re.compile(r"^class (\w+Experts)\(", re.MULTILINE)

# ----------------------------------------------------------------------------- enumeration


def _modeling_sources(model_type: str) -> tuple[str, str]:
    """(modeling source, configuration source) of a model type's transformers package."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    folder = Path(transformers.__file__).parent / "models" / model_type_to_module_name(model_type)
    if not folder.is_dir():
        return "", ""
    def read(prefix: str) -> str:
        return "".join(p.read_text() for p in sorted(folder.glob(f"{prefix}*.py")))

    return read("modeling_"), read("configuration_")


def _is_moe(model_type: str) -> tuple[bool, str]:
    modeling, configuration = _modeling_sources(model_type)
    experts = _EXPERTS_CLASS.findall(modeling)
    if experts:
        return True, ", ".join(sorted(set(experts)))
    fields = [f for f in _EXPERT_COUNT if re.search(rf"^\s+{f}\s*[:=]", configuration, re.MULTILINE)]
    if fields:
        return True, "config field " + ", ".join(fields)
    return False, ""


def enumerate_types() -> tuple[dict[str, dict], dict[str, dict]]:
    """(causal-LM MoE types to survey, MoE types that live only in other mappings: out of scope)."""
    from transformers.models.auto import modeling_auto as ma

    causal = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    survey = {}
    for mt, cls in causal.items():
        moe, why = _is_moe(mt)
        if moe:
            survey[mt] = {"class": cls, "evidence": why}
    out_of_scope: dict[str, dict] = {}
    for name in sorted(n for n in dir(ma) if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")):
        if name in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"):
            continue
        for mt, cls in getattr(ma, name).items():
            if mt in causal or mt in out_of_scope:
                continue
            moe, why = _is_moe(mt)
            if moe:
                task = name[len("MODEL_FOR_"):-len("_MAPPING_NAMES")].lower() if name.startswith("MODEL_FOR_") else name
                out_of_scope[mt] = {"class": cls if isinstance(cls, str) else cls[0], "mapping": task,
                                    "evidence": why}
    return survey, out_of_scope


# ----------------------------------------------------------------------------- tiny configs

N_LAYERS = 4
_QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4)
_GEMMA4_MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16)
# Per-type fixes the generic shrinking cannot guess (kept small; each says why). A dict value whose key
# names a sub-config is merged into that sub-config.
OVERRIDES: dict[str, dict] = {
    "dbrx": {"attn_config": {"rope_theta": 10000.0}},  # DbrxAttention reads attn_config.rope_theta; no default
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1},
    "qwen4_exp_text": _QSA,  # indexed-attention layers need the QSA indexer sizes (all default to None)
    "qwen4_exp": {"text_config": _QSA},
    "gemma4_text": _GEMMA4_MOE,  # the default Gemma-4 config is dense
    "gemma4": {"text_config": _GEMMA4_MOE},
    "doge": dict(is_moe=True, num_experts=16),  # CDMoE needs a square expert count; default is dense
}


def _shrink_value(key: str, value, default_layers: int | None, n_layers: int):
    """The tiny value of one config field, or `_KEEP`."""
    k = key.lower()
    if value is None:  # some defaults leave sizes unset; the model then cannot be built
        if k in _EXPERT_COUNT:
            return 8
        if k in _TOP_K:
            return 2
        if k in ("head_dim", "n_shared_experts"):
            return 8 if k == "head_dim" else 1
        return _KEEP
    if isinstance(value, bool):
        return _KEEP
    if isinstance(value, (list, tuple)) and default_layers and len(value) == default_layers:
        return list(value[:n_layers])  # per-layer pattern (layer_types, mlp_layer_types, ...)
    if isinstance(value, str) and default_layers and len(value) == default_layers and key.endswith("pattern"):
        return value[:n_layers]
    if not isinstance(value, int):
        return _KEEP
    if k in ("hidden_size", "d_model", "n_embd") or (k.startswith("adapter_") and "merge" not in k):
        return 32  # multimodal adapters must match the (tiny) hidden sizes
    if k in _EXPERT_COUNT:
        return 8 if value > 0 else value
    if k in _TOP_K:
        return min(value, 2)
    if k in ("num_hidden_layers", "num_layers", "n_layers", "n_layer"):
        return n_layers
    if k in ("first_k_dense_replace", "num_dense_layers"):
        return min(value, 1)
    if k in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        return min(value, 1)
    if k in ("n_group", "num_expert_group"):
        return 4 if value > 1 else value
    if k == "topk_group":
        return 2 if value > 1 else value
    if k in ("num_attention_heads", "n_heads", "n_head", "swa_num_attention_heads"):
        return 4
    if k in ("num_key_value_heads", "swa_num_key_value_heads", "n_kv_heads"):
        return _KV
    if k in ("head_dim", "swa_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_head_dim",
             "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "mamba_d_head", "mamba_head_dim",
             "kv_channels"):
        return 8
    if k == "qk_head_dim":
        return 16
    if k in ("kv_lora_rank", "q_lora_rank", "o_lora_rank"):
        return 16
    if k in ("index_n_heads", "linear_num_heads", "linear_num_key_heads", "linear_num_value_heads"):
        return 2
    if k in ("mamba_n_heads", "mamba_num_heads"):
        return 8  # 8 heads x head dim 8 = expand 2 x hidden 32
    if k in ("mamba_d_state", "ssm_state_size", "d_state"):
        return 8
    if "intermediate" in k or k in ("ffn_hidden_size", "expert_ffn_hidden_size", "router_hidden_size"):
        return 16 if value > 0 else value
    if k in ("vocab_size",):
        return 128
    if k in ("max_position_embeddings", "model_max_length", "max_seq_len"):
        return 256
    if k in ("sliding_window", "sliding_window_size", "attention_chunk_size", "index_topk", "chunk_size"):
        return min(value, 16)
    return _KEEP


class _Sentinel:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


_KEEP, _KV = _Sentinel("KEEP"), _Sentinel("KV")


def _shrink_config(config) -> dict:
    """Keyword overrides that make `config` (one level, no sub-configs) tiny."""
    d = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    default_layers = None
    for name in ("num_hidden_layers", "num_layers", "n_layers", "n_layer"):
        if isinstance(d.get(name), int):
            default_layers = d[name]
            break
    n_layers = min(default_layers or N_LAYERS, N_LAYERS)
    out = {}
    for k, v in d.items():
        new = _shrink_value(k, v, default_layers, n_layers)
        if new is _KV:
            heads = d.get("num_attention_heads") or d.get("n_heads")
            new = 4 if v == heads else 2  # MLA-style models need kv heads == heads
        if new is not _KEEP and new != v:
            out[k] = new
    if d.get("mlp_only_layers"):
        out["mlp_only_layers"] = []
    for tok, small in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        v = d.get(tok)
        if isinstance(v, int) and v >= 128:
            out[tok] = small
        elif isinstance(v, list):
            out[tok] = [x if x < 128 else small for x in v]
    for k, v in d.items():  # multimodal special tokens must stay inside the tiny vocab
        if (k.endswith("_token_id") or k.endswith("_token_index")) and k not in out and isinstance(v, int) and v >= 128:
            out[k] = 100 + (hash(k) % 20)
    return out


def tiny_config(model_type: str):
    """A tiny config of `model_type`: defaults with common fields shrunk, sub-configs too."""
    from transformers import AutoConfig, PretrainedConfig

    base = AutoConfig.for_model(model_type)
    kwargs = _shrink_config(base)
    for k, v in vars(base).items():
        if isinstance(v, PretrainedConfig):
            sub = dict(v.to_dict(), **_shrink_config(v))
            sub.pop("per_layer_config", None)  # derived from the full layer count; rebuilt for the tiny one
            kwargs[k] = sub
    for k, v in OVERRIDES.get(model_type, {}).items():
        kwargs[k] = dict(kwargs.get(k) or {}, **v) if isinstance(v, dict) and k.endswith("_config") else v
    kwargs["experts_implementation"] = "eager"
    return AutoConfig.for_model(model_type, **kwargs), kwargs


# Why each unsupported type fails, read off its modeling file (the survey's own reason is the adapter's
# error message; this is the diagnosis). Keep in sync when transformers or the adapter changes.
_BIAS_ELSEWHERE = ("DeepSeek-V3-like router (sigmoid, correction bias for selection, renormalised), but the "
                   "correction bias is a buffer on the block passed into the router call (`gate(h, bias)`); the "
                   "adapter reads weight/bias/correction bias from one router module, and so do the runtime and "
                   "exporters.")
NOTES: dict[str, str] = {
    "afmoe": "Router Linear at `router.gate` and the correction bias at the block (`expert_bias`), otherwise "
             "the DeepSeek-V3 convention with `route_scale`; the adapter expects `gate`/`router` to be the "
             "Linear-like module holding weight and bias itself.",
    "aria_text": "Experts stored transposed (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`; transformers marks "
                 "the class `is_transposed=True`), which `storage.py` reads as `[E, 2I, H]`; the fallback's "
                 "whole-block check refuses it. Needs an `is_transposed` storage layout.",
    "axk1": "DeepSeek-V3 block plus a `post_mlp_layernorm` on the block output (routed + shared); a post-norm "
            "inside the block is outside the adapter's model (routed experts + shared experts).",
    "dbrx": "Decoder layers at `transformer.blocks`, MoE under `ffn`, router Linear at `router.layer` with "
            "softmax, top-k and p-norm renormalisation (`moe_normalize_expert_weights`) done in the block, "
            "experts stored as flat `[E*I, H]` `w1`/`v1`/`w2` in `experts.mlp`: needs its own storage layout and "
            "a p-norm RouterSpec option.",
    "deepseek_v4": "Hash routing in the first MoE layers (experts chosen by a fixed token-id table `tid2eid`, "
                   "so routing needs `input_ids`) and a `sqrtsoftplus` scoring function; neither is a RouterSpec "
                   "convention.",
    "doge": "CDMoE: product-key retrieval over sqrt(E) x sqrt(E) keys of single-neuron experts stored as "
            "embeddings (`down_embed`/`up_embed`), mixed into a dense MLP; not gated-MLP experts.",
    "ernie4_5_moe": "Softmax router whose correction bias lives at `gate.moe_statics.e_score_correction_bias` "
                    "([1, E], selection only) and renormalises with clamp(min=`moe_norm_min`); the adapter only "
                    "reads a correction bias stored on the router module itself.",
    "gemma4": "Same as `gemma4_text` (the MoE lives in the text model).",
    "gemma4_text": "The MoE is inline in the decoder layer (`layer.router`, `layer.experts`, no block module), "
                   "runs in parallel with the dense MLP with its own pre/post norms, and its router RMS-normalises "
                   "and rescales the input and multiplies the weights by a learned per-expert scale. (The default "
                   "config is dense; the survey enables `enable_moe_block`.)",
    "hunyuan_v1_moe": "Mixtral convention (softmax, top-k, renormalised, fp32 logits) but the router Linear is "
                      "one level deeper (`mlp.gate.wg`) and the shared MLP is `shared_mlp`; a FamilySpec would "
                      "need a nested router path, which the runtime block and exporters do not handle yet.",
    "hy_v3": _BIAS_ELSEWHERE + " Also scales by `router_scaling_factor`.",
    "inkling2_loop_text": "Experts use a soft-capped SwiGLU (`Inkling2SoftcappedSwiGLU`), which `ExpertActivation` "
                          "does not model; the whole-block check refuses it.",
    "inkling2_text": "Experts use a soft-capped SwiGLU (`Inkling2SoftcappedSwiGLU`), which `ExpertActivation` "
                     "does not model; the whole-block check refuses it.",
    "inkling_text": "The router scores the shared experts together with the routed ones (weight has E + n_shared "
                    "rows; shared experts are scaled by router 'gammas'); the adapter's shared experts are "
                    "unscaled or sigmoid-gated.",
    "jetmoe": "`JetMoeParallelExperts` `input_linear`/`output_linear` with a block-level output bias and a "
              "`JetMoeTopKGating` router, plus mixture-of-attention experts (MoA) in the attention.",
    "kolibri1": "Selection on raw logits + correction bias, then sigmoid of the selected logits (not sigmoid "
                "then bias); not a RouterSpec convention.",
    "lfm2_moe": "Sigmoid router with the correction bias (`expert_bias`) on the block, passed into the router "
                "call, and renormalisation eps 1e-6.",
    "llama4": "Same as `llama4_text`.",
    "llama4_text": "The router weight (sigmoid of the top-k logits) scales each expert's INPUT, not its output; "
                   "with non-linear experts this is not the gate-times-output model every method assumes.",
    "longcat_flash": "Zero-computation (identity) experts appended to the router (`zero_expert_num`) and the "
                     "router Linear at `router.classifier`.",
    "minimax_m2": _BIAS_ELSEWHERE,
    "minimax_m3_vl_text": "Experts use GPT-OSS's clamped SwiGLU on non-interleaved fused storage (the adapter "
                          "uses the clamped SwiGLU only for GPT-OSS's interleaved layout), and the block scales "
                          "the routed sum by `routed_scaling_factor` (the fallback's router check fails on that).",
    "nemotron_h": "Non-gated experts (`up_proj`/`down_proj` only, relu2) with optional latent projections around "
                  "them, block under `mixer` in a hybrid Mamba stack.",
    "phimoe": "SparseMixer routing (successive top-1 choices with a jitter-threshold mask and a softmax per "
              "choice); not a RouterSpec convention.",
    "zaya": "MLP router carrying a state across layers (`router_states`) with a skip expert; the block returns "
            "that state for the next layer.",
}
# Declared families added from the survey, with the reason the fallback could not take them.
NOTES_SUPPORTED: dict[str, str] = {
    "beam": "declared (`families.py`): DeepSeek-V3 router, but the block applies `routed_scaling_factor` after the "
            "experts, so the HF router's weights are unscaled and the fallback's router check fails.",
}


# ----------------------------------------------------------------------------- worker


def _randomise(model, seed: int = 0) -> None:
    """Routers, gates and experts get non-degenerate random values (HF often zero-initialises them)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pat = re.compile(r"router|gate|expert|correction_bias|sinks", re.IGNORECASE)
    cls_pat = re.compile(r"Router|Gate|Gating|Experts", re.IGNORECASE)
    with torch.no_grad():
        for mname, module in model.named_modules():
            in_moe = bool(cls_pat.search(type(module).__name__))
            for pname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if t is None or not t.is_floating_point() or t.numel() == 0:
                    continue
                full = f"{mname}.{pname}"
                if not (in_moe or pat.search(full)):
                    continue
                if "correction_bias" in full or "expert_bias" in full:
                    scale = 0.05
                elif "expert" in full.lower() and t.dim() > 1:
                    scale = 0.1
                else:
                    scale = 0.5 if t.dim() > 1 else 0.1
                t.copy_(torch.randn(t.shape, generator=gen) * scale)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def _expert_layers(adapter) -> list[int]:
    """Decoder layers holding a module whose class name ends in 'Experts' (ground truth for coverage)."""
    found = []
    for i, layer in enumerate(adapter.decoder_layers):
        if any(type(m).__name__.endswith("Experts") for m in layer.modules()):
            found.append(i)
    return found


def _diagnose(model) -> str:
    """Where the model keeps its experts and what sits next to them (for 'not recognised' rows)."""
    for layer in _layers(model):
        for name, m in layer.named_modules():
            if type(m).__name__.endswith("Experts") or type(m).__name__.endswith("CDMoE"):
                parent_name = name.rsplit(".", 1)[0] if "." in name else ""
                parent = layer.get_submodule(parent_name) if parent_name else layer
                tensors = ", ".join(f"{n}{list(t.shape)}" for n, t in
                                    list(m.named_parameters(recurse=False))[:4])
                siblings = ", ".join(f"{n}: {type(c).__name__}" for n, c in parent.named_children() if c is not m)
                return f"experts at `{name}` ({type(m).__name__}: {tensors}); beside it: {siblings}"[:400]
    return "no module named *Experts in the decoder layers"


def _layers(model):
    for m in model.modules():
        if isinstance(m, __import__("torch").nn.ModuleList) and len(m) and "Layer" in type(m[0]).__name__ + "Block":
            return m
    return []


def _hf_block(block, h):
    out = block(h)
    return out[0] if isinstance(out, tuple) else out


def _check_adapter(model, declared: bool) -> dict:
    """Run the four checks with one adapter; returns status, reason and details."""
    import torch

    from moecompress.errors import MoECompressError
    from moecompress.models import MoEAdapter

    rec: dict = {}
    try:
        adapter = MoEAdapter(model)
    except MoECompressError as e:
        msg = str(e)
        if "convention" in msg:
            status = "detected-but-router-unverifiable"
        elif "MoE block of" in msg:
            status = "detected-but-block-mismatch"
        else:
            status = "structure-not-recognised"
        return {"status": status, "reason": _first_line(e), "found": _diagnose(model)}
    except Exception as e:  # noqa: BLE001 - any crash in detection is a finding
        return {"status": "structure-not-recognised", "reason": "adapter crashed: " + _first_line(e)}
    truth = _expert_layers(adapter)
    rec.update(moe_layers=adapter.moe_layers, expert_layers=truth)
    first = adapter.layer(adapter.moe_layers[0])
    rec.update(block_attr=first.block_attr, router_attr=type(first.router).__name__,
               storage=first.storage.layout, shared=type(first.shared).__name__ if first.shared is not None else None,
               router=first.spec.describe(), verified=all(adapter.layer(i).verified for i in adapter.moe_layers))
    if not rec["verified"]:
        return dict(rec, status="detected-but-router-unverifiable", reason="router weights on meta device")
    missing = [i for i in truth if i not in adapter.moe_layers]
    if missing:
        return dict(rec, status="structure-not-recognised",
                    reason=f"experts in layers {missing} not found (block attribute or router name unknown)")
    gen = torch.Generator().manual_seed(1)
    for i in adapter.moe_layers:
        h = torch.randn(2, 9, adapter.hidden_size, generator=gen)
        try:
            with torch.no_grad():
                ref = _hf_block(adapter.layer(i).block, h)
                ours = adapter.moe_forward(i, h)
        except Exception as e:  # noqa: BLE001
            return dict(rec, status="detected-but-block-mismatch", reason=f"layer {i}: " + _first_line(e))
        diff = (ours.float() - ref.float()).abs().max().item() if ours.shape == ref.shape else float("inf")
        if not diff <= 1e-5 + 1e-5 * ref.abs().max().item():
            return dict(rec, status="detected-but-block-mismatch",
                        reason=f"moe_forward differs from the HF block on layer {i} (max abs diff {diff:.3g})")
    # write/read round trip; the HF block must change exactly as predicted
    i, e = adapter.moe_layers[-1], adapter.num_experts(adapter.moe_layers[-1]) // 2
    h = torch.randn(64, adapter.hidden_size, generator=gen)
    original = adapter.get_expert(i, e)
    new = original.map(lambda t: torch.randn(t.shape, generator=gen) * 0.1)
    try:
        with torch.no_grad():
            before = adapter.moe_forward(i, h[None])[0]
            hf_before = _hf_block(adapter.layer(i).block, h[None])[0]
            adapter.set_expert(i, e, new)
            back = adapter.get_expert(i, e)
            exact = all(torch.equal(t, getattr(new, k)) for k, t in back.tensors().items())
            hf_after = _hf_block(adapter.layer(i).block, h[None])[0]
            after = adapter.moe_forward(i, h[None])[0]
            adapter.set_expert(i, e, original)
            restored = torch.equal(_hf_block(adapter.layer(i).block, h[None])[0], hf_before)
    except Exception as ex:  # noqa: BLE001
        return dict(rec, status="detected-but-block-mismatch", reason="expert round trip: " + _first_line(ex))
    tracks = torch.allclose(hf_after - hf_before, after - before, atol=1e-5, rtol=1e-4)
    if not (exact and restored and tracks):
        return dict(rec, status="detected-but-block-mismatch",
                    reason=f"expert round trip failed (exact={exact}, restored={restored}, hf_tracks={tracks})")
    rec["num_experts"], rec["top_k"] = adapter.num_experts(i), adapter.top_k(i)
    return dict(rec, status="supported-declared" if declared else "supported-fallback-verified", reason="")


def worker(model_type: str) -> dict:
    import warnings
    from unittest import mock

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from moecompress.models import FAMILIES

    rec: dict = {"model_type": model_type}
    try:
        config, kwargs = tiny_config(model_type)
        rec["overrides"] = {k: v for k, v in kwargs.items() if not isinstance(v, dict)}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001
        return dict(rec, status="could-not-build-tiny-config", reason=_first_line(e))
    rec["params"] = sum(p.numel() for p in model.parameters())
    _randomise(model)
    declared = model.config.model_type in FAMILIES or getattr(model.config, "model_type", None) in FAMILIES
    rec.update(_check_adapter(model, declared))
    rec["declared"] = declared
    if declared:  # would the fallback alone have handled it?
        with mock.patch.dict(FAMILIES, clear=True):
            fb = _check_adapter(model, False)
        rec["fallback_alone"] = {"status": fb["status"], "reason": fb.get("reason", "")}
    return rec


# ----------------------------------------------------------------------------- driver


def run_survey(types: dict[str, dict], timeout: float) -> dict[str, dict]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    results = {}
    for n, (mt, info) in enumerate(types.items(), 1):
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", mt], capture_output=True, text=True,
                                  timeout=timeout, env=env, cwd=ROOT, check=False)
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
            if line is None:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                rec = {"model_type": mt, "status": "could-not-build-tiny-config", "reason": f"worker died: {err}"[:300]}
            else:
                rec = json.loads(line)
        except subprocess.TimeoutExpired:
            rec = {"model_type": mt, "status": "could-not-build-tiny-config",
                   "reason": f"timed out after {timeout:.0f} s"}
        rec.update(info, seconds=round(time.time() - t0, 1))
        results[mt] = rec
        print(f"[{n}/{len(types)}] {mt:24s} {rec['status']:34s} {rec.get('reason', '')[:90]}", flush=True)
    return results


# ----------------------------------------------------------------------------- docs


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render(data: dict) -> str:
    results = data["results"]
    counts = {s: sum(1 for r in results.values() if r["status"] == s) for s in STATUSES}
    lines = [DOC_HEAD.strip(), ""]
    lines += [
        "## Survey of the installed transformers",
        "",
        f"transformers {data['transformers']} / torch {data['torch']}, surveyed {data['date']}: "
        f"{len(results)} causal-LM model types define routed experts.",
        "",
        "| status | count |",
        "|---|---|",
    ]
    lines += [f"| {s} | {counts[s]} |" for s in STATUSES]
    lines += ["", STATUS_LEGEND.strip(), "",
              "| model_type | class | status | router found (tiny default config) / why not supported | "
              "fallback alone |",
              "|---|---|---|---|---|"]
    for mt in sorted(results):
        r = results[mt]
        if r["status"].startswith("supported"):
            reason = f"{r.get('router', '')}; block `{r.get('block_attr')}`, {r.get('storage')} experts"
            if r.get("shared"):
                reason += f", shared {r['shared']}"
            if mt in NOTES_SUPPORTED:
                reason += ". " + NOTES_SUPPORTED[mt]
        else:
            reason = NOTES.get(mt) or r.get("reason", "")
        fb = r.get("fallback_alone")
        fbs = "" if not fb else fb["status"]
        lines.append(f"| `{mt}` | {r['class']} | {r['status']} | {_md_escape(reason)} | {fbs} |")
    lines += ["", "### MoE models outside the causal-LM mapping (out of scope)", "",
              "These define routed experts but are not `AutoModelForCausalLM` classes (vision-language, "
              "encoder-decoder, token-classification or backbone models); the toolkit does not load them.", "",
              "| model_type | class | mapping |", "|---|---|---|"]
    for mt in sorted(data["out_of_scope"]):
        o = data["out_of_scope"][mt]
        lines.append(f"| `{mt}` | {o['class']} | {o['mapping']} |")
    lines += ["", DOC_TAIL.strip(), ""]
    return "\n".join(lines)


DOC_HEAD = """
# Supported models

`moecompress` reads a MoE checkpoint only through `moecompress.models.MoEAdapter`
(`src/moecompress/models/`). An adapter finds the decoder layers with routed experts, exposes
each router's exact semantics as a `RouterSpec`, reads/writes experts in one orientation, and
re-implements the MoE block (`moe_forward`) so that it equals the HuggingFace block.

A model is handled in one of two ways:

* **declared family** — a `FamilySpec` in `models/families.py` says where the block, router,
  experts and shared experts live and how to read the router convention off the config;
* **fallback** — anything else is auto-detected (below); its router convention is accepted only
  after it reproduces the HF router on random tokens, and the whole block only after `moe_forward`
  reproduces it. A model that fails either check is refused with a `MoECompressError`, never guessed.

## Declared families

| model_type | checkpoints (examples) | MoE block | router convention | shared experts |
|---|---|---|---|---|
| `qwen3_moe` | Qwen3-30B-A3B, Qwen3-235B-A22B | `mlp` | softmax over E, top-k, renormalised iff `norm_topk_prob` (true in the Qwen3 releases) | none |
| `qwen2_moe` | Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B | `mlp` | softmax over E, top-k, renormalised iff `norm_topk_prob` (false in the releases) | `shared_expert`, scaled by `sigmoid(shared_expert_gate(h))` |
| `olmoe` | OLMoE-1B-7B | `mlp` | softmax over E, top-k, renormalised iff `norm_topk_prob` (false) | none |
| `mixtral` | Mixtral-8x7B, 8x22B | `mlp` | softmax over E, top-k, always renormalised | none |
| `deepseek_v2` | DeepSeek-V2(-Lite), DeepSeek-Coder-V2 | `mlp` | softmax over E in float32; `topk_method: group_limited_greedy` restricts to the `topk_group` best of `n_group` groups (group score = max); weights not renormalised, times `routed_scaling_factor` | `shared_experts` |
| `deepseek_v3` | DeepSeek-V3/R1, Kimi-K2, Moonlight-16B-A3B (all ship `model_type: deepseek_v3`) | `mlp` | sigmoid over E in float32; `e_score_correction_bias` added for selection only; group-limited (group score = sum of top-2); selected sigmoid scores renormalised (`norm_topk_prob`, eps 1e-20) and times `routed_scaling_factor` | `shared_experts` |
| `gpt_oss` | gpt-oss-20b, gpt-oss-120b | `mlp` (returns `(hidden, router_scores)`) | top-k of the raw logits (router has a bias), softmax over the k | none |
| `granitemoe` | granite-3.0-1b-a400m, 3b-a800m | `block_sparse_moe` | top-k of the raw logits, softmax over the k | none |
| `beam` | (transformers' `BeamForCausalLM`) | `mlp` | as `deepseek_v3`; the HF block applies `routed_scaling_factor` after the experts, which equals scaling the weights | none |

The `route(spec, h, ..., present=, allowed=)` function reproduces all of these and adds the two
pruning masks: `present` (renorm: absent experts are deleted before normalisation) and `allowed`
(keep: absent experts stay in the normalisation but are never selected).
"""

STATUS_LEGEND = """
Statuses: **supported-declared** — a declared `FamilySpec`, all checks pass;
**supported-fallback-verified** — found by the fallback, whose router and whole-block checks (repeated on
every load) pass, and all survey checks pass;
**detected-but-router-unverifiable** — experts found but no known router convention reproduces the HF router
(or the model uses a router the fallback cannot call);
**detected-but-block-mismatch** — experts and router found, but `moe_forward` (or the expert round trip)
does not reproduce the HF block, e.g. because the block adds terms the adapter does not model (the adapter
refuses these);
**structure-not-recognised** — the adapter found no routed experts where the model has them;
**could-not-build-tiny-config** — the survey could not build a tiny random model from the default config
(this says nothing about the adapter).

How the survey checks a type: it builds the type's default config with common fields shrunk (hidden 32, 4
layers with MoE layers kept, 8 experts, top-2, 4 heads of width 8, expert/dense widths 16, vocab 128, LoRA
ranks 16, expert groups 4/2, per-layer lists truncated; a few per-type overrides in `OVERRIDES`), builds a
random float32 model with the eager experts implementation and random router/expert weights, then requires:
the adapter finds every decoder layer that holds an `*Experts` module; every router is declared or
fallback-verified; `moe_forward(i, h)` equals the HF block on every MoE layer (atol 1e-5); and an expert
write/read round trip is exact, changes the HF block exactly as `moe_forward` predicts, and restores it.
"Fallback alone" re-runs a declared family with its `FamilySpec` hidden. Routers that depend on config values
are re-verified on every real load, so a row here is a statement about the code path, not a specific
checkpoint.
"""

DOC_TAIL = """
## How the fallback works

For a model type without a `FamilySpec` (`models/adapter.py`):

1. **Decoder layers**: `model.get_decoder().layers`, else the `nn.ModuleList` whose length is
   `config.num_hidden_layers`.
2. **MoE block**: the first of the layer attributes `mlp`, `block_sparse_moe`, `feed_forward`, `moe`, `ffn`
   whose `experts` child is a recognised expert storage (below).
3. **Experts**: `experts.gate_up_proj` 3-D (transformers v5 fused; with `gate_up_proj_bias` it is
   the GPT-OSS interleaved layout) or an `nn.ModuleList` of MLPs with `gate_proj/up_proj/down_proj`
   (or `w1/w3/w2`) Linear layers.
4. **Router**: the block attribute `gate` or `router` whose 2-D `weight` has E rows (E = number of experts).
   Top-k comes from `router.top_k` or `config.num_experts_per_tok`.
5. **Shared experts**: the block attribute `shared_expert`, `shared_experts` or `shared_mlp`, with
   `shared_expert_gate` (sigmoid scale) when present.
6. **Router convention**: candidates are built from the config (`scoring_func`, `norm_topk_prob`,
   `n_group`/`topk_group`, `routed_scaling_factor`, router bias, `e_score_correction_bias`) and then every
   combination of softmax/sigmoid × renormalised or not × top-k before or after the softmax × eps 0/1e-20.
   A candidate is accepted only if `route(spec, ...)` reproduces the HF router's selected experts and weights
   on 64 random tokens; if none does the adapter refuses the model (`MoECompressError`) rather than guess.
   A router whose call needs more than the hidden states (e.g. `gate(h, correction_bias)`) cannot be
   checked and is refused the same way.
7. **Whole block**: a verified router does not prove the block has nothing else in it (a post-norm, a custom
   activation, transposed expert storage), so each auto-detected block must also be reproduced by
   `moe_forward` on 16 random tokens (median per-token relative error at most 1e-3 in float32/float64,
   5e-2 in half precision, with the block briefly in eval mode); otherwise the adapter refuses the model.
   The router check is skipped (and the layer marked unverified) when the router weights are on the meta
   device; the block check is skipped when any of the block's weights are (offloaded models).

Declared families skip steps 6 and 7: their conventions are fixed in `families.py` and covered by
`tests/test_adapters.py`.

## What would unlock more families

From the survey above, small extensions of the adapter would cover several unsupported types:

* **Router weight / correction bias outside the router module** (`minimax_m2`, `hy_v3`, `lfm2_moe`,
  `ernie4_5_moe`, `afmoe`; also `hunyuan_v1_moe`'s nested `gate.wg`): `FamilySpec` paths for the router
  Linear and the correction bias, honoured by `router_params`, the runtime block and the exporters.
* **Expert activation read from the experts module** (`minimax_m3_vl_text`: clamped SwiGLU on fused storage;
  `inkling2_*`: soft-capped SwiGLU).
* **Transposed fused storage** (`aria_text`): honour the experts module's `is_transposed` flag.

The others need new concepts (hash or SparseMixer routing, input-scaled experts, identity/skip experts,
router-scaled shared experts, non-gated experts, inline MoE without a block module, cross-layer router state).

## Expert weight orientation

Whatever the storage, `adapter.experts(i)` / `get_expert(i, e)` / `set_expert(i, e, w)` use nn.Linear's
out x in orientation (`storage.py`): for E experts, hidden H and expert width I,
`gate [E, I, H]`, `up [E, I, H]`, `down [E, H, I]`, optional biases `gate_bias`/`up_bias [E, I]`,
`down_bias [E, H]`; one expert computes `down @ (act(gate @ x + b_g) * (up @ x + b_u)) + b_d`, with the
family's activation (`config.hidden_act`; GPT-OSS uses its clamped SwiGLU `(up + 1) * gate * sigmoid(1.702 gate)`).
Storages: transformers v5 fused `gate_up_proj [E, 2I, H]` (gate rows first) + `down_proj [E, H, I]`;
GPT-OSS `gate_up_proj [E, H, 2I]` (gate/up interleaved on the last dim) + biases + `down_proj [E, I, H]`;
per-expert `nn.ModuleList` (remote-code and older checkpoints).

## Regenerating this page

```bash
OMP_WAIT_POLICY=PASSIVE python scripts/survey_models.py          # ~10 s per type, one at a time, 1 thread
OMP_WAIT_POLICY=PASSIVE python scripts/survey_models.py --only beam,minimax_m2   # re-check some types
python scripts/survey_models.py --render-only                    # re-render from build/survey.json
python scripts/survey_models.py --list                           # the types that would be surveyed
```

A type is surveyed when it is in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and its modeling file defines a class
ending in `Experts` (or its config declares an expert count); MoE types found only in other auto mappings are
listed as out of scope. Each type runs in its own subprocess with a 60 s timeout (`--timeout`).

The survey writes `build/survey.json` (per model type: status, reason, layers found, router convention,
storage layout, the tiny-config overrides it used).
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated model types (merged into an existing build/survey.json)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the model types that would be surveyed")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker), default=str))
        return
    if args.render_only:
        DOC_OUT.write_text(render(json.loads(JSON_OUT.read_text())))
        print(f"wrote {DOC_OUT}")
        return
    import torch
    import transformers

    survey, out_of_scope = enumerate_types()
    if args.list:
        print("\n".join(f"{k}: {v['evidence']}" for k, v in survey.items()))
        return
    data = {"results": {}}
    if args.only:
        if JSON_OUT.exists():
            data = json.loads(JSON_OUT.read_text())
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in survey]
        if unknown:
            sys.exit(f"not a surveyed MoE causal-LM type: {', '.join(unknown)}")
        todo = {k: survey[k] for k in wanted}
    else:
        todo = survey
    data["results"].update(run_survey(todo, args.timeout))
    data.update(transformers=transformers.__version__, torch=torch.__version__,
                date=datetime.date.today().isoformat(), out_of_scope=out_of_scope)
    JSON_OUT.parent.mkdir(parents=True, exist_ok=True)
    JSON_OUT.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    DOC_OUT.parent.mkdir(parents=True, exist_ok=True)
    DOC_OUT.write_text(render(data))
    print(f"wrote {JSON_OUT} and {DOC_OUT}")


if __name__ == "__main__":
    main()
