"""Loading a GGUF export (one ``model.gguf`` beside the original's config.json) through transformers' own GGUF
loader, for the architectures that loader reads; the others, and any GGUF whose weights it leaves unread, are
refused in one sentence (`load_gguf_dir`, `GGUFFormat.load`)."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from ..errors import MoECompressError
from ..models import parse_dtype
from ..models.families import expert_count_keys
from ..plan import PLAN_FILE, CompressionPlan
from .gguf import GGUF_FILE
from .gguf_guard import GGUFHeader, check_complete, expert_count, read_header, shown
from .readers import read_json

_SLACK = 2**20  # parameters a config may describe beyond twice the GGUF's (tied heads written out, buffers)


def _gguf_header(path: Path) -> GGUFHeader:
    """The GGUF's header, read by our own bounded reader before `gguf`'s or transformers' (`gguf_guard`), with every
    tensor its metadata implies present (`check_complete`)."""
    header = read_header(path)
    header.arch  # noqa: B018 - refuses a GGUF without an architecture
    check_complete(header)
    return header


def _refuse_unreadable(path: Path, arch: str, model_type: str) -> NoReturn:
    raise MoECompressError(
        f"{path} is a llama.cpp GGUF of architecture '{arch}' ({model_type}), which transformers' GGUF loader "
        f"(and so moecompress.load) does not load; run it in llama.cpp (llama-cli -m {path}) or export the plan "
        "with --format hf to load it here."
    )


def _config_model_type(d: Path, path: Path, arch: str) -> str:
    """The model_type config.json names, refused unless transformers' GGUF loader reads it: no code of the
    directory's (``auto_map``) ever runs for a GGUF, which only transformers' own architectures load."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    raw = read_json(d / "config.json", "config")
    model_type = raw.get("model_type")
    label = shown(str(model_type))
    if isinstance(model_type, str) and model_type in GGUF_SUPPORTED_ARCHITECTURES:
        return model_type
    if raw.get("auto_map") is not None:
        raise MoECompressError(
            f"{path} is a llama.cpp GGUF of architecture '{arch}' whose config.json names the custom model_type "
            f"'{label}' with its own code (auto_map), which transformers' GGUF loader cannot use and moecompress "
            f"does not run; run it in llama.cpp (llama-cli -m {path}) or put the original model's config.json "
            "beside it."
        )
    _refuse_unreadable(path, arch, label)


def _check_config_fits(config, header: GGUFHeader, d: Path) -> None:
    """config.json belongs to the GGUF: its layer count and hidden size are the GGUF's, and the model it describes
    has no more parameters than the file holds (twice, plus slack), so nothing is built larger than the file."""
    from ..models import skeleton

    arch, where = header.arch, d / "config.json"
    for key, attr in (("block_count", "num_hidden_layers"), ("embedding_length", "hidden_size")):
        held, said = header.integer(f"{arch}.{key}"), getattr(config, attr, None)
        if held is not None and said is not None and said != held:
            raise MoECompressError(
                f"{where} says {attr} {shown(str(said))} but {header.path} holds {held} ({arch}.{key}), so the "
                "config does not belong to this GGUF; copy the original model's config.json beside it."
            )
    elements = sum(t.n_elements for t in header.tensors.values())
    try:
        model = skeleton(config)
    except Exception:  # a class transformers cannot build: from_pretrained says so in its own sentence
        return
    implied = sum(p.numel() for p in model.parameters())
    if implied > 2 * elements + _SLACK:
        raise MoECompressError(
            f"{where} describes a model of {implied:,} parameters but {header.path} holds {elements:,}, so the "
            "config does not belong to this GGUF; copy the original model's config.json beside it."
        )


def gguf_config(d: Path, trust_remote_code: bool = False):
    """The config transformers builds a GGUF export with: the directory's config.json (transformers' GGUF config
    mapping ignores ``expert_feed_forward_length``) with the expert count the GGUF holds (a pruned export's
    config.json is the original's); refused when transformers' GGUF loader does not read the architecture, when the
    config does not belong to the GGUF, and for a GGUF our bounded reader refuses (`gguf_guard`).
    trust_remote_code: the user's flag, passed to transformers explicitly (never None, which prompts)."""
    from transformers import AutoConfig

    path = d / GGUF_FILE
    header = _gguf_header(path)
    arch = header.arch
    if not (d / "config.json").is_file():
        raise MoECompressError(
            f"{d} holds {GGUF_FILE} but no config.json beside it; copy the original model's config.json there "
            f"or run it in llama.cpp (llama-cli -m {path})."
        )
    model_type = _config_model_type(d, path, arch)
    try:
        config = AutoConfig.from_pretrained(d, trust_remote_code=bool(trust_remote_code))
    except (OSError, ValueError, KeyError, TypeError):
        raise MoECompressError(
            f"{d}/config.json is not a {model_type} config transformers reads; copy the original model's "
            "config.json beside the GGUF."
        ) from None
    apply_expert_count(config, header, d)
    _check_config_fits(config, header, d)
    return config


def apply_expert_count(config, header: GGUFHeader, d: Path) -> None:
    """Set `config`'s routed-expert count to the GGUF's (a pruned export keeps the original's config.json); a GGUF
    holding more experts than config.json's model has is refused (the config does not belong to it)."""
    experts = expert_count(header)
    if experts is None:
        return
    for key in expert_count_keys(config):
        said = getattr(config, key, None)
        if isinstance(said, int) and not isinstance(said, bool) and experts > said:
            raise MoECompressError(
                f"{header.path} holds {experts} experts a layer but {d / 'config.json'} says {key} {said}, so "
                "the config does not belong to this GGUF; copy the original model's config.json beside it."
            )
        setattr(config, key, experts)


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


def load_gguf_dir(
    d: Path, device_map=None, dtype="auto", max_memory=None, offload_folder=None, trust_remote_code=False
):
    """A directory holding ``model.gguf`` through ``AutoModelForCausalLM.from_pretrained(d, gguf_file=...)``
    (which dequantizes Q8_0 / Q4_0 to floats); the plan, when present, is attached as ``model._moecompress_plan``.
    A model some of whose weights transformers' loader did not find in the GGUF under the names it looks for
    (gpt-oss's experts and sinks: it expects other names than llama.cpp's) is refused, not returned half random;
    so is one lacking a tensor the loader would fill with zeros (`gguf_guard.check_complete`). trust_remote_code:
    the user's flag, passed explicitly (transformers prompts on a terminal when it is None)."""
    from transformers import AutoModelForCausalLM

    path = d / GGUF_FILE
    config = gguf_config(d, trust_remote_code)
    kwargs = _gguf_kwargs(dtype, device_map, max_memory, offload_folder)
    kwargs["trust_remote_code"] = bool(trust_remote_code)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, config=config, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MoECompressError(
            f"transformers could not load {path} ({first}); run it in llama.cpp (llama-cli -m {path}) or "
            "export the plan with --format hf."
        ) from None
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    if mismatched:
        raise MoECompressError(
            f"{path} holds {len(mismatched)} weights in other shapes than its config.json says (first: "
            f"{mismatched[0]}), so the config does not belong to this GGUF; copy the original model's config.json "
            "beside it."
        )
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
            (d / PLAN_FILE).read_bytes(), where=str(d / PLAN_FILE)
        )
    return model
