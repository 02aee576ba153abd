"""Writes deploy/grafana/dashboards/*.json. Edit here, then run:

    python deploy/grafana/build_dashboards.py

tests/test_dashboards.py fails when the committed JSON differs from what this script writes,
and tests/integration/test_observability.py evaluates every expression against a real
Prometheus scraping a real replica.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
# Grafana fills these in; tests substitute them before asking Prometheus.
SEL = 'instance=~"$instance"'
# Series of one model (batching, latency, memory prediction) also follow the model variable.
MSEL = f'{SEL},model=~"$model"'
WINDOW = "$__rate_interval"
API = f'endpoint!="other",{SEL}'  # the API endpoints, not health checks or scrapes

Panel = dict[str, Any]


def target(expr: str, legend: str, ref: str, **extra: Any) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def timeseries(title: str, unit: str, targets: list[tuple[str, str]], *, bars: bool = False,
               description: str = "") -> Panel:  # fmt: skip
    custom: dict[str, Any] = {"drawStyle": "bars" if bars else "line", "fillOpacity": 10}
    if bars:
        custom.update(fillOpacity=80, stacking={"mode": "normal", "group": "A"})
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)],
    }


def heatmap(title: str, metric: str, description: str) -> Panel:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "yAxis": {"axisPlacement": "left", "unit": "short"},
            "tooltip": {"mode": "single", "yHistogram": True},
        },
        "targets": [
            target(
                f"sum by (le) (increase({metric}_bucket{{{MSEL}}}[{WINDOW}]))",
                "{{le}}",
                "A",
                format="heatmap",
            )
        ],
    }


def quantiles(metric: str, labels: str, by: str = "le") -> list[tuple[str, str]]:
    prefix = "".join(f"{{{{{label}}}}} " for label in ("instance", "model") if label in by)
    return [
        (
            f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{labels}}}[{WINDOW}])))",
            f"{prefix}p{round(q * 100)}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def ratio(numerator: str, denominator: str) -> str:
    return f"sum(rate({numerator}[{WINDOW}])) / sum(rate({denominator}[{WINDOW}]))"


def latency_row() -> list[Panel]:
    # Every route that runs a model (/v1/infer, /v1/embeddings, /v1/rerank, v2 infer): all
    # but /v1/models, whichever protocol the clients speak.
    infer = f'endpoint!="/v1/models",{MSEL}'
    return [
        timeseries(
            "Request latency, fleet (p50 / p95 / p99)", "s",
            quantiles("batchfit_request_duration_seconds", infer),
            description="End-to-end latency of inference requests inside the replicas "
            "(/v1/infer, /v1/embeddings, /v1/rerank and v2 infer), all replicas pooled "
            "(histogram_quantile over sum by le).",
        ),
        timeseries(
            "Request latency per replica (p50 / p95 / p99)", "s",
            quantiles("batchfit_request_duration_seconds", infer, by="le, instance"),
        ),
        timeseries(
            "Queue wait (p50 / p95 / p99)", "s",
            quantiles("batchfit_queue_wait_seconds", MSEL),
            description="From admission to the start of the item's batch.",
        ),
        timeseries(
            "Batch execution time (p50 / p95 / p99)", "s",
            quantiles("batchfit_batch_duration_seconds", MSEL),
            description="Wall time of one forward pass on the model thread.",
        ),
        timeseries(
            "Queue wait per model (p99)", "s",
            [(f"histogram_quantile(0.99, sum by (le, model) "
              f"(rate(batchfit_queue_wait_seconds_bucket{{{MSEL}}}[{WINDOW}])))", "{{model}}")],
            description="Models on one replica share its queue and model thread: the oldest "
            "waiting item runs next, whatever its model, so a flood to one model shows here "
            "as a longer wait for the others only up to the flood's queue share.",
        ),
        timeseries(
            "Batch execution time per model (p50)", "s",
            [(f"histogram_quantile(0.5, sum by (le, model) "
              f"(rate(batchfit_batch_duration_seconds_bucket{{{MSEL}}}[{WINDOW}])))",
              "{{model}}")],
        ),
    ]  # fmt: skip


def throughput_row() -> list[Panel]:
    total = f"sum(rate(batchfit_requests_total{{{API}}}[{WINDOW}]))"
    return [
        timeseries(
            "Requests per second by status code", "reqps",
            [(f"sum by (code) (rate(batchfit_requests_total{{{API}}}[{WINDOW}]))", "{{code}}")],
        ),
        timeseries(
            "Error ratio", "percentunit",
            [
                (f'(sum(rate(batchfit_requests_total{{{API},code=~"5.."}}[{WINDOW}])) or '
                 f"vector(0)) / {total}", "5xx"),
                (f'(sum(rate(batchfit_requests_total{{{API},code=~"4.."}}[{WINDOW}])) or '
                 f"vector(0)) / {total}", "4xx"),
            ],
            description="Share of API requests answered with 5xx (server side, including 504 "
            "deadline and 507 out of memory) and 4xx (client side, including 429 overloaded).",
        ),
        timeseries(
            "Rejections by reason", "reqps",
            [(f"sum by (reason) (rate(batchfit_rejections_total{{{SEL}}}[{WINDOW}]))",
              "{{reason}}")],
            description="Requests refused before or instead of compute.",
        ),
        timeseries(
            "Errors by type", "reqps",
            [(f'sum by (error_type) (rate(batchfit_requests_total{{{API},error_type!=""}}'
              f"[{WINDOW}]))", "{{error_type}}")],
        ),
        timeseries(
            "Inputs and tokens per second", "short",
            [
                (f"sum by (model) (rate(batchfit_inputs_total{{{MSEL}}}[{WINDOW}]))",
                 "{{model}} inputs/s"),
                (f"sum by (model) (rate(batchfit_input_tokens_total{{{MSEL}}}[{WINDOW}]))",
                 "{{model}} tokens/s"),
            ],
        ),
        timeseries(
            "Cancellations by stage", "short",
            [(f"sum by (stage) (rate(batchfit_cancelled_items_total{{{SEL}}}[{WINDOW}]))",
              "{{stage}}")],
            description="Items whose request went away while queued (dropped before compute) "
            "or while running (result discarded).",
        ),
        timeseries(
            "Queue depth, capacity and requests in flight", "short",
            [
                (f"batchfit_queue_depth{{{SEL}}}", "{{instance}} depth"),
                (f"batchfit_queue_capacity{{{SEL}}}", "{{instance}} capacity"),
                (f"batchfit_requests_in_flight{{{SEL}}}", "{{instance}} in flight"),
            ],
        ),
        timeseries(
            "Ready and draining", "short",
            [
                (f"batchfit_ready{{{SEL}}}", "{{instance}} ready"),
                (f"batchfit_draining{{{SEL}}}", "{{instance}} draining"),
                (f"batchfit_model_info{{{MSEL}}}",
                 "{{instance}} {{model}}: {{task}} on {{device}} ({{dtype}})"),
            ],
        ),
    ]  # fmt: skip


def batching_row() -> list[Panel]:
    return [
        timeseries(
            "Mean batch size", "short",
            [
                (ratio(f"batchfit_batch_size_sum{{{MSEL}}}",
                       f"batchfit_batch_size_count{{{MSEL}}}"), "fleet"),
                (f"sum by (instance, model) (rate(batchfit_batch_size_sum{{{MSEL}}}[{WINDOW}])) / "
                 f"sum by (instance, model) (rate(batchfit_batch_size_count{{{MSEL}}}"
                 f"[{WINDOW}]))", "{{instance}} {{model}}"),
            ],
        ),
        heatmap("Batch size", "batchfit_batch_size", "Items per forward pass (powers of two)."),
        heatmap(
            "Batch tokens", "batchfit_batch_tokens",
            "Padded tokens (items x longest input) per forward pass.",
        ),
        timeseries(
            "Padding ratio (padded / real tokens)", "short",
            [
                (ratio(f"batchfit_batch_padded_tokens_total{{{MSEL}}}",
                       f"batchfit_batch_real_tokens_total{{{MSEL}}}"), "mean"),
                (f"histogram_quantile(0.9, sum by (le) "
                 f"(rate(batchfit_batch_padding_ratio_bucket{{{MSEL}}}[{WINDOW}])))", "p90"),
            ],
            description="1 means no padding; the planner groups items of similar length.",
        ),
        timeseries(
            "Batch budget: items and tokens", "short",
            [
                (f"batchfit_batch_budget_items{{{MSEL}}}", "{{instance}} {{model}} items"),
                (f"batchfit_batch_budget_tokens{{{MSEL}}}", "{{instance}} {{model}} tokens"),
            ],
            description="The sizer's budget for the next batch.",
        ),
        timeseries(
            "Batch budget: bytes", "bytes",
            [(f"batchfit_batch_budget_bytes{{{MSEL}}}", "{{instance}} {{model}}")],
            description="Predicted-peak budget of each model's next batch: the free memory "
            "read just before it (which counts every model's weights) less headroom.",
        ),
        timeseries(
            "Failed batches", "short",
            [(f"sum(rate(batchfit_batch_failures_total{{{MSEL}}}[{WINDOW}]))", "failed/s")],
            description="Forward passes that failed for a reason other than memory.",
        ),
    ]  # fmt: skip


def memory_row() -> list[Panel]:
    return [
        timeseries(
            "Device memory: used vs total (NVML)", "bytes",
            [
                (f"batchfit_device_memory_used_bytes{{{SEL}}}", "{{instance}} used"),
                (f"batchfit_device_memory_total_bytes{{{SEL}}}", "{{instance}} total"),
            ],
            description="All processes on the device; 0 on CPU replicas.",
        ),
        timeseries(
            "Torch: allocated vs reserved", "bytes",
            [
                (f"batchfit_torch_allocated_bytes{{{SEL}}}", "{{instance}} allocated"),
                (f"batchfit_torch_reserved_bytes{{{SEL}}}", "{{instance}} reserved"),
                (f"batchfit_torch_reserved_bytes{{{SEL}}} - "
                 f"batchfit_torch_allocated_bytes{{{SEL}}}", "{{instance}} gap"),
            ],
            description="The gap is what the caching allocator holds but no tensor uses.",
        ),
        timeseries(
            "Host memory: resident and available", "bytes",
            [
                (f"batchfit_host_resident_bytes{{{SEL}}}", "{{instance}} resident"),
                (f"batchfit_host_available_bytes{{{SEL}}}", "{{instance}} available"),
            ],
        ),
        timeseries(
            "Batch peak: predicted vs measured", "bytes",
            [
                (f"batchfit_batch_predicted_peak_bytes{{{MSEL}}}",
                 "{{instance}} {{model}} predicted"),
                (f"batchfit_batch_measured_peak_bytes{{{MSEL}}}",
                 "{{instance}} {{model}} measured"),
            ],
            description="Above the memory in use before the batch. Measured above predicted "
            "means the sizer under-estimated.",
        ),
        timeseries(
            "Measured / predicted peak (p50 / p99)", "short",
            [
                (f"histogram_quantile({q}, sum by (le) "
                 f"(rate(batchfit_batch_peak_ratio_bucket{{{MSEL}}}[{WINDOW}])))", f"p{p}")
                for q, p in ((0.5, 50), (0.99, 99))
            ],
            description="Below 1: the prediction was safe.",
        ),
        timeseries(
            "Headroom and free memory at dispatch", "bytes",
            [
                (f"batchfit_memory_headroom_bytes{{{MSEL}}}", "{{instance}} {{model}} headroom"),
                (f"batchfit_memory_free_bytes{{{SEL}}}", "{{instance}} free"),
            ],
        ),
        timeseries(
            "OOM events by outcome (split / failed)", "short",
            [(f"sum by (outcome) (increase(batchfit_oom_events_total{{{MSEL}}}[{WINDOW}]))",
              "{{outcome}}")],
            bars=True,
            description="split: the batch ran out of memory and was retried as two halves; "
            "failed: a single input that does not fit, its request got 507.",
        ),
    ]  # fmt: skip


def by_model_quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le, model) "
         f"(rate({metric}_bucket{{{MSEL}}}[{WINDOW}])))", f"{{{{model}}}} p{round(q * 100)}")
        for q in (0.5, 0.99)
    ]  # fmt: skip


def generation_row() -> list[Panel]:
    """The generators (``--task generate``): streams' latency, tokens, sequences and their
    key/value cache. Empty on replicas that serve no generator."""
    return [
        timeseries(
            "Time to first token (p50 / p99) by model", "s",
            by_model_quantiles("batchfit_generation_time_to_first_token_seconds"),
            description="From a sequence's admission to its first token: its wait to join the "
            "steps and its prompt's prefill.",
        ),
        timeseries(
            "Time between tokens (p50 / p99) by model", "s",
            by_model_quantiles("batchfit_generation_time_between_tokens_seconds"),
            description="Between two tokens of one sequence: a decode step, and any wait "
            "between them (a prompt chunk prefilled in the same step, a preemption).",
        ),
        timeseries(
            "Generated and prompt tokens per second", "short",
            [
                (f"sum by (model) (rate(batchfit_generation_generated_tokens_total{{{MSEL}}}"
                 f"[{WINDOW}]))", "{{model}} generated/s"),
                (f"sum by (model) (rate(batchfit_generation_prompt_tokens_total{{{MSEL}}}"
                 f"[{WINDOW}]))", "{{model}} prompt/s"),
            ],
        ),
        timeseries(
            "Running and waiting sequences", "short",
            [
                (f"batchfit_generation_running_sequences{{{MSEL}}}",
                 "{{instance}} {{model}} running"),
                (f"batchfit_generation_waiting_sequences{{{MSEL}}}",
                 "{{instance}} {{model}} waiting"),
            ],
            description="Each choice of each request is one sequence. Running: its key/value "
            "cache is held (decoding, or prefilling its prompt); waiting: admitted, new or "
            "preempted.",
        ),
        timeseries(
            "Key/value cache: held vs budget", "bytes",
            [
                (f"batchfit_generation_cache_bytes{{{MSEL}}}", "{{instance}} {{model}} held"),
                (f"batchfit_generation_cache_budget_bytes{{{MSEL}}}",
                 "{{instance}} {{model}} budget"),
            ],
            description="What the running sequences' caches hold, against the most they may "
            "hold at the latest step (what they held plus the free memory, less headroom and "
            "the step's activations); "
            "near the budget, new sequences wait and the newest are preempted.",
        ),
        timeseries(
            "Preemptions, resumes and ends for memory", "short",
            [(f"sum by (reason) (rate(batchfit_generation_preemptions_total{{{MSEL}}}"
              f"[{WINDOW}]))", "preempted: {{reason}}"),
             (f"sum(rate(batchfit_generation_resumed_sequences_total{{{MSEL}}}[{WINDOW}]))",
              "resumed"),
             (f"sum by (outcome) (rate("
              f"batchfit_generation_oversized_sequences_total{{{MSEL}}}[{WINDOW}]))",
              "oversized: {{outcome}}")],
            description="Sequences whose cache was freed to resume later: memory (the next "
            "step would not fit) or out_of_memory (a step failed an allocation); those that "
            "resumed (prefilled again); and those memory could not hold even alone (length: "
            "ended with the tokens they had; refused: a prompt answered 507).",
        ),
        timeseries(
            "Finished sequences by reason", "short",
            [(f"sum by (reason) (rate(batchfit_generation_finished_sequences_total{{{MSEL}}}"
              f"[{WINDOW}]))", "{{reason}}")],
            description="stop (end of sequence or a stop string), length (max_tokens or the "
            "context), cancelled (the client went away), error.",
        ),
        heatmap(
            "Step tokens", "batchfit_generation_step_tokens",
            "Tokens one step feeds the model: one per decoding sequence, plus prompt chunks.",
        ),
        timeseries(
            "Step duration (p50 / p99) by model", "s",
            by_model_quantiles("batchfit_generation_step_duration_seconds"),
            description="Wall time of one step on the model thread, which it shares with the "
            "encoders' batches.",
        ),
        timeseries(
            "Generation request duration (p50 / p99) by model", "s",
            by_model_quantiles("batchfit_generation_request_duration_seconds"),
            description="From a sequence's admission to its last token.",
        ),
    ]  # fmt: skip


ROWS = (
    ("Latency", latency_row),
    ("Throughput and errors", throughput_row),
    ("Batching", batching_row),
    ("Memory", memory_row),
    ("Generation", generation_row),
)


def layout(rows: tuple[tuple[str, Any], ...]) -> list[Panel]:
    """Rows in order, two panels of 12 columns side by side under each."""
    panels: list[Panel] = []
    y = 0
    for row_title, build in rows:
        panels.append(
            {"type": "row", "title": row_title, "collapsed": False, "panels": [],
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )  # fmt: skip
        y += 1
        for i, panel in enumerate(build()):
            panel["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}
            panels.append(panel)
        y += 8 * ((len(build()) + 1) // 2)
    for panel_id, panel in enumerate(panels, start=1):
        panel["id"] = panel_id
    return panels


def _query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    """A dashboard variable over a label's values; several or all may be picked."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": "A"},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def batchfit_dashboard() -> dict[str, Any]:
    return {
        "uid": "batchfit",
        "title": "Batchfit",
        "description": "Latency, throughput, batching, memory and generation of the Batchfit "
        "replicas.",
        "tags": ["batchfit"],
        "timezone": "utc",
        "editable": False,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": []},
        "templating": {
            "list": [
                _query_variable("instance", "Replica", "label_values(batchfit_ready, instance)"),
                _query_variable("model", "Model", "label_values(batchfit_model_info, model)"),
            ]
        },
        "panels": layout(ROWS),
    }


DASHBOARD_FILES = {"batchfit.json": batchfit_dashboard}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    DASHBOARDS.mkdir(exist_ok=True)
    for name, build in DASHBOARD_FILES.items():
        (DASHBOARDS / name).write_text(render(build))
        print(f"wrote {DASHBOARDS / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
