"""``batchfit``'s command line, composed of the rooms' own: each room's ``cli`` module names
its commands (``COMMANDS``), adds their subparsers (``add_commands``) and runs a parsed one
(``run_command``)."""

from __future__ import annotations

# First, as ``python -m server`` does: OpenMP's wait policy, before anything imports torch
# (bulk's own default, imported next, would otherwise win for every command).
import server.openmp  # noqa: F401  # isort: skip

import argparse
import sys
from collections.abc import Sequence

from bulk import cli as bulk_cli
from server import cli as server_cli

# NOTE: the benchmarks are imported only where the whole parser is built: a bulk job needs
# none of them, and their imports (aiohttp), with the HTTP stack's (server/cli.py), took 0.6 s
# of a bulk job's start on 2 cores.


def build_parser() -> argparse.ArgumentParser:
    from bench import cli as bench_cli

    parser = argparse.ArgumentParser(
        prog="batchfit", description="Adaptive-batching inference server."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for room in (server_cli, bench_cli, bulk_cli):
        room.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``argv`` None: the process's own command line (the ``batchfit`` script, ``python -m
    batchfit``), a process that runs this one command."""
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in bulk_cli.COMMANDS:
        # Parsed by the bulk commands' own parser (the same flags): neither the benchmarks
        # nor what the server's commands need beyond their settings are imported.
        return bulk_cli.bulk_command_line(argv, own_process=own_process)
    args = build_parser().parse_args(argv)
    if args.command in server_cli.COMMANDS:
        return server_cli.run_command(args)
    if args.command in bulk_cli.COMMANDS:
        return bulk_cli.run_command(args, own_process=own_process)
    from bench import cli as bench_cli

    return bench_cli.run_command(args)
