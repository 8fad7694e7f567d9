"""The `results` dict: what `compare`/`demo`/`eval` fill in and `write_report` turns into a report.

Plain JSON-able data (saved as results.json). Validated with the pydantic models below; unknown
keys are kept (extra="allow"), so producers may add fields without breaking the report. The
schema is documented in docs/evaluation.md ("Results schema").

    {
      "schema": "moecompress.results/1",
      "model": {"name", "path", "model_type", "architecture", "router_convention", "num_layers",
                "moe_layers", "num_experts", "top_k", "dtype", "bytes": {"disk", "resident"}},
      "calibration": {"domain", "source", "tokens", "samples", "seq_len", "seed"} | null,
      "baseline": "original",                # arm the others are compared with (default: the
                                             # first arm of kind "original", else the first arm)
      "arms": [{
          "name": "reap-50-keep", "method": "reap", "kind": "compressed",   # | original | quant_baseline
          "params": {...}, "ratio": 0.5,
          "gate_semantics": "keep",          # keep | renorm | aggregate | any sentence (quant: n/a)
          "operator": "reroute",             # replacement operator for removed slots, or null
          "mask_id": "3f2a...",              # same id = same retained-expert mask (fixed-mask comparison)
          "export_format": "hf",             # hf | compact | packed | dense | in-memory
          "path": "...",
          "bytes": {"model": int, "disk": int, "resident": int, "routed_experts": int},
          "memory": {"peak_bytes", "baseline_bytes", "peak_delta_bytes", "kind"},
          "latency": {"prefill_tok_s", "decode_tok_s", "prompt_len", "new_tokens", ...},
          "metrics": {"<task>": TaskEntry, ...},
          "per_layer": [{"layer", "experts", "retained", "remapped", "dropped"}, ...],
      }],
      "comparisons": [...],                  # written by write_report (see stats.PairedResult)
      "checklist": [...],                    # written by write_report
      "settings": {"B": 1000, "seed": 0, "alpha": 0.05},
      "notes": ["free text", ...]
    }

TaskEntry (one per lm-eval task or perplexity stream; produced by `run_lm_eval` / `evaluate_stream`):

    {"output_type": "multiple_choice" | "generate_until" | "loglikelihood" | "perplexity" | ...,
     "aggregate": {"acc": 0.41, ...}, "higher_is_better": {"acc": true, ...}, "primary": "acc",
     "n": 400, "items": {"ids": [...], "acc": [...], ...}}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import MoECompressError

SCHEMA = "moecompress.results/1"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TaskEntry(_Open):
    output_type: str | None = None
    aggregate: dict[str, Any] = Field(default_factory=dict)
    higher_is_better: dict[str, bool] = Field(default_factory=dict)
    primary: str | None = None
    n: int | None = None
    items: dict[str, list] = Field(default_factory=lambda: {"ids": []})

    @model_validator(mode="after")
    def _items_align(self):
        ids = self.items.get("ids", [])
        for k, v in self.items.items():
            if len(v) != len(ids):
                raise ValueError(f"items['{k}'] has {len(v)} values for {len(ids)} ids")
        if self.primary is None:
            self.primary = next(
                (k for k in self.higher_is_better),
                next((k for k in self.aggregate if not k.endswith("_stderr")), None),
            )
        return self


class Bytes(_Open):
    model: int | None = None
    disk: int | None = None
    resident: int | None = None
    routed_experts: int | None = None


class Arm(_Open):
    name: str
    method: str
    kind: Literal["original", "compressed", "quant_baseline", "materialized"] = "compressed"
    params: dict[str, Any] = Field(default_factory=dict)
    ratio: float | None = None
    gate_semantics: str | None = None
    operator: str | None = None
    mask_id: str | None = None
    export_format: str | None = None
    path: str | None = None
    bytes: Bytes = Field(default_factory=Bytes)
    memory: dict[str, Any] | None = None
    latency: dict[str, Any] | None = None
    metrics: dict[str, TaskEntry] = Field(default_factory=dict)
    per_layer: list[dict[str, Any]] | None = None


class ModelInfo(_Open):
    name: str | None = None
    path: str | None = None
    model_type: str | None = None
    router_convention: str | None = None


class CalibrationInfo(_Open):
    domain: str | None = None
    source: str | None = None
    tokens: int | None = None


class Results(_Open):
    schema_: str = Field(SCHEMA, alias="schema")
    model: ModelInfo = Field(default_factory=ModelInfo)
    calibration: CalibrationInfo | None = None
    baseline: str | None = None
    arms: list[Arm]
    settings: dict[str, Any] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)

    @field_validator("arms")
    @classmethod
    def _unique_names(cls, arms):
        names = [a.name for a in arms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arm names must be unique; repeated: {dup}")
        return arms

    @model_validator(mode="after")
    def _baseline(self):
        if self.baseline is None and self.arms:
            self.baseline = next((a.name for a in self.arms if a.kind == "original"), self.arms[0].name)
        if self.baseline is not None and self.baseline not in {a.name for a in self.arms}:
            raise ValueError(f"baseline '{self.baseline}' is not one of the arms")
        return self


def validate_results(results: dict) -> Results:
    """Parse a results dict; a bad field is refused with one sentence pointing at it."""
    try:
        return Results.model_validate(results)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "results"
        raise MoECompressError(
            f"The results dict is invalid at '{where}': {err['msg']}; fix that field "
            "(schema in docs/evaluation.md)."
        ) from None


def arm_bytes(arm: Arm) -> int | None:
    """The size used for quality-vs-bytes: bytes.model, else on disk, else resident."""
    b = arm.bytes
    return b.model if b.model is not None else b.disk if b.disk is not None else b.resident
