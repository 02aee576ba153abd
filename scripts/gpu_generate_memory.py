"""Step 6 of the GPU check (``scripts/gpu_check.sh --generate-memory``, a call of its own):
streams on a generator while a second process takes 30% of the device's memory.

batchfit serves Gemma-3-270m's shape with random weights (``gpu_generate.py``) on the device;
64 streams run once undisturbed, then again with a second process that allocates 30% of the
device's memory a quarter of the way through (a quarter of the first run's time). The
replica reads the device's free memory before every step (other processes counted), so it
preempts the newest sequences and resumes them when they fit: every stream finishes, none
fails, and the replica lives. The figures: finished and failed streams, output tokens/s of
each run, the preemptions and resumes the replica counted, and what the second process
could take.

The dry run serves the tiny Gemma on the CPU, 8 streams, and its second process takes
200 MiB of RAM.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

MiB = 2**20
STREAMS = 64
DRY_STREAMS = 8
SHARE = 0.3
"""What the second process takes of the device's memory."""
DRY_SIBLING = 200 * MiB
TAKE_GPU = (
    "import sys, time, torch\n"
    "free, total = torch.cuda.mem_get_info()\n"
    "want = int(float(sys.argv[1]) * total)\n"
    "held = torch.empty(min(want, free), dtype=torch.uint8, device='cuda')\n"
    "held.fill_(1)\n"
    "print(f'took {held.numel()} of {total} bytes ({free} free before)', flush=True)\n"
    "time.sleep(3600)\n"
)
TAKE_RAM = (
    "import sys, time\n"
    "held = bytearray(b'x' * int(sys.argv[1]))\n"
    "print(f'took {len(held)} bytes', flush=True)\n"
    "time.sleep(3600)\n"
)
COUNTERS = ("batchfit_generation_preemptions_total", "batchfit_generation_resumed_sequences_total",
            "batchfit_generation_oversized_sequences_total")  # fmt: skip


def memory_step(device: str, work: Path) -> dict[str, Any]:
    from bench.generate.client import closed_loop_streams, completion_body, served_model
    from bench.generate.memory import DEADLINE_FLAGS
    from bench.generate.peers import batchfit_launch, start_server
    from bench.generate.workload import GenerateSpec, make_generate_requests

    from .gpu_generate import GEMMA_270M_SHAPE, TINY_SHAPE, save_random_gemma

    on_cuda = device.startswith("cuda")
    dtype = "float16" if on_cuda else "float32"
    folder = save_random_gemma(work / "gemma-3-270m-random" if on_cuda else work / "gemma-tiny",
                               GEMMA_270M_SHAPE if on_cuda else TINY_SHAPE)  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    spec = GenerateSpec() if on_cuda else GenerateSpec(max_prompt_tokens=256, max_new_tokens=32)
    requests = make_generate_requests(
        spec, STREAMS if on_cuda else DRY_STREAMS, lambda text: tokenizer(text)["input_ids"],
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), salt="memory",
    )  # fmt: skip
    launch = batchfit_launch(str(folder), ("--device", device, "--dtype", dtype, *DEADLINE_FLAGS))
    figures: dict[str, Any] = {"device": device, "dtype": dtype, "streams": len(requests),
                               "share": SHARE if on_cuda else None}  # fmt: skip
    with start_server(launch, work / "logs") as server:
        model = asyncio.run(served_model(server.url))
        bodies = [completion_body(r, model) for r in requests]

        def run(label: str) -> dict[str, Any]:
            result = asyncio.run(closed_loop_streams(server.url, bodies, concurrency=len(bodies),
                                                     max_duration_s=240, drain_s=30,
                                                     timeout_s=270))  # fmt: skip
            ok = [o for o in result.outcomes if o.ok]
            tokens = sum(o.completion_tokens for o in ok)
            figures[label] = {
                "finished": len(ok), "failed": len(bodies) - len(ok), "wall_s": result.wall_s,
                "output_tokens_per_s": tokens / result.wall_s if result.wall_s else None,
                "errors": sorted({(o.error or f"status {o.status}")[:120]
                                  for o in result.outcomes if not o.ok}),
            }  # fmt: skip
            logging.info("generate-memory %s: %s", label, figures[label])
            return figures[label]

        alone = run("alone")
        sibling: list[subprocess.Popen[str]] = []

        def take() -> None:
            code, amount = (TAKE_GPU, str(SHARE)) if on_cuda else (TAKE_RAM, str(DRY_SIBLING))
            sibling.append(subprocess.Popen([sys.executable, "-c", code, amount],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True))  # fmt: skip

        # A quarter of the way: the second run, which has more to wait for, is no shorter.
        timer = threading.Timer(alone["wall_s"] / 4, take)
        timer.start()
        try:
            run("with_second_process")
        finally:
            timer.cancel()
            figures["second_process"] = ["never started: the run ended first"]
            for process in sibling:
                assert process.stdout is not None
                figures["second_process"] = [process.stdout.readline().strip()]  # once it took
                process.kill()
                process.communicate()
        figures["replica_alive"] = server.process.poll() is None
        figures["counters"] = _counters(server.url)
    pressured = figures["with_second_process"]
    figures["vs_alone"] = (pressured["output_tokens_per_s"] or 0) / (
        alone["output_tokens_per_s"] or float("inf")
    )
    figures["passed"] = (
        alone["failed"] == 0 and pressured["failed"] == 0 and figures["replica_alive"]
        and bool(sibling)
    )  # fmt: skip
    return figures


def _counters(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(name + "{") or line.startswith(name + " "):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def memory_markdown(figures: dict[str, Any] | None) -> list[str]:
    if not figures:
        return []
    lines = ["## 6. Generation while a second process takes device memory", ""]
    if "error" in figures:
        return [*lines, f"The step broke: {figures['error']}", ""]
    taken = "30% of the device's memory" if figures.get("share") else "200 MiB of RAM"
    lines += [f"{figures['streams']} streams, {figures['dtype']} on {figures['device']}; the "
              f"second run with a process that takes {taken} a quarter of the way in "
              f"({' '.join(figures.get('second_process', []))}).", "",
              "| run | finished | failed | output tokens/s |",
              "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for label in ("alone", "with_second_process"):
        run = figures[label]
        speed = run["output_tokens_per_s"]
        lines.append(f"| {label.replace('_', ' ')} | {run['finished']} | {run['failed']} | "
                     f"{'-' if speed is None else f'{speed:.1f}'} |")  # fmt: skip
    counters = ", ".join(f"{k.removeprefix('batchfit_generation_')} {v:g}"
                         for k, v in figures.get("counters", {}).items())  # fmt: skip
    lines += ["", f"With the second process: {figures['vs_alone']:.2f}x the output tokens/s "
              f"alone; the replica {'lived' if figures['replica_alive'] else 'DIED'}; "
              f"{counters or 'no counters read'}.", ""]  # fmt: skip
    return lines
