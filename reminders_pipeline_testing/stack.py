"""The processes and databases a Dagster deployment test or benchmark starts, and the waits on them.

Shared by ``reminders_pipeline_tests`` (the stack, dev, stop-signal and Celery tests; any test that
needs a free or closed port) and ``bench/`` (the build and Celery scale-out benchmarks), which must
not import the tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    """``probe``'s first truthy value; an AssertionError naming ``what`` once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago, for a server another process will bind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    """Whether an HTTP server is up at ``url`` and answers 200."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class ThrowawayDatabases:
    """Databases created on the test PostgreSQL server and dropped (FORCE) at the end."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.admin = create_engine(self.server, isolation_level="AUTOCOMMIT")
        self.names: list[str] = []

    def create(self, prefix: str) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        self.names.append(name)
        return make_url(self.server).set(database=name).render_as_string(hide_password=False)

    def drop_all(self) -> None:
        with self.admin.connect() as conn:
            for name in self.names:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self.admin.dispose()


def dagster_url(sqlalchemy_url: str) -> str:
    """dagster-postgres needs psycopg2, named explicitly (SQLAlchemy 2.1 maps postgresql:// to psycopg 3)."""
    return make_url(sqlalchemy_url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


class Service:
    """A long-running Dagster process in its own process group, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.log_path = logs / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # lets it stop its own code server
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # anything it left behind in its group
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)
        self._log.close()
