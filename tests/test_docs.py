"""The generated parts of the user docs match the code: flags from Settings (docs/flags.md),
error types from server/errors.py (docs/errors.md), metrics from a replica's registry
(docs/observability.md); the bulk commands' hand-written flag table has every flag they take;
the README stays short, every relative link in it and in docs/ resolves, and docs/README.md
indexes every page."""

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


def test_flag_page_lists_every_serve_flag_and_its_variable():
    page = (ROOT / "docs" / "flags.md").read_text()
    for name in Settings.model_fields:
        assert f"`--{name.replace('_', '-')}`" in page, name
        assert f"`BATCHFIT_{name.upper()}`" in page, name
    for flag in ("--host", "--max-body-bytes", "--max-input-tokens", "--log-level"):
        assert f"| `{flag}` |" in page


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


def test_error_page_lists_every_error_type_with_its_status():
    page = (ROOT / "docs" / "errors.md").read_text()
    start = page.index("<!-- BEGIN GENERATED error-types")
    table = page[start : page.index("<!-- END GENERATED error-types", start)]
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


def test_the_readme_is_read_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 210, f"README.md has {len(lines)} lines; move detail to docs/"


FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, whose brackets are no links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _anchors(path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``, ``-1``, ``-2``... after repeats."""
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = base, 0
        while anchor in found:
            n += 1
            anchor = f"{base}-{n}"
        found.add(anchor)
    return found


def _relative_links(path) -> list[str]:
    targets = LINK.findall(_prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t)]


def _user_pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in _user_pages():
        for target in _relative_links(page):
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{where} (no such heading)")
    assert broken == []


def test_the_links_are_found():
    page = ROOT / "docs" / "README.md"
    assert "api.md" in _relative_links(page) and "../README.md" in _relative_links(page)
    assert "the-http-api" in _anchors(ROOT / "docs" / "api.md")
    assert "post-v1rerank" in _anchors(ROOT / "docs" / "api.md")
    assert "gomp_spincount" in _anchors(ROOT / "docs" / "cpu.md")


def test_the_docs_index_links_every_page():
    docs = ROOT / "docs"
    index = docs / "README.md"
    linked = {(docs / t.partition("#")[0]).resolve() for t in _relative_links(index)}
    pages = {p.resolve() for p in [*docs.glob("*.md"), *(docs / "bench").glob("*.md")]}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked - {index.resolve()})
    assert missing == [], "docs/README.md does not link these pages"
