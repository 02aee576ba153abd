import logging
import re

import pytest
from pydantic import ValidationError

from server.cli import build_parser, main, settings_from_args
from server.settings import Settings


def test_every_field_is_described():
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"


def test_env_prefix(monkeypatch):
    monkeypatch.setenv("BATCHFIT_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("BATCHFIT_MAX_WAIT_MS", "3")
    monkeypatch.setenv("BATCHFIT_MAX_LENGTH_RATIO", "1.5")
    settings = Settings()
    assert settings.max_batch_size == 7
    assert settings.batcher_config().max_wait_s == pytest.approx(0.003)
    assert settings.batcher_config().max_length_ratio == 1.5


def test_defaults_add_no_idle_wait_and_bound_padding():
    config = Settings().batcher_config()
    assert config.max_wait_s == 0
    assert config.max_length_ratio == 2.0


def test_cli_flags_match_field_names_and_override_env(monkeypatch):
    monkeypatch.setenv("BATCHFIT_PORT", "9000")
    args = build_parser().parse_args(
        ["serve", "--port", "9100", "--max-batch-size", "64", "--max-wait-ms", "1.5",
         "--max-batch-tokens", "2048", "--max-queue-items", "10", "--max-inputs-per-request",
         "10", "--device", "cpu"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert settings.port == 9100
    assert settings.max_batch_size == 64
    assert settings.max_batch_tokens == 2048
    assert settings.max_queue_items == 10
    assert settings.batcher_config().max_wait_s == pytest.approx(0.0015)


def test_every_field_has_a_flag():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in help_text


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_batch_size", 0, "greater than or equal to 1"),
        ("port", 70000, "less than or equal to 65535"),
        ("max_wait_ms", -1, "greater than or equal to 0"),
        ("task", "translate", "auto|embed|classify|rerank"),
        ("model", "a=x,a=y", "the name 'a' is given twice"),
        ("task", "b=embed", r"task for \['b'\], which no --model names"),
    ],
)
def test_bad_values_are_refused_with_the_value_shown(field, value, message):
    with pytest.raises(ValidationError, match=message) as info:
        Settings(**{field: value})
    assert str(value) in str(info.value)


def test_a_hung_pass_ends_the_process_at_twice_the_liveness_bound_unless_told():
    assert Settings().forward_exit_after_s == 600
    assert Settings(forward_timeout_s=900).forward_exit_after_s == 1800
    assert Settings(forward_timeout_s=0).forward_exit_after_s == 0  # liveness off: exit too
    assert Settings(forward_exit_s=0).forward_exit_after_s == 0
    assert Settings(forward_exit_s=300).forward_exit_after_s == 300
    assert settings_from_args(build_parser().parse_args(
        ["serve", "--forward-timeout-s", "1", "--forward-exit-s", "2.5"]
    )).forward_exit_after_s == 2.5  # fmt: skip
    with pytest.raises(ValidationError, match="would exit before its liveness says so"):
        Settings(forward_timeout_s=10, forward_exit_s=5)


def test_default_timeout_cannot_exceed_the_cap():
    with pytest.raises(ValidationError, match=r"default_timeout_s \(100.0\) exceeds"):
        Settings(default_timeout_s=100, max_timeout_s=10)


def test_unknown_setting_is_refused():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Settings(max_batchsize=3)


def test_plan_help_lists_only_the_flags_that_change_the_plan(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--model", "--device", "--dtype", "--memory-limit", "--memory-headroom"):
        assert flag in help_text
    for flag in ("--port", "--api-key", "--drain-timeout-s", "--max-queue-items", "--host"):
        assert flag not in help_text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--port", "9000"])


# A value other than the default for each plan flag; each must reach what the plan builds.
PLAN_VALUES = {
    "model": "/some/folder", "task": "embed", "device": "cpu", "dtype": "bfloat16",
    "quantize": "int8", "num_threads": 3, "max_input_tokens": 64, "max_batch_size": 7,
    "max_batch_tokens": 999, "memory_headroom": 0.3, "memory_limit": "1GiB",
    "default_prompt_name": ("query",), "warmup_timeout_s": 5.0,
}  # fmt: skip


def test_every_plan_flag_changes_what_the_plan_is_built_from():
    from server.runtime.plan import PLAN_FIELDS

    assert set(PLAN_VALUES) == PLAN_FIELDS
    base = Settings()
    for name, value in PLAN_VALUES.items():
        changed = Settings(**{name: value})
        built = (changed.model_spec(), changed.adaptive_config(), changed.memory_limit,
                 changed.warmup_timeout_s)  # fmt: skip
        assert built != (base.model_spec(), base.adaptive_config(), base.memory_limit,
                         base.warmup_timeout_s), name  # fmt: skip


def test_several_models_by_flag_with_names_and_tasks():
    args = build_parser().parse_args(
        ["serve", "--model", "all-MiniLM-L6-v2", "--model", "rr=/models/ce", "--model",
         "clf=/models/clf", "--task", "rr=rerank", "--task", "classify"]
    )  # fmt: skip
    entries = settings_from_args(args).model_entries()
    assert [(e.name, e.source, e.task) for e in entries] == [
        (None, "all-MiniLM-L6-v2", "classify"),  # a bare task applies to the unnamed ones
        ("rr", "/models/ce", "rerank"),
        ("clf", "/models/clf", "classify"),
    ]


@pytest.mark.parametrize(
    "value", ["e=all-MiniLM-L6-v2, rr=/models/ce", '["e=all-MiniLM-L6-v2", "rr=/models/ce"]']
)
def test_several_models_by_environment(monkeypatch, value):
    monkeypatch.setenv("BATCHFIT_MODEL", value)
    monkeypatch.setenv("BATCHFIT_TASK", "rr=rerank")
    specs = Settings().model_specs()
    assert [(name, spec.model, spec.task) for name, spec in specs] == [
        ("e", "all-MiniLM-L6-v2", "auto"),
        ("rr", "/models/ce", "rerank"),
    ]


def test_queue_share_applies_only_with_several_models():
    small = {"max_queue_items": 100, "max_queue_share": 0.5, "max_inputs_per_request": 50}
    assert Settings(**small).max_items_per_model() is None
    two = Settings(model="a=x,b=y", **small)
    assert two.max_items_per_model() == 50
    assert Settings(model="a=x,b=y").max_items_per_model() is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_queue_items": 64, "max_inputs_per_request": 100},
         "max_inputs_per_request (100) exceeds max_queue_items (64): such a request could never "
         "be admitted; lower --max-inputs-per-request or raise --max-queue-items"),
        ({"max_inputs_per_request": 2000},  # the default queue of 1024 items
         "max_inputs_per_request (2000) exceeds max_queue_items (1024)"),
        ({"model": "a=x,b=y", "max_queue_share": 0.2, "max_inputs_per_request": 256},
         "max_inputs_per_request (256) exceeds one model's share of the queue (204 = "
         "max_queue_items 1024 x max_queue_share 0.2): such a request could never be admitted; "
         "lower --max-inputs-per-request or raise --max-queue-share (or --max-queue-items)"),
    ],
)  # fmt: skip
def test_settings_under_which_a_full_request_can_never_be_admitted_are_refused(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings(**settings)


def test_every_full_request_fits_at_the_edges():
    Settings(max_queue_items=64, max_inputs_per_request=64)
    Settings(model="a=x,b=y", max_queue_share=0.25)  # a share of 256: exactly the limit
    Settings(max_queue_share=0.2)  # one model: no share applies


@pytest.mark.parametrize(
    ("settings", "limit", "note"),
    [
        ({"max_queue_items": 32}, 32,
         "--max-inputs-per-request lowered from its default 256 to 32 to fit --max-queue-items "
         "32: a larger request could never be admitted"),
        ({"model": "a=x,b=y", "max_queue_share": 0.2}, 204,
         "--max-inputs-per-request lowered from its default 256 to 204 to fit one model's share "
         "of the queue (--max-queue-items 1024 x --max-queue-share 0.2): a larger request could "
         "never be admitted"),
        ({"model": "a=x,b=y", "max_queue_items": 100, "max_queue_share": 0.5}, 50,
         "to 50 to fit one model's share of the queue (--max-queue-items 100 x --max-queue-share "
         "0.5)"),
        ({"max_queue_items": 1000}, 256, None),  # room for the default: kept, nothing to say
        ({"model": "a=x,b=y", "max_queue_share": 0.25}, 256, None),
        ({"max_queue_items": 32, "max_inputs_per_request": 8}, 8, None),  # set by hand: kept
    ],
)  # fmt: skip
def test_the_default_limit_of_inputs_is_lowered_to_what_the_queue_holds(settings, limit, note):
    lowered = Settings(**settings)
    assert lowered.max_inputs_per_request == limit
    assert lowered.server_config().max_inputs_per_request == limit
    if note is None:
        assert lowered.lowered_defaults() == []
    else:
        (said,) = lowered.lowered_defaults()
        assert note in said


def test_a_limit_set_in_the_environment_counts_as_set_by_hand(monkeypatch):
    monkeypatch.setenv("BATCHFIT_MAX_INPUTS_PER_REQUEST", "64")
    with pytest.raises(ValidationError, match=re.escape("max_inputs_per_request (64) exceeds")):
        Settings(max_queue_items=32)
    monkeypatch.setenv("BATCHFIT_MAX_QUEUE_ITEMS", "32")
    monkeypatch.delenv("BATCHFIT_MAX_INPUTS_PER_REQUEST")
    assert Settings().max_inputs_per_request == 32


def test_serve_starts_with_a_small_queue_and_logs_the_lowered_default(caplog, monkeypatch):
    served = []
    monkeypatch.setattr("server.cli._busy_port", lambda settings: None)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")  # serve sets it where unset
    # The engine's branch of serve, faked: it returns once the start-up log is written.
    monkeypatch.setattr("server.engine.serve_engine", lambda s: served.append(s) or 0)
    caplog.set_level(logging.INFO, logger="batchfit")
    assert main(["serve", "--max-queue-items", "32", "--api-workers", "2"]) == 0
    (settings,) = served
    assert (settings.max_queue_items, settings.max_inputs_per_request) == (32, 32)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "--max-inputs" in r.getMessage()]
    assert said == [(logging.INFO,
        "--max-inputs-per-request lowered from its default 256 to 32 to fit --max-queue-items "
        "32: a larger request could never be admitted")]  # fmt: skip


def test_serve_refuses_both_limits_set_by_hand_that_cannot_work_together(capsys, monkeypatch):
    monkeypatch.setattr("server.cli.serve", lambda settings: 0)  # never a real server here
    argv = ["serve", "--max-queue-items", "64", "--max-inputs-per-request", "100"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "max_inputs_per_request (100) exceeds max_queue_items (64)" in err
    assert "lower --max-inputs-per-request or raise --max-queue-items" in err


def test_api_workers_take_the_metrics_port_and_the_admin_token_and_are_at_least_one():
    settings = Settings(api_workers=2, metrics_port=9100, admin_token="secret")
    assert (settings.api_workers, settings.metrics_port) == (2, 9100)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        Settings(api_workers=0)
