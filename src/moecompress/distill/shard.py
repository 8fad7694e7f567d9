"""Where the frozen teacher lives under each distributed setup of the Trainer.

The Trainer (accelerate under it) shards only the model it trains, the student; the teacher is ours to
place, and `place_teacher` picks the layout from the Trainer's accelerator:

* FSDP2 (`distributed_type: FSDP`, `fsdp_version: 2`): `fully_shard` on each teacher decoder layer (and
  the embeddings and LM head) and then on the root, frozen, `reshard_after_forward=True`, on the student's
  device mesh. Each rank keeps 1/N of the teacher's parameters (DTensor shards) plus, during the teacher's
  forward, the unit all-gathered for it (one layer at a time, FSDP2 may prefetch the next). The teacher
  is sharded from the CPU copy it was loaded into: `fully_shard` moves one unit at a time to the device
  and keeps only the local shard there, so the whole teacher is never on one device.
* DeepSpeed ZeRO-3: the teacher gets its own ZeRO-3 engine without an optimizer (ZeRO-3 inference: the
  engine partitions the parameters it is given and gathers each module's around its forward) — the layout
  HF's TRL uses for frozen reference models. Imported only in that mode; not run on the development
  machine (no GPU, no deepspeed), see docs/dense.md.
* anything else (one device, DDP, FSDP1, ZeRO-1/2): the whole teacher on every device, as before.

The teacher passed in is sharded in place (its parameters become shards); every rank must then run each
teacher forward, which `DistillTrainer` does (all ranks compute every loss and every validation).
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import nn

from ..errors import MoECompressError
from ..models import MoEAdapter

Placement = Literal["replicated", "fsdp2", "zero3"]
# DeepSpeed values that transformers fills from the trained model at `deepspeed_init` time ("auto" until
# then); the teacher's engine is built earlier, so they are filled here with transformers' own formulas
_ZERO3_FROM_HIDDEN = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def teacher_placement(accelerator) -> Placement:
    """The teacher's layout for the Trainer's `accelerator` (module doc)."""
    if accelerator.is_fsdp2:
        return "fsdp2"
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        return "zero3"
    return "replicated"


def fsdp2_mesh(accelerator):
    """The device mesh accelerate shards the student on (its FSDP dimensions), or None for the default
    world mesh `fully_shard` builds itself (what accelerate uses when no parallelism config is set)."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        return None
    return mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]


def fsdp2_units(teacher: nn.Module) -> list[nn.Module]:
    """The teacher's FSDP2 units below the root: each decoder layer, the input embeddings and the LM head
    (when not tied to the embeddings). Each is gathered only for its own forward; the root keeps the rest
    (final norm, rotary buffers) and a tied embedding, gathered for the whole forward."""
    units = list(MoEAdapter(teacher).decoder_layers)
    emb, head = teacher.get_input_embeddings(), teacher.get_output_embeddings()
    if head is not None and emb is not None and head.weight is emb.weight:
        return units  # a tied weight must sit in one unit: the root's
    return units + [m for m in (emb, head) if m is not None]


def shard_fsdp2(teacher: nn.Module, mesh=None, offload_policy=None) -> nn.Module:
    """Shard the frozen `teacher` with FSDP2: `fully_shard` on each of `fsdp2_units`, then on the root,
    every unit resharded after its forward. Returns the same module."""
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy, fully_shard

    if isinstance(teacher, FSDPModule):  # already sharded (the same teacher distilled twice in one process)
        return teacher
    teacher.eval().requires_grad_(False)
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": True,
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    for unit in fsdp2_units(teacher):
        fully_shard(unit, **kwargs)
    fully_shard(teacher, **kwargs)
    return teacher


def zero3_inference_config(ds_config: dict, hidden_size: int) -> dict:
    """The student's DeepSpeed config turned into one for a frozen ZeRO-3 teacher: no optimizer or
    scheduler, stage 3, and the model-dependent "auto" bucket sizes set from the teacher's hidden size."""
    cfg = copy.deepcopy(ds_config)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    for key, value in _ZERO3_FROM_HIDDEN.items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value(hidden_size)
    return cfg


def shard_zero3(teacher: nn.Module, ds_config: dict):
    """The frozen `teacher` partitioned by its own ZeRO-3 engine (no optimizer); returns the engine,
    called like the model. Needs deepspeed (imported here only)."""
    try:
        import deepspeed
    except ImportError:
        raise MoECompressError(
            "The accelerate config selects DeepSpeed ZeRO-3 but deepspeed is not installed; "
            "`pip install deepspeed` or use configs/accelerate/fsdp2.yaml."
        ) from None
    teacher.eval().requires_grad_(False)
    engine, *_ = deepspeed.initialize(
        model=teacher, config=zero3_inference_config(ds_config, int(teacher.config.hidden_size))
    )
    engine.eval()
    return engine


def place_teacher(teacher: nn.Module, accelerator, device: torch.device, expanded_top_k: int | None = None):
    """The frozen teacher laid out for the Trainer's `accelerator` (module doc); call it on every rank."""
    placement = teacher_placement(accelerator)
    if placement == "fsdp2":
        plugin = getattr(
            accelerator.state, "fsdp_plugin", None
        )  # its offload policy applies to the teacher too
        return shard_fsdp2(
            teacher, fsdp2_mesh(accelerator), plugin.cpu_offload if plugin is not None else None
        )
    if placement == "zero3":
        if expanded_top_k is not None:
            # ZeRO-3 gathers a module's parameters in that module's forward hooks; the expanded teacher
            # replaces the MoE blocks by modules the engine never hooked, so their experts stay partitioned
            raise MoECompressError(
                "An expanded teacher (--expanded-top-k) is not supported under DeepSpeed "
                "ZeRO-3; use configs/accelerate/fsdp2.yaml or drop --expanded-top-k."
            )
        return shard_zero3(teacher, accelerator.state.deepspeed_plugin.deepspeed_config)
    return teacher.to(device).eval().requires_grad_(False)
