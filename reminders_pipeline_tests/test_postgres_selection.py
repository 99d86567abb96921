"""Which PostgreSQL the suite uses: the choice, and the "nothing answers on 5432" path end to end.

The end-to-end test moves the probed default address to a port nobody listens on (the machine's
shared server is not stopped: other sessions use it) and runs a database test module in a child
pytest, which must start the embedded server, run every PostgreSQL test on it and remove it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .postgres_server import EMBEDDED, PROBE_VARIABLE, answers, choose, default_address, default_url

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize(
    ("configured", "default_answers", "expected"),
    [
        (None, True, DEFAULT),  # the machine's server
        (None, False, EMBEDDED),  # a fresh machine: nothing on 5432
        ("", False, EMBEDDED),
        ("embedded", True, EMBEDDED),  # explicit, while the machine's server is up (CI's second major)
        ("EMBEDDED", True, EMBEDDED),
        ("postgresql://u@db:6543/postgres", False, "postgresql+psycopg://u@db:6543/postgres"),
        ("postgresql://u@db:6543/postgres", True, "postgresql+psycopg://u@db:6543/postgres"),
    ],
)
def test_an_explicit_choice_wins_then_the_default_server_then_the_embedded_one(configured, default_answers, expected):
    assert choose(configured, default_answers, DEFAULT) == expected


def test_the_probe_sees_a_listener_and_a_closed_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert answers(listener.getsockname())
    assert not answers(("127.0.0.1", unused_port()))
    assert default_address({}) == ("127.0.0.1", 5432)
    assert default_address({PROBE_VARIABLE: "127.0.0.1:1"}) == ("127.0.0.1", 1)
    assert default_url(("127.0.0.1", 5432)) == DEFAULT


@pytest.mark.timeout(240)
def test_with_nothing_on_the_default_address_the_suite_runs_on_an_embedded_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("REMINDERS_TEST_POSTGRES_URL", "CI")}
    env[PROBE_VARIABLE] = f"127.0.0.1:{unused_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "reminders_pipeline_tests/test_schema.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-2000:]
    header = re.search(r"^postgresql: PostgreSQL (18\.\d+) at unix socket (/\S+)/data, embedded", out, re.M)
    assert header, out[:1500]
    assert re.search(r"\[postgresql\] PASSED", out) and "SKIPPED" not in out, out[-3000:]
    assert not Path(header.group(2)).exists()  # stopped and removed at the end of the session
