"""Helpers several verbs share: option lists and pydantic configs built from options."""

from __future__ import annotations

from pydantic import ValidationError

from ..errors import MoECompressError


def split_list(s: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']: a comma-separated option."""
    return [x.strip() for x in s.split(",") if x.strip()]


def build_config(cls, **kwargs):
    """Build a pydantic config from options; a bad option becomes one sentence naming it."""
    try:
        return cls(**kwargs)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "an option"
        raise MoECompressError(f"Option {name} is invalid: {err['msg']}.") from None
