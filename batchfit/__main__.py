"""``python -m batchfit`` and the ``batchfit`` script: ``batchfit``'s command line."""

import gc
import sys


def main() -> int:
    # The libraries' imports (torch, transformers: some 340,000 objects that live as long as
    # the process) make next to no garbage, yet set off full collections, each walking all
    # that was imported so far: 0.4 s of every start on 2 cores. So none runs while they
    # import, and what they leave is frozen out of the collections after.
    gc.disable()
    try:
        from .cli import main as command_line

        gc.freeze()
    finally:
        gc.enable()
    return command_line()


if __name__ == "__main__":
    sys.exit(main())
