"""glibc malloc's thresholds: every large block mapped on its own while warm-up measures a
batch's footprint, blocks of tens of MiB reused from the heap while serving."""

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# In a process of its own: the thresholds are the whole process's.
SCRIPT = """
import ctypes
from batching.probes import tune_host_allocator

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
print(mapped_mib(2), end=" ")
assert tune_host_allocator(measuring=False)
print(mapped_mib(2), mapped_mib(24), mapped_mib(40))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc 2.33 or later")
def test_warm_up_maps_each_large_block_and_serving_reuses_the_heap_up_to_32_mib():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True
    )
    measuring, *serving = (int(mib) for mib in done.stdout.split())
    assert measuring == 2  # mapped on its own: freeing it lowers RSS at once
    # A forward pass's activations of a few MiB to 24 MiB come from the heap; only blocks
    # past 32 MiB are mapped.
    assert serving == [0, 0, 40]
