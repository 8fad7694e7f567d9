"""How exports are read back: the runtime's checkpoints into `CompressedMoEBlock`s, vanilla ones with transformers.

Each format class names its reader (`formats.Format.load`); `load.load` dispatches on the format an
export's marker records. The naming the runtime checkpoints share with their writers lives here too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..disk import read_weight_map
from ..errors import MoECompressError
from ..models import MoEAdapter, load_model, parse_dtype, skeleton
from ..models.sizes import check_config_sizes
from ..plan import PLAN_FILE, CompressionPlan
from ..runtime import CompressedMoEBlock, build_ops, empty_scope
from .writer import INDEX_FILE

SCOPE_PREFIX = (
    "moecompress.scopes."  # a scope's stored experts in a runtime checkpoint: SCOPE_PREFIX + <scope id>.
)
BASE_CONFIG_FILE = (
    "base_config.json"  # a runtime checkpoint's config, not config.json (see `Format.runtime_tensors`)
)


def read_json(path: Path, what: str) -> dict:
    """The JSON object in `path`, parsed within `safejson`'s limits; one sentence naming `what` otherwise."""
    from ..safejson import load_json

    return load_json(path, f"the {what} is corrupted, so re-export it")


def _shards(d: Path) -> list[Path]:
    if (d / INDEX_FILE).is_file():
        names = sorted(set(read_weight_map(d / INDEX_FILE).values()))
    else:
        names = ["model.safetensors"]
    files = [d / n for n in names]
    for f in files:
        if not f.is_file():
            raise MoECompressError(
                f"{d} lacks the weights file {f.name}: the checkpoint is incomplete; re-export it."
            )
    return files


def _set_tensor(model: nn.Module, name: str, t: torch.Tensor, where: Path) -> None:
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        mod = None
    slot = None
    if mod is not None and attr in mod._parameters:
        slot = mod._parameters
    elif mod is not None and attr in mod._buffers and mod._buffers[attr] is not None:
        slot = mod._buffers
    if slot is not None:
        _check_shape(slot[attr], t, name, where)
        slot[attr] = nn.Parameter(t, requires_grad=False) if slot is mod._parameters else t
    else:
        raise MoECompressError(
            f"{where} holds tensor '{name}', which this model does not have: the file is foreign "
            "or belongs to another plan; re-export the checkpoint."
        )


def _check_shape(ref: torch.Tensor, t: torch.Tensor, name: str, where: Path) -> None:
    if tuple(ref.shape) != tuple(t.shape):
        raise MoECompressError(
            f"{where} holds '{name}' with shape {tuple(t.shape)} but its plan implies "
            f"{tuple(ref.shape)}: the weights and plan.json do not belong together; re-export."
        )


def load_runtime(
    d: Path, device_map=None, dtype="auto", max_memory=None, offload_folder=None, trust_remote_code=False
):
    """A runtime checkpoint (`compact`, `packed`): the base model skeleton with a `CompressedMoEBlock` per
    MoE layer, filled from the shards; the plan is attached as ``model._moecompress_plan``. Every tensor the
    skeleton and the plan's scopes expect must be in the shards (a fused gate_up_proj included), else one sentence.
    trust_remote_code is accepted for the loaders' common signature and unused: the skeleton's class is always
    transformers' own for base_config.json's model_type, never code from the directory."""
    model, plan, scopes, want = _runtime_skeleton(d, dtype)
    single = isinstance(device_map, (str, torch.device)) and str(device_map) != "auto"
    device = str(device_map) if single else "cpu"
    from ..runtime.tensor_quant import quantized_names

    quantized = quantized_names(plan)  # packed key -> the non-expert weight it belongs to (plan.tensor_quant)
    held: dict[str, torch.Tensor] = {}
    for shard in _shards(d):
        _read_shard(shard, device, model, scopes, quantized, held, want)
    for name in plan.tensor_quant:  # dequantized into the module's weight (runtime.tensor_quant)
        _set_tensor(model, name, _dequantized_weight(plan, held, name, model, d), d)
    model.tie_weights()
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p is not None and p.is_meta:
            raise MoECompressError(
                f"{d} lacks tensor '{name}': the checkpoint is incomplete or corrupted; re-export it."
            )
    _check_quantized_slots(scopes.values(), d)
    if single:
        model.to(device)
    elif device_map is not None:
        model = _dispatch(model, device_map, max_memory, offload_folder)
    _load_generation_config(model, d)
    model.eval()
    model._moecompress_plan = plan
    return model


def _runtime_skeleton(d: Path, dtype):
    """`load_runtime`'s empty model: the base config's skeleton on the meta device with a `CompressedMoEBlock`
    per MoE layer of the plan; returns (model, plan, scopes by id, the dtype asked for or None)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not (d / BASE_CONFIG_FILE).is_file() or not (d / PLAN_FILE).is_file():
        raise MoECompressError(
            f"{d} is marked compact but lacks {BASE_CONFIG_FILE} or {PLAN_FILE}: the checkpoint "
            "is incomplete; re-export it."
        )
    cfg = read_json(d / BASE_CONFIG_FILE, "base config")
    if cfg.get("model_type") not in CONFIG_MAPPING:
        raise MoECompressError(
            f"{d / BASE_CONFIG_FILE} names model_type '{cfg.get('model_type')}', which the installed "
            "transformers does not know; upgrade transformers."
        )
    config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    check_config_sizes(config, d, str(d / BASE_CONFIG_FILE), skeleton, cfg)  # before anything allocates
    plan = CompressionPlan.from_json((d / PLAN_FILE).read_bytes(), where=str(d / PLAN_FILE))
    file_dtype = getattr(torch, plan.model.dtype)
    want = parse_dtype(dtype) if dtype not in (None, "auto") else None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=want or file_dtype)
    adapter = MoEAdapter(model)
    plan.check_model(adapter)
    scopes: dict[str, nn.Module] = {}
    for sc in plan.scopes:
        first = adapter.layer(sc.layers[0])
        scopes[sc.id] = empty_scope(plan, sc, first, want or file_dtype, config=model.config)
        for i in sc.layers:
            layer, lp = adapter.layer(i), plan.layer(i)
            ops = build_ops(plan, lp, layer, None, want or file_dtype, "meta", fill=False)
            adapter.set_block(i, CompressedMoEBlock(layer, lp, scopes[sc.id], ops, adapter.returns_tuple))
    return model, plan, scopes, want


def _read_shard(shard: Path, device: str, model, scopes: dict, quantized, held: dict, want) -> None:
    """Fill `model` and the `scopes` from one shard; a quantized non-expert weight's codes go to `held`
    (dequantized by the caller). A corrupted shard is one sentence."""
    from safetensors import safe_open

    try:
        with safe_open(str(shard), framework="pt", device=device) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                t = f.get_tensor(key)
                if t.device.type == "cpu" and t.data_ptr() % 64:
                    # mmap-backed at an unaligned file offset: copy, so kernels (and results) match memory
                    t = t.clone()
                if key in quantized:  # a quantized non-expert weight's codes: dequantized below
                    held[key] = t
                    continue
                _place_tensor(shard, key, t, model, scopes, want)
    except MoECompressError:
        raise
    except Exception as exc:  # safetensors reports truncation / bad headers with its own error types
        raise MoECompressError(
            f"{shard} is corrupted ({type(exc).__name__}); re-export the checkpoint."
        ) from None


def _place_tensor(shard: Path, key: str, t: torch.Tensor, model, scopes: dict, want) -> None:
    """Set tensor `key` of `shard` in its scope (a ``SCOPE_PREFIX`` key) or in `model`, cast to `want` unless
    it is packed."""
    # PuzzleMoE packed words and quantized scales stay exactly as stored
    packed = (".merged." in key or "_weight_" in key) and key.startswith(SCOPE_PREFIX)
    if want is not None and t.is_floating_point() and not packed:  # packed tensors stay as stored
        t = t.to(want)
    if key.startswith(SCOPE_PREFIX):
        rest = key[len(SCOPE_PREFIX) :]
        sid = max((s for s in scopes if rest.startswith(s + ".")), key=len, default=None)
        if sid is None:
            raise MoECompressError(
                f"{shard} holds tensor '{key}' for a scope the plan does not "
                "define: the file is foreign or belongs to another plan; re-export."
            )
        _set_tensor(scopes[sid], rest[len(sid) + 1 :], t, shard)
    else:
        _set_tensor(model, key, t, shard)


def _dispatch(model, device_map, max_memory, offload_folder):
    """`model` dispatched over `device_map` (a dict, or one inferred within `max_memory`) by accelerate."""
    from accelerate import dispatch_model, infer_auto_device_map

    # the weights were read into memory above; dispatch moves what exceeds max_memory to disk
    dm = (
        device_map
        if isinstance(device_map, dict)
        else infer_auto_device_map(
            model,
            max_memory=max_memory,
            no_split_module_classes=getattr(model, "_no_split_modules", None),
        )
    )
    model = dispatch_model(model, device_map=dm, offload_dir=offload_folder)
    model.hf_device_map = dm
    return model


def _load_generation_config(model, d: Path) -> None:
    """Set `model`'s generation config from `d` when it has a readable one."""
    gen_file = d / "generation_config.json"
    if gen_file.is_file():
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(str(d))
        except Exception:  # a broken generation config only loses sampling defaults
            pass


def _dequantized_weight(plan, held: dict, name: str, model: nn.Module, d: Path) -> torch.Tensor:
    """Weight `name` of a quantized non-expert tensor, dequantized to the dtype the skeleton holds it in; one
    sentence when its packed tensors are missing or do not hold the plan's shape."""
    from ..quant.tensor import check_packed
    from ..runtime.tensor_quant import dequantized, packed_of

    tq = plan.tensor_quant[name]
    found = packed_of(held, name)
    need = {"weight_packed", "weight_scale", "weight_shape"} | (
        set() if tq.quant.symmetric else {"weight_zero_point"}
    )
    if not need <= set(found):
        raise MoECompressError(
            f"{d} lacks the quantized tensors of '{name}': the checkpoint is incomplete or "
            "corrupted; re-export it."
        )
    if tuple(check_packed(found, tq.quant, f"The quantized weight '{name}' in {d}")) != tuple(tq.shape):
        raise MoECompressError(
            f"{d} holds '{name}' quantized with another shape than its plan's {tuple(tq.shape)}: "
            "the weights and plan.json do not belong together; re-export."
        )
    ref = model.get_parameter(name)
    return dequantized(plan, held, name, ref.dtype)


def _check_quantized_slots(scopes, d: Path) -> None:
    """Every quantized stored expert's ``weight_shape`` agrees with its packed tensors' shapes (which loading
    checked against the plan), before any forward unpacks them (`quant.tensor.check_packed`)."""
    from ..quant.tensor import check_packed
    from ..runtime.quantized import PARTS, StoredExpertSlot

    for scope in scopes:
        for m in scope.modules():
            if isinstance(m, StoredExpertSlot) and m.spec is not None:
                for part in PARTS:
                    check_packed(
                        {
                            s: getattr(m, f"{part}_{s}")
                            for s in ("weight_packed", "weight_scale", "weight_shape")
                        },
                        m.spec,
                        f"The {part} projection of a stored expert in {d}",
                    )


def load_transformers(
    d: Path, device_map=None, dtype="auto", max_memory=None, offload_folder=None, trust_remote_code=False
):
    """A vanilla checkpoint (`hf`, `materialized`, or any HF checkpoint) with plain transformers; the plan,
    when present, is attached as ``model._moecompress_plan``. trust_remote_code: the user's flag (`load_model`)."""
    model = load_model(
        str(d),
        dtype=dtype or "auto",
        device_map=device_map,
        max_memory=max_memory,
        offload_folder=offload_folder,
        trust_remote_code=bool(trust_remote_code),
    )
    if (d / PLAN_FILE).is_file():
        model._moecompress_plan = CompressionPlan.from_json(
            (d / PLAN_FILE).read_bytes(), where=str(d / PLAN_FILE)
        )
    return model
