"""``python -m server``: the server's own commands (serve, plan, up); ``batchfit`` (the
script, ``python -m batchfit``) has every room's."""

import gc
import importlib
import sys
from collections.abc import Callable


def quietly_imported(module: str) -> Callable[[], int]:
    """``module``'s ``main``, imported with garbage collection off and what the import left
    frozen out of it.

    The libraries' imports (torch, transformers: some 340,000 objects that live as long as
    the process) make next to no garbage, yet set off full collections, each walking all that
    was imported so far: 0.4 s of every start on 2 cores. The replicas of ``batchfit up`` and
    the benchmarks' servers start through ``python -m server``, each start and restart
    waiting on it; ``batchfit/__main__.py`` starts this way too."""
    gc.disable()
    try:
        command_line = importlib.import_module(module).main
        gc.freeze()
    finally:
        gc.enable()
    return command_line


def main() -> int:
    return quietly_imported("server.cli")()


if __name__ == "__main__":
    sys.exit(main())
