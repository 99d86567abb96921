"""``reminders dev`` and ``reminders serve`` stop on SIGTERM as a supervisor sends it.

Started the way a supervisor or a script's ``cmd &`` starts them: in their own session, and (for
``dev``) with SIGINT ignored, a disposition every child inherits through exec. Before the fix
``dagster dev`` mapped SIGTERM to that ignored SIGINT and nothing stopped; ``serve`` died by the
signal uvicorn re-raised (status 143). Now: exit status 0 within 10 s, and every process that was
running under the command when the signal came is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from reminders_pipeline import migrate
from reminders_pipeline.db import Database

from .test_dagster_stack import answers, free_port, wait_for

STOP_BOUND = 10.0  # seconds: the bound, and docker stop's default grace before SIGKILL


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def alive(procs: list[psutil.Process]) -> list[str]:
    """Those still running (a zombie has exited: it only waits for init to reap it)."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(proc.cmdline())[:160])
        except psutil.NoSuchProcess:
            pass
    return left


def stop_and_check(process: subprocess.Popen[bytes], log: Path, sig: int = signal.SIGTERM) -> None:
    """Send ``sig``; exit status 0 and no process of the tree left, both within the bound."""
    tree = descendants(process.pid)
    process.send_signal(sig)
    deadline = time.monotonic() + STOP_BOUND
    try:
        code = process.wait(timeout=STOP_BOUND)
    except subprocess.TimeoutExpired:
        code = None
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(tree)
    for proc in tree:  # whatever happened, leave nothing running
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    if code is None:
        process.kill()
        process.wait()
    output = log.read_text(errors="replace")[-4000:]
    assert code == 0, f"exit status {code}\n{output}"
    assert not left, f"still running {STOP_BOUND}s after the signal: {left}\n{output}"


def supervised(command: list[str], cwd: Path, env: dict[str, str], log: Path, ignore_sigint: bool) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session, optionally with SIGINT ignored (through a shell that execs it)."""
    if ignore_sigint:
        command = ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("REMINDERS_", "DAGSTER_"))}


@pytest.mark.timeout(240)
def test_reminders_dev_stops_on_sigterm_with_sigint_ignored(tmp_path):
    ui = free_port()
    command = [sys.executable, "-m", "reminders_pipeline.cli", "dev", "--port", str(ui), "--demo-port", str(free_port())]
    log = tmp_path / "dev.log"
    process = supervised(command, tmp_path, clean_env(), log, ignore_sigint=True)
    try:
        try:
            wait_for("the Dagster UI", lambda: answers(f"http://127.0.0.1:{ui}/server_info"), 150)
        except AssertionError:
            raise AssertionError(log.read_text(errors="replace")[-6000:]) from None
        names = " ".join(" ".join(p.cmdline()) for p in descendants(process.pid))
        assert all(part in names for part in ("dagster dev", "dagster_webserver", "dagster._daemon", "code-server")), names
        stop_and_check(process, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "Dagster services shut down" in log.read_text(errors="replace")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_reminders_serve_stops_on_sigterm_and_ctrl_c_with_status_0(tmp_path, sig):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    db = Database(url)
    migrate.upgrade(db)
    db.dispose()
    port = free_port()
    env = {**clean_env(), "REMINDERS_DATABASE_URL": url, "REMINDERS_TOKEN": "secret"}
    command = [sys.executable, "-m", "reminders_pipeline.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "serve.log"
    process = supervised(command, tmp_path, env, log, ignore_sigint=False)
    try:
        try:
            wait_for("/healthz", lambda: answers(f"http://127.0.0.1:{port}/healthz"), 60, every=0.2)
        except AssertionError:
            raise AssertionError(log.read_text(errors="replace")[-4000:]) from None
        stop_and_check(process, log, sig)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "Application shutdown complete" in log.read_text(errors="replace")
