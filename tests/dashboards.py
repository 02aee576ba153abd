"""Read the shipped Grafana dashboards: every panel's PromQL, with the row it sits in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.servers import ROOT

DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    row: str
    panel: str
    ref: str
    expr: str

    def promql(self, *, window: str = "1m", instance: str = ".*", model: str = ".*") -> str:
        """The expression as Grafana would send it, with its variables filled in."""
        return (
            self.expr.replace("$__rate_interval", window)
            .replace("$__interval", window)
            .replace("$instance", instance)
            .replace("$model", model)
        )

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.row} / {self.panel} [{self.ref}]"


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panel_queries(path: Path) -> list[PanelQuery]:
    """Every target of every panel, rows included (collapsed rows keep panels inside)."""
    dashboard = load(path)
    queries = []
    row = ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            nested = panel.get("panels", [])
        else:
            nested = [panel]
        for inner in nested:
            for target in inner.get("targets", []):
                queries.append(
                    PanelQuery(path.stem, row, inner["title"], target["refId"], target["expr"])
                )
    return queries


def all_panel_queries() -> list[PanelQuery]:
    return [query for path in dashboard_files() for query in panel_queries(path)]
