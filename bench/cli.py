"""``batchfit bench``: its subcommand, flags and the entry point (``batchfit/cli.py`` composes
it into ``batchfit``)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from .generate.cli import add_generate_flags, bench_generate
from .loadgen import CLIENTS
from .repeated import RepeatedOptions, run_repeated
from .report import QUICK_NOTE, write_report
from .runner import OVERHEAD_LOADS, SERVER_CONFIGS, BenchOptions, quick_options, run_bench
from .targets import targets

COMMANDS = {"bench": "Benchmark the server against the in-process limit; write a report."}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def add_commands(commands: Any) -> None:
    """``bench``, on ``batchfit``'s subparsers."""
    add_bench_flags(commands.add_parser("bench", help=COMMANDS["bench"]))


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    # fmt: off
    add("--quick", action="store_true",
        help="A smoke test in well under a minute (off and adaptive, 2 load levels, small "
             "counts); its figures are not comparable with the targets, which it leaves out.")
    add("--out", type=Path, default=None,
        help="Folder for report.md, results.json and the PNG plots (default: bench-report; "
             "with --generate: bench-report-generate).")
    add("--configs", type=_names, default=None,
        help=f"Comma-separated server configurations, of {','.join(SERVER_CONFIGS)} "
             "(default: all; --quick: off,adaptive).")
    add("--concurrency", type=_ints, default=None,
        help="Closed-loop load levels: concurrent clients (default: 1,4,16,64; --quick: 1,8).")
    add("--rates", type=_floats, default=None,
        help="Open-loop load levels: requests per second, Poisson with bursts (default: none).")
    add("--requests", type=int, default=None,
        help="Requests per closed-loop level (default: 400; --quick: 24).")
    add("--duration-s", type=float, default=None,
        help="Length of each open-loop level (default: 10).")
    add("--idle-requests", type=int, default=None,
        help="Single-input requests sent one by one for the idle-latency target "
             "(default: 100; --quick: 10).")
    add("--overhead-requests", type=int, default=None,
        help="Single-input requests per level against a no-op model, for the server's own CPU "
             "time per request (default: 400; --quick: 40; 0 skips it).")
    add("--overhead-load", choices=OVERHEAD_LOADS, default=None,
        help="The no-op phase's load generator: wrk (default; the aiohttp client where wrk "
             "is not installed) or aiohttp.")
    add("--overhead-duration-s", type=float, default=None,
        help="Length of each wrk level of the no-op phase, for each server, in 2-s rounds "
             "taking turns with the bare stack (default: 10; --quick: 2).")
    add("--clients", type=_names, default=None,
        help=f"Load generators for the real model, of {','.join(CLIENTS)}: the first drives "
             "every level, the others adaptive's one-client and highest levels and the "
             "no-batching server's (default: aiohttp,httpx).")
    add("--no-baselines", action="store_false", dest="baselines", default=None,
        help="Skip the bare stack (beside the no-op model) and the no-batching server.")
    add("--repeated-traffic", action="store_true",
        help="Instead: repeated traffic (30%% of inputs from a hot set of 32 texts) against "
             "one replica with the output cache off and one with it on; writes repeated.md. "
             "Uses --requests (default 400; --quick: 60), the first --concurrency level "
             "(default 16; --quick: 8), --seed and --server-flag.")
    add("--seed", type=int, default=None, help="Workload seed (default: 0).")
    add("--server-flag", action="append", default=[], dest="server_flags", metavar="FLAG",
        help="Extra flag for every server (repeatable), e.g. --server-flag=--max-wait-ms=0.")
    # fmt: on
    add_generate_flags(parser)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    given = {
        "configs": args.configs,
        "concurrency": args.concurrency,
        "rates": args.rates,
        "requests_per_level": args.requests,
        "duration_s": args.duration_s,
        "idle_requests": args.idle_requests,
        "overhead_requests": args.overhead_requests,
        "overhead_load": args.overhead_load,
        "overhead_duration_s": args.overhead_duration_s,
        "clients": args.clients,
        "baselines": args.baselines,
        "seed": args.seed,
        "extra_server_flags": tuple(args.server_flags) or None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.quick:
        return quick_options(**given)
    return BenchOptions(**given)  # type: ignore[arg-type]


def repeated_options(args: argparse.Namespace) -> RepeatedOptions:
    return RepeatedOptions(
        requests=args.requests or (60 if args.quick else 400),
        concurrency=args.concurrency[0] if args.concurrency else (8 if args.quick else 16),
        seed=args.seed or 0,
        server_flags=tuple(args.server_flags),
    )


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed ``batchfit bench``."""
    logging.basicConfig(level="INFO", format="%(asctime)s bench: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.generate:
        return bench_generate(args)
    if args.out is None:
        args.out = Path("bench-report")
    if args.repeated_traffic:
        command = "batchfit " + shlex.join(
            sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench"]
        )
        run_repeated(repeated_options(args), args.out, command)
        print((args.out / "repeated.md").read_text())
        return 0
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"batchfit bench: {exc}", file=sys.stderr)
        return 2
    result = run_bench(options)
    command = "batchfit " + shlex.join(sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench"])
    paths = write_report(result, args.out, command=command)
    if options.quick:
        print(QUICK_NOTE)
    else:
        for target in targets(result):
            status = "n/a" if target.met is None else ("met" if target.met else "MISSED")
            print(f"{target.name}: {target.measured} ratio {target.ratio:.2f} ({status})")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
