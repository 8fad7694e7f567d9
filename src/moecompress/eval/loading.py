"""Loading a model for evaluation: in the checkpoint's own dtype, offloaded when it does not fit.

`compare` / `demo` keep the reference loaded while each arm is evaluated, so both must be held at once.
Loading them in float32 doubled a bf16 checkpoint's bytes; they are loaded in `eval.dtype` instead
(``auto``: the reference checkpoint's stored dtype, read from its safetensors headers), and every arm in
that same dtype so KL compares like with like. KL and perplexity upcast the logits to float32 before
``log_softmax`` (`metrics.evaluate_stream`; lm-eval through ``softmax_dtype``), so bf16 weights change
the model, not the numerics of the metric.

Offloading: the bytes a model needs at the evaluation dtype (its stored tensors, floating ones at that
dtype) are compared with a budget — ``eval.max_memory`` or, by default, 90 % of the memory available
when it is loaded (the reference already counted as used). A model over budget is loaded with
``device_map="auto"`` and ``max_memory`` = the budget (GPUs get their free memory), the rest offloaded
to disk by accelerate, one folder per model under the run's work directory; the arm records ``offloaded: true``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import MoECompressError

HEADROOM = 0.9  # of the available memory: activations, logits and the allocator need the rest


def eval_dtype(requested: str, reference_dir: str | Path) -> str:
    """The dtype every evaluated model is loaded in: `requested`, or for "auto" the reference's stored dtype."""
    if requested != "auto":
        return requested
    from ..disk import stored_dtype

    return stored_dtype(reference_dir) or "float32"


def eval_bytes(directory: str | Path, dtype: str) -> int:
    """Bytes a checkpoint takes in memory when loaded in `dtype`: floating tensors at `dtype`, others as stored."""
    from ..disk import DTYPES, read_header

    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total = 0
    for file in sorted(Path(directory).glob("*.safetensors")):
        for h in read_header(file).values():
            name, stored = DTYPES.get(h["dtype"], (h["dtype"].lower(), 1))
            floating = name.startswith(("float", "bfloat"))
            total += math.prod(h["shape"]) * (size if floating else stored)
    return total


def memory_budget(max_memory: str | int | None) -> int:
    """`max_memory` in bytes, or HEADROOM × the memory available now."""
    if max_memory is not None:
        from ..validate import parse_size

        return parse_size(max_memory)
    import psutil

    return int(HEADROOM * psutil.virtual_memory().available)


def _device_max_memory(budget: int) -> dict[Any, int]:
    mm: dict[Any, int] = {"cpu": budget}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            mm[i] = int(HEADROOM * torch.cuda.mem_get_info(i)[0])
    return mm


def load_for_eval(
    path: str | Path,
    dtype: str,
    *,
    max_memory: str | int | None,
    offload_dir: str | Path,
    loader: Callable[..., Any],
) -> tuple[Any, dict[str, Any]]:
    """(model, {"dtype", "offloaded", "bytes", "budget"}): `loader(path, dtype=..., **offload kwargs)` loads it.

    `loader` takes ``dtype`` and, only when offloading, ``device_map``, ``max_memory`` and
    ``offload_folder`` (`models.load_model` and `export.load` both do).
    """
    need = eval_bytes(path, dtype)
    budget = memory_budget(max_memory)
    info = {"dtype": dtype, "offloaded": need > budget, "bytes": need, "budget": budget}
    if not info["offloaded"]:
        return loader(path, dtype=dtype), info
    import tempfile

    Path(offload_dir).mkdir(parents=True, exist_ok=True)
    # one folder per model: the reference stays loaded (and reads its offloaded weights) while arms load
    folder = Path(tempfile.mkdtemp(prefix=f"{Path(path).name}-", dir=offload_dir))
    model = loader(
        path,
        dtype=dtype,
        device_map="auto",
        max_memory=_device_max_memory(budget),
        offload_folder=str(folder),
    )
    dm = getattr(model, "hf_device_map", None) or {}
    info["device_map"] = {str(d): sum(1 for v in dm.values() if v == d) for d in dict.fromkeys(dm.values())}
    return model, info


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def eval_tokenizer(source: str, trust_remote_code: bool):
    """The checkpoint's tokenizer; one sentence saying what is missing when it has none (a directory without
    tokenizer files gives transformers' tokenizer class with an empty vocabulary, which encodes text to nothing)."""
    from transformers import AutoTokenizer

    from ..export.gguf import GGUF_FILE

    d = Path(source).expanduser()
    if (d / GGUF_FILE).is_file() and not any((d / f).is_file() for f in _TOKENIZER_FILES):
        raise MoECompressError(
            f"{source} holds {GGUF_FILE} but no tokenizer files (tokenizer.json, tokenizer_config.json); copy "
            "the original model's tokenizer files beside it."
        )
    refusal = (
        f"No tokenizer could be loaded from {source}; copy the original model's tokenizer files into the "
        "checkpoint directory."
    )
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=bool(trust_remote_code))
    except (OSError, ValueError, TypeError, KeyError):
        raise MoECompressError(refusal) from None
    if len(tok) <= 2 and not tok("a b c").input_ids:
        raise MoECompressError(refusal)
    return tok
