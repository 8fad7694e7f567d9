"""JSON from files moecompress did not necessarily write, parsed within limits (issue 51, item 9).

Every reader of a plan.json, stats.json, config.json, base_config.json, run.json, marker or results file goes
through `load_json` (a file) or `parse_json` (text already read). Before `json` sees the text:

- the file is at most `max_bytes` (default 64 MiB) — a larger one is refused unread;
- it is UTF-8 (a decode error is a sentence, not a `UnicodeDecodeError`);
- its nesting is at most `MAX_DEPTH` levels, counted without recursion (brackets outside strings, `scan`:
  vectorised passes), so a file nested 200,000 deep is refused before the recursive parser could overflow;
- no number has a run of more than `MAX_INT_DIGITS` digits (same pass), so a 5000-digit integer is a sentence,
  not Python's int-digit ValueError;
- the top-level value has the type asked for (a JSON object by default).

Each refusal is one `MoECompressError` sentence: "<where> <what is wrong>; <fix>." — `fix` is the caller's
("re-run calibration", "re-export it"), since only the caller knows what produced the file.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

from .errors import MoECompressError

MAX_BYTES = 64 * 2**20
MAX_DEPTH = 256
MAX_INT_DIGITS = 64

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)

_TYPE_NAMES = {dict: "a JSON object", list: "a JSON array"}


def scan(text: str) -> tuple[int, int]:
    """(deepest nesting of arrays and objects, longest run of digits) of JSON `text`, strings left out, found
    without recursion: strings blanked by one regular expression, then vectorised passes over the bytes."""
    import numpy as np

    codes = np.frombuffer(_STRING.sub('""', text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    if codes.size == 0:
        return 0, 0
    step = _steps()[codes]
    step = step[step != 0]
    depth = int(np.cumsum(step, dtype=np.int64).max()) if step.size else 0
    digit = ((codes >= 48) & (codes <= 57)).astype(np.int8)
    edges = np.diff(digit, prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return max(depth, 0), int((ends - starts).max()) if starts.size else 0


@functools.lru_cache(maxsize=1)
def _steps():
    """+1 for an opening bracket, -1 for a closing one, 0 for any other byte."""
    import numpy as np

    table = np.zeros(256, dtype=np.int8)
    table[[ord("["), ord("{")]] = 1
    table[[ord("]"), ord("}")]] = -1
    return table


def parse_json(text: str | bytes, where: str, fix: str, expect: type | tuple | None = dict):
    """The value of JSON `text` read from `where`, within this module's limits; one sentence
    "<where> ...; <fix>." otherwise. `expect`: the type(s) the top-level value must have (None: any)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MoECompressError(
                f"{where} is not UTF-8 text (byte {exc.start} cannot be decoded); {fix}."
            ) from None
    depth, digits = scan(text)
    if depth > MAX_DEPTH:
        raise MoECompressError(
            f"{where} nests its JSON too deeply ({depth} levels of arrays or objects, more than the "
            f"{MAX_DEPTH} moecompress reads); {fix}."
        )
    if digits > MAX_INT_DIGITS:
        raise MoECompressError(f"{where} holds a number of more than {MAX_INT_DIGITS} digits; {fix}.")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MoECompressError(f"{where} is not valid JSON (line {exc.lineno}); {fix}.") from None
    except (RecursionError, ValueError):  # not reached after the checks above; kept as a last guard
        raise MoECompressError(f"{where} is not JSON moecompress can read; {fix}.") from None
    if expect is not None and not isinstance(data, expect):
        kinds = expect if isinstance(expect, tuple) else (expect,)
        want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise MoECompressError(f"{where} does not hold {want}; {fix}.")
    return data


def load_json(
    path: str | os.PathLike,
    fix: str,
    expect: type | tuple | None = dict,
    max_bytes: int = MAX_BYTES,
    where: str | None = None,
):
    """`parse_json` of the file at `path` (read only when at most `max_bytes`). An unreadable file is a
    sentence too. `where` names the file in the sentence (default: its path)."""
    path = Path(path)
    where = str(path) if where is None else where
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise MoECompressError(
                f"{where} is {size:,} bytes, more than the {max_bytes:,} moecompress reads from such a "
                f"file; {fix}."
            )
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise MoECompressError(
            f"{where} cannot be read ({exc.strerror or type(exc).__name__}); {fix}."
        ) from None
    return parse_json(raw, where, fix, expect)


def try_load_json(path: str | os.PathLike, expect: type | tuple | None = dict, max_bytes: int = MAX_BYTES):
    """`load_json`'s value, or None for a file that is missing, unreadable or outside the limits (for callers
    that treat such a file as "not ours" rather than refuse it)."""
    try:
        return load_json(path, "", expect, max_bytes)
    except MoECompressError:
        return None
