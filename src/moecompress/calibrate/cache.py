"""Hidden states between layers: in CPU memory, or on disk with an offload directory.

In memory a single buffer is overwritten batch by batch (batch b's output replaces its input once
that input is consumed), unless a second pass over the same inputs may follow (layer transforms),
which needs two buffers. On disk two buffers alternate (``p0``/``p1``) and ``state.json`` records
after which layer the current buffer is complete, so a killed run can resume from it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


class ActivationCache:
    def __init__(
        self, offload_dir: str | os.PathLike | None = None, double: bool = False, tag: str = "rank0"
    ):
        self.dir = None if offload_dir is None else Path(offload_dir) / tag
        self.double = double or self.dir is not None
        self.parity = 0
        self._cur: dict[int, torch.Tensor] = {}
        self._next: dict[int, torch.Tensor] = {}
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def _file(self, parity: int, b: int) -> Path:
        return self.dir / f"p{parity}" / f"b{b:06d}.safetensors"

    def read(self, b: int) -> torch.Tensor:
        if self.dir is None:
            return self._cur[b]
        from safetensors.torch import load_file

        return load_file(str(self._file(self.parity, b)))["h"]

    def write(self, b: int, h: torch.Tensor) -> None:
        h = h.detach().to("cpu").contiguous()
        if self.dir is None:
            (self._next if self.double else self._cur)[b] = h
            return
        from safetensors.torch import save_file

        path = self._file(1 - self.parity, b)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"h": h}, str(path))

    def commit(self, after_layer: int, key: str = "") -> None:
        """The buffer just written becomes the input of the next layer."""
        if self.dir is None:
            if self.double:
                self._cur, self._next = self._next, {}
            return
        self.parity = 1 - self.parity
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps({"key": key, "after_layer": after_layer, "parity": self.parity}))
        os.replace(tmp, self.dir / "state.json")

    def restore(self, key: str, after_layer: int, batches: list[int]) -> bool:
        """Reuse an on-disk buffer holding the outputs of `after_layer` for this run; False if none."""
        if self.dir is None or not (self.dir / "state.json").is_file():
            return False
        from ..safejson import try_load_json

        state = try_load_json(self.dir / "state.json")  # ours, but bounded all the same (`safejson`)
        if state is None:
            return False
        if state.get("key") != key or state.get("after_layer") != after_layer:
            return False
        if not all(self._file(state["parity"], b).is_file() for b in batches):
            return False
        self.parity = state["parity"]
        return True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._cur.values()) + sum(
            t.numel() * t.element_size() for t in self._next.values()
        )

    def clear(self) -> None:
        self._cur, self._next = {}, {}
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
