"""Streaming, deterministic, sharded safetensors writer.

Tensors are appended to a shard's data file the moment they are produced (nothing is buffered
beyond the tensor in hand), so peak memory while exporting is one decoder layer, whatever the
checkpoint size. A shard is closed when the next tensor would exceed `max_shard_bytes`; on
`close()` each shard becomes ``[u64 header length][JSON header][data]`` (the safetensors format)
and the set is named like `save_pretrained` does: ``model.safetensors`` alone, or
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
Same tensors in the same order -> byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..disk import dtype_tag, encode_header
from ..errors import MoECompressError
from ..validate import parse_size

INDEX_FILE = "model.safetensors.index.json"


class ShardWriter:
    """Append tensors to numbered shards in `directory`; `close()` finalises files and the index."""

    def __init__(
        self, directory: str | os.PathLike, max_shard_bytes: int | str = "5GB", prefix: str = "model"
    ):
        self.dir = Path(directory)
        self.max = parse_size(max_shard_bytes)
        self.prefix = prefix
        self.shards: list[
            dict
        ] = []  # {"data": path, "entries": {name: (dtype, shape, start, end)}, "size": n}
        self._file = None
        self._names: set[str] = set()

    def _open(self) -> None:
        path = self.dir / f".{self.prefix}-shard{len(self.shards):05d}.data"
        self._file = open(path, "wb")
        self.shards.append({"data": path, "entries": {}, "size": 0})

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise MoECompressError(
                f"Tensor '{name}' was written twice; this is a bug in the exporter, please report it."
            )
        tag = dtype_tag(tensor.dtype)
        if tag is None:
            raise MoECompressError(
                f"Tensor '{name}' has dtype {tensor.dtype}, which safetensors cannot store."
            )
        self._names.add(name)
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self._file is None or (self.shards[-1]["size"] and self.shards[-1]["size"] + nbytes > self.max):
            self._close_data()
            self._open()
        shard = self.shards[-1]
        start = shard["size"]
        if nbytes:
            self._file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        shard["entries"][name] = (tag, list(t.shape), start, start + nbytes)
        shard["size"] = start + nbytes

    def add_all(self, tensors: dict[str, torch.Tensor]) -> None:
        """Append a batch (one layer, one scope, ...) in name order: the bytes never depend on dict order."""
        for name, t in sorted(tensors.items()):
            self.add(name, t)

    def _close_data(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> list[str]:
        """Finalise every shard (header + data) and the index; returns the shard file names."""
        self._close_data()
        if not self.shards:
            self._open()
            self._close_data()
        n = len(self.shards)
        names = (
            [f"{self.prefix}.safetensors"]
            if n == 1
            else [f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        weight_map, total = {}, 0
        for shard, fname in zip(self.shards, names):
            with open(self.dir / fname, "wb") as out, open(shard["data"], "rb") as data:
                out.write(encode_header(shard["entries"], {"format": "pt"}))
                out.flush()
                _copy(data, out, shard["size"])
            shard["data"].unlink()
            for k in shard["entries"]:
                weight_map[k] = fname
            total += shard["size"]
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def _copy(src, dst, size: int) -> None:
    """Kernel-side copy when available (no user-space buffer), else a chunked copy."""
    left, offset_in = size, 0
    try:
        while left > 0:
            done = os.copy_file_range(src.fileno(), dst.fileno(), left, offset_in)
            if done == 0:
                break
            left -= done
            offset_in += done
    except (AttributeError, OSError):
        pass  # not supported here: finish with a plain copy from where the kernel copy stopped
    if left > 0:
        src.seek(offset_in)
        shutil.copyfileobj(src, dst, 16 * 2**20)
