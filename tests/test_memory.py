"""`memory.py`: the allocator settings the streamed jobs rely on (glibc only; elsewhere they do nothing)."""

import os
import subprocess
import sys

import pytest

from moecompress import memory

# a fresh process: in a long-lived one, glibc serves a large block from a free heap chunk that fits whatever
# the threshold (the threshold decides only how a block the heap cannot hold is made)
PROBE = """
import ctypes
from moecompress import memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = memory._libc()
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mapped_by(size):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(size)
    grown = libc.mallinfo2().hblkhd - before
    libc.free(p)
    return grown

libc.free(libc.malloc(8 << 20))  # glibc's dynamic threshold rises to 8 MiB: a 6 MiB block would be heap space
with memory.large_blocks_mmapped(threshold=4 << 20):
    inside = mapped_by(6 << 20)
after = mapped_by(6 << 20)
print(inside >= 6 << 20, after == 0)
"""


def test_large_blocks_get_their_own_mappings_inside_only():
    libc = memory._libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]  # mmapped inside; heap space after (the threshold is 32 MiB then)


def test_the_cli_caps_the_kernel_caches_unless_the_user_set_them(monkeypatch):
    from moecompress.cli import app
    from moecompress.cli.entry import run

    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.setenv(name, "x")  # recorded, so the teardown restores the variable's absence
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    try:
        run(app, ["--help"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    assert os.environ["LRU_CACHE_CAPACITY"] == memory.KERNEL_CACHE_ENTRIES
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
