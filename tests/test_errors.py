import pytest
from starlette.exceptions import HTTPException as StarletteHTTPException

from batching import (
    DeadlineExceeded,
    InferenceFailed,
    NeverAdmitted,
    OutOfMemory,
    QueueFull,
    ShuttingDown,
)
from models import InputTooLong
from server.errors import ERROR_TYPES, NGINX, REPLICA, ApiError, error_body, to_api_error
from server.middleware import REJECTION_REASON


@pytest.mark.parametrize(
    ("error", "status", "error_type"),
    [
        (QueueFull(10, 10, 1.0), 429, "overloaded"),
        (NeverAdmitted(100, 64), 413, "too_many_inputs"),
        (InputTooLong(0, 600, 256), 413, "input_too_long"),
        (DeadlineExceeded(1.0), 504, "deadline_exceeded"),
        (OutOfMemory("input 0 does not fit"), 507, "out_of_memory"),
        (ShuttingDown("stopped"), 503, "draining"),
        (InferenceFailed("inference failed"), 500, "internal_error"),
        (ApiError(401, "unauthorized", "bad key"), 401, "unauthorized"),
        (KeyError("secret internals"), 500, "internal_error"),
    ],
)
def test_error_table(error, status, error_type):
    api_error = to_api_error(error)
    assert (api_error.status, api_error.error_type) == (status, error_type)


def test_unexpected_errors_do_not_leak_their_text():
    assert "secret" not in to_api_error(KeyError("secret internals")).message


def test_retry_after_on_overload():
    assert to_api_error(QueueFull(1, 1, 2.0)).retry_after_s == 2.0


def test_an_error_type_missing_from_the_registry_is_refused():
    with pytest.raises(ValueError, match=r"'made_up' is not in server/errors\.py ERROR_TYPES"):
        ApiError(400, "made_up", "x")
    with pytest.raises(ValueError, match="'overloaded' is not answered with status 503"):
        ApiError(503, "overloaded", "x")
    with pytest.raises(ValueError, match="not in"):
        error_body("made_up", "x", "rid", status=400)
    assert ApiError(400, "invalid_request", "x").status == 400  # each of its statuses
    assert ApiError(422, "invalid_request", "x").status == 422


def test_every_registered_type_is_answered_by_a_replica_or_nginx_and_has_a_meaning():
    for kind in ERROR_TYPES.values():
        assert kind.when and set(kind.answered_by) <= {REPLICA, NGINX}, kind
    assert all(kind in ERROR_TYPES for kind in REJECTION_REASON), REJECTION_REASON


@pytest.mark.parametrize(
    ("status", "error_type"), [(400, "invalid_json"), (404, "not_found"),
                               (405, "method_not_allowed"), (413, "payload_too_large")],
)  # fmt: skip
def test_the_frameworks_own_errors_map_to_registered_types(status, error_type):
    api_error = to_api_error(StarletteHTTPException(status, "x"))
    assert (api_error.status, api_error.error_type) == (status, error_type)


def _literal_error_types() -> list[tuple[str, int | None, str]]:
    """(file:line, status, error_type) of every ApiError-like call in server/ whose type is a
    literal: the registry is checked at construction, and this finds the paths no test runs."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "server"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            args = node.args
            if node.func.id in ("ApiError", "ParamError") and len(args) >= 2:
                status, kind = args[0], args[1]
            elif node.func.id == "error_body" and args:
                kind = args[0]
                status = next((k.value for k in node.keywords if k.arg == "status"), None)
            else:
                continue
            if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                value = status.value if isinstance(status, ast.Constant) else None
                found.append((f"{path.name}:{node.lineno}", value, kind.value))
    return found


def test_every_error_type_the_code_names_is_registered_with_its_status():
    found = _literal_error_types()
    assert len(found) >= 30 and {kind for _, _, kind in found} >= {
        "unsupported_parameter",
        "wrong_task",
        "not_found",
    }
    for where, status, kind in found:
        assert kind in ERROR_TYPES, where
        if status is not None and ERROR_TYPES[kind].statuses:
            assert status in ERROR_TYPES[kind].statuses, (where, status, kind)


def test_a_request_that_can_never_be_admitted_gets_no_retry_after():
    assert to_api_error(NeverAdmitted(100, 64)).retry_after_s is None
