"""The bytes of an export's weight files beyond its tensors, and the budget those files must fit.

A safetensors file is ``[u64 header length][JSON header, space-padded to 8 bytes][data]`` (`disk.encode_header`):
its non-tensor bytes are 8 + the header, one entry per tensor (name, dtype, shape, two data offsets) plus the
``__metadata__`` and at most 7 bytes of padding. A GGUF (`export.gguf`) holds its metadata and tokenizer
(`GGUFFile.metadata_bytes`), one tensor info per tensor, and pads the infos and every tensor's data to 32 bytes.
`safetensors_entry_bytes`, `SAFETENSORS_SHARD_BYTES`, `safetensors_shards` and `GGUF_TENSOR_BYTES` bound these
from the names, dtypes and shapes a plan may write: what `auto` reserves before it allocates its budget
(`export/auto_reserve.py`, docs/auto.md, "The budget and the byte count").

`check_weight_budget` is the final check: a plan that records a budget for its weight files
(``params["auto"]["files_budget_bytes"]``) is refused, before the output is renamed into place, when the weight files
written are larger (`BudgetExceeded`, exit 1); the temporary output is removed by `atomic_dir`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..errors import BudgetExceeded
from ..validate import parse_size

SAFETENSORS_METADATA = {"format": "pt"}  # what `ShardWriter.close` writes as every shard's __metadata__
MAX_SHARD_BYTES = "5GB"  # `ShardWriter`'s and `export`'s default shard size
# a shard's bytes beyond its tensors' entries: the u64 length, the braces, the __metadata__ entry and its comma,
# and at most 7 bytes of padding to 8-byte alignment
SAFETENSORS_SHARD_BYTES = (
    8 + 2 + len(json.dumps({"__metadata__": SAFETENSORS_METADATA}, separators=(",", ":"))) - 2 + 1 + 7
)
GGUF_ALIGNMENT = 32  # gguf's default alignment, which `GGUFFile` keeps
GGUF_MAX_NAME = 64  # GGML_MAX_NAME: the longest tensor name llama.cpp reads
GGUF_MAX_DIMS = 4
# one tensor's info (u64 name length, name, u32 dims, u64 per dim, u32 type, u64 offset) and its data's padding
GGUF_TENSOR_BYTES = 8 + GGUF_MAX_NAME + 4 + 8 * GGUF_MAX_DIMS + 4 + 8 + (GGUF_ALIGNMENT - 1)
# the key-value `GGUFFile.write` may add after the metadata was measured (moecompress.inexact_fp16_scales: u64
# key length, key, u32 type, u64 value), and the infos' padding to the alignment
GGUF_FILE_BYTES = 8 + 64 + 4 + 8 + (GGUF_ALIGNMENT - 1)


def safetensors_entry_bytes(name: str, dtype: str, shape: Sequence[int], digits: int) -> int:
    """Bytes of tensor `name`'s entry in a safetensors header as `disk.encode_header` writes it, its separating
    comma included, each of its two data offsets taken at `digits` digits (an upper bound when no offset has
    more)."""
    offset = 10 ** (digits - 1)
    entry = {name: {"data_offsets": [offset, offset], "dtype": dtype, "shape": [int(x) for x in shape]}}
    return len(json.dumps(entry, separators=(",", ":"))) - 2 + 1


def safetensors_shards(data_bytes: int, max_shard: int | str = MAX_SHARD_BYTES) -> int:
    """An upper bound on the shards `ShardWriter` writes for `data_bytes` of tensors: a shard is closed only when
    the next tensor would take it past `max_shard`, so two consecutive shards hold more than `max_shard`."""
    return 1 + 2 * data_bytes // parse_size(max_shard)


def offset_digits(data_bytes: int) -> int:
    """Digits of the largest data offset a safetensors file of at most `data_bytes` of tensors writes."""
    return len(str(max(1, int(data_bytes))))


def recorded_budget(plan) -> int | None:
    """The budget `plan` records for its weight files' bytes (`auto`'s ``files_budget_bytes``), or None."""
    found = (plan.params or {}).get("auto", {}).get("files_budget_bytes")
    return None if found is None else int(found)


def check_weight_budget(plan, weight_bytes: int, evaluation_only: bool = False) -> None:
    """Refuse an export whose weight files are larger than the budget its plan records (one sentence, exit 1).
    A full-size, evaluation-only export (``materialized``) is never a compressed model and is not checked."""
    budget = recorded_budget(plan)
    if budget is None or evaluation_only or weight_bytes <= budget:
        return
    auto = plan.params["auto"]
    scope = ""
    if (
        auto.get("budget_scope") == "routed"
    ):  # the files may hold the tensors a routed budget leaves as they are
        routed = int(auto["budget_bytes"])
        scope = f" (the {routed}-byte routed budget plus the {budget - routed} bytes of tensors outside it)"
    raise BudgetExceeded(
        f"auto's output would be {weight_bytes} bytes, over the {budget}-byte budget{scope}; nothing was written: "
        f"raise the budget by at least {weight_bytes - budget} bytes."
    )


__all__ = [
    "GGUF_FILE_BYTES",
    "GGUF_TENSOR_BYTES",
    "MAX_SHARD_BYTES",
    "SAFETENSORS_SHARD_BYTES",
    "check_weight_budget",
    "offset_digits",
    "recorded_budget",
    "safetensors_entry_bytes",
    "safetensors_shards",
]
