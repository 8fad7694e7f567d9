"""What a checkpoint directory stores, read from its safetensors headers alone (no tensor data).

Byte accounting must follow the checkpoint as stored, not the model in memory: a bf16 checkpoint
loaded as float32 for computation still costs 2 bytes per parameter on disk. A safetensors file is
``[u64 little-endian header length][JSON header][data]``; the header maps each tensor name to its
dtype, shape and data offsets, which is all this module reads.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path, PurePosixPath

from .errors import MoECompressError

# safetensors dtype tag -> torch dtype name and bytes per element
DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


def tag_bytes(tag: str, default: int) -> int:
    """Bytes per element of safetensors dtype `tag` (`DTYPES`, the one table), `default` for a tag it lacks."""
    return DTYPES[tag][1] if tag in DTYPES else default


MAX_HEADER = 100 * 2**20  # the largest safetensors header read (safetensors' own limit)


def read_header(file: str | os.PathLike) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of one safetensors file (metadata dropped). A declared
    header length beyond the file or `MAX_HEADER` is a ValueError, never a read of that many bytes."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER, os.fstat(f.fileno()).st_size - 8):
            raise ValueError(f"{file}: header length {n} beyond the file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{file}: header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def checked_header(file: str | os.PathLike) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype tag, shape)} of one safetensors file whose header agrees with the file's real bytes:
    every entry a shape of non-negative integers whose bytes are exactly its data offsets, inside the file (a
    dtype `DTYPES` lacks: its offsets inside the file). What a config's sizes are checked against
    (`models.check_config_sizes`); one sentence otherwise."""
    from .safejson import parse_json

    file = Path(file)
    bad = (
        f"{file} is not a valid safetensors file (its header does not describe its bytes); re-download or "
        "re-export the checkpoint"
    )
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise MoECompressError(bad + ".")
            header = parse_json(f.read(n), str(file), bad)
    except OSError as exc:
        raise MoECompressError(
            f"{file} cannot be read ({exc.strerror}); re-download the checkpoint."
        ) from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    out: dict[str, tuple[str, list[int]]] = {}
    for name, h in header.items():
        ok = isinstance(h, dict) and isinstance(h.get("dtype"), str) and isinstance(h.get("shape"), list)
        ok = ok and all(type(d) is int and d >= 0 for d in h["shape"])
        offsets = h.get("data_offsets") if ok else None
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        ok = ok and 0 <= offsets[0] <= offsets[1] <= data
        # a dtype this table lacks (sub-byte, U32) is held to its offsets only
        if not ok or (
            h["dtype"] in DTYPES and offsets[1] - offsets[0] != math.prod(h["shape"]) * DTYPES[h["dtype"]][1]
        ):
            raise MoECompressError(f"{bad} (tensor '{str(name)[:100]}').")
        out[name] = (h["dtype"], list(h["shape"]))
    return out


def stored_tensors(directory: str | os.PathLike) -> dict[str, tuple[str, int]]:
    """{tensor name: (torch dtype name, bytes)} over every ``*.safetensors`` file of `directory`."""
    out: dict[str, tuple[str, int]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        for name, h in read_header(file).items():
            dtype, size = DTYPES.get(h["dtype"], (h["dtype"].lower(), 0))
            out[name] = (dtype, size * math.prod(h["shape"]))
    return out


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that would hold `path` (its nearest existing ancestor's): what a dry-run
    compares an output's size with before the output exists."""
    import shutil

    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def checkpoint_dir(candidate) -> Path | None:
    """`candidate` as a directory holding safetensors weights, else None (an in-memory model, a hub id)."""
    if not candidate:
        return None
    p = Path(str(candidate))
    return p if p.is_dir() and any(p.glob("*.safetensors")) else None


def stored_dtype(directory: str | os.PathLike) -> str | None:
    """The floating dtype holding most of `directory`'s bytes ("bfloat16" for the fixtures), or None when it
    stores no floating tensor: what "the checkpoint's dtype" means for loading it in its own precision."""
    by_dtype: dict[str, int] = {}
    for dtype, size in stored_tensors(directory).values():
        if dtype.startswith(("float", "bfloat")):
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    return max(by_dtype, key=by_dtype.get) if by_dtype else None


def dtype_tag(dtype) -> str | None:
    """The safetensors dtype tag of a torch dtype (None: safetensors cannot store it)."""
    return next((tag for tag, (name, _) in DTYPES.items() if str(dtype) == f"torch.{name}"), None)


def encode_header(
    entries: dict[str, tuple[str, list[int], int, int]], metadata: dict[str, str] | None
) -> bytes:
    """``[u64 little-endian length][JSON header]`` of a safetensors file whose data follows, for
    ``entries`` = {name: (dtype tag, shape, start, end)} (offsets into the data). Keys sorted and the header
    padded with spaces to 8-byte alignment, as safetensors writes it, so equal tensors give equal bytes."""
    header: dict = {
        k: {"dtype": d, "shape": list(sh), "data_offsets": [a, b]} for k, (d, sh, a, b) in entries.items()
    }
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_tensors(file: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write torch `tensors` as one safetensors file, each straight from its own memory.

    safetensors' ``save_file`` first copies every tensor into one bytes object, so a layer's statistics
    ([E, H, H] moments and Hessians, the largest there are) were held twice while written."""
    import torch

    items = [(k, tensors[k].detach().cpu().contiguous()) for k in sorted(tensors)]
    entries, offset = {}, 0
    for k, t in items:
        n = t.numel() * t.element_size()
        entries[k] = (dtype_tag(t.dtype), list(t.shape), offset, offset + n)
        offset += n
    with open(file, "wb") as f:
        f.write(encode_header(entries, metadata))
        for _, t in items:
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def read_weight_map(index: str | os.PathLike) -> dict[str, str]:
    """The `weight_map` of a ``model.safetensors.index.json``: tensor name -> shard path, relative to the
    checkpoint directory and confined to it. An entry such as ``../x.safetensors`` or ``/etc/x`` used to be
    opened outside the checkpoint. Only the names are checked, so symlinked shards (the HF cache) still load."""
    from .safejson import try_load_json

    index = Path(index)
    weight_map = (try_load_json(index) or {}).get("weight_map")
    if weight_map is None:
        raise MoECompressError(
            f"{index} is not a valid safetensors index: the checkpoint is corrupted; re-download it."
        ) from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise MoECompressError(
            f"{index} has a weight_map that is not a mapping of tensor names to file names: the "
            "checkpoint is corrupted; re-download it."
        )
    for f in weight_map.values():
        parts = PurePosixPath(f.replace("\\", "/")).parts
        if not parts or f.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
            raise MoECompressError(
                f"{index} names the shard '{f}', which lies outside the checkpoint directory; "
                "the index is corrupted or malicious, so re-download the checkpoint."
            )
    return weight_map
