"""Schemathesis against the served ``/openapi.json``: no 5xx for any generated input, and the app
answers as its document says (status codes, content types, response schemas, auth enforced,
schema-violating requests refused).

``positive_data_acceptance`` is left out on purpose: some valid-looking inputs are refused for
reasons a JSON Schema cannot state (a rule that does not parse, a URL that is not http(s), ``?id=``
and a body ``id`` that disagree), and those 422s are the contract, not a bug.

The CLI runs as a subprocess against the app served in this process, with a fixed seed so CI
replays the same cases; ``REMINDERS_FUZZ_EXAMPLES``/``REMINDERS_FUZZ_SEED`` widen or vary a local run.
A generated device may name any URL, and a build reads every device's sources: in this process
every source socket is refused before a name is resolved or a packet sent, so the fuzz reads
nothing from anywhere (a refused read is an ordinary ``address_refused`` failure to the app).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from schemathesis.core.warnings import SchemathesisWarning

from reminders_pipeline.sources.egress import AddressRefused, GuardedBackend
from reminders_pipeline.sources.urls import shown_url

from .test_http_support import SECRET, http_settings

EXAMPLES = os.environ.get("REMINDERS_FUZZ_EXAMPLES", "100")
SEED = os.environ.get("REMINDERS_FUZZ_SEED", "20260910")


@pytest.fixture
def no_source_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every source connection the app attempts, each refused before DNS (``host:port``)."""
    attempted: list[str] = []

    async def refuse(self: GuardedBackend, host: str, port: int, *args: object, **kwargs: object) -> None:
        attempted.append(f"{host}:{port}")
        raise AddressRefused("the fuzz test reads no source")

    monkeypatch.setattr(GuardedBackend, "connect_tcp", refuse)
    return attempted


# The document lists ``now`` only where it is accepted, so both shapes are fuzzed; they differ only
# in the internal routes' bodies, so the second fuzzes those (the time goes to generating cases).
@pytest.mark.parametrize(
    ("accept_now", "operations"), [(False, ".*"), (True, "^/internal/")], ids=["production", "now-accepted"]
)
def test_no_server_error_for_any_generated_input(
    serve, settings, no_source_reads, tmp_path: Path, accept_now: bool, operations: str
):
    # Dry run (no APNs), no source reads (no_source_reads).
    s = serve(http_settings(settings, source_timeout_seconds=1.0, http_accept_now=accept_now))
    # The guard is in place: a public source is refused before DNS, an ordinary failed read.
    public = "https://example.com/feed.json"
    assert s.put_device("fuzz-guard", source_urls=[public]).status_code == 200
    built = s.api.post("/internal/reminders/build", json={"device_id": "fuzz-guard"})
    assert built.json()["sources_failed"] == [{"url": shown_url(public), "error": "address_refused"}], built.text
    assert no_source_reads == ["example.com:443"]
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{s.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {SECRET}",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--include-path-regex",
        operations,
        "--max-examples",
        EXAMPLES,
        "--seed",
        SEED,
        "--request-timeout",
        "30",
        "--no-color",
        # Every warning but missing_test_data: a Snooze or Done names a row an alert was sent for,
        # which no generated request makes, so its 404 is the contract (test_actions.py acts on sent rows).
        "--warnings",
        ",".join(w for w in SchemathesisWarning if w not in ("missing_test_data", "low_valid_rate")),
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    report = done.stdout[-12000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert "No issues found" in done.stdout, report
    assert "Server error" not in done.stdout
