"""A plan on disk: deterministic ``plan.json`` beside ``plan_tensors.safetensors``. The functions take the
plan class as an argument, so this module does not import it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import ValidationError

from ..errors import MoECompressError
from ..safejson import MAX_BYTES, parse_json
from .schema import PLAN_FILE, SCHEMA_VERSION, TENSORS_FILE, PlanTensors, fail


def to_json(plan) -> str:
    """Deterministic JSON: sorted keys, no None fields; same plan -> same bytes."""
    data = plan.model_dump(mode="json", exclude_none=True)
    if not data.get("tensor_quant"):
        data.pop("tensor_quant", None)  # plans without non-expert precisions serialize as before
    return json.dumps(data, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def from_json(cls, text: str | bytes, where: str = "the plan"):
    """A `cls` (the plan class) read from JSON text (or its UTF-8 bytes); one sentence naming `where` if it is
    not a valid plan. Parsed within `safejson`'s limits (nesting, number digits), so a crafted plan.json is a
    sentence too."""
    data = parse_json(text, where, "regenerate or fix it", expect=None)
    if isinstance(data, dict) and data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        fail(
            f"{where} has schema version {data.get('schema_version')}, but this moecompress reads version "
            f"{SCHEMA_VERSION}; regenerate the plan with this version."
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise MoECompressError(
            f"{where} is invalid at '{loc}': {err['msg']}; fix it (see docs/plan.md)."
        ) from None


def save(plan, directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write plan.json (+ plan_tensors.safetensors when tensors are given) into `directory`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / PLAN_FILE).write_text(to_json(plan))
    if tensors:
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().contiguous().cpu() for k, v in sorted(tensors.items())},
            str(d / TENSORS_FILE),
            metadata={"format": "pt"},
        )
    return d / PLAN_FILE


def _read_plan_bytes(file: Path) -> bytes:
    """plan.json's bytes, refused unread beyond `safejson.MAX_BYTES`."""
    size = file.stat().st_size
    if size > MAX_BYTES:
        fail(
            f"{file} is {size:,} bytes, more than the {MAX_BYTES:,} a plan.json may have; regenerate the plan."
        )
    return file.read_bytes()


def load(cls, path: str | os.PathLike) -> tuple:
    """Read a plan (a plan.json file or a directory holding one) and its tensors if present."""
    p = Path(path)
    file = p / PLAN_FILE if p.is_dir() else p
    if not file.is_file():
        fail(f"No plan at {path}: pass a plan.json file or a directory that holds one.")
    plan = cls.from_json(_read_plan_bytes(file), where=str(file))
    tensors: PlanTensors = {}
    tfile = file.parent / TENSORS_FILE
    if tfile.is_file():
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(tfile))
        except Exception:  # safetensors raises its own error types for truncated/garbled files
            fail(f"{tfile} is corrupted (not a readable safetensors file); regenerate the plan.")
    return plan, tensors
