"""`moecompress inspect`: structure, router semantics and a byte breakdown of a MoE checkpoint.

Works from the config alone (the model is built on the meta device), so inspecting a
1T-parameter hub model costs no memory; bytes assume the checkpoint's stored dtype. A GGUF directory (a
``model.gguf`` beside the original's config.json) is described as the file holds it: its header is read by our
bounded reader (`export.gguf_guard`), the expert count is the GGUF's (a pruned export keeps the original's
config.json), and the bytes are the file's: each part's tensors at their GGUF types, the rest (other tensors,
metadata, tokenizer, padding) up to the file's size.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..atomic import dir_bytes
from ..models import MoEAdapter, load_config, skeleton

# GGUF tensor names (llama.cpp's) of each part inspect counts; the rest is everything else
_GGUF_PARTS = (
    ("shared_experts", re.compile(r"blk\.\d+\..*_shexp(\.|$).*")),
    ("routed_experts", re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.(weight|bias)")),
    ("router", re.compile(r"blk\.\d+\.(ffn_gate_inp\.(weight|bias)|exp_probs_b(\.bias)?)")),
)


def _numel(module) -> int:
    """Parameters plus persistent buffers (e.g. DeepSeek-V3's e_score_correction_bias): what a checkpoint stores."""
    n = sum(p.numel() for p in module.parameters())
    for sub in module.modules():
        n += sum(
            b.numel()
            for name, b in sub.named_buffers(recurse=False)
            if name not in sub._non_persistent_buffers_set
        )
    return n


def _dtype_of(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    return dtype


def _gguf_of(source: str):
    """The checked header of a GGUF directory's model.gguf (no safetensors beside it), else None."""
    from ..export.gguf import GGUF_FILE
    from ..export.gguf_guard import check_complete, read_header

    d = Path(str(source)).expanduser()
    if not (d / GGUF_FILE).is_file() or any(d.glob("*.safetensors")):
        return None
    header = read_header(d / GGUF_FILE)
    check_complete(header)
    return header


def _gguf_parts(header) -> tuple[dict, dict, str]:
    """(bytes, parameters, dtype) of a GGUF by part: its tensors' bytes at their GGUF types and elements, ``rest``
    and ``total`` including what is not a tensor, so ``total`` bytes are the file's size."""
    nbytes = dict.fromkeys(("routed_experts", "router", "shared_experts"), 0)
    params = dict(nbytes)
    for t in header.tensors.values():
        part = next((p for p, rx in _GGUF_PARTS if rx.fullmatch(t.name)), None)
        if part is not None:
            nbytes[part] += t.nbytes
            params[part] += t.n_elements
    total_params = sum(t.n_elements for t in header.tensors.values())
    nbytes.update(rest=header.size - sum(nbytes.values()), total=header.size)
    params.update(rest=total_params - sum(params.values()), total=total_params)
    types = sorted({t.type_name for t in header.tensors.values()})
    return nbytes, params, f"gguf ({', '.join(types)})"


def _config_of(source: str, gguf, trust_remote_code: bool):
    """The checkpoint's config, with the expert count its GGUF file holds where it is one."""
    config = load_config(source, trust_remote_code)
    if gguf is not None:
        from ..export.gguf_load import apply_expert_count

        apply_expert_count(config, gguf, Path(str(source)).expanduser())
    return config


def inspect_model(source: str, trust_remote_code: bool = False) -> dict:
    """Family, layers, experts, top-k, router semantics and bytes per category, as plain data (a GGUF directory:
    as its model.gguf holds them)."""
    gguf = _gguf_of(source)
    config = _config_of(source, gguf, trust_remote_code)
    model = skeleton(config)
    adapter = MoEAdapter(model)
    elem = torch.empty((), dtype=_dtype_of(config)).element_size()
    routed = router = shared = 0
    layers = []
    for i in adapter.moe_layers:
        layer = adapter.layer(i)
        n_routed = _numel(layer.storage.module)
        n_router = _numel(layer.router)
        n_shared = sum(_numel(m) for m in (layer.shared, layer.shared_gate) if m is not None)
        routed, router, shared = routed + n_routed, router + n_router, shared + n_shared
        layers.append(
            dict(
                layer=i,
                experts=layer.storage.num_experts,
                top_k=layer.spec.top_k,
                expert_width=layer.storage.intermediate_size,
                shared=layer.shared is not None,
                router=layer.spec.describe(),
                router_verified=layer.verified,
            )
        )
    total = _numel(model)
    rest = total - routed - router - shared
    first = adapter.layer(adapter.moe_layers[0])
    out = dict(
        source=str(source),
        model_type=adapter.model_type,
        architecture=type(model).__name__,
        declared_family=adapter.family is not None,
        num_layers=len(adapter.decoder_layers),
        moe_layers=adapter.moe_layers,
        dense_layers=adapter.dense_layers,
        experts_per_layer=sorted({d["experts"] for d in layers}),
        top_k=first.spec.top_k,
        router=first.spec.to_dict(),
        router_convention=first.spec.describe(),
        dtype=str(_dtype_of(config)),
        bytes=dict(
            routed_experts=routed * elem,
            router=router * elem,
            shared_experts=shared * elem,
            rest=rest * elem,
            total=total * elem,
        ),
        parameters=dict(routed_experts=routed, router=router, shared_experts=shared, rest=rest, total=total),
        layers=layers,
    )
    if gguf is not None:
        _as_gguf_holds_it(out, gguf)
    if Path(str(source)).is_dir():
        out["bytes_on_disk"] = dir_bytes(source)
    return out


def _as_gguf_holds_it(out: dict, gguf) -> None:
    """`inspect_model`'s summary with the bytes, parameters and types the GGUF file holds."""
    out["bytes"], out["parameters"], out["dtype"] = _gguf_parts(gguf)
    out["gguf"] = dict(
        file=str(gguf.path),
        architecture=gguf.arch,
        bytes=gguf.size,
        tensor_types=sorted({t.type_name for t in gguf.tensors.values()}),
    )
