"""Generated parts of the user docs: the serve flag table (from ``Settings``) in docs/flags.md,
the error table (from ``server/errors.py``'s ``ERROR_TYPES``) in docs/errors.md, and the metric
table (from a replica's registry) in docs/observability.md.

``python -m server.docs`` rewrites them; ``python -m server.docs --check`` exits 1 when a file
is stale (a test runs it). Each region sits between ``<!-- BEGIN GENERATED name -->`` and
``<!-- END GENERATED name -->``; everything outside the markers is left alone.
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from .errors import ERROR_TYPES, ErrorType
from .settings import Settings

ROOT = Path(__file__).resolve().parent.parent
_TYPE_LABELS = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "info"}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):  # a repeatable flag
        return ", ".join(_default(v) for v in value) or "unset"
    return str(value)


def flag_table(settings_class: type[BaseModel] = Settings, prefix: str = "BATCHFIT_") -> str:
    """One row per field: flag, environment variable, default and meaning."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in settings_class.model_fields.items():
        flag = "--" + name.replace("_", "-")
        shown = f"`{flag}` / `--no-{flag[2:]}`" if field.annotation is bool else f"`{flag}`"
        meaning = field.description or ""
        if typing.get_origin(field.annotation) is typing.Literal:
            choices = ", ".join(f"`{c}`" for c in typing.get_args(field.annotation))
            meaning += f" One of {choices}."
        rows.append(
            f"| {shown} | `{prefix}{name.upper()}` | {_default(field.default)} | {_cell(meaning)} |"
        )
    return "\n".join(rows)


def error_table(error_types: Iterable[ErrorType] | None = None) -> str:
    """One row per ``error_type``, by status: who answers it and when."""
    kinds = list(ERROR_TYPES.values() if error_types is None else error_types)
    rows = ["| status | error_type | answered by | when |", "| --- | --- | --- | --- |"]
    for kind in sorted(kinds, key=lambda k: k.statuses[0] if k.statuses else 999):
        status = " or ".join(map(str, kind.statuses)) or "as raised"
        by = ", ".join(kind.answered_by)
        rows.append(f"| {status} | `{kind.name}` | {by} | {_cell(kind.when)} |")
    return "\n".join(rows)


def replica_registry() -> CollectorRegistry:
    """The registry of a replica as ``create_app`` builds it (no model is loaded)."""
    from .app import create_app

    registry = CollectorRegistry()
    create_app(Settings(), registry=registry)
    return registry


def _label_names(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    # NOTE: prometheus_client has no public way to list a labelled metric's label names before
    # it has a child; its collectors keep them in ``_labelnames``.
    found = {}
    for collector in list(registry._collector_to_names):
        for family in collector.describe() if hasattr(collector, "describe") else ():
            found[family.name] = tuple(getattr(collector, "_labelnames", ()))
    return found


def metric_table(registry: CollectorRegistry | None = None) -> str:
    """One row per metric family of a replica: name as scraped, type, labels, help text."""
    registry = registry if registry is not None else replica_registry()
    labels = _label_names(registry)
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for family in registry.collect():  # in the order the replica registers them
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        names = ", ".join(labels.get(family.name, ()))
        rows.append(
            f"| `{family.name}{suffix}` | {_TYPE_LABELS.get(family.type, family.type)} | {names} "
            f"| {_cell(family.documentation)} |"
        )
    return "\n".join(rows)


REGIONS: dict[str, dict[str, Callable[[], str]]] = {
    "docs/flags.md": {"serve-flags": flag_table},
    "docs/errors.md": {"error-types": error_table},
    "docs/observability.md": {"metrics": metric_table},
}


def render(text: str, name: str, content: str) -> str:
    """``text`` with the region ``name`` replaced by ``content``."""
    pattern = re.compile(
        rf"(<!-- BEGIN GENERATED {re.escape(name)}[^>]*-->\n).*?(<!-- END GENERATED "
        rf"{re.escape(name)} -->)",
        re.S,
    )
    if not pattern.search(text):
        raise ValueError(f"no region {name!r} (<!-- BEGIN GENERATED {name} ... -->)")
    return pattern.sub(lambda m: m.group(1) + content + "\n" + m.group(2), text, count=1)


def stale_files(root: Path = ROOT, *, write: bool = False) -> list[str]:
    """The files whose generated regions differ from what the code says (rewritten if
    ``write``)."""
    stale = []
    for path, regions in REGIONS.items():
        text = (root / path).read_text(encoding="utf-8")
        new = text
        for name, generate in regions.items():
            new = render(new, name, generate())
        if new != text:
            stale.append(path)
            if write:
                (root / path).write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = stale_files(write=not args.check)
    for path in stale:
        print(f"{path}: {'stale' if args.check else 'rewritten'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
