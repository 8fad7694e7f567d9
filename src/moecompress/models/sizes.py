"""A config's sizes checked against the weights beside it before anything is built from it (issue 51): a
config.json or base_config.json edited to ``hidden_size: 1e9`` made the skeleton allocate terabytes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..errors import MoECompressError

# config fields that size what a skeleton allocates, and the largest value each may take: counts (layers,
# experts, heads) and dimensions (the largest real vocabularies are ~2^18, hidden sizes ~2^14)
_MAX_COUNT, _MAX_DIM = 2**12, 2**22
_SIZE_KEYS = {
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "num_experts",
            "num_local_experts",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "n_group",
            "topk_group",
        ),
        _MAX_COUNT,
    ),
    **dict.fromkeys(
        (
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "head_dim",
            "vocab_size",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
        ),
        _MAX_DIM,
    ),
}
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "tok_embeddings.weight", "word_embeddings.weight")
_FLOAT_TAGS = ("F64", "F32", "F16", "BF16")
# a skeleton may describe more parameters than the weights store bytes (pruned, 2-bit experts), but not this
# many times more: a config edited to hidden_size 1e9 would have its skeleton allocate terabytes
_SKELETON_PER_BYTE, _SKELETON_SLACK = 256, 2**27
_CHECKED: set = set()


_BAD = "the config is corrupted or does not belong to these weights; re-download or re-export the checkpoint"


def check_config_sizes(config, directory, where: str, build, raw: dict | None = None) -> None:
    """Refuse, in one sentence and before any skeleton is built, a config whose sizes do not fit the weights
    beside it: a size field that is not an integer within `_SIZE_KEYS`' bounds, a vocab_size / hidden_size other
    than the stored embedding's shape, more layers than the weights hold, or a model whose meta skeleton has more
    parameters than `_SKELETON_PER_BYTE` per stored byte. The weights are judged by their safetensors headers,
    each checked against its file's real size (`disk.checked_header`). Checked once per process for a directory
    and config unchanged since. `build(config)`: the meta-device skeleton (`loading.skeleton`); `raw`: the file's
    own fields, checked first so that a sentence names the key as the file spells it (``num_local_experts``,
    which the config object calls ``num_experts``)."""
    from ..disk import checked_header

    directory = Path(directory)
    shards = sorted(directory.glob("*.safetensors"))
    key = (
        str(directory.resolve()),
        json.dumps(config.to_dict(), sort_keys=True, default=str),
        tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in shards),
    )
    if key in _CHECKED:
        return
    fields = [(n, (raw or {}).get(n), cap) for n, cap in _SIZE_KEYS.items()]
    for name, value, cap in fields + [(n, getattr(config, n, None), cap) for n, cap in _SIZE_KEYS.items()]:
        values = value if isinstance(value, (list, tuple)) else [value]  # per-layer sizes (some families)
        if value is not None and not all(type(v) is int and 0 <= v <= cap for v in values):
            raise MoECompressError(
                f"{where} sets {name} to {str(value)[:40]}, not an integer from 0 to {cap:,}: {_BAD}."
            )
    if shards:  # none: a bare config (inspect), a GGUF directory
        headers = {}
        for shard in shards:
            headers.update({n: (tag, shape, shard) for n, (tag, shape) in checked_header(shard).items()})
        _check_against_headers(config, headers, directory, where)
        _check_skeleton(config, headers, directory, where, build)
    _CHECKED.add(key)


def _check_against_headers(config, headers: dict, directory: Path, where: str) -> None:
    """vocab_size x hidden_size is the stored embedding's shape; num_hidden_layers no more than the weights hold."""
    hidden, vocab = getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)
    for name, (tag, shape, shard) in headers.items():
        if name.endswith(_EMBEDDINGS) and tag in _FLOAT_TAGS and len(shape) == 2 and hidden and vocab:
            if shape != [vocab, hidden]:
                raise MoECompressError(
                    f"{where} says vocab_size {vocab} and hidden_size {hidden}, but {shard.name} stores the "
                    f"embedding {name} as {shape}: {_BAD}."
                )
    layer_ids = {int(m.group(1)) for n in headers if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))}
    layers = getattr(config, "num_hidden_layers", None)
    if layer_ids and isinstance(layers, int) and layers > max(layer_ids) + 1:
        raise MoECompressError(
            f"{where} says num_hidden_layers {layers}, but the weights in {directory} hold layers 0 to "
            f"{max(layer_ids)} only: {_BAD}."
        )


def _check_skeleton(config, headers: dict, directory: Path, where: str, build) -> None:
    """The meta skeleton's parameter count within `_SKELETON_PER_BYTE` per byte the weights store."""
    from ..disk import DTYPES

    stored = sum(math.prod(shape) * DTYPES.get(tag, ("", 1))[1] for tag, shape, _ in headers.values())
    try:
        model = build(config)
    except Exception:  # a class this transformers cannot build: the loader that needs it says so itself
        return
    implied = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    if implied > _SKELETON_PER_BYTE * stored + _SKELETON_SLACK:
        raise MoECompressError(
            f"{where} describes a model of {implied:,} parameters, but the weights in {directory} hold only "
            f"{stored:,} bytes: {_BAD}."
        )
