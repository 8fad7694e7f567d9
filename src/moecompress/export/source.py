"""Where an exporter reads the original weights from, one decoder layer at a time.

A source exposes a model object (real, or a meta skeleton whose layer i is materialised between
`load_layer(i)` and `free_layer(i)`), an adapter on it, each layer's state dict (names relative to
the decoder layer) and the non-layer tensors (embeddings, final norm, head) under native names.

* `ModelSource` — a model already in memory (nothing to stream).
* `CheckpointSource` — a checkpoint directory read with `moecompress.checkpoint.CheckpointReader`,
  so exporting a checkpoint larger than RAM holds one layer at a time.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..errors import MoECompressError
from ..models import MoEAdapter


def layer_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    """The state_dict prefix of the decoder layers (e.g. 'model.layers')."""
    for name, mod in model.named_modules():
        if mod is layers:
            return name
    raise MoECompressError(
        "Cannot locate the decoder layers in the model's state dict; this architecture is "
        "not supported by the exporters."
    )


def _untied(model: nn.Module, state: dict) -> dict:
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return remove_tied_weights_from_state_dict(state, model)
    except Exception:  # a meta skeleton or an older transformers: tied names are simply both kept
        return state


class ModelSource:
    """An in-memory original model."""

    streaming = False

    def __init__(self, model: nn.Module, source_dir: str | None = None):
        from ..runtime import CompressedMoEBlock

        if any(isinstance(m, CompressedMoEBlock) for m in model.modules()):
            raise MoECompressError(
                "This model already runs a compression plan; export from the original model "
                "(or its checkpoint directory) with the plan instead."
            )
        self.model = model
        self.config = model.config
        self.adapter = MoEAdapter(model)
        self.prefix = layer_prefix(model, self.adapter.decoder_layers)
        name = source_dir or getattr(model, "name_or_path", None)
        self.source_dir = Path(name) if name and Path(name).is_dir() else None

    def load_layer(self, i: int) -> None:
        pass

    def free_layer(self, i: int) -> None:
        pass

    def layer_state(self, i: int) -> dict:
        return self.adapter.decoder_layers[i].state_dict()

    def other_state(self) -> dict:
        full = self.model.state_dict()
        return _untied(self.model, {k: v for k, v in full.items() if not k.startswith(self.prefix + ".")})

    def generation_config(self):
        return getattr(self.model, "generation_config", None)


class CheckpointSource(ModelSource):
    """A checkpoint directory streamed layer by layer into a meta skeleton."""

    streaming = True

    def __init__(self, path: str, reader_cls):
        from ..models import skeleton

        self.reader = reader_cls(path)
        self.config = self.reader.config
        self.model = skeleton(self.config)
        self.adapter = MoEAdapter(self.model)
        self.prefix = layer_prefix(self.model, self.adapter.decoder_layers)
        self.source_dir = Path(self.reader.path)  # a hub id resolves to its local snapshot

    def load_layer(self, i: int) -> None:
        self.reader.load_layer(self.model, i, device="cpu")
        if i in self.adapter.layers:  # the reader may have swapped modules: re-read the handles
            found = self.adapter._detect_layer(i, self.adapter.decoder_layers[i])
            if found is not None:
                self.adapter.layers[i] = found

    def free_layer(self, i: int) -> None:
        self.reader.free_layer(self.model, i)

    def other_state(self) -> dict:
        return dict(self.reader.other_state())

    def generation_config(self):
        return None


def open_source(model_or_path, streaming: bool = True):
    """A `ModelSource` for a model, a `CheckpointSource` for a directory or hub id (or, without the
    streaming reader, the loaded model)."""
    if isinstance(model_or_path, nn.Module):
        return ModelSource(model_or_path)
    from ..models import load_model, resolve_source

    src = resolve_source(model_or_path)
    if streaming:  # a directory or a hub id (the reader resolves it to the local snapshot)
        try:
            from ..checkpoint import CheckpointReader
        except ImportError:
            CheckpointReader = None
        if CheckpointReader is not None:
            return CheckpointSource(src, CheckpointReader)
    return ModelSource(load_model(src), source_dir=src if Path(src).is_dir() else None)
