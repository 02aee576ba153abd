"""Memory probes: what is free right now, and the peak of one batch.

Three real sources behind one interface: NVML (the device, other processes included),
torch.cuda (the caching allocator and exact per-batch peaks) and the host (/proc, cgroup and
the address-space limit). ``CompositeProbe`` (``composite.py``) combines them.
"""

from __future__ import annotations

import logging
import resource
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from .allocator import release_host_memory
from .procfs import UNLIMITED, CgroupMemory, MemoryCgroup, OpenFiles, kib_field, own_memory_cgroup

log = logging.getLogger(__name__)


class ProbeError(Exception):
    """A probe could not read (no driver, unreadable file, odd values)."""


LIMIT_SOURCES = ("cgroup", "rlimit", "flag", "host", "device")


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """The limit that binds: the one whose room is smallest, and where it comes from."""

    source: str  # one of LIMIT_SOURCES
    limit_bytes: int
    where: str  # e.g. the cgroup's path, "--memory-limit", "RLIMIT_AS"

    def describe(self) -> str:
        return f"{self.limit_bytes / 2**20:.0f} MiB ({self.source} {self.where})"


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """One look at memory. ``free_bytes`` is what this process could still allocate."""

    free_bytes: int | None = None
    used_bytes: int | None = None  # by this process: RSS on the host, reserved on CUDA
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    resident_bytes: int | None = None
    resident_peak_bytes: int | None = None  # since start: VmHWM kept across per-batch resets
    limit: MemoryLimit | None = None  # the limit behind free_bytes
    sources: tuple[str, ...] = field(default=())
    """The probes read now."""
    failing: tuple[str, ...] = field(default=())
    """Probes in error: their last good reading (if any) stands in for them."""
    enforced: MemoryLimit | None = None
    """The enforced limit memory reaches first: the smallest room under a cgroup, the host's
    memory, the address-space limit or the device. ``--memory-limit`` is not one: nothing
    enforces it at its value (on CPU the address-space cap stands 256 MiB above it)."""
    enforced_free_bytes: int | None = None
    shared_device: bool | None = None
    """A GPU other processes also use (NVML lists them); None where unknown."""


def limit_kills(limit: MemoryLimit, *, shared_device: bool | None = None) -> bool:
    """Whether going past ``limit`` kills instead of failing an allocation: then a lone
    input predicted above the room under it is refused before it runs (docs/memory.md).

    - ``cgroup``: the kernel's OOM killer, no error to catch.
    - ``host`` (the host's memory, where no lower limit applies): the OOM killer too, or a
      swapping host; so ``host`` counts as killing.
    - ``device`` shared with other processes: an allocation past the room can fail theirs,
      or ours part way, as the room shrinks under us; a device of our own fails our
      allocation with a CUDA OOM error, which the OOM path handles.
    - ``rlimit`` (the address-space limit) fails an allocation.
    - ``flag`` (``--memory-limit``) is never the enforced limit: it caps the budget, and
      going past its value fails no allocation and kills nothing (the address-space cap,
      or the device, then decides).
    """
    if limit.source == "device":
        return bool(shared_device)
    return limit.source in ("cgroup", "host")


def refusal_room(reading: MemoryReading | None) -> int | None:
    """The room a lone input must fit in to run, where the enforced limit kills; None where
    an input too large is tried and the OOM path answers it."""
    if reading is None or reading.enforced is None or reading.enforced_free_bytes is None:
        return None
    if not limit_kills(reading.enforced, shared_device=reading.shared_device):
        return None
    return reading.enforced_free_bytes


class MemoryProbe(Protocol):
    name: str

    def read(self) -> MemoryReading: ...

    def start_batch(self) -> int | None:
        """Reset peak tracking; return memory in use now (the batch's baseline)."""
        ...

    def batch_peak(self) -> int | None:
        """Peak memory in use since ``start_batch`` (same scale as its baseline)."""
        ...


class HostProbe:
    """The CPU host: resident memory, its per-batch peak, and the tightest of four rooms.

    Free is the smallest of MemAvailable, the room under this process's memory cgroup (the
    tightest of its own limit and its ancestors', against usage less inactive file cache),
    the address-space limit's room (RLIMIT_AS minus VmSize) and the configured
    ``memory_limit_bytes`` minus RSS. The per-batch peak is VmHWM after resetting it through
    ``/proc/self/clear_refs``; VmHWM is also read just before each reset, so the peak since
    start (``peak_resident_bytes``) stays exact. ``cgroup`` defaults to this process's own,
    found once.
    """

    name = "host"

    def __init__(
        self, *, memory_limit_bytes: int | None = None, proc: Path = Path("/proc"),
        cgroup: MemoryCgroup | Literal["own"] | None = "own",
    ) -> None:  # fmt: skip
        self.memory_limit_bytes = memory_limit_bytes
        self._can_reset_peak = True
        self._files = OpenFiles()
        self._status = str(proc / "self" / "status")
        self._meminfo = str(proc / "meminfo")
        self._clear_refs = str(proc / "self" / "clear_refs")
        self._proc = proc
        self.peak_resident_bytes = 0
        self._peak_lock = threading.Lock()
        if cgroup == "own":
            cgroup = own_memory_cgroup(proc)
        self.cgroup = CgroupMemory(cgroup, self._files) if cgroup is not None else None

    def _read(self, path: str) -> bytes:
        try:
            return self._files.read(path)
        except OSError as exc:
            raise ProbeError(f"cannot read {path}: {exc}") from exc

    def _fold_peak(self, status: bytes) -> int:
        """Fold the VmHWM in ``status`` (the peak since the last reset) into the peak since
        start; return the latter."""
        hwm = kib_field(status, b"VmHWM") or 0
        with self._peak_lock:
            self.peak_resident_bytes = max(self.peak_resident_bytes, hwm)
            return self.peak_resident_bytes

    def read(self) -> MemoryReading:
        status = self._read(self._status)
        peak = self._fold_peak(status)
        meminfo = self._read(self._meminfo)
        rss = kib_field(status, b"VmRSS")
        available = kib_field(meminfo, b"MemAvailable")
        if rss is None or available is None:
            raise ProbeError("VmRSS or MemAvailable missing")
        free = available
        binding: tuple[str, int, str] | None = None  # source, limit, where: built lazily
        if self.cgroup is not None:
            try:
                cgroup = self.cgroup.read()
            except (OSError, ValueError) as exc:
                raise ProbeError(f"cannot read the memory cgroup: {exc}") from exc
            if cgroup is not None and cgroup.room_bytes < free:
                free, binding = cgroup.room_bytes, ("cgroup", cgroup.limit_bytes, cgroup.path)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft < UNLIMITED:
            room = max(0, soft - (kib_field(status, b"VmSize") or 0))
            if room < free:
                free, binding = room, ("rlimit", soft, "RLIMIT_AS")
        if binding is None:
            binding = ("host", kib_field(meminfo, b"MemTotal") or available + rss, "memory")
        enforced, enforced_free = MemoryLimit(*binding), free
        if self.memory_limit_bytes is not None:
            room = max(0, self.memory_limit_bytes - rss)
            if room < free:
                free, binding = room, ("flag", self.memory_limit_bytes, "--memory-limit")
        return MemoryReading(
            free_bytes=free, used_bytes=rss, resident_bytes=rss, resident_peak_bytes=peak,
            limit=MemoryLimit(*binding), sources=(self.name,), enforced=enforced,
            enforced_free_bytes=enforced_free,
        )  # fmt: skip

    def settle(self) -> None:
        """Before a calibration batch: hand the allocator's free memory back to the kernel,
        so the batch's footprint shows in its peak instead of hiding in resident holes."""
        release_host_memory(self._proc)

    def start_batch(self) -> int | None:
        status = self._read(self._status)  # resetting the peak leaves VmRSS as it is
        if self._can_reset_peak:
            self._fold_peak(status)
            try:
                self._files.write(self._clear_refs, b"5")
            except OSError as exc:
                self._can_reset_peak = False
                log.warning("cannot reset the peak RSS (%s); batch peaks are not measured", exc)
        return kib_field(status, b"VmRSS")

    def batch_peak(self) -> int | None:
        if not self._can_reset_peak:
            return None
        return kib_field(self._read(self._status), b"VmHWM")


class TorchCudaProbe:
    """torch.cuda: free device memory plus the allocator's reusable cache; exact peaks."""

    name = "torch.cuda"

    def __init__(
        self, device: str, *, memory_limit_bytes: int | None = None, cuda: object | None = None
    ) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        if not cuda.is_available():
            raise ProbeError("CUDA is not available")
        self._cuda = cuda
        self._device = device
        self.memory_limit_bytes = memory_limit_bytes

    def read(self) -> MemoryReading:
        try:
            free, total = self._cuda.mem_get_info(self._device)
            allocated = self._cuda.memory_allocated(self._device)
            reserved = self._cuda.memory_reserved(self._device)
        except RuntimeError as exc:
            raise ProbeError(f"torch.cuda: {exc}") from exc
        # Cached but unused blocks are free for us, though not for other processes.
        room = device_room = free + (reserved - allocated)
        limit = device = MemoryLimit("device", total, self._device)
        if self.memory_limit_bytes is not None and self.memory_limit_bytes - allocated < room:
            room = max(0, self.memory_limit_bytes - allocated)
            limit = MemoryLimit("flag", self.memory_limit_bytes, "--memory-limit")
        return MemoryReading(
            free_bytes=room, used_bytes=reserved, allocated_bytes=allocated,
            reserved_bytes=reserved, device_total_bytes=total,
            device_used_bytes=total - free, limit=limit, sources=(self.name,),
            enforced=device, enforced_free_bytes=device_room,
        )  # fmt: skip

    def start_batch(self) -> int | None:
        self._cuda.reset_peak_memory_stats(self._device)
        return self._cuda.memory_allocated(self._device)

    def batch_peak(self) -> int | None:
        return self._cuda.max_memory_allocated(self._device)

    def release_cache(self) -> None:
        self._cuda.empty_cache()


class NvmlProbe:
    """NVML: the device's used and total memory, every process included."""

    name = "nvml"

    def __init__(self, device_index: int = 0, *, nvml: object | None = None) -> None:
        if nvml is None:
            import pynvml as nvml
        self._nvml = nvml
        try:
            nvml.nvmlInit()
            self._handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as exc:  # NVMLError has many subclasses; all mean "no NVML here"
            raise ProbeError(f"NVML unavailable: {exc}") from exc

    def read(self) -> MemoryReading:
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception as exc:
            raise ProbeError(f"NVML read failed: {exc}") from exc
        if info.total <= 0 or info.used > info.total:
            raise ProbeError(f"odd NVML reading: used={info.used} total={info.total}")
        return MemoryReading(
            free_bytes=int(info.free), device_used_bytes=int(info.used),
            device_total_bytes=int(info.total),
            limit=MemoryLimit("device", int(info.total), "NVML"), sources=(self.name,),
            shared_device=self._shared(),
        )  # fmt: skip

    def _shared(self) -> bool | None:
        """Whether processes besides this one hold memory on the device. Counted, not
        matched by pid: inside a container NVML reports the host's pids."""
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # NVMLError's many subclasses; unknown is not shared
            return None
        return len(processes) > 1

    def start_batch(self) -> int | None:
        return None

    def batch_peak(self) -> int | None:
        return None


THREAD_RESERVE_BYTES = 256 * 2**20


def limit_address_space(
    room_bytes: int, *, reserve_bytes: int = THREAD_RESERVE_BYTES, proc: Path = Path("/proc")
) -> int:
    """Cap this process's address space at its current size plus ``room_bytes``, so that a
    runaway batch gets a real allocation failure instead of swapping the host. Returns the
    limit set.

    ``reserve_bytes`` more is allowed for address space that is not memory: thread stacks
    and malloc arenas of threads started later (OpenMP's pool at the first forward pass, the
    tokenizer threads) reserve address space they never touch."""
    size = kib_field((proc / "self" / "status").read_bytes(), b"VmSize")
    if size is None:
        raise ProbeError(f"no VmSize in {proc}/self/status")
    limit = size + room_bytes + reserve_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit
