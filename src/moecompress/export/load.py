"""`load`: read any export back, through the reader of the format its marker names (`formats.FORMATS`).

A moecompress export records its format in ``moecompress.json``; the format class says how its
checkpoints load (`Format.load`: the runtime's for compact/packed, plain transformers for hf /
materialized). A directory without the marker but with a config.json is a plain HF checkpoint.
A GGUF export (one ``model.gguf``) loads through transformers' own GGUF loader for the architectures that
loader reads, and is refused in one sentence for the others (`gguf_load.load_gguf_dir`, also `GGUFFormat.load`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MoECompressError
from .core import MARKER_FILE
from .formats import FORMATS
from .gguf import GGUF_FILE
from .gguf_arith import check_arithmetic, emulate_llama_cpp
from .gguf_load import load_gguf_dir
from .readers import load_transformers, read_json


def load(
    path,
    device_map=None,
    dtype="auto",
    max_memory=None,
    offload_folder=None,
    arithmetic="exact",
    trust_remote_code=False,
):
    """Load an export: ``compact`` / ``packed`` into the runtime, ``hf`` / ``materialized`` (or any HF checkpoint)
    with plain transformers, ``gguf`` with transformers' GGUF loader where it reads the architecture; the plan,
    when present, is attached as ``model._moecompress_plan``.
    max_memory / offload_folder: accelerate's offloading with ``device_map="auto"``.
    arithmetic: ``exact``, or ``llama.cpp`` to compute as llama.cpp does from the plan's GGUF (a compact export in
    float32; `gguf_arith.emulate_llama_cpp`).
    trust_remote_code: whether the directory's own modeling code may run (passed to transformers explicitly, never
    None, which makes it prompt on a terminal); a GGUF never needs it."""
    check_arithmetic(arithmetic)
    model = _load(path, device_map, dtype, max_memory, offload_folder, bool(trust_remote_code))
    return emulate_llama_cpp(model) if arithmetic == "llama.cpp" else model


def _load(path, device_map, dtype, max_memory, offload_folder, trust_remote_code=False):
    d = Path(path).expanduser()
    if not d.exists():
        raise MoECompressError(f"No checkpoint at {path}: pass the directory an export wrote.")
    if not d.is_dir():
        raise MoECompressError(f"{path} is a file; pass the checkpoint directory an export wrote.")
    marker_file = d / MARKER_FILE
    if marker_file.is_file():
        name = read_json(marker_file, "moecompress marker").get("format")
        fmt = FORMATS.get(name) if isinstance(name, str) else None
        if fmt is None:
            raise MoECompressError(
                f"{marker_file} names format '{name}', which this moecompress cannot read; "
                "upgrade moecompress or re-export."
            )
        return fmt.load(d, device_map, dtype, max_memory, offload_folder, trust_remote_code=trust_remote_code)
    safetensors = ("model.safetensors", "model.safetensors.index.json")
    # a GGUF beside its config.json, no marker
    if (d / GGUF_FILE).is_file() and not any((d / n).is_file() for n in safetensors):
        return load_gguf_dir(d, device_map, dtype, max_memory, offload_folder, trust_remote_code)
    if not (d / "config.json").is_file():
        raise MoECompressError(
            f"{path} is neither a moecompress export nor a HuggingFace checkpoint (no "
            f"{MARKER_FILE} or config.json); pass the directory an export wrote."
        )
    return load_transformers(d, device_map, dtype, max_memory, offload_folder, trust_remote_code)
