"""The shipped Prometheus and Grafana files, checked without starting them.

tests/integration/test_observability.py evaluates every expression against a real Prometheus.
"""

import importlib.util
import re

import pytest
import yaml
from prometheus_client import CollectorRegistry

from server import Settings, create_app
from tests.dashboards import all_panel_queries, dashboard_files, load
from tests.fakes import ScriptedModel
from tests.servers import ROOT

GRAFANA = ROOT / "deploy" / "grafana"
ROWS = ["Latency", "Throughput and errors", "Batching", "Memory", "Generation"]


def build_module():
    spec = importlib.util.spec_from_file_location(
        "build_dashboards", GRAFANA / "build_dashboards.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    create_app(Settings(), model=ScriptedModel(), registry=registry)
    names = set()
    for family in registry.collect():
        if family.type == "gauge":
            names.add(family.name)
        names.update(sample.name for sample in family.samples)
        # Labelled metrics have no samples until a label value is used.
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",),
                    "info": ("_info",)}.get(family.type, ())  # fmt: skip
        names.update(family.name + suffix for suffix in suffixes)
    return names


def test_committed_dashboards_match_the_generator():
    module = build_module()
    assert {path.name for path in dashboard_files()} == set(module.DASHBOARD_FILES)
    for name, build in module.DASHBOARD_FILES.items():
        committed = (GRAFANA / "dashboards" / name).read_text()
        assert committed == module.render(build), (
            f"{name} is stale: run python deploy/grafana/build_dashboards.py"
        )


def test_dashboard_has_its_rows_in_order():
    dashboard = load(GRAFANA / "dashboards" / "batchfit.json")
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ROWS
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "batchfit"


def test_every_panel_uses_the_provisioned_datasource():
    for path in dashboard_files():
        for panel in load(path)["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, panel
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "prometheus"


def test_every_metric_a_panel_reads_is_exported():
    exported = exported_names()
    for query in all_panel_queries():
        for name in re.findall(r"\bbatchfit_[a-z_]+", query.expr):
            assert name in exported, f"{query}: {name} is not exported"


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        ("Latency", ["histogram_quantile(0.5, sum by (le)", "histogram_quantile(0.99, sum by (le)",
                     "sum by (le, instance)", "batchfit_queue_wait_seconds_bucket",
                     "batchfit_batch_duration_seconds_bucket"]),
        ("Throughput and errors", ["sum by (code)", "batchfit_rejections_total",
                                   'code=~"5.."']),
        ("Batching", ["batchfit_batch_size_sum", "batchfit_batch_size_bucket",
                      "batchfit_batch_padded_tokens_total", "batchfit_batch_budget_items"]),
        ("Memory", ["batchfit_device_memory_used_bytes", "batchfit_device_memory_total_bytes",
                    "batchfit_torch_allocated_bytes", "batchfit_torch_reserved_bytes",
                    "batchfit_batch_predicted_peak_bytes", "batchfit_batch_measured_peak_bytes",
                    "batchfit_memory_headroom_bytes", "batchfit_oom_events_total"]),
        ("Generation", ["batchfit_generation_time_to_first_token_seconds_bucket",
                        "batchfit_generation_time_between_tokens_seconds_bucket",
                        "histogram_quantile(0.5, sum by (le, model)",
                        "histogram_quantile(0.99, sum by (le, model)",
                        "rate(batchfit_generation_generated_tokens_total",
                        "rate(batchfit_generation_prompt_tokens_total",
                        "batchfit_generation_running_sequences",
                        "batchfit_generation_waiting_sequences",
                        "batchfit_generation_cache_bytes", "batchfit_generation_cache_budget_bytes",
                        "sum by (reason) (rate(batchfit_generation_preemptions_total",
                        "rate(batchfit_generation_resumed_sequences_total",
                        "batchfit_generation_oversized_sequences_total",
                        "sum by (reason) (rate(batchfit_generation_finished_sequences_total",
                        "batchfit_generation_step_tokens_bucket"]),
    ],
)  # fmt: skip
def test_rows_show_what_the_issue_asks(row, needles):
    exprs = " ".join(q.expr for q in all_panel_queries() if q.row == row)
    for needle in needles:
        assert needle in exprs, f"{row} row lacks {needle}"


@pytest.mark.parametrize("title", ["Batch size", "Step tokens"])
def test_token_and_size_heatmaps_read_buckets_as_a_heatmap(title):
    dashboard = load(GRAFANA / "dashboards" / "batchfit.json")
    heatmap = next(p for p in dashboard["panels"] if p["title"] == title)
    assert heatmap["type"] == "heatmap"
    assert heatmap["targets"][0]["format"] == "heatmap"


def test_the_generation_panels_read_each_metric_of_a_generator():
    """Every generation metric is on a panel of the Generation row, and only there; the
    latencies as p50 and p99 by model, the cache against its budget on one panel."""
    registry = CollectorRegistry()
    create_app(Settings(), model=ScriptedModel(), registry=registry)
    families = {family.name for family in registry.collect()}
    generation = {name for name in families if name.startswith("batchfit_generation_")}
    assert len(generation) == 15
    queries = all_panel_queries()
    row = [q for q in queries if q.row == "Generation"]
    read = {name for q in row for name in re.findall(r"\bbatchfit_[a-z_]+", q.expr)}
    assert {re.sub(r"_(bucket|total)$", "", name) for name in read} == generation
    assert not any("batchfit_generation_" in q.expr for q in queries if q.row != "Generation")
    panels = {}
    for query in row:
        panels.setdefault(query.panel, []).append(query.expr)
    for metric in ("time_to_first_token_seconds", "time_between_tokens_seconds"):
        (exprs,) = [e for e in panels.values() if f"batchfit_generation_{metric}" in e[0]]
        assert [e.split(",")[0] for e in exprs] == [
            "histogram_quantile(0.5", "histogram_quantile(0.99",
        ]  # fmt: skip
        assert all("sum by (le, model)" in e for e in exprs)
    (cache,) = [e for e in panels.values() if "batchfit_generation_cache_bytes" in e[0]]
    assert "batchfit_generation_cache_budget_bytes" in cache[1]


def test_grafana_provisioning_uses_the_agreed_names():
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert [(d["uid"], d["type"], d["url"]) for d in datasources] == [
        ("prometheus", "prometheus", "http://prometheus:9090")
    ]
    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "batchfit.yml").read_text()
    )["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]


def test_prometheus_scrapes_each_replica_metrics_port_directly():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert list(jobs) == ["batchfit"]
    targets = [t for group in jobs["batchfit"]["static_configs"] for t in group["targets"]]
    assert targets == ["replica-0:8001", "replica-1:8001"]
    assert not any("nginx" in t for t in targets)


def per_model_series() -> set[str]:
    """Names of the series that carry a ``model`` label, as a started replica exports them."""
    registry = CollectorRegistry()
    runtime = create_app(Settings(), model=ScriptedModel(), registry=registry).state.runtime
    runtime.batching_metrics.for_model("m")
    runtime.memory_metrics.for_model("m")
    runtime.metrics.inputs.labels("m")
    runtime.metrics.input_tokens.labels("m")
    runtime.metrics.request_duration.labels("/v1/infer", "m")
    runtime.metrics.model.labels("m").info({"name": "m"})
    runtime.generators.metrics.for_model("m")
    return {
        sample.name for family in registry.collect() for sample in family.samples
        if "model" in sample.labels
    }  # fmt: skip


def test_the_model_variable_filters_every_per_model_series():
    dashboard = load(GRAFANA / "dashboards" / "batchfit.json")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["instance", "model"]
    assert variables["model"]["query"]["query"] == "label_values(batchfit_model_info, model)"
    labelled = per_model_series()
    assert {"batchfit_queue_wait_seconds_bucket", "batchfit_batch_budget_bytes"} <= labelled
    for query in all_panel_queries():
        for name, selector in re.findall(r"\b(batchfit_[a-z_]+)\{([^}]*)\}", query.expr):
            wants_model = name in labelled
            assert ('model=~"$model"' in selector) is wants_model, f"{query}: {name}{{{selector}}}"


def _matches(operator: str, value: str, label: str) -> bool:
    return {
        "=": label == value,
        "!=": label != value,
        "=~": re.fullmatch(value, label) is not None,
        "!~": re.fullmatch(value, label) is None,
    }[operator]


def test_request_latency_panels_count_every_route_that_runs_a_model():
    """Whichever protocol the clients speak (OpenAI's /v1/embeddings alone, say), the latency
    panels show their requests; /v1/models runs no model and is left out."""
    from server.middleware import COUNTED_ENDPOINTS, V2_INFER

    inference = (COUNTED_ENDPOINTS - {"/v1/models"}) | {V2_INFER}
    selectors = [
        selector
        for query in all_panel_queries()
        for selector in re.findall(
            r"batchfit_request_duration_seconds_bucket\{([^}]*)\}", query.expr
        )
    ]
    assert selectors
    for selector in selectors:
        matchers = re.findall(r'\bendpoint(=~|!~|!=|=)"([^"]*)"', selector)
        assert matchers, selector
        for endpoint in inference:
            assert all(_matches(op, value, endpoint) for op, value in matchers), (
                endpoint,
                selector,
            )
        assert not all(_matches(op, value, "/v1/models") for op, value in matchers), selector
