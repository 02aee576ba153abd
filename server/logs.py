"""The log format of every process of a replica (the engine's API processes import this and
not the CLI, which brings the bench and bulk commands)."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
