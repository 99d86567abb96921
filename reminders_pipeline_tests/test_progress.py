"""Long CLI work shows progress on a terminal (stderr only) and still prints one JSON summary."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from reminders_pipeline.ops.retention import prune
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.base import RecordingSender
from reminders_pipeline.sending.drain import drain

from .support import NOW, at, device, item

EXE = str(Path(sys.executable).with_name("reminders"))


def calls() -> tuple[list[tuple[int, int | None]], object]:
    seen: list[tuple[int, int | None]] = []
    return seen, lambda done, total: seen.append((done, total))


def test_the_core_reports_progress_of_build_drain_and_prune(db, settings, feeds, monkeypatch):
    monkeypatch.setattr("reminders_pipeline.planning.build.WRITE_BATCH_DEVICES", 2)
    url = feeds.items("/feed.json", [item("a", 3600), item("b", 3700)])
    for i in range(5):
        device(db, settings, f"d{i}", sources=[url])
    built, report = calls()
    assert build(db, settings, now=NOW, progress=report).devices_built == 5
    assert built == [(0, 5), (2, 5), (4, 5), (5, 5)]

    drained, report = calls()
    small = settings.with_(claim_batch_size=4)
    summary = drain(db, small, RecordingSender().factory(), now=at(200), progress=report)
    assert summary.claimed == 10
    assert drained == [(4, 10), (8, 10), (10, 10)]

    pruned, report = calls()
    assert prune(db, settings.with_(prune_batch_size=3), now=at(8 * 86400), progress=report) == 10
    assert pruned == [(3, None), (6, None), (9, None), (10, None)]


def run_cli(db_url: str, *args: str, tty: bool) -> tuple[int, str, str]:
    """The installed ``reminders`` with stderr on a pseudo-terminal (or a pipe), stdout on a pipe."""
    env = {**os.environ, "REMINDERS_DATABASE_URL": db_url, "REMINDERS_ENABLED": "false"}
    if not tty:
        out = subprocess.run([EXE, *args], env=env, capture_output=True, text=True, timeout=120)
        return out.returncode, out.stdout, out.stderr
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([EXE, *args], env=env, stdout=subprocess.PIPE, stderr=follower, text=True)
        os.close(follower)
        stdout, _ = proc.communicate(timeout=120)
        err = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            err += chunk
        return proc.returncode, stdout, err.decode()
    finally:
        os.close(leader)


def test_progress_goes_to_a_terminal_and_never_to_a_pipe(db_url):
    for i in range(3):
        code, _, _ = run_cli(db_url, "device", "put", f"d{i}", "--apns-token", "ab" * 32, tty=False)
        assert code == 0
    code, stdout, stderr = run_cli(db_url, "build", "--all", "--now", NOW.stored, tty=True)
    assert code == 0
    assert json.loads(stdout)["devices_built"] == 3  # stdout: exactly the JSON summary
    assert "build: 0/3 devices" in stderr and "build: 3/3 devices" in stderr
    code, stdout, stderr = run_cli(db_url, "build", "--all", "--now", NOW.stored, tty=False)
    assert code == 0 and json.loads(stdout)["devices_built"] == 3
    assert stderr == ""
    code, stdout, stderr = run_cli(db_url, "prune", "--now", NOW.stored, tty=True)
    assert code == 0 and json.loads(stdout)["deleted"] == 0
    assert "prune: 0 rows deleted" in stderr
    code, stdout, stderr = run_cli(db_url, "drain", "--now", NOW.stored, tty=True)
    assert code == 0 and json.loads(stdout)["due"] == 0
