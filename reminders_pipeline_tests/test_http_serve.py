"""The real entry point as a subprocess: ``reminders serve`` (or ``python -m
reminders_pipeline.http.serve`` until the CLI has the command) on a free port, configured only by
the environment, shut down by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from reminders_pipeline import cli
from reminders_pipeline_testing.stack import free_port

from .test_http_support import APNS_TOKEN

SECRET = "serve-secret"


def serve_command(port: int) -> list[str]:
    if "serve" in cli.main.commands:
        return [sys.executable, "-m", "reminders_pipeline.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return [sys.executable, "-m", "reminders_pipeline.http.serve", "--host", "127.0.0.1", "--port", str(port)]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            return httpx.get(f"{base}/healthz", timeout=1)
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server did not come up")


def test_serve_runs_the_app_from_the_environment(db_url, tmp_path):
    port = free_port()
    env = {**os.environ, "REMINDERS_DATABASE_URL": db_url, "REMINDERS_TOKEN": SECRET}
    env.pop("REMINDERS_ENABLED", None)
    proc = subprocess.Popen(
        serve_command(port), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        health = wait_healthy(base, proc)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert httpx.get(f"{base}/v1/devices/phone-1").status_code == 401
        auth = {"Authorization": f"Bearer {SECRET}"}
        put = httpx.put(f"{base}/v1/devices/phone-1", json={"apns_token": APNS_TOKEN}, headers=auth)
        assert put.status_code == 200, put.text
        assert httpx.get(f"{base}/v1/devices/phone-1/feed?tz=3600", headers=auth).json()["items"] == []
        drained = httpx.post(f"{base}/internal/reminders/drain", headers=auth)
        assert drained.status_code == 200 and drained.json()["due"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # uvicorn shuts down gracefully; serve() absorbs the signal it re-raises: a stop is exit status 0.
    assert proc.returncode == 0, err
    assert "Application shutdown complete" in err


def test_serve_refuses_a_bad_configuration(tmp_path):
    env = {**os.environ, "REMINDERS_CHUNK_COUNT": "zero"}
    done = subprocess.run(
        [sys.executable, "-m", "reminders_pipeline.http.serve", "--port", str(free_port())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "REMINDERS_CHUNK_COUNT" in done.stderr
