"""``python -m batchfit`` and the ``batchfit`` script: ``batchfit``'s command line."""

import sys

from server.__main__ import quietly_imported


def main() -> int:
    return quietly_imported("batchfit.cli")()


if __name__ == "__main__":
    sys.exit(main())
