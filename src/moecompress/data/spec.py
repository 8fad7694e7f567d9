"""Data spec strings: ``c4:128``, ``wikitext2@test``, ``path/to/file.jsonl#text:64``, ``a:64+b:64``.

Grammar (one term per source, ``+`` between terms)::

    spec  := term ('+' term)*
    term  := source ['@' split] [':' count]
    source:= hub name (c4, wikitext2, fineweb-edu, gsm8k) | fixture name (fixture-calib, fixture-heldout)
           | fixture corpus (fixture-calib/technical, /scripture, /aphorisms; passages as documents)
           | 'task:' lm-eval task name (task:hellaswag, task:fixture_cloze)
           | path to a .txt / .jsonl / .json file, optionally '#field' for JSON records (default 'text')

``count`` is a number of sequences of the requested length; without it a hub source gives 128
and a file or fixture gives every sequence its text fills. For a ``task:`` term it is a number of
the task's documents (default 128), each rendered as lm-eval's zero-shot prompt, unlabeled, one
sequence per prompt (data/tasks.py); ``@split`` picks train, validation or test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import MoECompressError
from .sources import FIXTURES, HUB_DATASETS, fixture_domain

_EXAMPLE = (
    "e.g. c4:128, wikitext2:64, fixture-calib:32, task:hellaswag:128, path/to/file.txt or "
    "path/to/file.jsonl#text:64+gsm8k:64"
)
_FILE_SUFFIXES = (".txt", ".jsonl", ".json")


@dataclass(frozen=True)
class SourceSpec:
    """One term of a data spec."""

    term: str
    kind: Literal["hub", "fixture", "file", "task"]
    name: str  # hub short name, fixture name, lm-eval task name or file path
    field: str | None = None  # JSON records: the text field
    split: str | None = None
    count: int | None = None


def _parse_term(term: str, spec: str) -> SourceSpec:
    """One term of `spec`: ``[task:]NAME[@split][:count]``, a hub dataset, a fixture or a data file."""
    body, count = term, None
    m = re.fullmatch(r"(.*?):(\d+)", body)
    if m:
        body, count = m.group(1), int(m.group(2))
        if count <= 0:
            raise MoECompressError(
                f"The data spec '{spec}' asks for {count} sequences from '{body}'; ask for at least one."
            )
    split = None
    if "@" in body and not Path(body).exists():
        body, split = body.rsplit("@", 1)
        if not split:
            raise MoECompressError(
                f"The data spec term '{term}' has an empty split after '@'; write e.g. wikitext2@test."
            )
    body = body.strip()
    if not body:
        raise MoECompressError(f"The data spec '{spec}' has an empty term; {_EXAMPLE}.")
    key = body.lower()
    if key.startswith("task:"):
        name = body[len("task:") :].strip()
        if not name:
            raise MoECompressError(
                f"The data spec term '{term}' names no task; write task:NAME:COUNT, e.g. "
                "task:fixture_cloze:64 or task:hellaswag:128."
            )
        return SourceSpec(term, "task", name, None, split, count)
    if key in HUB_DATASETS:
        return SourceSpec(term, "hub", key, None, split, count)
    if key in FIXTURES or fixture_domain(key):
        return SourceSpec(term, "fixture", key, None, split, count)
    found = _file_term(term, body, split, count)
    if found is not None:
        return found
    known = ", ".join(list(HUB_DATASETS) + list(FIXTURES))
    raise MoECompressError(
        f"Unknown dataset '{body}' in data spec '{spec}'; use one of {known} or a path to a .txt/.jsonl file."
    )


def _file_term(term: str, body: str, split: str | None, count: int | None) -> SourceSpec | None:
    """The term as a data file (``path`` or ``path.jsonl#field``), refused in one sentence when that file cannot
    be read as text; None when `body` does not look like a file."""
    path, field = body, None
    if "#" in body and not Path(body).exists():
        path, field = body.rsplit("#", 1)
        field = field or None
    p = Path(path).expanduser()
    if p.suffix.lower() in _FILE_SUFFIXES or p.exists() or "/" in path:
        # the same terms name calibration and evaluation (--ppl) text, so the messages say "data file"
        if p.is_dir():
            raise MoECompressError(f"The data file {path} is a directory; pass a .txt or .jsonl file.")
        if p.exists() and not p.is_file():  # /dev/zero, a FIFO, a socket: reading it would never end or block
            raise MoECompressError(
                f"The data file {path} is not a regular file (a device or pipe); pass a .txt or .jsonl file."
            )
        if not p.is_file():
            raise MoECompressError(
                f"The data file {path} does not exist; pass an existing .txt or .jsonl file."
            )
        if p.suffix.lower() not in _FILE_SUFFIXES:
            raise MoECompressError(
                f"{path} is neither .txt, .jsonl nor .json; pass plain text (.txt) or JSON "
                "records (.jsonl#field)."
            )
        if field and p.suffix.lower() == ".txt":
            raise MoECompressError(
                f"'#{field}' only applies to JSON records, but {path} is plain text; drop '#{field}'."
            )
        return SourceSpec(
            term, "file", str(p), field or ("text" if p.suffix.lower() != ".txt" else None), split, count
        )
    return None


def parse_spec(spec: str) -> list[SourceSpec]:
    """Parse a data spec into its terms; a spec naming nothing is refused with one sentence."""
    if not isinstance(spec, str) or not spec.strip():
        raise MoECompressError(f"The data spec is empty; name a dataset or file, {_EXAMPLE}.")
    terms = [t.strip() for t in spec.split("+")]
    if not any(terms) or any(not t for t in terms) or all(re.fullmatch(r"[:\d@#]*", t) for t in terms):
        raise MoECompressError(f"The data spec '{spec}' names no dataset; {_EXAMPLE}.")
    return [_parse_term(t, spec) for t in terms]
