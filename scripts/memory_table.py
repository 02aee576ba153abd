"""Print how closely the sizer predicts a forward pass's peak memory, per model family: the
prior from the architecture and the model after warm-up's calibration, each against the
peak measured as calibration measures it (VmHWM above the baseline, allocator settled), at
batch shapes warm-up did not run, padded as served batches are.

    python -m scripts.memory_table [--family qwen3 --family long-decoder] [--keep DIR]

The families are the parity table's (tiny random-weight models in their real layouts) and
two long-context ones: a Qwen3-shaped decoder with 32,768 positions and a ModernBERT with
8,192. Needs the test dependencies: ``pip install -e '.[test]'``. CPU only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from batching import AdaptiveSizer, HostProbe, measured_forward, tune_host_allocator
from models import load_model
from server import Settings
from server.runtime.runtime import Runtime
from tests.families import FAMILIES, build_all, quiet
from tests.long_models import build_long_decoder, build_long_modernbert

MiB = 2**20
LONG = {"long-decoder": build_long_decoder, "long-modernbert": build_long_modernbert}
MAX_TOKENS = 32768  # most padded tokens in one batch (a few seconds on a CPU)
MIN_PEAK = 32 * MiB
"""Smaller peaks are left out: there the allocator's own slack (its 1 MiB thresholds while
measuring, first-use caches of each new shape) is as large as the activations."""
REPEATS = 2  # each shape measured twice, its peak the larger


@dataclass
class Row:
    family: str
    attention: str
    proven: str
    prior: list[float] = field(default_factory=list)  # predicted / measured, per shape
    calibrated: list[float] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)
    measured: list[int] = field(default_factory=list)
    model: str = ""


def shapes_for(max_length: int) -> list[tuple[int, int]]:
    """Batches of 1 to 256 inputs at a quarter, half and all of the maximum length (the last
    row of each one token shorter, so padded), within ``MAX_TOKENS`` padded tokens; one
    input alone at each length."""
    lengths = sorted({max(8, max_length // 4 - 3), max(8, max_length // 2 - 5), max_length})
    return [
        (n, length)
        for length in lengths
        for n in (1, 3, 16, 64, 256)
        if n == 1 or n * length <= MAX_TOKENS
    ]


async def measure(name: str, folder: Path, max_batch_tokens: int) -> Row:
    settings = Settings(
        model=(str(folder),), dtype="float32", max_batch_size=256,
        max_batch_tokens=max_batch_tokens, memory_release_idle_s=0,
    )  # fmt: skip
    with quiet():
        model = load_model(settings.model_spec())
    probe = HostProbe(cgroup=None)
    runtime = Runtime(settings, registry=CollectorRegistry(), model=model, probe=probe)
    await runtime.start()
    try:
        if runtime.startup_error is not None:
            raise runtime.startup_error
        slot = runtime.slot()
        sizer = slot.sizer
        assert isinstance(sizer, AdaptiveSizer) and runtime.batcher is not None
        shape = model.info.shape
        row = Row(name, shape.attention, slot.report.describe() if slot.report else "-")
        safety = sizer.config.safety_factor
        row.model = str(sizer.model)
        tune_host_allocator(measuring=True)
        for n, length in shapes_for(model.info.max_input_tokens):
            items = model.synthetic_items(n, length)
            peak = 0
            for _ in range(REPEATS):
                _, measured = await runtime.model_thread.call(
                    functools.partial(
                        measured_forward, model.forward, items, probe=probe, settle=True
                    )
                )
                peak = max(peak, measured or 0)
            if peak < MIN_PEAK:
                continue
            row.prior.append(sizer.prior.predict(n, length) * safety / peak)
            row.calibrated.append(sizer.predict(n, length) / peak)
            row.shapes.append(f"{n}x{length}")
            row.measured.append(peak)
        tune_host_allocator(measuring=False)
        return row
    finally:
        await runtime.stop()


def table(rows: list[Row]) -> str:
    lines = [
        "| family | attention | warm-up | prior / measured | calibrated / measured "
        "(min, median, max) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:

        def spread(values: list[float]) -> str:
            if not values:
                return "-"
            return f"{min(values):.2f}, {statistics.median(values):.2f}, {max(values):.2f}"

        lines.append(
            f"| {row.family} | {row.attention} | {row.proven} | {spread(row.prior)} | "
            f"{spread(row.calibrated)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [f.name for f in FAMILIES] + list(LONG)
    parser.add_argument("--family", action="append", choices=names, help="repeatable")
    parser.add_argument("--keep", type=Path, help="Build the models in DIR and keep them.")
    parser.add_argument("--verbose", action="store_true", help="every shape's ratios")
    parser.add_argument(
        "--tiny", action="store_true",
        help="The parity table's own tiny models (peaks of a few MiB, where the allocator's "
        "slack is as large as the activations) instead of each family at MiniLM's width.",
    )  # fmt: skip
    args = parser.parse_args(argv)
    wanted = args.family or names
    with tempfile.TemporaryDirectory(prefix="batchfit-memory-") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        families = tuple(f for f in FAMILIES if f.name in wanted)
        print(f"building {len(wanted)} models in {root}", file=sys.stderr)
        folders = build_all(root, families, wide=not args.tiny)
        for name, build in LONG.items():
            if name in wanted:
                with quiet():
                    folders[name] = build(root / name)
        rows = []
        for name in wanted:
            row = asyncio.run(measure(name, folders[name], MAX_TOKENS))
            rows.append(row)
            print(f"{name}: measured; {row.model}", file=sys.stderr)
            if args.verbose:
                for shape, prior, calibrated, peak in zip(
                    row.shapes, row.prior, row.calibrated, row.measured, strict=True
                ):
                    print(
                        f"  {shape:>10}  measured {peak / MiB:8.2f} MiB  prior {prior:5.2f}  "
                        f"calibrated {calibrated:5.2f}"
                    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
