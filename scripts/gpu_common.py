"""What the GPU check's steps share: the device's memory, a ballast, reading a replica's metrics."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

GIB = 2**30


def scrape(url: str) -> dict[str, float]:
    """Every sample of a replica's ``/metrics``, keyed ``name`` or ``name{k="v",...}`` with
    the ``model`` label left out (summed over the models; the GPU check serves one)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model"
            )
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values


class MetricsSampler(threading.Thread):
    """Scrapes a replica every ``every_s`` while a load runs: the extremes of its memory
    gauges (the batch budget, the last batch's measured and predicted peak, torch's
    reserved memory, what the probes call free)."""

    WATCHED = (
        "batchfit_batch_budget_bytes",
        "batchfit_batch_measured_peak_bytes",
        "batchfit_batch_predicted_peak_bytes",
        "batchfit_torch_reserved_bytes",
        "batchfit_memory_free_bytes",
        "batchfit_device_memory_used_bytes",
        "batchfit_host_resident_bytes",
    )

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.every_s = every_s
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}
        self.num_scrapes = 0
        self._done = threading.Event()

    def run(self) -> None:
        while True:
            try:
                values = scrape(self.url)
            except httpx.HTTPError:
                values = {}
            for name in self.WATCHED:
                if name in values:
                    self.low[name] = min(self.low.get(name, values[name]), values[name])
                    self.high[name] = max(self.high.get(name, values[name]), values[name])
            self.num_scrapes += 1
            if self._done.wait(self.every_s):
                return

    def __enter__(self) -> MetricsSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join(10)


def nvml_free_bytes(device: str) -> int | None:
    """Free memory of a CUDA device as NVML tells this process (the check itself, not the
    replica); None where NVML cannot be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(device.partition(":")[2] or 0))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    except Exception:  # no module, no driver, no device: NVML has many error types
        return None


class Ballast:
    """Device memory held by this process so that about ``leave_bytes`` stay free; on the CPU
    it holds nothing (a replica's ``--memory-limit`` plays its part there).

    NVML's free memory is read by the check before and after the ballast, independently of
    anything a replica reports: ``room_bytes`` (free before, less the ballast's own bytes) is
    all a replica started beside it could ever use."""

    def __init__(self, device: str, leave_bytes: int) -> None:
        self.device = device
        self.held_bytes = 0
        self.free_after_bytes: int | None = None
        self.nvml_free_before_bytes: int | None = None
        self.nvml_free_after_bytes: int | None = None
        self._tensor: Any = None
        if device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info(device)  # this process's context exists now
            self.nvml_free_before_bytes = nvml_free_bytes(device)
            self.held_bytes = max(0, free - leave_bytes)
            self._tensor = torch.empty(self.held_bytes, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(device)
            self.free_after_bytes = torch.cuda.mem_get_info(device)[0]
            self.nvml_free_after_bytes = nvml_free_bytes(device)

    @property
    def room_bytes(self) -> int | None:
        if self.nvml_free_before_bytes is None:
            return None
        return self.nvml_free_before_bytes - self.held_bytes

    def seen_by_nvml(self) -> bool:
        """NVML's free memory dropped by the ballast's bytes (within 2% and 256 MiB)."""
        before, after = self.nvml_free_before_bytes, self.nvml_free_after_bytes
        if before is None or after is None:
            return False
        return abs((before - after) - self.held_bytes) <= 0.02 * self.held_bytes + 256 * 2**20

    def release(self) -> None:
        if self._tensor is not None:
            import torch

            self._tensor = None
            torch.cuda.empty_cache()
            torch.cuda.synchronize(self.device)


def device_facts(device: str) -> dict[str, Any]:
    """What the figures were measured on."""
    import platform

    import torch

    facts: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(device)
        facts.update(
            name=properties.name,
            total_bytes=properties.total_memory,
            multiprocessors=properties.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        facts.update(name=platform.processor() or platform.machine())
    return facts


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
