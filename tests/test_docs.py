"""The generated parts of the user docs match the code: flags from Settings, metrics from a
replica's registry."""

import pytest
from pydantic import Field

from server.docs import ROOT, flag_table, metric_table, render, replica_registry, stale_files
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
