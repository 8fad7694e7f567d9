"""Boundary checks shared by the verbs: every numeric option is range-checked before any model loads."""

from __future__ import annotations

import math
import re

from .errors import MoECompressError

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")

# the one size syntax of every option and recipe field that takes bytes (--max-memory, --budget 4GB, shard size)
SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """'5GB' / '500MB' / '1.5GiB' / 1234 -> bytes: decimal B, KB, MB, GB, TB (powers of 1000, as transformers) or
    binary KiB, MiB, GiB, TiB (powers of 1024), case-insensitive; a bare number is bytes. ValueError otherwise."""
    if isinstance(size, bool):
        raise ValueError(f"{size!r} is not a size")
    if isinstance(size, int):
        return size
    m = _SIZE.match(str(size))
    if m is None or m.group(2).upper() not in SIZE_UNITS:
        raise ValueError(f"{size!r} is not a size such as 4GB, 500MB or 1.5GiB")
    return math.floor(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


def check_range(
    flag: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False, hint: str = ""
) -> None:
    """Refuse `value` of option `flag` outside [lo, hi] (open ends with lo_open / hi_open), NaN or infinite.

    None (an option not given) passes.
    """
    if value is None:
        return
    bad = isinstance(value, float) and not math.isfinite(value)
    bad = bad or (lo is not None and (value <= lo if lo_open else value < lo))
    bad = bad or (hi is not None and (value >= hi if hi_open else value > hi))
    if bad:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi}"
        want = " and ".join(s for s in (lo_s, hi_s) if s)
        raise MoECompressError(f"{flag} must be {want}, not {value}{'; ' + hint if hint else ''}.")


def parse_floats(flag: str, text: str) -> list[float]:
    """'0.25,0.5' -> [0.25, 0.5]; a non-number is refused in one sentence."""
    out = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            out.append(float(part))
        except ValueError:
            raise MoECompressError(
                f"{flag} '{text}' holds '{part}', which is not a number; write e.g. {flag} 0.25,0.5."
            ) from None
    if not out:
        raise MoECompressError(f"{flag} is empty; write e.g. {flag} 0.25,0.5.")
    return out


def check_name(name: str, what: str = "Arm name") -> str:
    """Names that become paths: letters, digits, '.', '_', '+', '-' only, never '.' or '..'."""
    if not SAFE_NAME.match(name) or set(name) <= {"."}:
        raise MoECompressError(
            f"{what} '{name}' may hold only letters, digits, '.', '_', '+' and '-' (it names "
            "a directory); rename it."
        )
    return name


SEED_MAX = 2**32 - 1  # numpy's limit (lm-eval seeds numpy with it); torch takes 64-bit seeds


def check_seed(flag: str, seed) -> None:
    """A seed every generator accepts: an integer in [0, 2**32 - 1] (`--seed 10**26` overflowed torch)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise MoECompressError(f"{flag} must be an integer between 0 and {SEED_MAX}, not {seed}.")


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's named device maps


def check_device(device, flag: str = "--device") -> None:
    """Refuse, before any model loads, a device this machine cannot run on, naming the device: a name torch does
    not know (``--device bogus`` was blamed on the checkpoint), CUDA on a CPU-only torch or with no GPU visible
    (a traceback), ``cuda:N`` beyond the devices present, or a device type moecompress does not run on. None
    (the default) and accelerate's named maps (`DEVICE_MAPS`) pass."""
    if device is None or str(device) in DEVICE_MAPS:
        return
    import torch

    name = str(device)
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise MoECompressError(
            f"{flag} '{name}' is not a device; use cpu, cuda, cuda:N, mps or auto."
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MoECompressError(
                f"{flag} {name} was requested but this torch sees no CUDA device (a CPU-only build, or no GPU "
                "visible); pass --device cpu."
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise MoECompressError(
                f"{flag} {name} names a CUDA device this machine lacks (it has {torch.cuda.device_count()}); "
                "pass --device cuda:0 or auto."
            )
    elif dev.type == "mps" and not (
        getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    ):
        raise MoECompressError(
            f"{flag} mps was requested but this torch has no MPS device; pass --device cpu."
        )
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise MoECompressError(
            f"{flag} '{name}' is a device type moecompress does not run on; use cpu, cuda, cuda:N, mps or auto."
        )
