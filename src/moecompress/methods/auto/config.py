"""`auto`'s recipe: `AutoConfig` and its validation, the budget (`parse_budget`, `routed_budget`) and the
statistics a config needs (`needs_stats`).

Byte accounting: every byte is counted at the checkpoint's on-disk dtype (``ModelInfo``), whatever
dtype the model is computed in, and the budget is a fraction of the original routed-expert bytes as
stored, or an absolute size of the routed experts (``budget: 4GB``; ``parse_budget``). ``accounting``:
``stored`` (default) counts what the compact checkpoint stores — the runtime pads a layer's tilts to
its largest rank and partial copies to their largest width — so the budget holds for the plan's
logical bytes and for the checkpoint's tensors; ``logical`` counts unpadded bytes. The plan's final
bytes come from ``CompressionPlan.logical_bytes`` (the one byte count) and must equal the solver's.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...errors import MoECompressError
from ...plan import ModelInfo
from ...validate import parse_size
from .quant import quant_stats
from .target import target_defaults

CandidateName = Literal["reroute", "drop", "constant", "tilt", "partial", "remap", "pair"]
ALL_CANDIDATES = ("reroute", "drop", "constant", "tilt", "partial", "remap", "pair")
ALL_BITS = (16, 8, 4, 3, 2)


def parse_budget(value) -> tuple[float | None, int | None]:
    """A budget as (fraction, None) or (None, bytes), of what `AutoConfig.budget_scope` counts: the whole file's
    weights (default) or the routed experts'.

    A plain number in (0, 1] is a fraction of those bytes in the original as stored on disk;
    ``"50%"`` is the same as 0.5; a size with a unit is an absolute byte count: decimal
    ``B``, ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000) or binary ``KiB``, ``MiB``, ``GiB``, ``TiB``
    (powers of 1024), case-insensitive, e.g. ``"4GB"``, ``"500MB"``, ``"1.5GiB"``.
    """
    bad = (
        f"Budget '{value}' is not a fraction in (0, 1] or a size such as 4GB, 500MB or 1.5GiB; "
        "pass e.g. --budget 0.5 or --budget 500MB."
    )
    if isinstance(value, bool):
        raise MoECompressError(bad)
    if isinstance(value, (int, float)):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise MoECompressError(bad)
        return float(value), None
    text = str(value).strip()
    if text.endswith("%"):
        try:
            return parse_budget(float(text[:-1]) / 100)
        except ValueError:
            raise MoECompressError(bad) from None
    try:
        number = float(text)  # a bare number is a fraction here, not bytes
    except ValueError:
        number = None
    if number is not None:
        return parse_budget(number)
    try:
        nbytes = parse_size(text)
    except ValueError:
        raise MoECompressError(bad) from None
    if nbytes <= 0:
        raise MoECompressError(bad)
    return None, nbytes


class AutoConfig(BaseModel):
    """Budget-optimal mixed compression recipe."""

    model_config = ConfigDict(extra="forbid")

    budget: float | None = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="bytes kept, as a fraction of the original's "
        "as stored on disk (of the whole file's weights, or of the routed experts': "
        "budget_scope); a size string ('4GB', '500MiB') sets budget_bytes",
    )
    budget_bytes: int | None = Field(
        None,
        gt=0,
        description="absolute budget at the checkpoint's dtypes: the whole "
        "file's weights, or the routed experts' (stored experts + operators) with "
        "budget_scope routed; overrides budget",
    )
    budget_scope: Literal["whole", "routed"] = Field(
        "whole",
        description="whole: the budget counts every weight of the file, and auto also chooses a precision "
        "for the non-expert weights (tensor_classes); routed: it counts the routed experts only, every other "
        "tensor stays as it is",
    )
    target: str = Field(
        "moecompress",
        description="the runtime the plan must run in, one of plan/targets.py's `TARGETS` (moecompress: "
        "everything; each other target's search space is its entry's `space`): auto/target.py",
    )
    tensor_classes: list[str] | None = Field(
        None,
        description="non-expert classes auto may quantize with budget_scope whole (attention, shared, "
        "dense_mlp, embeddings, lm_head; never the router); None: every one the model has, []: none",
    )
    candidates: list[CandidateName] = Field(
        default_factory=lambda: list(ALL_CANDIDATES),
        description="representations a removed slot may take (keep is implicit)",
    )
    ranks: list[int] = Field(
        default_factory=lambda: [8, 32], description="tilt ranks (and partial-copy budgets)"
    )
    gates: list[Literal["renorm", "keep"]] = Field(
        default_factory=lambda: ["renorm", "keep"], description="gate scales a reroute-style layer may use"
    )
    fit: Literal["weighted", "unweighted"] = Field(
        "weighted", description="gate²-weighted operator fits, or exactly the prune method's operators"
    )
    ridge: float = Field(1e-3, ge=0.0, description="scale-free ridge of the tilt fits")
    cross_fit: bool = Field(
        True,
        description="score fitted operators out of sample: fit on one half of the "
        "calibration batches, score on the other (weighted fits)",
    )
    accounting: Literal["stored", "logical"] = Field(
        "stored",
        description="bytes as the compact checkpoint "
        "stores them (padding included) or the plan's logical bytes",
    )
    search: Literal["full", "fast"] = Field(
        "fast",
        description="fast: quantized keeps priced from round-to-nearest codes scaled by one GPTQ chunk per layer, "
        "GPTQ only for the chosen widths, and unless given candidates [reroute, drop] and sensitivity global; "
        "full: every candidate, GPTQ of every expert at every width, probes per layer and kind "
        "(docs/auto.md, 'Fast search')",
    )
    sensitivity: Literal["kind", "probe", "noise", "global", "uniform"] = Field(
        "kind",
        description="KL per unit of estimated error: kind = per layer and representation (probe of the "
        "layer compressed with that representation alone at the budget ratio); probe = per layer (the layer's own "
        "frontier state at the budget ratio); noise = per layer, Gaussian noise of known energy; global = one "
        "factor for every layer, from noise in all of them at once; uniform = 1",
    )
    sensitivity_sequences: int = Field(
        8, ge=1, description="calibration sequences for sensitivity/measurement"
    )
    sensitivity_seq_len: int = Field(128, ge=8)
    noise: float = Field(
        0.05, gt=0.0, description="sensitivity noise energy relative to the layer's output energy"
    )
    measure: bool = Field(
        True, description="measure each layer's KL (full search only) and the whole plan's (a few forwards)"
    )
    pair_partners: int | None = Field(
        None,
        ge=1,
        description="nearest experts tried as PuzzleMoE partners "
        "(None: every other expert up to 32 experts, else 8)",
    )
    bits: list[Literal[16, 8, 5, 4, 3, 2]] = Field(
        default_factory=lambda: list(ALL_BITS),
        description="bit widths a kept expert may take (16 = unquantized, "
        "the checkpoint's dtype); [16] is structure only",
    )
    quant_group: Literal[32, 64, 128] | None = Field(
        128, description="quantization group along the input dimension (None: per output channel)"
    )
    quant_algo: Literal["gptq", "rtn"] = Field("gptq", description="how quantized keeps choose their codes")
    quant_weighting: Literal["gate2", "uniform"] = Field(
        "gate2",
        description="GPTQ Hessians: gate²-weighted "
        "(the objective the estimator scores) or every routed token",
    )
    divergence_stages: int = Field(
        5,
        ge=0,
        description="with budget_scope whole on a 16-bit checkpoint (target moecompress): the leading stages "
        "(embeddings, then each layer's attention and MLP) whose served-precision divergence auto measures and "
        "may keep exact (auto/divergence.py); 0: off",
    )
    divergence_sequences: int = Field(
        64, ge=1, description="calibration sequences (of sensitivity_seq_len tokens) of the divergence probe"
    )
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _budget(cls, data):
        """``budget`` may be a size: it then becomes ``budget_bytes`` (one sentence if it is neither); a target
        fills in its search space (`target.target_defaults`)."""
        data = search_defaults(target_defaults(data))
        if isinstance(data, dict) and data.get("budget") is not None:
            fraction, nbytes = parse_budget(data["budget"])
            if nbytes is not None:
                if data.get("budget_bytes") is not None:
                    raise MoECompressError(
                        "Give the auto budget once: a size in budget or budget_bytes, not both."
                    )
                data = {**data, "budget": None, "budget_bytes": nbytes}
            else:
                data = {**data, "budget": fraction}
        return data

    @model_validator(mode="after")
    def _check(self):
        if any(r < 1 for r in self.ranks):
            raise ValueError("ranks must be positive (the constant is candidate 'constant')")
        if "reroute" in self.candidates and not self.gates:
            raise ValueError("reroute needs at least one gate")
        if self.budget_scope == "routed" and self.tensor_classes:
            raise ValueError(
                "tensor_classes need budget_scope whole: a routed budget counts the routed experts only, "
                "so it has no bytes to give other tensors"
            )
        if 16 not in self.bits:
            raise ValueError(
                "bits must include 16 (every layer starts from its unquantized experts); "
                "e.g. bits: [16, 4, 2]"
            )
        return self

    @property
    def proxy_pricing(self) -> bool:
        """Quantized keeps priced from round-to-nearest codes, GPTQ only for the chosen widths (fast search)."""
        return self.search == "fast" and self.quant_algo == "gptq"

    @property
    def quant_bits(self) -> list[int]:
        """The bit widths below 16, decreasing."""
        return sorted({b for b in self.bits if b < 16}, reverse=True)


FAST_DEFAULTS = {"candidates": ["reroute", "drop"], "sensitivity": "global"}


def search_defaults(data):
    """``search: fast`` (the default) fills in its candidates and sensitivity where not given."""
    if not isinstance(data, dict) or data.get("search", "fast") != "fast":
        return data
    return {**data, **{k: v for k, v in FAST_DEFAULTS.items() if data.get(k) is None}}


def hessians_only(config: AutoConfig) -> bool:
    """Whether GPTQ's Hessians are the only square statistics `config` reads (no operator fit, remap or pair)."""
    return set(config.candidates) <= {"reroute", "drop"}


def needs_stats(config: AutoConfig) -> list[str]:
    c = set(config.candidates)
    names = {"counts", "tokens", "auto_g2", "auto_g2_y", "auto_g2_yy", "auto_sample"}
    if "tilt" in c:
        names |= {"auto_g2_x", "auto_g2_xx", "auto_g2_xy"}
        if config.fit == "unweighted":
            names |= {
                "moment_experts",
                "moment_count",
                "moment_in_mean",
                "moment_out_mean",
                "input_moment",
                "cross_moment",
            }
    if "constant" in c and config.fit == "unweighted":
        names.add("out_mean")
    if "partial" in c:
        names |= {"auto_g2_a", "auto_g2_aa"}
        if config.fit == "unweighted":
            names |= {"mid_channel_norm", "mid_mean"}
    if "remap" in c:
        names.add("auto_remap")
    if "reroute" in c:
        names |= {"auto_reroute_keep", "auto_reroute_renorm"}
    if "pair" in c:
        names |= {"in_channel_norm", "mid_channel_norm"}  # PuzzleMoE saliency
    if config.cross_fit and config.fit == "weighted" and c & {"constant", "tilt", "partial"}:
        names |= {f"{n}_f1" for n in names if n.startswith("auto_g2")}
    names |= quant_stats(config.bits, config.quant_algo, config.quant_weighting)
    return sorted(names)


def routed_budget(config: AutoConfig, info: ModelInfo) -> int:
    """Bytes allowed in the budget's scope: budget_bytes, or the fraction of the original's bytes as stored (the
    whole file's weights, or the routed experts' with budget_scope routed)."""
    if config.budget_bytes is not None:
        return config.budget_bytes
    return math.floor((0.5 if config.budget is None else config.budget) * scope_bytes(config, info))


def scope_bytes(config: AutoConfig, info: ModelInfo) -> int:
    """The original's bytes the budget is a fraction of."""
    return info.expert_bytes + (info.other_bytes if config.budget_scope == "whole" else 0)
