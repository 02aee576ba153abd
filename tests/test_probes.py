import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from batching import (
    CompositeProbe,
    HostProbe,
    MemoryReading,
    NvmlProbe,
    ProbeError,
    TorchCudaProbe,
)
from batching.composite import probes_for_device
from batching.procfs import kib_field

# --- the host probe, against the real /proc of this machine ---


def test_host_probe_reads_this_process():
    reading = HostProbe().read()
    total = kib_field(Path("/proc/meminfo").read_bytes(), b"MemTotal")
    assert 10 * 2**20 < reading.resident_bytes < total
    assert 0 < reading.free_bytes <= total
    assert reading.sources == ("host",)


def test_host_probe_memory_limit_caps_free():
    probe = HostProbe(memory_limit_bytes=2**40)
    rss = probe.read().resident_bytes
    limited = HostProbe(memory_limit_bytes=rss + 5 * 2**20).read()
    assert limited.free_bytes <= 5 * 2**20 + 2**20  # RSS moves a little between reads


def test_host_probe_measures_a_batch_peak():
    probe = HostProbe()
    baseline = probe.start_batch()
    block = bytearray(64 * 2**20)  # touched: bytearray zero-fills its pages
    del block
    peak = probe.batch_peak()
    assert peak - baseline >= 60 * 2**20
    # A new batch starts from the current RSS, not the old peak.
    baseline = probe.start_batch()
    assert probe.batch_peak() - baseline < 32 * 2**20


def test_host_probe_keeps_the_peak_since_start_across_batch_resets():
    probe = HostProbe(cgroup=None)
    status = Path("/proc/self/status")
    before = kib_field(status.read_bytes(), b"VmHWM")
    probe.start_batch()
    # A new high-water mark, 64 MiB above any this process had before.
    block = bytearray(before - kib_field(status.read_bytes(), b"VmRSS") + 64 * 2**20)
    del block
    probe.start_batch()  # the next batch resets VmHWM: the peak survives only in the probe
    assert kib_field(status.read_bytes(), b"VmHWM") < before + 32 * 2**20
    assert probe.read().resident_peak_bytes >= before + 60 * 2**20


def test_address_space_limit_turns_a_runaway_allocation_into_a_real_oom():
    script = """
import torch
from batching import limit_address_space
from models import is_out_of_memory
limit_address_space(64 * 2**20)
try:
    torch.ones(2**30, dtype=torch.uint8)
except Exception as exc:
    print("oom" if is_out_of_memory(exc) else f"other: {exc!r}")
small = torch.ones(2**20, dtype=torch.uint8)  # still works under the limit
print("small ok", int(small.sum()))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split("\n")[:2] == ["oom", f"small ok {2**20}"], result.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"MemTotal", 1024000),  # the first line
        (b"VmRSS", 20480),  # a tab before the number
        (b"VmHWM", 3072),  # the last line, no newline after it
        (b"RSS", None),  # only a suffix of a name
        (b"Name", None),  # not a kB field
        (b"VmSwap", None),  # absent
    ],
)
def test_kib_field(name, value):
    text = b"MemTotal:       1000 kB\nVmRSS:\t  20 kB\nName:\tpython\nVmHWM:  3 kB"
    assert kib_field(text, name) == value


def test_cpu_device_gets_the_host_probe():
    probe = probes_for_device("cpu")
    assert [p.name for p in probe.probes] == ["host"]


# --- NVML and torch.cuda through injected fakes ---


class FakeNvml:
    def __init__(self, used=6 * 2**30, total=80 * 2**30, fail_init=False):
        self.used, self.total, self.fail_init = used, total, fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self.used, total=self.total, free=self.total - self.used)


class FakeCuda:
    def __init__(self):
        self.free, self.total = 70 * 2**30, 80 * 2**30
        self.allocated, self.reserved, self.peak = 2 * 2**30, 3 * 2**30, 0
        self.emptied = 0

    def is_available(self):
        return True

    def mem_get_info(self, device):
        return self.free, self.total

    def memory_allocated(self, device):
        return self.allocated

    def memory_reserved(self, device):
        return self.reserved

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def empty_cache(self):
        self.emptied += 1


def test_nvml_probe_counts_other_processes():
    reading = NvmlProbe(0, nvml=FakeNvml(used=6 * 2**30)).read()
    assert reading.device_used_bytes == 6 * 2**30
    assert reading.free_bytes == 74 * 2**30


def test_nvml_probe_unavailable_or_odd():
    with pytest.raises(ProbeError, match="NVML unavailable"):
        NvmlProbe(0, nvml=FakeNvml(fail_init=True))
    with pytest.raises(ProbeError, match="odd NVML reading"):
        NvmlProbe(0, nvml=FakeNvml(used=90, total=80)).read()


def test_torch_cuda_probe_counts_the_allocator_cache_as_free_and_measures_peaks():
    cuda = FakeCuda()
    probe = TorchCudaProbe("cuda:0", cuda=cuda)
    reading = probe.read()
    assert reading.free_bytes == 70 * 2**30 + 2**30  # device free + cached-but-unused
    assert (reading.allocated_bytes, reading.reserved_bytes) == (2 * 2**30, 3 * 2**30)
    baseline = probe.start_batch()
    cuda.peak = baseline + 5 * 2**30
    assert probe.batch_peak() - baseline == 5 * 2**30
    assert reading.limit.describe() == "81920 MiB (device cuda:0)"
    limited = TorchCudaProbe("cuda:0", cuda=cuda, memory_limit_bytes=4 * 2**30).read()
    assert limited.free_bytes == 2 * 2**30
    assert limited.limit.describe() == "4096 MiB (flag --memory-limit)"


def test_composite_takes_the_smallest_free(caplog):
    nvml = FakeNvml(used=79 * 2**30)  # another process holds nearly everything
    cuda = FakeCuda()
    composite = CompositeProbe([TorchCudaProbe("cuda:0", cuda=cuda), NvmlProbe(0, nvml=nvml)])
    reading = composite.read()
    assert reading.free_bytes == 2**30
    assert reading.limit.where == "NVML"  # the limit behind the smallest free
    assert reading.allocated_bytes == 2 * 2**30
    assert reading.sources == ("torch.cuda", "nvml") and reading.failing == ()
    composite.release_cache()
    assert cuda.emptied == 1


class FlakyProbe:
    """A probe whose ``read`` raises while ``failing``; it counts the calls."""

    name = "flaky"

    def __init__(self, free_bytes):
        self.free_bytes, self.failing, self.calls = free_bytes, False, 0

    def read(self):
        self.calls += 1
        if self.failing:
            raise ProbeError("cannot read /sys/fs/cgroup/memory.current: EIO")
        return MemoryReading(free_bytes=self.free_bytes, sources=(self.name,))

    def start_batch(self):
        if self.failing:
            raise ProbeError("cannot read /proc/self/status")
        return 100

    def batch_peak(self):
        return 150


def test_a_failing_probe_is_retried_with_backoff_and_its_last_reading_stands_in(caplog):
    now = [0.0]
    flaky = FlakyProbe(free_bytes=1000)
    composite = CompositeProbe([flaky], clock=lambda: now[0], retry_initial_s=1, retry_max_s=4)
    assert composite.read().free_bytes == 1000
    flaky.failing, flaky.free_bytes = True, 500
    with caplog.at_level(logging.WARNING):
        calls = []
        for t in (0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 9.0, 12.0):  # retries at 1, 3, 7, 11
            now[0] = t
            reading = composite.read()
            assert (reading.free_bytes, reading.failing, reading.sources) == (1000, ("flaky",), ())
            calls.append(flaky.calls)
        assert calls == [2, 2, 3, 3, 4, 4, 5, 5, 6]  # waits of 1, 2, 4, then at most 4 s
        assert composite.start_batch() is None  # no baseline from a probe in error
        flaky.failing = False
        now[0] = 16.0
        reading = composite.read()
    assert (reading.free_bytes, reading.failing, reading.sources) == (500, (), ("flaky",))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # once per change of state
    assert messages[0].startswith("memory probe flaky failed: cannot read /sys/fs/cgroup/")
    assert "with its last reading and the proven ceiling meanwhile" in messages[0]
    assert messages[1] == "memory probe flaky reads again after 16s in error"
    assert composite.start_batch() == 100 and composite.batch_peak() == 150


def test_a_probe_that_fails_measuring_a_batch_does_not_fail_the_batch():
    flaky = FlakyProbe(free_bytes=1000)
    composite = CompositeProbe([flaky], clock=lambda: 0.0)
    flaky.failing = True
    assert composite.start_batch() is None and composite.batch_peak() is None
    assert composite.read().failing == ("flaky",)  # in error until its retry reads


def test_a_probe_in_error_from_the_start_reads_nothing():
    flaky = FlakyProbe(free_bytes=1000)
    flaky.failing = True
    reading = CompositeProbe([flaky], clock=lambda: 0.0).read()
    assert (reading.free_bytes, reading.failing) == (None, ("flaky",))


def test_composite_with_no_probes_reads_nothing():
    assert CompositeProbe([]).read().free_bytes is None


def test_a_lone_probe_s_reading_passes_through_the_composite_as_it_is():
    reading = MemoryReading(free_bytes=1000, used_bytes=10, sources=("host",))
    probe = type("Lone", (), {"name": "host", "read": lambda self: reading})()
    assert CompositeProbe([probe]).read() is reading  # read after batches: no copies
    merged = CompositeProbe([probe, probe]).read()
    assert (merged.free_bytes, merged.sources) == (1000, ("host", "host"))
