import pytest

from batching import (
    DeadlineExceeded,
    InferenceFailed,
    NeverAdmitted,
    OutOfMemory,
    QueueFull,
    ShuttingDown,
)
from models import InputTooLong
from server.errors import ApiError, to_api_error


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


def test_a_request_that_can_never_be_admitted_gets_no_retry_after():
    assert to_api_error(NeverAdmitted(100, 64)).retry_after_s is None
