"""The runtimes a plan may be made for (`--target`): one `Target` entry each, registered here with `register_target`.

A target names the export format its runtime loads, what that runtime refuses beyond what the format holds
(`reason`), the search space `auto` keeps to for it (`space`: defaults, the values a field may take, whether every
stored expert shares one width, the non-expert classes left unquantized) and the help text the CLI prints. The CLI's
`--target` help, the refusals, `AutoConfig.target`'s validation and `auto`'s search all read `TARGETS`, so a new
runtime is one entry here (plus its export format, if it loads a new one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Space:
    """What `auto` may search for a target: fields filled in where not given (`defaults`), the values a given
    field may take (`allowed`: a list field must be a subset), whether every stored expert shares one width, the
    non-expert classes never quantized, and the clause a refusal gives."""

    defaults: dict
    allowed: dict
    one_expert_width: bool
    unquantized_classes: tuple[str, ...] = field(default=())
    why: str = ""


@dataclass(frozen=True)
class Target:
    """A runtime: its name, the format it loads (None: any, chosen by the plan), what it refuses beyond that
    format (`reason(plan)`: a clause or None), `auto`'s search space for it (None: everything) and its help."""

    name: str
    format: str | None
    help: str
    space: Space | None = None
    reason: Callable | None = None


TARGETS: dict[str, Target] = {}
DEFAULT_TARGET = "moecompress"  # every plan, in our runtime: what a run without --target makes


def register_target(target: Target) -> Target:
    TARGETS[target.name] = target
    return target


def target_names() -> str:
    """The known targets, for sentences and help: "moecompress, llama.cpp, vllm, transformers"."""
    return ", ".join(TARGETS)


def get_target(name: str) -> Target:
    """The registered target `name`, or one sentence naming the known ones."""
    from ..errors import MoECompressError

    if name not in TARGETS:
        raise MoECompressError(f"Target '{name}' is not known; use {target_names()}.")
    return TARGETS[name]


# vLLM's compressed-tensors loader: WNA16 schemes run on its Marlin kernels (4- and 8-bit, symmetric, groups below
# or per channel), for linear layers and the fused MoE alike; its lm_head takes no quantization method
VLLM_BITS, VLLM_GROUPS = (4, 8), (32, 64, 128, None)


def vllm_reason(plan) -> str | None:
    """Why vLLM cannot run `plan` from an hf checkpoint beyond what compressed-tensors itself holds (a clause), or
    None when it can."""
    quantized = [("experts", "experts", s) for s in plan.quant_specs() if s is not None]
    quantized += [(tq.kind, f"{tq.kind} weight '{name}'", tq.quant) for name, tq in plan.tensor_quant.items()]
    for kind, what, spec in quantized:
        if kind == "lm_head":
            return f"its {what} is quantized, and vLLM loads a compressed-tensors lm_head unquantized only"
        if spec.bits not in VLLM_BITS or not spec.symmetric or spec.group_size not in VLLM_GROUPS:
            return (
                f"its {what} {spec.name()} is not one of vLLM's WNA16 schemes (symmetric 4 or 8 bits, group "
                "32, 64, 128 or per channel)"
            )
    return None


STRUCTURE = dict(candidates=["reroute"], gates=["renorm"])  # what a standard router expresses

register_target(Target("moecompress", None, "every plan, in moecompress's runtime"))
register_target(
    Target(
        "llama.cpp",
        "gguf",
        "writes gguf; auto searches one expert count and one Q8_0 / Q5_0 / Q4_0 / 16-bit type per layer tensor",
        # what llama.cpp's GGUF types hold exactly (export.gguf.exact_type)
        Space(
            dict(STRUCTURE, bits=[16, 8, 5, 4], quant_group=32),
            dict(STRUCTURE, bits=[16, 8, 5, 4], quant_group=[32]),
            one_expert_width=False,
            why="one GGUF type per layer tensor: Q8_0 / Q5_0 / Q4_0 from group-32 codes",
        ),
    )
)
register_target(
    Target(
        "vllm",
        "hf",
        "writes hf; auto searches one expert count and one expert precision, 4 or 8 bits",
        Space(
            dict(STRUCTURE, bits=[16, 8, 4]),
            dict(STRUCTURE, bits=[16, 8, 4], quant_group=[32, 64, 128, None]),
            one_expert_width=True,
            unquantized_classes=("embeddings", "lm_head"),
            why="its compressed-tensors loader runs WNA16 at 4 or 8 bits, groups 32 / 64 / 128 or per channel",
        ),
        vllm_reason,
    )
)
register_target(
    Target(
        "transformers",
        "hf",
        "writes hf; auto searches one expert count and one expert precision",
        Space(
            dict(STRUCTURE),
            dict(STRUCTURE),
            one_expert_width=True,
            unquantized_classes=("embeddings",),
            why="an hf checkpoint has one expert count and one expert precision, compressed-tensors for quantized "
            "weights",
        ),
    )
)
