"""An operator's drill: PostgreSQL down for two minutes under `reminders dispatch`.

A throwaway cluster of the machine's PostgreSQL on its own port (``initdb``/``pg_ctl``; as root
they run as ``postgres``), migrated, with one device and rows coming due before, during and
after the outage. `reminders dispatch` (a dry run: rows settle ``disabled``, so no APNs is
needed) runs against it; the server is stopped for ``--outage`` seconds and started again.

Printed: the dispatcher's stderr lines during and after the outage, and whether every row that
came due was claimed once the server was back, without restarting the dispatcher (a claim whose
settlement the cut lost stays claimed until the abandoned sweep fails it: it is counted apart). The bar:
under 100 lines, and every row settled within ``--recover`` seconds of the return.

    .venv/bin/python bench/drill_pg_outage.py [--outage 120] [--recover 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import insert, text

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import devices
from reminders_pipeline.planning.build import queue_rows

ROOT = Path(__file__).resolve().parents[1]


class Cluster:
    """``initdb`` then ``pg_ctl start``/``stop`` on a free port, in a temporary directory."""

    def __init__(self) -> None:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        found = [Path(out)] if out else []
        found += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
        self.bindir = next(b for b in found if (b / "initdb").exists())
        self.root = Path(tempfile.mkdtemp(prefix="drill-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._pg("initdb", "-D", str(self.root / "data"), "-A", "trust", "-U", "postgres", "--no-sync")

    def _pg(self, tool: str, *args: str) -> None:
        cmd = [str(self.bindir / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self._pg("pg_ctl", "-D", str(self.root / "data"), "-l", str(self.root / "log"), "-o", opts, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """``mode`` as ``pg_ctl -m`` takes it: ``immediate`` is a crash (no checkpoint, clients cut)."""
        self._pg("pg_ctl", "-D", str(self.root / "data"), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


def seed(db: Database, now: float, offsets: range) -> int:
    """One device, and one row due at ``now + offset`` for each offset."""
    stamp = Instant.from_unix(now)
    with db.write() as conn:
        conn.execute(insert(devices).values(id="drill", target="00" * 32, chunk=0, created_at=stamp, updated_at=stamp))
        rows = [
            {"device_id": "drill", "source_id": None, "item_id": f"1:item-{o}", "rule": "lead:60",
             "send_after": Instant.from_unix(now + o), "event_at": Instant.from_unix(now + o + 60),
             "expires_at": Instant.from_unix(now + o + 1860), "title": "Standup", "body": None}
            for o in offsets
        ]  # fmt: skip
        queue_rows(conn, rows, stamp)
    return len(rows)


def pending(db: Database, before: float) -> int:
    """Rows due by ``before`` that nobody claimed."""
    with db.engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM notification_queue WHERE status = 'pending' AND send_after <= :t"),
            {"t": Instant.from_unix(before).stored},
        ).scalar_one()


def claimed(db: Database) -> int:
    """Rows whose claim committed but whose settlement was lost with the server: the dispatcher
    cannot know whether they went, so the abandoned sweep fails them, never resends them."""
    with db.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM notification_queue WHERE status = 'claimed'")).scalar_one()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=120.0)
    parser.add_argument("--recover", type=float, default=30.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cluster = Cluster()
    stderr_path = cluster.root / "dispatch.stderr"
    try:
        cluster.start()
        db = Database(cluster.url)
        migrate.upgrade(db)
        start = time.time()
        rows = seed(db, start, range(5, int(args.outage) + 40, 5))
        db.dispose()
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")}
        env.update({"REMINDERS_DATABASE_URL": cluster.url, "REMINDERS_ENABLED": "false"})
        with stderr_path.open("w") as err:
            dispatcher = subprocess.Popen(
                [sys.executable, "-m", "reminders_pipeline.cli", "-v", "dispatch"],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
            )  # fmt: skip
        time.sleep(10)
        lines_before = len(stderr_path.read_text().splitlines())
        cluster.stop()
        down_at = time.time()
        time.sleep(args.outage)
        cluster.start()
        back_at = time.time()
        db = Database(cluster.url)
        recovered = None
        while time.time() - back_at < args.recover:
            if pending(db, back_at) == 0:
                recovered = time.time() - back_at
                break
            time.sleep(0.5)
        time.sleep(max(0.0, start + args.outage + 45 - time.time()))  # the rows due after the return
        left = pending(db, time.time() - 2)
        left_claimed = claimed(db)
        db.dispose()
        dispatcher.terminate()
        dispatcher.wait(30)
        lines = stderr_path.read_text().splitlines()
        result = {
            "outage_s": back_at - down_at,
            "rows": rows,
            "dispatcher_alive_after": dispatcher.returncode in (0, -15),
            "stderr_lines_from_outage": len(lines) - lines_before,
            "recovered_s": recovered,
            "pending_at_end": left,
            "left_claimed_by_the_cut": left_claimed,
        }
        result["met"] = result["stderr_lines_from_outage"] < 100 and recovered is not None and left == 0
    finally:
        cluster.destroy()
    if args.json:
        print(json.dumps(result))
        return
    print(json.dumps(result, indent=1))
    print("\n".join(lines[lines_before:][:40]))
    print("met" if result["met"] else "MISSED")


if __name__ == "__main__":
    main()
