"""What a test does when something it needs is missing here."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(message: str) -> NoReturn:
    """Fail under CI (``.ci/run`` installs everything, as root), skip elsewhere, saying why."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
