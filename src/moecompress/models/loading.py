"""Loading HF MoE checkpoints (local directory or hub id) with clear failures."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from ..errors import MoECompressError
from ..safejson import load_json
from .sizes import check_config_sizes

_DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype):
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise MoECompressError(f"Unknown dtype '{name}'; use one of {', '.join(_DTYPES)}.") from None


def resolve_fixture(source: str | os.PathLike) -> str:
    """`fixture:NAME` -> the shipped fixture directory (the one place every verb resolves it); else unchanged."""
    source = str(source)
    if not source.startswith("fixture:"):
        return source
    name = source.split(":", 1)[1]
    root = Path(__file__).resolve().parent.parent / "fixtures"
    names = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []
    if name not in names:
        raise MoECompressError(
            f"Unknown fixture '{name}'; the shipped fixtures are {', '.join(names) or 'missing'}"
            " (use a full clone of moecompress if none are listed)."
        )
    return str(root / name)


def resolve_source(source: str | os.PathLike) -> str:
    """A local directory path (`fixture:NAME` included), or a hub id; a missing local path is refused here."""
    source = resolve_fixture(source)
    p = Path(source).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise MoECompressError(f"{source} has no config.json: pass a HuggingFace checkpoint directory.")
        return str(p)
    if p.exists():
        raise MoECompressError(
            f"{source} is a file, not a checkpoint directory: pass the directory holding "
            "config.json and the safetensors weights."
        )
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise MoECompressError(
            f"No model directory at {source}: pass an existing local checkpoint directory "
            "or a hub id such as Qwen/Qwen3-30B-A3B."
        )
    return source


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or huggingface.co cannot be resolved/connected quickly."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _offline_kwargs(src: str) -> dict:
    # hub ids while offline still load from the local HF cache, without minutes of retries
    return {} if Path(src).is_dir() or hub_reachable() else {"local_files_only": True}


def load_config(source: str, trust_remote_code: bool = False):
    """The transformers config of a directory or hub id. A local config.json is parsed within `safejson`'s limits
    first, and its sizes are checked against the safetensors headers beside it (`check_config_sizes`)."""
    from transformers import AutoConfig

    trust_remote_code = bool(trust_remote_code)  # None would make transformers prompt on a terminal
    src = resolve_source(source)
    local = Path(src).is_dir()
    raw = (
        load_json(Path(src) / "config.json", "the checkpoint is corrupted, so re-download it")
        if local
        else {}
    )
    try:
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code, **_offline_kwargs(src))
    except (OSError, ValueError, KeyError) as exc:
        if Path(src).is_dir():
            raise MoECompressError(
                f"Unknown architecture '{str(raw.get('model_type'))[:80]}' in {src}: the installed transformers does not know it; "
                "upgrade transformers or pass --trust-remote-code if you trust the checkpoint's code."
            ) from None
        raise MoECompressError(
            f"Could not fetch {src} from the HuggingFace hub ({'offline' if not hub_reachable() else type(exc).__name__}); "
            "download the checkpoint where the hub is reachable and pass its local directory."
        ) from None
    if local:
        check_config_sizes(config, src, f"{src}/config.json", skeleton, raw)
    return config


# torch's default dtype is one per process: `from_config` sets it to the config's dtype and back, and so does
# `StreamedAdapter` around it. Two threads doing so at once (calibrations run in threads of one process) restore
# each other's value, and the process was left with bfloat16 as its default; they take turns instead.
DEFAULT_DTYPE_LOCK = threading.RLock()


def dtype_target(model, dtype: torch.dtype | None):
    """(name, tensor) -> the dtype from_pretrained gives that tensor when `model` loads in `dtype` (None: the
    tensor's own): floating tensors take `dtype` unless the model class keeps them in float32
    (``_keep_in_fp32_modules_strict``, through ``_get_dtype_plan``); others keep theirs."""
    from transformers.core_model_loading import build_glob_alternation

    def target(name: str, t: torch.Tensor) -> torch.dtype:
        if not t.is_floating_point():
            return t.dtype
        want = dtype or t.dtype
        plan = model._get_dtype_plan(want) if hasattr(model, "_get_dtype_plan") else {}
        if plan:
            alt, by_group, _ = build_glob_alternation(list(plan))
            m = alt.search(name)
            if m is not None:
                return plan[by_group[m.lastgroup]]
        return want

    return target


def skeleton(config):
    """The model with every parameter on the meta device: structure without memory."""
    from transformers import AutoModelForCausalLM

    with DEFAULT_DTYPE_LOCK, torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def load_model(
    source: str,
    dtype="auto",
    device_map=None,
    trust_remote_code: bool = False,
    experts_implementation: str | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
):
    """Load a causal LM from a directory or hub id (safetensors only, never pickled weights).

    device_map / max_memory / offload_folder go to `from_pretrained` (accelerate offloading). trust_remote_code goes
    to transformers as a bool, never None (which makes it prompt on a terminal). A checkpoint lacking weights the
    model has (transformers would initialise them at random) is refused in one sentence."""
    from transformers import AutoModelForCausalLM

    from ..disk import read_weight_map

    trust_remote_code = bool(trust_remote_code)

    config = load_config(source, trust_remote_code)
    src = resolve_source(source)
    index = Path(src) / "model.safetensors.index.json"
    if index.is_file():  # transformers would open whatever shard path the index names
        read_weight_map(index)
    kwargs = dict(
        dtype=parse_dtype(dtype),
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        **_offline_kwargs(src),
    )
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    if offload_folder is not None:
        kwargs["offload_folder"] = offload_folder
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    try:
        model, info = AutoModelForCausalLM.from_pretrained(src, config=config, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MoECompressError(
            f"Could not load weights from {src} ({first}); check that the directory holds "
            "complete safetensors weights for this config."
        ) from None
    missing = sorted(str(k) for k in info.get("missing_keys") or ())
    if missing:
        raise MoECompressError(
            f"{src} lacks {len(missing)} of its model's weights (first: {missing[0]}), which would be "
            "initialised at random; re-export or re-download the complete checkpoint."
        )
    model.eval()
    return model
