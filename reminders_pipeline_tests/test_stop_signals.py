"""``reminders dev`` and ``reminders serve`` stop on SIGTERM as a supervisor sends it.

Stopped means stopped: with a dispatcher run in flight, SIGTERM to ``reminders dev`` ends every
process below it (the code server waiting for its runs and the run worker included), the run stops
claiming at once and settles what is on the wire, and no row is claimed after the signal.

Started the way a supervisor or a script's ``cmd &`` starts them: in their own session, and (for
``dev``) with SIGINT ignored, a disposition every child inherits through exec. Before the fix
``dagster dev`` mapped SIGTERM to that ignored SIGINT and nothing stopped; ``serve`` died by the
signal uvicorn re-raised (status 143). Now: exit status 0 within 10 s (15 s for ``dev``, which
lets a send on the wire answer first), and every process that was running under the command when
the signal came is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import insert

from reminders_pipeline import ledger
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import devices
from reminders_pipeline.planning.build import queue_rows
from reminders_pipeline_testing.stack import answers, free_port, wait_for

from .support import subscribe
from .test_faults import RULE, ids_where, ledger_rows, request_key, token_of

STOP_BOUND = 10.0  # seconds: docker stop's default grace before SIGKILL
DEV_STOP_BOUND = (
    15.0  # seconds from SIGTERM to `reminders dev` until nothing it started runs (a send may be on the wire)
)
# `reminders dev` walks its process tree and forwards SIGINT to the run worker, whose loop then stops
# claiming: a claim the worker began before its own signal arrived commits just after the one sent to
# `reminders dev`. Rows come due every 62 ms in the test below, so a worker that kept claiming would
# stamp about eight claims within this window and more after it.
SIGNAL_PROPAGATION = 0.5


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


def stop_and_check(
    process: subprocess.Popen[bytes], log: Path, sig: int = signal.SIGTERM, bound: float = STOP_BOUND
) -> None:
    """Send ``sig``; exit status 0 and no process of the tree left, both within ``bound`` seconds."""
    tree = descendants(process.pid)
    process.send_signal(sig)
    deadline = time.monotonic() + bound
    try:
        code = process.wait(timeout=bound)
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
    assert not left, f"still running {bound}s after the signal: {left}\n{output}"


def supervised(
    command: list[str], cwd: Path, env: dict[str, str], log: Path, ignore_sigint: bool
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session, optionally with SIGINT ignored (through a shell that execs it)."""
    if ignore_sigint:
        command = ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("REMINDERS_", "DAGSTER_"))}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_reminders_dev_stops_on_sigterm_or_a_closed_terminal_with_sigint_ignored(tmp_path, sig):
    ui = free_port()
    command = [
        sys.executable,
        "-m",
        "reminders_pipeline.cli",
        "dev",
        "--port",
        str(ui),
        "--demo-port",
        str(free_port()),
    ]
    log = tmp_path / "dev.log"
    process = supervised(command, tmp_path, clean_env(), log, ignore_sigint=True)
    try:
        try:
            wait_for("the Dagster UI", lambda: answers(f"http://127.0.0.1:{ui}/server_info"), 150)
        except AssertionError:
            raise AssertionError(log.read_text(errors="replace")[-6000:]) from None
        names = " ".join(" ".join(p.cmdline()) for p in descendants(process.pid))
        assert all(part in names for part in ("dagster dev", "dagster_webserver", "dagster._daemon", "code-server")), (
            names
        )
        stop_and_check(process, log, sig=sig, bound=DEV_STOP_BOUND)
    finally:
        if process.poll() is None:
            kill_all_below(process)
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


def kill_all_below(process: subprocess.Popen[bytes]) -> None:
    """After a failed test: SIGKILL the command and every process below it, in whatever group
    (``reminders dev`` puts ``dagster dev`` in a group of its own)."""
    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    for proc in below:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def group_members(pgid: int) -> list[str]:
    """Running processes of process group ``pgid`` (the test starts each command as a group leader)."""
    left = []
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(" ".join(proc.info["cmdline"] or [])[:160])
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return left


def load_due_and_coming(db: Database, now: float, n_devices: int, due_now: int, coming: int, every: float) -> None:
    """``due_now`` rows per device due at once, then ``coming`` rows coming due one every ``every`` s."""
    stamp = Instant.from_unix(now)
    rows = []
    for d in range(n_devices):
        times = [now - 5] * due_now + [now + every * (k * n_devices + d + 1) for k in range(coming)]
        for k, at in enumerate(times):
            rows.append(
                {
                    "device_id": f"dev-{d}", "source_id": 1, "item_id": f"1:item-{d}-{k}", "rule": RULE,
                    "send_after": Instant.from_unix(at), "event_at": Instant.from_unix(at + 3600),
                    "expires_at": Instant.from_unix(at + 5400), "title": f"Event {d}/{k}", "body": None,
                }
            )  # fmt: skip
    # The devices' calendar (source 1) is never read here: stamped built an hour ahead, every build
    # of their chunk (the demo's first, a catch-up) leaves them alone.
    built = stamp + 3600
    with db.write() as conn:
        conn.execute(
            insert(devices),
            [
                {
                    "id": f"dev-{d}", "target": token_of(d), "chunk": 0, "created_at": stamp, "updated_at": stamp,
                    "reminders_built_at": built,
                }
                for d in range(n_devices)
            ],
        )  # fmt: skip
        subscribe(conn, 1, (f"dev-{d}" for d in range(n_devices)), stamp)
        queue_rows(conn, rows, stamp)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_a_stop_of_reminders_dev_ends_its_in_flight_dispatcher_run_and_nothing_is_claimed_after(tmp_path, mock, stop):
    """A real dispatcher run (REMINDERS_ENABLED=true, the mock APNs holding each answer 3 s) is
    sending when SIGTERM comes, or Ctrl-C (SIGINT to the terminal's whole process group): within
    15 s no process of the group or below the command remains, the sends on the wire were answered
    and settled, no claim is stamped after the signal, and the stop reads as one: no
    KeyboardInterrupt traceback and no ERROR line for the dispatcher run (a build caught mid-run is
    still reported interrupted by Dagster)."""
    mock.drop_all_connections()
    mock.wait_idle(10)
    mock.reset()
    mock.script_default(delay=3.0)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    ui = free_port()
    env = {
        **clean_env(),
        **mock.env(),
        "REMINDERS_DATABASE_URL": url,
        "REMINDERS_ENABLED": "true",
        "REMINDERS_CLAIM_BATCH_SIZE": "5",
    }
    command = [
        sys.executable,
        "-m",
        "reminders_pipeline.cli",
        "dev",
        "--port",
        str(ui),
        "--demo-port",
        str(free_port()),
    ]
    log = tmp_path / "dev.log"
    process = supervised(command, tmp_path, env, log, ignore_sigint=False)
    db = Database(url)
    tree: list[psutil.Process] = []
    try:
        try:
            wait_for("a dispatcher run beating", lambda: _beat(db), 300, every=1.0)
        except AssertionError:
            raise AssertionError(log.read_text(errors="replace")[-6000:]) from None
        mock.reset()
        mock.script_default(delay=3.0)
        load_due_and_coming(db, time.time(), n_devices=4, due_now=2, coming=100, every=0.25)
        wait_for("a send on the wire", lambda: any(r.token.startswith("0") for r in mock.requests), 60, every=0.05)
        tree = descendants(process.pid)
        assert any(
            "multiprocessing" in " ".join(p.cmdline()) or "execute_run" in " ".join(p.cmdline()) for p in tree
        ), [p.cmdline() for p in tree]
        ours = {token_of(d) for d in range(4)}
        on_the_wire = {request_key(r) for r in mock.requests if r.token in ours}
        signalled_at = Instant.now()
        stopped_from = log.stat().st_size
        if stop == "sigterm":
            process.send_signal(signal.SIGTERM)
        else:
            os.killpg(process.pid, signal.SIGINT)
        deadline = time.monotonic() + DEV_STOP_BOUND
        try:
            code = process.wait(timeout=DEV_STOP_BOUND)
        except subprocess.TimeoutExpired:
            code = None
        while (alive(tree) or group_members(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left, group_left = alive(tree), group_members(process.pid)
    finally:
        for proc in tree:  # dagster dev's group is its own: kill_all_below misses what was orphaned
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if process.poll() is None:
            kill_all_below(process)
    output = log.read_text(errors="replace")[-6000:]
    assert code == 0, f"exit status {code}\n{output}"
    assert not left and not group_left, f"still running {DEV_STOP_BOUND}s after {stop}: {left or group_left}\n{output}"
    after_stop = log.read_bytes()[stopped_from:].decode(errors="replace")
    assert not re.search(r"^KeyboardInterrupt$", after_stop, re.MULTILINE), after_stop[-6000:]
    assert " - ERROR - dispatcher - " not in after_stop, after_stop[-6000:]

    final = ledger_rows(db)
    db.dispose()
    reached = signalled_at + SIGNAL_PROPAGATION
    claimed_after = {i: r["claimed_at"] for i, r in final.items() if r["claimed_at"] and r["claimed_at"] > reached}
    assert not claimed_after, f"claimed after the signal at {signalled_at} reached the worker: {claimed_after}"
    assert not ids_where(final, status="claimed"), "SIGTERM left claims behind"
    keys = {(r["device_id"], r["item_id"], r["rule"]): i for i, r in final.items()}
    assert {final[keys[k]]["outcome"] for k in on_the_wire} == {"sent"}, (
        "a send on the wire at the signal was not settled"
    )
    coming_after = {i for i, r in final.items() if r["device_id"].startswith("dev-") and r["send_after"] > reached}
    assert coming_after and coming_after <= ids_where(final, status="pending")


def _beat(db: Database) -> bool:
    try:
        with db.read() as conn:
            return ledger.latest_beat(conn) is not None
    except Exception:  # noqa: BLE001 - the ledger is created by `reminders dev` itself
        return False


@pytest.mark.timeout(180)
def test_sigterm_to_reminders_serve_mid_drain_claims_nothing_more_and_settles_what_is_on_the_wire(tmp_path, mock):
    """A POST /internal/reminders/drain is sending 100 due rows five at a time, each answer held
    2 s, when SIGTERM comes: the drain claims no further slice, the request is answered with what
    was settled, and the server exits 0 with nothing left claimed."""
    import httpx

    from .test_faults import load_due

    mock.drop_all_connections()
    mock.wait_idle(10)
    mock.reset()
    mock.script_default(delay=2.0)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    db = Database(url)
    migrate.upgrade(db)
    load_due(db, n_devices=20, items_per_device=5)
    port = free_port()
    env = {
        **clean_env(), **mock.env(), "REMINDERS_DATABASE_URL": url, "REMINDERS_TOKEN": "secret", "REMINDERS_ENABLED": "true",
        "REMINDERS_CLAIM_BATCH_SIZE": "5", "REMINDERS_APNS_CONCURRENCY": "5",
    }  # fmt: skip
    command = [sys.executable, "-m", "reminders_pipeline.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "serve.log"
    process = supervised(command, tmp_path, env, log, ignore_sigint=False)
    answer: dict[str, object] = {}

    def post_drain() -> None:
        reply = httpx.post(
            f"http://127.0.0.1:{port}/internal/reminders/drain", headers={"Authorization": "Bearer secret"}, timeout=60
        )
        answer.update(status=reply.status_code, body=reply.json())

    try:
        try:
            wait_for("/healthz", lambda: answers(f"http://127.0.0.1:{port}/healthz"), 60, every=0.2)
        except AssertionError:
            raise AssertionError(log.read_text(errors="replace")[-4000:]) from None
        client = threading.Thread(target=post_drain)
        client.start()
        wait_for("a send on the wire", lambda: len(mock.requests) > 0, 60, every=0.05)
        on_the_wire = {request_key(r) for r in mock.requests}
        signalled_at = Instant.now()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=STOP_BOUND)
        client.join(10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = log.read_text(errors="replace")[-4000:]
    assert code == 0, f"exit status {code}\n{output}"
    final = ledger_rows(db)
    db.dispose()
    claimed_after = {i: r["claimed_at"] for i, r in final.items() if r["claimed_at"] and r["claimed_at"] > signalled_at}
    assert not claimed_after, f"claimed after the signal at {signalled_at}: {claimed_after}"
    assert not ids_where(final, status="claimed"), "SIGTERM left claims behind"
    assert ids_where(final, status="pending"), "after SIGTERM no further slice may be claimed"
    keys = {(r["device_id"], r["item_id"], r["rule"]): i for i, r in final.items()}
    assert {final[keys[k]]["outcome"] for k in on_the_wire} == {"sent"}, (
        "a send on the wire at the signal was not settled"
    )
    sent = ids_where(final, outcome="sent")
    assert answer.get("status") == 200 and answer["body"]["outcomes"] == {"sent": len(sent)}, (answer, output)


ORPHANS_SCRIPT = """
import json, os, subprocess, sys, time
from reminders_pipeline.dev.proctree import become_subreaper, descendants, end_tree
assert become_subreaper()
# An orphan in a session of its own: its parent shell has exited when run() returns.
subprocess.run(["/bin/sh", "-c", "setsid sleep 300 & echo $! > orphan.pid"], check=True)
orphan = int(open("orphan.pid").read())
found = {pid for pid, _ in descendants(os.getpid())}
# A grace no load outlasts: end_tree returns as soon as nothing is left, so a SIGTERM that works
# is never mistaken for one that did not.
ended = {pid for pid, _ in end_tree(os.getpid(), set(), time.monotonic() + 60)}
# A child that ignores SIGTERM, started only once the orphan is gone, and known ready to ignore it.
stubborn = subprocess.Popen(["/bin/sh", "-c", "trap '' TERM; : > ready; while true; do sleep 0.1; done"])
while not os.path.exists("ready"):
    time.sleep(0.01)
found |= {pid for pid, _ in descendants(os.getpid())}
killed = {pid for pid, _ in end_tree(os.getpid(), set(), time.monotonic() + 0.5)}
print(json.dumps({"orphan": orphan, "stubborn": stubborn.pid, "found": sorted(found), "killed": sorted(ended | killed),
                  "left": sorted(pid for pid, _ in descendants(os.getpid()))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper is Linux's")
def test_end_tree_finds_an_orphan_that_changed_session_and_kills_what_ignores_sigterm(tmp_path):
    """What ``reminders dev`` relies on: a descendant whose parent died and which left the session
    is still found below the command, SIGTERM ends it, and one that ignores SIGTERM is killed."""
    done = subprocess.run(
        [sys.executable, "-c", ORPHANS_SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["orphan"] in seen["found"] and seen["stubborn"] in seen["found"], seen
    assert seen["orphan"] not in seen["killed"] and seen["stubborn"] in seen["killed"], seen
    assert not seen["left"], seen
    assert not psutil.pid_exists(seen["orphan"]) or psutil.Process(seen["orphan"]).status() == psutil.STATUS_ZOMBIE


ORPHANED_PARENT = """
import subprocess, sys, time
from reminders_pipeline.dev.proctree import ended_with_parent
child = subprocess.Popen(ended_with_parent([sys.executable, "-c", "import time; time.sleep(120)"]), process_group=0)
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.timeout(60)
def test_a_child_in_its_own_group_ends_when_its_parent_is_killed(tmp_path):
    """``dagster dev`` runs in a process group of its own, so a SIGKILL to ``reminders dev``'s group
    misses it; the parent-death signal still ends it."""
    parent = subprocess.Popen([sys.executable, "-c", ORPHANED_PARENT], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.pid != parent.pid and os.getpgid(child.pid) == child.pid
        time.sleep(0.5)
        assert "time.sleep(120)" in " ".join(child.cmdline())  # the shim exec'd the command
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for("the orphaned child to end", lambda: not alive([child]), 10, every=0.1)
    finally:
        if parent.poll() is None:
            kill_all_below(parent)
        try:
            child.kill()
        except (psutil.NoSuchProcess, NameError):
            pass
