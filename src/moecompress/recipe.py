"""YAML recipes: data describing one compression arm, or a file of several arms sharing settings.

    model: path/or/hub-id
    calibration: {data: fixture-calib:64, seq_len: 256, seed: 0}
    eval: {ppl: fixture-heldout, tasks: [fixture_cloze, fixture_nextword], limit: 200}
    name: reap-50-keep            # optional; derived from method + params otherwise
    quant: w4g128                 # optional: quantize the stored experts (a spec, or {quant, algo, weighting}), and
                                  # other tensor classes: {experts: w4g128, attention: w8g128, embeddings: w8c}
    method: prune
    params: {criterion: reap, ratio: 0.5, gate: keep}
    format: auto                  # auto | hf | compact | packed | materialized | gguf

A file may instead hold ``arms: [{name, method, params, format}, ...]`` beside the shared
``model``/``calibration``/``eval`` keys; an arm may name its own ``calibration`` (its domain), which
only the arms naming the same spec share.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from .errors import MoECompressError
from .methods.quantize import QuantConfig
from .validate import SAFE_NAME, SEED_MAX, check_name


class CalibrationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("fixture-calib:64", description="data spec (or a stats directory)")
    seq_len: int = Field(256, gt=0)
    seed: int = Field(0, ge=0, le=SEED_MAX)
    batch_size: int = Field(8, gt=0)


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ppl: str | None = Field("fixture-heldout", description="text spec for perplexity and KL")
    window: int = Field(256, gt=1)
    max_tokens: int | None = Field(16384, description="cap on perplexity tokens")
    tasks: list[str] = Field(default_factory=lambda: ["fixture_cloze", "fixture_nextword"])
    limit: int | None = Field(200, description="documents per lm-eval task")
    num_fewshot: int | None = None
    batch_size: int = 8
    latency: bool = Field(True, description="measure prefill/decode tokens/s and peak memory")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype the reference and every arm are loaded in for evaluation; auto = the "
        "reference checkpoint's stored dtype (logits are upcast to float32 for KL and perplexity)",
    )
    max_memory: str | None = Field(
        None,
        description="memory for one evaluated model (e.g. '40GB'); a model needing more is loaded with "
        "device_map offloading. Default: 90% of the memory available when it is loaded",
    )
    quant_baselines: list[str] = Field(
        default_factory=lambda: ["w4g128", "w3g128"],
        description="pure-quantization reference arms (method 'quant', GPTQ) on the routed experts: specs such as "
        "w4g128 (a bare bit width b means w<b>g128)",
    )

    @field_validator("max_memory")
    @classmethod
    def _size(cls, v):
        if v is None:
            return v
        from .validate import parse_size

        try:
            ok = parse_size(v) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"'{v}' is not a positive size; write it like 40GB or 512MB")
        return v

    @field_validator("quant_baselines", mode="before")
    @classmethod
    def _bits_to_specs(cls, v):
        return [f"w{x}g128" if isinstance(x, int) and not isinstance(x, bool) else x for x in (v or [])]


class ArmSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    method: str
    params: dict[str, Any] = Field(default_factory=dict)
    format: str = "auto"
    distill: dict[str, Any] | None = Field(
        None,
        description="dense arms only: knowledge-distillation settings (moecompress.distill.DistillConfig, "
        "e.g. {tokens: 65536, data: fixture-calib}) applied to the student before evaluation",
    )
    quant: QuantConfig | None = Field(
        None,
        description="weight quantization of every stored expert the method keeps: a spec such as w4g128, or "
        "{quant: w4g128, algo: gptq|rtn, weighting: uniform|gate2}; non-expert tensor classes by name ({experts: "
        "w4g128, attention: w8g128, shared: w4g128, embeddings: w8c}) or scope: all",
    )
    _config: BaseModel | None = PrivateAttr(None)  # the method's validated config (`load_recipe`)
    calibration: CalibrationSpec | None = Field(
        None,
        description="this arm's own calibration (e.g. in-domain: {data: 'task:gsm8k:128'}); default: the "
        "recipe's shared one. Arms naming the same spec share one calibration; every arm is still scored on the "
        "same evaluation items",
    )

    @field_validator("quant", mode="before")
    @classmethod
    def _spec_shorthand(cls, v):
        return {"quant": v} if isinstance(v, str) else v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str | None) -> str | None:
        # the name becomes a checkpoint directory under --out: no separators, no '..'
        if v is not None and not SAFE_NAME.match(v):
            raise ValueError(
                "may hold only letters, digits, '.', '_', '+' and '-' and must start with a letter or digit"
            )
        return v

    @property
    def config(self) -> BaseModel | None:
        """The method's config, validated once when the recipe was loaded (None before)."""
        return self._config

    @config.setter
    def config(self, value: BaseModel) -> None:
        self._config = value

    def display_name(self) -> str:
        if self.name:
            return self.name
        p = self.params
        bits = [self.method] + [str(p[k]) for k in ("criterion", "operator", "gate", "scope_size") if k in p]
        if "ratio" in p:
            try:
                bits.append(f"{round(100 * float(p['ratio']))}")
            except (TypeError, ValueError, OverflowError):
                bits.append(str(p["ratio"]))
        if self.method == "quant":
            bits.append(f"{p.get('quant', 'w4g128')}-{p.get('algo', 'gptq')}")
        name = "-".join(bits) + (_quant_tag(self.quant) if self.quant else "")
        return check_name(name, "The derived arm name")


def _quant_tag(q: QuantConfig) -> str:
    """An arm name's quantization part: ``+w4g128-gptq`` (routed experts), then ``-all`` and ``-attention-w8g32``
    ... for the non-expert classes (issue 30)."""
    tag = f"+{q.quant}-{q.algo}" if q.quant is not None else "+"
    if q.scope == "all":
        tag += "-all"
    for cls, spec in sorted((q.classes or {}).items()):
        tag += f"-{cls}-{spec}"
    return tag.replace("+-", "+")


class Recipe(BaseModel):
    """Shared settings plus one or more arms."""

    model_config = ConfigDict(extra="forbid")

    model: str
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    arms: list[ArmSpec] = Field(default_factory=list)
    seed: int = Field(0, ge=0, le=SEED_MAX)


def _err(where: str, exc: ValidationError) -> MoECompressError:
    e = exc.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "recipe"
    return MoECompressError(f"{where}: field '{loc}' is invalid ({e['msg']}); fix the recipe.")


def parse_recipe(data: dict, where: str = "recipe") -> Recipe:
    """A recipe dict (single-arm or multi-arm form) -> Recipe, with one-sentence errors."""
    if not isinstance(data, dict):
        raise MoECompressError(f"{where} must be a YAML mapping with model, method and params.")
    data = dict(data)
    single = {k: data.pop(k) for k in ("name", "method", "params", "format", "distill", "quant") if k in data}
    if single:
        if "method" not in single:
            raise MoECompressError(f"{where}: field 'method' is missing; name the compression method.")
        data.setdefault("arms", []).append(single)
    try:
        recipe = Recipe(**data)
    except ValidationError as exc:
        raise _err(where, exc) from None
    from .methods import parse_config

    for arm in recipe.arms:
        try:
            arm.config = parse_config(arm.method, arm.params)  # validated once; compress takes this object
        except MoECompressError as exc:
            raise MoECompressError(f"{where}: {exc}") from None
    return recipe


MAX_RECIPE_NODES = 100_000


def _check_size(data, path) -> None:
    """Refuse a recipe of more than MAX_RECIPE_NODES values once YAML aliases are expanded.

    `safe_load` shares an aliased node instead of copying it, so a "billion laughs" file of nested aliases
    loads small, then grew past 5.9 GB when a field was copied or written out (a `distill:` block). Real
    recipes hold a few hundred values; the count stops at the limit, so a bomb costs nothing to refuse."""
    todo, seen = [data], 0
    while todo:
        node = todo.pop()
        seen += 1
        if seen > MAX_RECIPE_NODES:
            raise MoECompressError(
                f"{path} expands to more than {MAX_RECIPE_NODES:,} values (nested YAML "
                "aliases?); write the recipe out plainly."
            )
        if isinstance(node, dict):
            todo.extend(node.keys())
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


class _DuplicateKey(Exception):
    def __init__(self, key, where: str):
        super().__init__(key)
        self.where = where


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a mapping naming one key twice (YAML itself keeps the last silently, so
    ``ratio: 0.25`` then ``ratio: 0.75`` ran with 0.75 without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: explicit keys may override it
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class gives its own error
                break
            if duplicate:
                raise _DuplicateKey(key, f" (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: str | os.PathLike, model: str | None = None) -> Recipe:
    """The one loader of recipe files (`compare`, `demo` and `compress --recipe`).

    `model`: the model named on the command line; it fills (and overrides) the recipe's `model`.
    """
    p = Path(path)
    if not p.is_file():
        raise MoECompressError(f"No recipe at {path}; pass a YAML recipe file.")
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as exc:
        raise MoECompressError(
            f"{path} sets '{str(exc)[:80]}' twice{exc.where}; keep one (YAML would silently take the last)."
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise MoECompressError(
            f"{path} is not valid YAML ({str(exc).splitlines()[0]}); fix the file."
        ) from None
    except RecursionError:
        raise MoECompressError(f"{path} nests too deeply to be a recipe; fix the file.") from None
    _check_size(data, path)
    if model is not None and isinstance(data, dict):
        data = dict(data, model=model)
    return parse_recipe(data, where=str(path))


def merge_recipes(recipes: list[Recipe]) -> Recipe:
    """One recipe with every arm; the shared settings must agree (one calibration serves all arms)."""
    first = recipes[0]
    for r in recipes[1:]:
        for key in ("model", "calibration", "eval"):
            if getattr(r, key) != getattr(first, key):
                raise MoECompressError(
                    f"The recipes disagree on '{key}'; arms compared together must share the "
                    "model, the calibration and the evaluation settings."
                )
    arms = [a for r in recipes for a in r.arms]
    names = [a.display_name() for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MoECompressError(f"Two arms are both named '{dup[0]}'; give them distinct 'name' fields.")
    if not arms:
        raise MoECompressError("The recipes define no arms; add 'method' and 'params' (or an 'arms' list).")
    return first.model_copy(update={"arms": arms})
