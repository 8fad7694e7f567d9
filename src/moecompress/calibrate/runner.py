"""The sequential runner: embeddings, then one decoder layer at a time over every calibration batch.

Memory model: the model is a meta-device skeleton; the runner materialises the non-layer tensors
just long enough to embed the batches and capture what the model hands each decoder layer
(attention masks, rotary position embeddings, per-layer attention types), frees them, then for
each decoder layer streams its weights from the safetensors shards (`CheckpointReader`), pushes
every batch through it, stores the outputs as the next layer's inputs (CPU memory or an offload
directory) and frees the layer. Peak memory is about one layer's weights plus the activation cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from ..checkpoint import CheckpointReader
from ..data import CalibrationData
from ..models import MoEAdapter
from .cache import ActivationCache


class _Stop(Exception):
    """Raised by the last layer's catcher: the embedding pass is done."""


class _Catcher(nn.Module):
    """Stands in for decoder layer i during the embedding pass: records its inputs, passes them on."""

    def __init__(self, layer: nn.Module, index: int, sink: Callable, last: bool):
        super().__init__()
        object.__setattr__(self, "_wrapped", layer)
        self.index, self.sink, self.last = index, sink, last

    def __getattr__(self, name):  # models read attributes such as `attention_type` off their layers
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_wrapped"), name)

    def forward(self, hidden_states, *args, **kwargs):
        self.sink(self.index, hidden_states, args, kwargs)
        if self.last:
            raise _Stop
        return hidden_states


def _free_module_tensors(module: nn.Module, skip_prefix: str) -> None:
    """Send every tensor of `module` outside `skip_prefix` back to meta."""
    for name, sub in module.named_modules():
        if name == skip_prefix or name.startswith(skip_prefix + "."):
            continue
        for n, p in list(sub._parameters.items()):
            if p is not None and not p.is_meta:
                sub._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for n, b in list(sub._buffers.items()):
            if b is not None and not b.is_meta:
                sub._buffers[n] = torch.empty_like(b, device="meta")


def _mask_key(ids: torch.Tensor, mask: torch.Tensor) -> str:
    h = hashlib.sha1(str(tuple(ids.shape)).encode())
    h.update(mask.to(torch.int8).contiguous().numpy().tobytes())
    return h.hexdigest()


class SequentialRunner:
    """Runs calibration batches through a streamed checkpoint layer by layer.

    Args:
        reader: the checkpoint.
        data: calibration sequences.
        device / dtype: where and in which precision layers run (dtype None: the checkpoint's own).
        batch_size: sequences per batch.
        rank / world: this process's share of the batches (round-robin).
        offload_dir: keep hidden states on disk there instead of CPU memory.
        double_buffer: keep a layer's inputs until the layer is done (needed for layer transforms).
    """

    def __init__(
        self,
        reader: CheckpointReader,
        data: CalibrationData,
        device="cpu",
        dtype=None,
        batch_size: int = 8,
        rank: int = 0,
        world: int = 1,
        offload_dir=None,
        double_buffer: bool = False,
        run_key: str = "",
    ):
        from ..models import skeleton

        self.reader, self.data = reader, data
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.rank, self.world = rank, world
        self.model = skeleton(reader.config)
        self.model.eval()
        self.adapter = MoEAdapter(self.model)
        self.layers = self.adapter.decoder_layers
        self.batches = data.batches(batch_size, rank, world)
        self.cache = ActivationCache(offload_dir, double_buffer, tag=f"rank{rank}")
        self.run_key = run_key
        self._kwargs: dict[int, list[dict]] = {}  # batch -> per-layer kwargs (deduplicated by mask content)
        self._masks: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ embedding pass
    def embed(self, store_hidden: bool = True) -> None:
        """Embed every batch of this rank and capture each decoder layer's call arguments."""
        reader, model = self.reader, self.model
        reader.load_non_layer(model, self.device, self.dtype)
        n = len(self.layers)
        seen: dict[str, list[dict]] = {}
        originals = list(self.layers)
        current: dict = {}

        def sink(i, hidden, args, kwargs):
            if i == 0:
                current["hidden"] = hidden
            kw = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}
            current.setdefault("kwargs", [None] * n)[i] = kw

        for i in range(n):
            self.layers[i] = _Catcher(originals[i], i, sink, last=i == n - 1)
        try:
            base = model.base_model
            with torch.no_grad():
                for b, rows in self.batches:
                    ids = self.data.input_ids[rows]
                    mask = self.data.attention_mask[rows]
                    current.clear()
                    try:
                        base(
                            input_ids=ids.to(self.device),
                            attention_mask=mask.to(self.device),
                            use_cache=False,
                        )
                    except _Stop:
                        pass
                    key = _mask_key(ids, mask)
                    self._kwargs[b] = seen.setdefault(key, current["kwargs"])
                    self._masks[b] = mask
                    if store_hidden:
                        self.cache.write(b, current["hidden"])
        finally:
            for i in range(n):
                self.layers[i] = originals[i]
            _free_module_tensors(model, reader.layers_prefix)
        if store_hidden:
            self.cache.commit(-1, self.run_key)

    # ------------------------------------------------------------------ layer passes
    def load_layer(self, i: int) -> nn.Module:
        return self.reader.load_layer(self.model, i, self.device, self.dtype)

    def free_layer(self, i: int) -> None:
        self.reader.free_layer(self.model, i)

    @torch.no_grad()
    def run_layer(
        self,
        i: int,
        layer: nn.Module | None = None,
        observer=None,
        write: bool = True,
        on_batch: Callable | None = None,
        on_output: Callable | None = None,
        before_batch: Callable[[int], None] | None = None,
    ) -> None:
        """Push every batch through decoder layer i (optionally observed); outputs become the next inputs."""
        layer = self.layers[i] if layer is None else layer
        for b, _ in self.batches:
            if before_batch is not None:
                before_batch(b)
            h = self.cache.read(b).to(self.device)
            if observer is not None:
                observer.set_valid(self._masks[b].to(self.device))
            out = layer(h, **self._kwargs[b][i])
            out = out[0] if isinstance(out, tuple) else out
            if on_output is not None:
                on_output(i, b, out)
            if write:
                self.cache.write(b, out)
            if on_batch is not None:
                on_batch()

    def moe_passes(self):
        """Walk the decoder layers up to the last MoE layer in order, each loaded in turn: yield each MoE layer's
        index while it is loaded (the caller runs its batches, writing its outputs), run every other layer
        here; then commit the outputs and free the layer."""
        moe = self.adapter.moe_layers
        for i in range(max(moe) + 1):
            self.load_layer(i)
            if i in moe:
                yield i
            else:
                self.run_layer(i)
            self.commit(i)
            self.free_layer(i)

    def commit(self, i: int) -> None:
        self.cache.commit(i, self.run_key)

    def restore(self, after_layer: int) -> bool:
        return self.cache.restore(self.run_key, after_layer, [b for b, _ in self.batches])
