"""An operator's drill: APNs unreachable for two minutes under `reminders dispatch`.

The suite's mock APNs (HTTP/2 over TLS, in this process) refuses every connection for
``--outage`` seconds, then listens again. `reminders dispatch` runs as a process with sending on,
over a SQLite ledger holding one device and ``--reminders`` rows coming due 2.4 s apart from the
outage's start. Alerts go to a webhook this script serves.

Printed: each row's outcome and attempts, the halts and alerts, and how late after APNs' return
each row went. The bar: none failed, no attempt spent, one halt and one alert, all
sent within 5 s of APNs' return (or settled by the lateness policy, with their reason).

    .venv/bin/python bench/drill_apns_outage.py [--outage 120] [--reminders 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # reminders_pipeline_testing, not installed

from sqlalchemy import insert, select  # noqa: E402

from reminders_pipeline import migrate  # noqa: E402
from reminders_pipeline.build import queue_rows  # noqa: E402
from reminders_pipeline.db import Database  # noqa: E402
from reminders_pipeline.schema import devices, notification_queue  # noqa: E402
from reminders_pipeline.times import Instant  # noqa: E402
from reminders_pipeline_testing.mock_apns import MockApns  # noqa: E402

TOKEN = "ab" * 32


class Hook(BaseHTTPRequestHandler):
    """The alert webhook: keeps each POST's text."""

    posts: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Hook.posts.append(json.loads(body)["text"])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def seed(db: Database, start: float, n: int) -> None:
    stamp = Instant.from_unix(start)
    with db.write() as conn:
        conn.execute(insert(devices).values(id="drill", apns_token=TOKEN, chunk=0, created_at=stamp, updated_at=stamp))
        queue_rows(conn, [
            {"device_id": "drill", "source_id": None, "item_id": f"1:e{k}", "rule": "lead:3600",
             "send_after": Instant.from_unix(start + 2.4 * k), "event_at": Instant.from_unix(start + 2.4 * k + 3600),
             "expires_at": Instant.from_unix(start + 2.4 * k + 5400), "title": f"E{k}", "body": None}
            for k in range(n)
        ], stamp)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=120.0)
    parser.add_argument("--reminders", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="drill-apns-"))
    url = f"sqlite:///{workdir / 'ledger.sqlite3'}"
    db = Database(url)
    migrate.upgrade(db)
    hook = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    mock = MockApns()
    mock.start()
    mock.refuse("connect")
    start = time.time() + 2
    seed(db, start, args.reminders)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")}
    env.update(mock.env())
    env.update({
        "REMINDERS_DATABASE_URL": url, "REMINDERS_ENABLED": "true",
        "REMINDERS_ALERT_WEBHOOK_URL": f"http://127.0.0.1:{hook.server_port}/hook",
    })  # fmt: skip
    stderr = workdir / "dispatch.stderr"
    with stderr.open("w") as err:
        dispatcher = subprocess.Popen(
            [sys.executable, "-m", "reminders_pipeline.cli", "dispatch"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        time.sleep(max(0.0, start + args.outage - time.time()))
        mock.refuse(None)
        back = time.time()
        time.sleep(max(10.0, start + 2.4 * args.reminders - time.time() + 10))
    finally:
        dispatcher.terminate()
        out, _ = dispatcher.communicate(timeout=60)
        mock.stop()
        hook.shutdown()
    with db.engine.connect() as conn:
        rows = conn.execute(select(notification_queue)).mappings().all()
    db.dispose()
    outcomes = Counter((r["outcome"], r["outcome_detail"]) for r in rows)
    late = [r["sent_at"].unix - max(r["send_after"].unix, back) for r in rows if r["outcome"] == "sent"]
    summary = json.loads(out) if out.strip() else {}
    result = {
        "outage_s": back - start,
        "reminders": len(rows),
        "outcomes": {f"{o}:{d}" if d else str(o): n for (o, d), n in outcomes.items()},
        "attempts_spent": sum(r["attempts"] for r in rows),
        "alerts": len(Hook.posts),
        "halted": summary.get("halted"),
        "latest_after_return_s": max(late) if late else None,
        "stderr_lines": len(stderr.read_text().splitlines()),
        "stderr": str(stderr),
    }
    policy = {"event_started", "too_late"}
    result["met"] = (
        all(o == "sent" or o in policy for o, _ in outcomes)
        and result["attempts_spent"] == 0
        and result["alerts"] == 1
        and (not late or max(late) <= 5.0)
    )
    print(json.dumps(result, indent=None if args.json else 1))
    if not args.json:
        print("\n".join(Hook.posts))
        print("met" if result["met"] else "MISSED")


if __name__ == "__main__":
    main()
