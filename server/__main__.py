"""``python -m server``: the server's own commands (serve, plan, up); ``batchfit`` (the
script, ``python -m batchfit``) has every room's."""

import gc
import sys


def main() -> int:
    # As batchfit/__main__.py does, and for the same 0.4 s: the replicas of ``batchfit up``
    # (and the benchmarks' servers) start this way, each start and restart waiting on it.
    gc.disable()
    try:
        from .cli import main as command_line

        gc.freeze()
    finally:
        gc.enable()
    return command_line()


if __name__ == "__main__":
    sys.exit(main())
