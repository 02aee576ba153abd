"""glibc malloc's thresholds: every large block mapped on its own while warm-up measures a
batch's footprint; while serving, blocks of tens of MiB reused from the heap where only the
host's memory bounds the process, and only blocks under 4 MiB under a limit of its own."""

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# In a process of its own: the thresholds are the whole process's.
SCRIPT = """
import ctypes
from batching import MemoryLimit, MemoryReading, tune_host_allocator

def bound_by(source):
    return MemoryReading(enforced=MemoryLimit(source, 2**34, "test"))

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost")
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped_mib(mib):
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(mib * 2**20)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return round(mapped / 2**20)

assert tune_host_allocator(measuring=True)
print(mapped_mib(2))
for reading in (bound_by("host"), bound_by("cgroup"), bound_by("rlimit"), None):
    assert tune_host_allocator(measuring=False, reading=reading)
    print(mapped_mib(2), mapped_mib(24), mapped_mib(40))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc 2.33 or later")
def test_warm_up_maps_each_large_block_and_serving_reuses_the_heap_where_memory_allows():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True
    )
    measuring, host, cgroup, rlimit, unknown = (
        [int(mib) for mib in line.split()] for line in done.stdout.splitlines()
    )
    assert measuring == [2]  # mapped on its own: freeing it lowers RSS at once
    # Bound by the host's memory only: a forward pass's activations of a few MiB to 24 MiB
    # come from the heap; only blocks past 32 MiB are mapped.
    assert host == [0, 0, 40]
    # Under a limit of its own (or none known), blocks of 4 MiB and more are mapped.
    assert cgroup == rlimit == unknown == [0, 24, 40]
