"""Print how closely Batchfit's answers equal the reference for every model family: one tiny
random-weight model per family (built in its real layout), all served by one replica, each
compared with sentence-transformers or transformers' pipeline reading the same folder, in
float32, batched and one input at a time.

    python -m scripts.parity_table [--family qwen3 --family bert-cls] [--keep DIR]

Needs the test dependencies (sentence-transformers): ``pip install -e '.[test]'``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.families import FAMILIES, build_all, measure, table
from tests.servers import run_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family", action="append", choices=[f.name for f in FAMILIES],
        help="Only these families (repeatable); default: all of them.",
    )  # fmt: skip
    parser.add_argument("--keep", type=Path, help="Build the models in DIR and keep them.")
    args = parser.parse_args(argv)
    families = tuple(f for f in FAMILIES if not args.family or f.name in args.family)
    with tempfile.TemporaryDirectory(prefix="batchfit-parity-") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        print(f"building {len(families)} tiny models in {root}", file=sys.stderr)
        folders = build_all(root, families)
        flags = [f for name, path in folders.items() for f in ("--model", f"{name}={path}")]
        with run_server(root, *flags, "--max-batch-size", "16", "--dtype", "float32") as server:
            print(f"serving them at {server.url}", file=sys.stderr)
            results = [measure(server.url, family, folders[family.name]) for family in families]
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
