"""Loading a GGUF export (one ``model.gguf`` beside the original's config.json) through transformers' own GGUF
loader, for the architectures that loader reads; the others, and any GGUF whose weights it leaves unread, are
refused in one sentence (`load_gguf_dir`, `GGUFFormat.load`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import MoECompressError
from ..models import parse_dtype
from ..models.families import expert_count_keys
from ..plan import PLAN_FILE, CompressionPlan
from .gguf import GGUF_FILE


def _gguf_header(path: Path) -> tuple[str, int | None]:
    """The GGUF's ``general.architecture`` and ``{arch}.expert_count`` (None when it has none)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
        field = reader.fields.get(f"{arch}.expert_count")
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise MoECompressError(
            f"{path} is not a readable GGUF file (corrupted or truncated); re-export it with --format gguf."
        ) from None
    return str(arch), None if field is None else int(field.contents())


def _refuse_unreadable(path: Path, arch: str, model_type: str):
    raise MoECompressError(
        f"{path} is a llama.cpp GGUF of architecture '{arch}' ({model_type}), which transformers' GGUF loader "
        f"(and so moecompress.load) does not load; run it in llama.cpp (llama-cli -m {path}) or export the plan "
        "with --format hf to load it here."
    )


def gguf_config(d: Path):
    """The config transformers builds a GGUF export with: the directory's config.json (transformers' GGUF config
    mapping ignores ``expert_feed_forward_length``) with the expert count the GGUF holds (a pruned export's
    config.json is the original's); refused when transformers' GGUF loader does not read the architecture."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    path = d / GGUF_FILE
    arch, experts = _gguf_header(path)
    if not (d / "config.json").is_file():
        raise MoECompressError(
            f"{d} holds {GGUF_FILE} but no config.json beside it; copy the original model's config.json there "
            f"or run it in llama.cpp (llama-cli -m {path})."
        )
    try:
        config = AutoConfig.from_pretrained(d)
    except (OSError, ValueError, KeyError):
        raise MoECompressError(
            f"{d}/config.json is not a config transformers reads; re-export the checkpoint."
        ) from None
    if config.model_type not in GGUF_SUPPORTED_ARCHITECTURES:
        _refuse_unreadable(path, arch, config.model_type)
    if experts is not None:
        for key in expert_count_keys(config):
            setattr(config, key, experts)
    return config


def _gguf_kwargs(dtype, device_map, max_memory, offload_folder) -> dict:
    kwargs = {"dtype": parse_dtype(dtype or "auto"), "output_loading_info": True}
    for key, value in (
        ("device_map", device_map),
        ("max_memory", max_memory),
        ("offload_folder", offload_folder),
    ):
        if value is not None:
            kwargs[key] = value
    return kwargs


def load_gguf_dir(d: Path, device_map=None, dtype="auto", max_memory=None, offload_folder=None):
    """A directory holding ``model.gguf`` through ``AutoModelForCausalLM.from_pretrained(d, gguf_file=...)``
    (which dequantizes Q8_0 / Q4_0 to floats); the plan, when present, is attached as ``model._moecompress_plan``.
    A model some of whose weights transformers' loader did not find in the GGUF under the names it looks for
    (gpt-oss's experts and sinks: it expects other names than llama.cpp's) is refused, not returned half random."""
    from transformers import AutoModelForCausalLM

    path = d / GGUF_FILE
    config = gguf_config(d)
    kwargs = _gguf_kwargs(dtype, device_map, max_memory, offload_folder)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, config=config, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MoECompressError(
            f"transformers could not load {path} ({first}); run it in llama.cpp (llama-cli -m {path}) or "
            "export the plan with --format hf."
        ) from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise MoECompressError(
            f"transformers' GGUF loader left {len(missing)} weights of {path} unread (first: {missing[0]}), so the "
            f"model would be partly random; run it in llama.cpp (llama-cli -m {path}) or export the plan with "
            "--format hf to load it here."
        )
    model.eval()
    if (d / PLAN_FILE).is_file():
        model._moecompress_plan = CompressionPlan.from_json(
            (d / PLAN_FILE).read_text(), where=str(d / PLAN_FILE)
        )
    return model
