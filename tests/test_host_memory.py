"""device_memory.release_host_memory gives freed heap pages back to the OS (the CPU default run's RSS grew
step after step without it, issue 50)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from qerl.device_memory import release_host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_freed_holes_in_the_heap_go_back_to_the_os():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    n, size = 2000, 64 * 1024  # below glibc's mmap threshold: heap chunks, freed into holes free() cannot trim
    blocks = [libc.malloc(size) for _ in range(2 * n)]
    for p in blocks:
        ctypes.memset(p, 1, size)  # resident
    for p in blocks[0::2]:  # every other block freed: holes between live blocks
        libc.free(p)
    before = rss_bytes()
    release_host_memory()
    after = rss_bytes()
    for p in blocks[1::2]:
        libc.free(p)
    assert before - after > 0.5 * n * size  # most of the 125 MB of holes left the process
