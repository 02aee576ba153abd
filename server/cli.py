"""The server's commands of ``batchfit`` (serve, plan, up): every Settings field is a flag of
the same name. ``batchfit/cli.py`` composes them with the other rooms' commands."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from .logs import configure_logging
from .settings import LauncherSettings, Settings

# NOTE: the HTTP stack (uvicorn, the app, the launcher) is imported by the commands that use
# it: a bulk job, whose command line (batchfit/cli.py) imports this module, needs none of it,
# and its imports (FastAPI and, in the benchmarks, aiohttp) took 0.6 s of a bulk job's start
# on 2 cores.

log = logging.getLogger("batchfit")
COMMANDS = {
    "serve": "Serve a model over HTTP.",
    "plan": "Load the model, calibrate memory as serve does, print the memory plan.",
    "up": "Start several replicas behind a local Nginx (no Docker needed).",
}


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings_class: type[BaseSettings] = Settings,
    *,
    skip: frozenset[str] = frozenset(),
    only: frozenset[str] | None = None,
) -> None:
    """One flag per Settings field (those in ``only``, if given, less ``skip``); unset flags
    fall back to BATCHFIT_* and then defaults."""
    for name, field in settings_class.model_fields.items():
        if name in skip or (only is not None and name not in only):
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        choices = (
            typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
        )
        if annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=field.description,
            )  # fmt: skip
        elif typing.get_origin(annotation) is tuple:
            parser.add_argument(
                flag, dest=name, action="append", default=argparse.SUPPRESS,
                help=f"{field.description} (repeatable; default: {','.join(field.default)})",
                metavar="VALUE",
            )  # fmt: skip
        else:
            parser.add_argument(
                flag, dest=name, choices=choices, default=argparse.SUPPRESS,
                help=f"{field.description} (default: {field.default})",
                metavar=None if choices else _metavar(annotation),
            )  # fmt: skip


def _metavar(annotation: object) -> str:
    if isinstance(annotation, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return getattr(annotation, "__name__", "VALUE").upper()


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return Settings(**given)


# oneDNN (torch on CPU) caches compiled primitives per tensor shape, 1024 by default. The
# planner sends batches of many shapes (n inputs x L tokens); in a soak RSS grew 180 MiB in a
# few thousand batches as that cache filled. 64 bounds it, at no measured cost in speed.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = "64"


class ListeningMessage(logging.Filter):
    """Rewrites uvicorn's "Uvicorn running on ..." line: it comes while the model is still
    loading, and reads as if the server were ready."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Uvicorn running on"):
            record.msg = (
                "listening on %s://%s:%d; loading the model (/health/ready is 503 until ready)"
            )
            record.__dict__.pop("color_message", None)
        return True


def serve(settings: Settings) -> int:
    import uvicorn

    from .app import create_app
    from .heap import freeze_startup_heap
    from .one_write import OneWriteHTTPProtocol
    from .runtime.drain import DrainingServer
    from .supervise.nginx import UVICORN_KEEP_ALIVE_S

    busy = _busy_port(settings)
    if busy is not None:
        print(f"batchfit: {busy}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    for note in settings.lowered_defaults():
        log.info(note)
    # Read by oneDNN at its first use: before the model loads. An operator's value wins.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    if settings.api_workers > 1:
        from .engine import serve_engine  # its own processes, its own event loop

        return serve_engine(settings)
    config = uvicorn.Config(
        None,  # set below
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # One write per response: a replica that dies leaves Nginx all of an answer or none of
        # it, and none is retried elsewhere (server/one_write.py).
        http=OneWriteHTTPProtocol,
        # uvicorn's loggers go through ours (one format) instead of its own config.
        log_config=None,
        access_log=False,
        # Nginx keeps upstream connections alive for less than this, so it never reuses a
        # connection uvicorn is closing.
        timeout_keep_alive=UVICORN_KEEP_ALIVE_S,
        # After the drain, admitted work is answered and a body still arriving is refused 503
        # (server/one_write.py): only answers still being written are left, so this is short.
        # On Kubernetes (deploy/kubernetes/base/deployment.yaml): preStop 5 s + drain up to
        # 30 s + up to 5 s for the answers of aborted work (Runtime.drain) + these 2 s = 42 s,
        # 3 s inside terminationGracePeriodSeconds 45 for the lifespan's shutdown and exit.
        timeout_graceful_shutdown=2,
        lifespan="on",
    )
    logging.getLogger("uvicorn.error").addFilter(ListeningMessage())
    app = create_app(
        settings,
        on_fatal=lambda: setattr(server, "should_exit", True),
        # A serving process only: a test process creates and drops many apps.
        on_ready=freeze_startup_heap,
        watch_loop=True,
    )
    runtime = app.state.runtime
    server = DrainingServer(
        config, drain=lambda: runtime.drain(settings.drain_timeout_s), abort=runtime.abort
    )
    config.app = app
    server.run()
    failed = runtime.startup_error is not None or runtime.batcher_error is not None
    code = 1 if failed else 0
    if runtime.model_thread.busy:
        # Stopped while loading or warming up: the load or forward pass in progress cannot
        # be interrupted, and the interpreter would wait for its thread at exit.
        log.warning("exiting without waiting for the model thread to finish")
        logging.shutdown()
        os._exit(code)
    return code


def add_commands(commands: Any) -> None:
    """``serve``, ``plan`` and ``up``, on ``batchfit``'s subparsers."""
    from .runtime.plan import PLAN_FIELDS
    from .supervise.launcher import REPLICA_ADDRESS_FIELDS

    serve_parser = commands.add_parser("serve", help=COMMANDS["serve"])
    plan_parser = commands.add_parser("plan", help=COMMANDS["plan"])
    add_settings_flags(plan_parser, only=PLAN_FIELDS)
    add_settings_flags(serve_parser)
    up_parser = commands.add_parser(
        "up",
        help=COMMANDS["up"],
        description="Start --replicas replicas on loopback ports and Nginx on --port in front "
        "of them. The serve flags below are passed to every replica.",
    )
    add_settings_flags(up_parser, LauncherSettings)
    add_settings_flags(up_parser, Settings, skip=REPLICA_ADDRESS_FIELDS)


def build_parser() -> argparse.ArgumentParser:
    """The server's own commands (``python -m server``); ``batchfit`` adds the other rooms'."""
    parser = argparse.ArgumentParser(
        prog="batchfit", description="Adaptive-batching inference server."
    )
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def _busy_port(settings: Settings) -> str | None:
    """Which of the ports to listen on is taken, said in one line (None: both are free),
    before the model loads: a taken one would otherwise end start-up in a traceback."""
    from .metrics_server import bind

    for flag, port in (("--port", settings.port), ("--metrics-port", settings.metrics_port)):
        if not port:  # none, or 0: any free port
            continue
        try:
            bind(settings.host, port).close()
        except OSError as exc:
            return (
                f"cannot listen on {settings.host}:{port} ({flag}): "
                f"{os.strerror(exc.errno) if exc.errno else exc}; choose "
                "another port, or stop what listens there"
            )
    return None


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed ``serve``, ``plan`` or ``up``."""
    if args.command == "up":
        from .supervise.launcher import up

        return up(args)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"batchfit: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(settings)
    if args.command == "plan":
        from .runtime.plan import memory_plan

        configure_logging("warning")
        try:
            print(memory_plan(settings))
        except KeyboardInterrupt:
            # As serve does: a load or forward pass in progress is not waited for.
            logging.shutdown()
            os._exit(130)
        return 0
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """The server's own commands; ``argv`` None: the process's command line (``python -m
    server``)."""
    return run_command(build_parser().parse_args(argv))
