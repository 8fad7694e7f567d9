"""`memory.py`: the allocator settings the streamed jobs rely on (glibc only; elsewhere they do nothing)."""

import ctypes

import pytest
import torch

from moecompress import memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


@pytest.fixture
def mapped_bytes():
    libc = memory._libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33")
    libc.mallinfo2.restype = _MallInfo2
    return lambda: libc.mallinfo2().hblkhd


def test_large_blocks_get_their_own_mappings_inside_only(mapped_bytes):
    @memory.large_blocks_mmapped(threshold=4 << 20)
    def allocate():
        before = mapped_bytes()
        t = torch.empty(6 << 20, dtype=torch.uint8)  # 6 MiB: over the threshold, under glibc's 32 MiB ceiling
        return t, mapped_bytes() - before

    t, inside = allocate()
    assert inside >= 6 << 20  # a mapping of its own, returned to the OS when freed
    del t
    before = mapped_bytes()
    u = torch.empty(6 << 20, dtype=torch.uint8)
    assert mapped_bytes() - before < 6 << 20  # after: the threshold is glibc's ceiling, so heap space again
    del u
