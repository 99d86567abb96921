"""Schemathesis against the served ``/openapi.json``: no 5xx for any generated input, and the app
answers as its document says (status codes, content types, response schemas, auth enforced,
schema-violating requests refused).

``positive_data_acceptance`` is left out on purpose: some valid-looking inputs are refused for
reasons a JSON Schema cannot state (a rule that does not parse, a URL that is not http(s), ``?id=``
and a body ``id`` that disagree), and those 422s are the contract, not a bug.

The CLI runs as a subprocess against the app served in this process, with a fixed seed so CI
replays the same cases; ``REMINDERS_FUZZ_EXAMPLES``/``REMINDERS_FUZZ_SEED`` widen or vary a local run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_http_support import SECRET, http_settings, serve  # noqa: F401 - fixtures

EXAMPLES = os.environ.get("REMINDERS_FUZZ_EXAMPLES", "25")
SEED = os.environ.get("REMINDERS_FUZZ_SEED", "20260910")


@pytest.mark.parametrize("accept_now", [False, True], ids=["production", "now-accepted"])
def test_no_server_error_for_any_generated_input(serve, settings, tmp_path: Path, accept_now: bool):
    # Dry run (no APNs), short source reads: a generated device may point anywhere. The document
    # lists ``now`` only where it is accepted, so both shapes are fuzzed.
    s = serve(http_settings(settings, source_timeout_seconds=1.0, http_accept_now=accept_now))
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{s.url}/openapi.json",
        "--header", f"Authorization: Bearer {SECRET}",
        "--checks", "all",
        "--exclude-checks", "positive_data_acceptance",
        "--max-examples", EXAMPLES,
        "--seed", SEED,
        "--request-timeout", "30",
        "--no-color",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    report = done.stdout[-12000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert "No issues found" in done.stdout, report
    assert "Server error" not in done.stdout
