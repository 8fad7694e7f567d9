"""Every weight of a checkpoint in one tensor class: what a precision is given to (issue 30, item 1).

DESIGN.md §4: "every stored expert — and every other weight of the model (attention, shared experts, dense MLPs,
embeddings, lm_head) — has a precision". The classes:

| class | what |
| --- | --- |
| ``experts`` | routed experts (their precision is `StoredExpert.quant`, per stored expert) |
| ``attention`` | everything under the decoder layer's attention module (q/k/v/o, MLA's low-rank q_a/q_b/kv_a/kv_b) |
| ``shared`` | shared experts |
| ``dense_mlp`` | the MLP of a decoder layer without routed experts (DeepSeek's first_k_dense_replace layers) |
| ``embeddings`` | the input embeddings (a tied lm_head is this same tensor, counted once) |
| ``lm_head`` | the output projection when it is not tied to the embeddings |
| ``router`` | router weights and biases, DeepSeek-V3's score-correction bias, Qwen2-MoE's shared-expert gate |
| ``norm`` | every normalisation module's parameters (never quantized) |
| ``other`` | anything else (GPT-OSS attention sinks are ``attention``; rotary buffers are not persistent) |

Where the parts live is family data (`FamilySpec.attention_attr`, `dense_mlp_attr`, and the adapter's block,
router, experts and shared-expert handles), so no name patterns are matched here. Names are the model's
``state_dict`` names, deduplicated as ``save_pretrained`` writes them: non-expert tensors keep them on disk.
"""

from __future__ import annotations

from torch import nn

CLASSES = ("experts", "attention", "shared", "dense_mlp", "embeddings", "lm_head", "router", "norm", "other")
# classes whose 2-D ``.weight`` tensors a plan may give an integer precision (`CompressionPlan.tensor_quant`)
QUANTIZABLE = ("attention", "shared", "dense_mlp", "embeddings", "lm_head", "router")


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return name.endswith(("norm", "rmsnorm", "layernorm")) or isinstance(module, (nn.LayerNorm, nn.GroupNorm))


def _roots(adapter) -> dict[int, str]:
    """id(module) -> class for the modules that define a class (everything below them inherits it)."""
    model = adapter.model
    fam = adapter.family
    attn_attr = fam.attention_attr if fam else "self_attn"
    mlp_attr = fam.dense_mlp_attr if fam else "mlp"
    roots: dict[int, str] = {}
    for i, dec in enumerate(adapter.decoder_layers):
        attn = getattr(dec, attn_attr, None)
        if isinstance(attn, nn.Module):
            roots[id(attn)] = "attention"
        if i in adapter.layers:
            layer = adapter.layers[i]
            roots[id(layer.block)] = "other"  # parts of the block not named below
            roots[id(layer.storage.module)] = "experts"
            roots[id(layer.router)] = "router"
            if layer.shared is not None:
                roots[id(layer.shared)] = "shared"
            if layer.shared_gate is not None:
                roots[id(layer.shared_gate)] = "router"
        else:
            mlp = getattr(dec, mlp_attr, None)
            if isinstance(mlp, nn.Module):
                roots[id(mlp)] = "dense_mlp"
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        roots[id(emb)] = "embeddings"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        roots[id(head)] = "lm_head"
    return roots


def tensor_classes(adapter) -> dict[str, str]:
    """name -> class for every parameter and persistent buffer of ``adapter.model`` (state_dict names; a tied
    lm_head is not listed: its tensor is the embeddings')."""
    model = adapter.model
    roots = _roots(adapter)
    module_class: dict[str, str] = {}
    out: dict[str, str] = {}

    def walk(prefix: str, module: nn.Module, inherited: str) -> None:
        cls = "norm" if _is_norm(module) else roots.get(id(module), inherited)
        module_class[prefix] = cls
        for name, _p in module.named_parameters(prefix=prefix, recurse=False):
            out.setdefault(name, cls)
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out.setdefault(f"{prefix}.{name}" if prefix else name, cls)
        for name, child in module.named_children():
            walk(f"{prefix}.{name}" if prefix else name, child, cls)

    walk("", model, "other")
    seen: set[int] = set()
    keep = {}
    # deduplicate shared tensors (a tied lm_head) as named_parameters does: the first name wins
    for name, p in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if name in out and id(p) not in seen:
            seen.add(id(p))
            keep[name] = out[name]
    return keep


def quantizable(name: str, shape, cls: str) -> bool:
    """May a plan give this tensor an integer precision? A 2-D ``.weight`` of a `QUANTIZABLE` class."""
    return cls in QUANTIZABLE and name.endswith(".weight") and len(tuple(shape)) == 2


def tensor_shapes(adapter) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor `tensor_classes` lists (meta tensors included)."""
    shapes = {n: tuple(p.shape) for n, p in adapter.model.named_parameters(remove_duplicate=False)}
    shapes.update({n: tuple(b.shape) for n, b in adapter.model.named_buffers(remove_duplicate=False)})
    return shapes
