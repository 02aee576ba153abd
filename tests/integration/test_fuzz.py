"""Schemathesis fuzzes the running replica's OpenAPI schema (bounded number of examples)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.servers import run_server

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).with_name("schemathesis.toml")
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance,negative_data_rejection"
)
MAX_EXAMPLES = 100


def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(tmp_path):
    with run_server(
        tmp_path, "--max-inputs-per-request", "8", "--max-input-tokens", "32",
        "--max-body-bytes", "65536", "--max-batch-tokens", "512", "--max-timeout-s", "30",
        "--default-timeout-s", "30",
    ) as server:  # fmt: skip
        # No --max-time: with one, schemathesis keeps fuzzing until the time is spent.
        # One worker: with two, hypothesis's ast.parse calls race on CPython 3.11 ("AST
        # constructor recursion depth mismatch"), an error of the tool, not of the server.
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
             f"{server.url}/openapi.json", "--checks", CHECKS, "--max-examples",
             str(MAX_EXAMPLES), "--seed", "20261129", "--workers", "1",
             "--request-timeout", "60"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert httpx.get(f"{server.url}/health/ready", timeout=10).status_code == 200
        scrape = httpx.get(f"{server.url}/metrics", timeout=10).text
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = re.search(r"(\d+) generated, (\d+) passed", output)
    assert summary, output
    assert summary.group(1) == summary.group(2) and int(summary.group(1)) >= MAX_EXAMPLES, output
    print(output[-2000:])
    assert 'code="500"' not in scrape
    assert "Traceback" not in server.log()
