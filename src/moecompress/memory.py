"""Give memory freed by the C allocator back to the operating system after a layer is evicted.

Streaming code (calibration, the method view, the exporter) allocates and frees one decoder layer's
tensors per layer: hundreds of 1-10 MB blocks. glibc serves blocks below its mmap threshold from heap
arenas, and the threshold rises to the largest block freed so far (up to 32 MiB), so after the first
layer most of a layer's tensors live in the heap, and freeing them leaves free pages glibc keeps. The
resident set then climbs layer after layer. ``malloc_trim(0)`` returns every free page of every arena
(``madvise``); calling it once per evicted layer took PuzzleMoE's `compress` of the 4.98 GB benchmark
model from a 2.59 GB to a 2.13 GB peak at no measurable cost. (A fixed low mmap threshold reached
1.63 GB but made PuzzleMoE three times slower: its expert-sized temporaries then fault in fresh pages
every time.) On platforms without glibc it does nothing.

`bound_kernel_caches` caps the two caches torch's CPU kernels for bfloat16 matmuls keep per input shape
(ideep's ``LRU_CACHE_CAPACITY`` and oneDNN's ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 entries each by
default). A shape costs about half a megabyte there, and the per-expert loops of a bfloat16 model meet a
new shape for nearly every (expert, routed token count): on a 1024-wide layer, 1200 shapes held 618 MB.
`auto`'s `compress` of an 8-expert copy of the benchmark model (same widths, 12 layers) grew 15 MB a layer
with the default caches, 2-3 MB (its token sample) with them capped. At 64 entries each the same 1200
shapes hold 49 MB; small bfloat16 matmuls with repeating shapes then run about a third slower.

`large_blocks_mmapped` is that fixed threshold, for the one job whose heap fragmented anyway: ``auto``
fits and scores every expert with dozens of H × H float64 temporaries (8 MB at H = 1024) between the
layer's long-lived tensors. With glibc's dynamic threshold they live in the heap, which grew by 150 MB a
layer on the wide benchmark model with a third of it free; mmapped, each is returned when freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_DYNAMIC_MAX = 32 << 20  # glibc's largest dynamic mmap threshold on 64-bit


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018  exists only in glibc
        return libc
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return None


KERNEL_CACHE_ENTRIES = "64"


def bound_kernel_caches() -> None:
    """Cap torch's per-shape CPU kernel caches at `KERNEL_CACHE_ENTRIES` each, unless the user set them.
    Read when the first such kernel runs, so this must come before any computation (the CLI's entry)."""
    os.environ.setdefault("LRU_CACHE_CAPACITY", KERNEL_CACHE_ENTRIES)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", KERNEL_CACHE_ENTRIES)


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the OS; True with glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@contextlib.contextmanager
def large_blocks_mmapped(threshold: int = 4 << 20):
    """Within, blocks of `threshold` bytes or more that no free heap chunk can hold get their own mappings
    (returned to the OS when freed) instead of growing the heap; also a decorator. glibc cannot go back to
    its dynamic threshold afterwards, so on exit the threshold is that one's ceiling (32 MiB), and free heap
    pages are returned."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, _DYNAMIC_MAX)
        release_freed_memory()
