"""The generated parts of the user docs match the code: flags from Settings, error types from
server/errors.py, metrics from a replica's registry; and the bulk commands' hand-written flag
table has every flag they take."""

import re

import pytest
from pydantic import Field

from server.docs import (
    ROOT,
    error_table,
    flag_table,
    metric_table,
    render,
    replica_registry,
    stale_files,
)
from server.errors import ERROR_TYPES, ErrorType
from server.settings import Settings


def test_generated_tables_are_up_to_date():
    assert stale_files() == [], "run: python -m server.docs"


def test_readme_lists_every_serve_flag_and_its_variable():
    readme = (ROOT / "README.md").read_text()
    for name in Settings.model_fields:
        assert f"`--{name.replace('_', '-')}`" in readme, name
        assert f"`BATCHFIT_{name.upper()}`" in readme, name
    for flag in ("--host", "--max-body-bytes", "--max-input-tokens", "--log-level"):
        assert f"| `{flag}` |" in readme


def test_a_new_setting_makes_the_flag_table_stale():
    class MoreSettings(Settings):
        new_knob_s: float = Field(2.5, description="A knob added later.")

    table = flag_table(MoreSettings)
    assert table != flag_table()
    assert table.endswith("| `--new-knob-s` | `BATCHFIT_NEW_KNOB_S` | 2.5 | A knob added later. |")


def test_metric_table_covers_every_metric_of_a_replica():
    registry = replica_registry()
    table = metric_table(registry)
    docs = (ROOT / "docs" / "observability.md").read_text()
    for family in registry.collect():
        assert f"`{family.name}" in table and f"`{family.name}" in docs, family.name
    for name in ("batchfit_open_items", "batchfit_active_infer_requests",
                 "batchfit_event_loop_tasks"):  # fmt: skip
        assert f"| `{name}` | gauge |" in docs
    assert "| `batchfit_requests_total` | counter | endpoint, code, error_type |" in docs


def test_render_replaces_only_its_region():
    text = "intro\n<!-- BEGIN GENERATED t: how -->\nold\nrows\n<!-- END GENERATED t -->\noutro\n"
    assert render(text, "t", "new") == (
        "intro\n<!-- BEGIN GENERATED t: how -->\nnew\n<!-- END GENERATED t -->\noutro\n"
    )
    with pytest.raises(ValueError, match="no region 'other'"):
        render(text, "other", "x")


def test_readme_error_table_lists_every_error_type_with_its_status():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- BEGIN GENERATED error-types")
    table = readme[start : readme.index("<!-- END GENERATED error-types", start)]
    for kind in ERROR_TYPES.values():
        assert f"| `{kind.name}` |" in table, kind.name
    for name, status in [("not_found", 404), ("method_not_allowed", 405),
                         ("unsupported_parameter", 400), ("rate_limited", 429)]:  # fmt: skip
        assert f"| {status} | `{name}` |" in table, name


def test_a_new_error_type_makes_the_error_table_stale():
    kinds = [*ERROR_TYPES.values(), ErrorType("teapot", (418,), "asked for coffee")]
    table = error_table(kinds)
    assert table != error_table()
    assert "| 418 | `teapot` | replica | asked for coffee |" in table


# Phrases of notes on how the work was done, which have no place in a user's guide.
DEVELOPMENT_NOTES = (
    r"\bissue #?\d+",
    r"(?<![\w&/])#\d+\b",
    r"\ba test fails\b",
    r"\bsoak test\b",
    r"\bour hosts?\b",
    r"\buntil you do\b",
    r"\bfastest on \d+ vCPUs\b",
)


def test_user_docs_carry_no_development_notes():
    """The README, docs/ (but the developers' own page) and pyproject's comments speak to
    users."""
    paths = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for path in paths:
        if path.name == "development.md":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.name}:{number}: {line}" for pattern in DEVELOPMENT_NOTES
                      if re.search(pattern, line, re.IGNORECASE)]  # fmt: skip
    assert found == []


def test_the_bulk_flag_table_lists_every_flag_of_the_bulk_commands_and_no_other():
    import argparse

    from bulk.cli import COMMANDS, add_bulk_flags

    flags: set[str] = set()
    for task in COMMANDS:
        parser = argparse.ArgumentParser()
        add_bulk_flags(parser, task)
        flags |= {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    flags.discard("--help")
    text = (ROOT / "docs" / "bulk.md").read_text()
    table = text.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(--[a-z-]+)[` ]", table, re.MULTILINE))
    assert documented == flags
