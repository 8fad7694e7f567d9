"""Streaming access to a safetensors checkpoint, one decoder layer at a time.

A `CheckpointReader` never loads the whole model: it indexes the shards' headers once, maps every
on-disk key to the model's native ``state_dict()`` name with transformers' own conversion
machinery (``conversion_mapping.get_model_conversion_mapping`` + ``core_model_loading``: the same
renamings and converters ``from_pretrained`` applies, e.g. per-expert ``experts.3.gate_proj.weight``
keys merged into the fused ``experts.gate_up_proj``), and reads only the tensors of the layer asked
for (``safe_open`` + ``get_slice``, memory-mapped, handles closed after each read so the mapped pages
leave the resident set).

Typical use (the calibration runner and the exporters)::

    reader = CheckpointReader(path)
    model = skeleton(reader.config)                 # meta device, no memory
    reader.load_non_layer(model, "cpu", torch.bfloat16)
    layer = reader.load_layer(model, 3)             # decoder layer 3 materialised
    ...
    reader.free_layer(model, 3)                     # back to meta
"""

from __future__ import annotations

import functools
import inspect
import re
from copy import deepcopy
from pathlib import Path

import torch
from torch import nn

from ..disk import read_weight_map, tag_bytes
from ..errors import MoECompressError
from ..memory import release_freed_memory

__all__ = ["CheckpointReader", "checkpoint_fingerprint", "legacy_fingerprint"]


def _checkpoint_dir(path: str) -> Path:
    """A local directory for `path` (a hub id is resolved through the local cache / hub snapshot)."""
    from ..models.loading import hub_reachable, resolve_source

    src = resolve_source(path)
    if Path(src).is_dir():
        return Path(src)
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                src,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"],
                local_files_only=not hub_reachable(),
            )
        )
    except Exception:
        raise MoECompressError(
            f"Could not fetch {src} from the HuggingFace hub (offline or unknown id); download "
            "the checkpoint where the hub is reachable and pass its local directory."
        ) from None


def _index_shards(root: Path) -> dict[str, Path]:
    """On-disk key -> shard file, from model.safetensors.index.json or the shards' own headers."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_weight_map(index)  # every shard confined to the checkpoint directory
        missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if missing:
            raise MoECompressError(
                f"The checkpoint at {root} is missing shard {missing[0]} named by its index; "
                "re-download the complete checkpoint."
            )
        return {k: root / f for k, f in weight_map.items()}
    shards = sorted(root.glob("*.safetensors"))
    if not shards and (root / "model.gguf").is_file():  # a GGUF export: evaluation only, never a source
        raise MoECompressError(
            f"{root} holds a GGUF (model.gguf), which moecompress only evaluates and loads (eval, load); "
            "calibrate and compress the original safetensors checkpoint instead."
        )
    if not shards:
        raise MoECompressError(
            f"{root} holds no .safetensors weights; convert the checkpoint to safetensors "
            "(pickled .bin weights are never loaded)."
        )
    out: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                out.update(dict.fromkeys(f.keys(), shard))
        except Exception:
            raise MoECompressError(
                f"{shard} is not a readable safetensors file: the checkpoint is corrupted; re-download it."
            ) from None
    return out


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Install `value` as parameter or buffer `name` of `root` (replacing a meta placeholder)."""
    path, _, leaf = name.rpartition(".")
    module = root.get_submodule(path) if path else root
    if leaf in module._buffers:
        module._buffers[leaf] = value
    elif leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        raise KeyError(name)


def _recreate_buffers(module: nn.Module, device) -> bool:
    """Recompute non-persistent buffers (rotary inv_freq) of a meta module by re-instantiating it on `device`."""
    cls = type(module)
    cfg = getattr(module, "config", None)
    params = inspect.signature(cls.__init__).parameters
    try:
        if cfg is not None and "device" in params:
            fresh = cls(config=cfg, device=device) if "config" in params else cls(cfg, device=device)
        elif cfg is not None:
            with torch.device(device):
                fresh = cls(cfg)
        else:
            return False
    except Exception:
        return False
    for name, buf in fresh.named_buffers(recurse=False):
        module._buffers[name] = buf.to(device)
    return True


class CheckpointReader:
    """Read one decoder layer (or the non-layer tensors) of a safetensors checkpoint at a time.

    Attributes:
        path: the checkpoint directory.
        config: its transformers config.
        layers_prefix: native name of the decoder-layer ModuleList (``model.layers``).
        num_layers: number of decoder layers.
    """

    def __init__(self, path: str, trust_remote_code: bool = False):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        from ..models import MoEAdapter, load_config, skeleton

        self.path = _checkpoint_dir(str(path))
        self.config = load_config(str(self.path), trust_remote_code)
        self._key_file = _index_shards(self.path)
        self._skeleton = skeleton(self.config)  # private: names, shapes and the conversion mapping
        self.layers_prefix, self.num_layers = self._find_layers(self._skeleton, MoEAdapter)
        meta_sd = self._skeleton.state_dict()
        mapping = get_model_conversion_mapping(self._skeleton)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
        prefix = self._skeleton.base_model_prefix

        # native key -> (converter template or None, [(on-disk key, source pattern)]), in from_pretrained's order
        self._targets: dict[str, tuple[object | None, list[tuple[str, str]]]] = {}
        self.unexpected_keys: list[str] = []
        for key in sorted(self._key_file, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
            if renamed not in meta_sd and key in meta_sd:
                renamed, pattern = rename_source_key(key, [], [], prefix, meta_sd)
            if renamed not in meta_sd:
                self.unexpected_keys.append(key)  # e.g. DeepSeek-V3's multi-token-prediction layer
                continue
            template = pattern_to_converter[pattern] if pattern is not None else None
            entry = self._targets.setdefault(renamed, (template, []))
            entry[1].append((key, pattern if pattern is not None else key))

        layer_re = re.compile(rf"^{re.escape(self.layers_prefix)}\.(\d+)\.")
        self._by_layer: dict[int | None, list[str]] = {}
        for native in self._targets:
            m = layer_re.match(native)
            self._by_layer.setdefault(int(m.group(1)) if m else None, []).append(native)

    # ------------------------------------------------------------------ structure
    @staticmethod
    def _find_layers(model: nn.Module, adapter_cls) -> tuple[str, int]:
        layers = adapter_cls(model).decoder_layers
        for name, module in model.named_modules():
            if module is layers:
                return name, len(layers)
        raise MoECompressError(
            "Cannot locate the decoder layers of this checkpoint's model class; "
            "it is not supported (see docs/models.md)."
        )

    def fingerprint(self) -> str:
        """The identity of the weights: a hash of every byte (see `checkpoint_fingerprint`)."""
        return checkpoint_fingerprint(self.path)

    def converts(self, i: int | None) -> bool:
        """Does reading layer i (None: the rest) merge or reshape on-disk tensors (e.g. per-expert keys)?"""
        return any(self._targets[n][0] is not None for n in self._by_layer.get(i, []))

    def layer_keys(self, i: int) -> list[str]:
        """On-disk keys that make up decoder layer i."""
        return [k for native in self._by_layer.get(i, []) for k, _ in self._targets[native][1]]

    def layer_bytes(self, i: int | None) -> int:
        """Bytes on disk of decoder layer i (None: the non-layer tensors)."""
        from safetensors import safe_open

        keys = [k for native in self._by_layer.get(i, []) for k, _ in self._targets[native][1]]
        total = 0
        for shard, group in self._group_by_shard(keys).items():
            with safe_open(str(shard), framework="pt") as f:
                for k in group:
                    sl = f.get_slice(k)
                    n = 1
                    for s in sl.get_shape():
                        n *= s
                    total += n * tag_bytes(sl.get_dtype(), 4)
        return total

    def _group_by_shard(self, keys) -> dict[Path, list[str]]:
        out: dict[Path, list[str]] = {}
        for k in keys:
            out.setdefault(self._key_file[k], []).append(k)
        return out

    # ------------------------------------------------------------------ reading
    def _state(self, natives: list[str]) -> dict[str, torch.Tensor]:
        """Read and convert the given native keys (on-disk dtype, CPU)."""
        from safetensors import safe_open

        def read(key: str) -> torch.Tensor:
            # one handle per on-disk key: closing it unmaps the pages just copied out of the shard, so a native
            # tensor merged from per-expert keys never has all of its source pages resident at once
            with safe_open(str(self._key_file[key]), framework="pt") as f:
                return f.get_slice(key)[...]

        out: dict[str, torch.Tensor] = {}
        for native in natives:
            template, sources = self._targets[native]
            if template is None:
                out[native] = read(sources[0][0])
                continue
            conv = deepcopy(template)
            for key, pattern in sources:
                conv.add_tensor(native, key, pattern, functools.partial(read, key))
            realized = conv.convert(native, model=self._skeleton, config=self.config)
            for name, value in realized.items():
                out[name] = value[0] if isinstance(value, list) else value
        return out

    def native_state(self, i: int) -> dict[str, torch.Tensor]:
        """Decoder layer i's tensors under native ``model.state_dict()`` names, in the on-disk dtype."""
        if not 0 <= i < self.num_layers:
            raise MoECompressError(
                f"Layer {i} does not exist; the checkpoint has {self.num_layers} decoder layers."
            )
        return self._state(self._by_layer.get(i, []))

    def read_tensors(self, natives: list[str]) -> dict[str, torch.Tensor]:
        """Only the given tensors (native names; on-disk dtype, CPU), without materialising their layer: what the
        quantization of non-expert weights reads (`methods.tensor_quant`)."""
        unknown = [n for n in natives if n not in self._targets]
        if unknown:
            raise MoECompressError(
                f"The checkpoint at {self.path} has no tensor '{unknown[0]}'; it does not match "
                "its config.json."
            )
        return self._state(list(natives))

    def other_state(self) -> dict[str, torch.Tensor]:
        """Every tensor outside the decoder layers (embeddings, final norm, lm_head, ...), native names."""
        return self._state(self._by_layer.get(None, []))

    # ------------------------------------------------------------------ materialising
    def _install(self, model: nn.Module, state: dict[str, torch.Tensor], device, dtype) -> None:
        from ..models.loading import dtype_target

        target = dtype_target(model, dtype)
        expected = dict(model.state_dict(keep_vars=True))
        for name, t in state.items():
            ref = expected.get(name)
            if ref is None:
                continue
            if tuple(t.shape) != tuple(ref.shape):
                raise MoECompressError(
                    f"Tensor {name} has shape {tuple(t.shape)} in the checkpoint but the config "
                    f"implies {tuple(ref.shape)}: the checkpoint does not match its config.json."
                )
            _set_tensor(model, name, t.to(device=device, dtype=target(name, t)))

    def load_layer(self, model: nn.Module, i: int, device="cpu", dtype=None) -> nn.Module:
        """Materialise decoder layer i of the meta skeleton `model` from the shards; returns the layer module.

        dtype None keeps the on-disk dtype (like ``dtype="auto"``); parameters the model class keeps in
        float32 (``_keep_in_fp32_modules_strict``) stay float32 as from_pretrained would leave them.
        """
        state = self.native_state(i)
        self._install(model, state, device, parse_dtype_or_none(dtype))
        layer = model.get_submodule(f"{self.layers_prefix}.{i}")
        self._check_materialised(layer, f"{self.layers_prefix}.{i}", device)
        return layer

    def load_non_layer(self, model: nn.Module, device="cpu", dtype=None) -> None:
        """Materialise embeddings, final norm, lm_head (tied if the config says so) and rotary buffers."""
        self._install(model, self.other_state(), device, parse_dtype_or_none(dtype))
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        layers = model.get_submodule(self.layers_prefix)
        for name, module in model.named_modules():
            if module is layers or name.startswith(self.layers_prefix + "."):
                continue
            if any(b.is_meta for b in module.buffers(recurse=False)):
                _recreate_buffers(module, device)
        for name, t in model.named_parameters(remove_duplicate=False):
            if not name.startswith(self.layers_prefix + ".") and t.is_meta:
                raise MoECompressError(
                    f"The checkpoint at {self.path} has no tensor for {name}: it is incomplete; "
                    "re-download it."
                )

    def free_layer(self, model: nn.Module, i: int) -> None:
        """Return decoder layer i to the meta device (its memory is released)."""
        layer = model.get_submodule(f"{self.layers_prefix}.{i}")
        for module in layer.modules():
            for n, p in list(module._parameters.items()):
                if p is not None and not p.is_meta:
                    module._parameters[n] = nn.Parameter(
                        torch.empty_like(p, device="meta"), requires_grad=False
                    )
            for n, b in list(module._buffers.items()):
                if b is not None and not b.is_meta:
                    module._buffers[n] = torch.empty_like(b, device="meta")
        release_freed_memory()

    def _check_materialised(self, layer: nn.Module, prefix: str, device) -> None:
        for module in layer.modules():
            if any(b.is_meta for b in module.buffers(recurse=False)):
                _recreate_buffers(module, device)
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if t.is_meta:
                raise MoECompressError(
                    f"The checkpoint at {self.path} has no tensor for {prefix}.{name}: it is "
                    "incomplete or does not match its config.json; re-download it."
                )


def parse_dtype_or_none(dtype):
    if dtype is None or dtype == "auto":
        return None
    from ..models import parse_dtype

    return parse_dtype(dtype)


FINGERPRINT_SCHEME = "sha256-full/1"  # the prefix of every fingerprint `checkpoint_fingerprint` gives
_CHUNK = 16 * 2**20  # bytes hashed per read
_SHARD_DIGESTS: dict[tuple, str] = {}  # (path, device, inode, size, mtime, ctime) -> sha256 of the whole file


def checkpoint_fingerprint(path: str | Path) -> str:
    """``sha256-full/1:<hex>``: the identity of a checkpoint, which changes when any byte of any tensor does.

    sha256 over config.json, the shard index and, for every shard, its name, size and the sha256 of all its
    bytes (streamed in 16 MiB reads, shards hashed on up to 4 threads; about 1-2 GB/s, so ~1 min for a 100 GB
    checkpoint). A shard's digest is kept for the process, keyed on its inode, size, modification and change
    times, so a run that fingerprints its model several times (at the start, again before its rename) reads
    the weights once; a file rewritten in place changes its change time (ctime), which no user can set back,
    and a file changed in the last 2 s is hashed again every time (a change in the same clock tick).

    Earlier versions sampled 4 x 64 KiB of each shard (a bare 64-digit hex digest): a changed tensor went
    unnoticed, so such a recorded fingerprint never equals this one (`legacy_fingerprint`) and stores or
    interrupted runs that carry one are refused with a sentence saying to recalibrate (docs/calibration.md)."""
    import hashlib

    root = Path(path)
    h = hashlib.sha256(FINGERPRINT_SCHEME.encode())
    for name in ("config.json", "model.safetensors.index.json"):
        if (root / name).is_file():
            h.update(f"\n{name}\n".encode())
            h.update((root / name).read_bytes())
    shards = sorted(root.glob("*.safetensors"))
    for shard, digest in zip(shards, _shard_digests(shards)):
        h.update(f"\n{shard.name}:{shard.stat().st_size}:{digest}".encode())
    return f"{FINGERPRINT_SCHEME}:{h.hexdigest()}"


def legacy_fingerprint(fingerprint) -> bool:
    """Whether a recorded fingerprint is of the sampled kind earlier versions wrote (it proves nothing about
    the weights), not `checkpoint_fingerprint`'s."""
    return isinstance(fingerprint, str) and not fingerprint.startswith(FINGERPRINT_SCHEME + ":")


def _shard_digests(shards: list[Path]) -> list[str]:
    """sha256 of every byte of each shard, from the process's cache where the file is unchanged since."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    def key(shard: Path) -> tuple:
        st = shard.stat()
        return (str(shard.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    started = time.time_ns()
    keys = [key(s) for s in shards]
    todo = [(s, k) for s, k in zip(shards, keys) if k not in _SHARD_DIGESTS]
    if len(todo) > 1:
        with ThreadPoolExecutor(max_workers=min(4, len(todo))) as pool:  # hashlib releases the GIL
            digests = list(pool.map(lambda sk: _file_sha256(sk[0]), todo))
    else:
        digests = [_file_sha256(s) for s, _ in todo]
    fresh = dict(zip((k for _, k in todo), digests))
    for (s, k), d in zip(todo, digests):
        # kept only for a file unchanged while hashed and last changed over 2 s before (a change within the
        # same timestamp tick would leave the key as it was: git's "racy" rule)
        if key(s) == k and started - max(k[4], k[5]) > 2 * 10**9:
            _SHARD_DIGESTS[k] = d
    return [fresh[k] if k in fresh else _SHARD_DIGESTS[k] for k in keys]


def _file_sha256(file: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
