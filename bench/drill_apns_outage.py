"""An operator's drill: APNs out for two minutes under `reminders dispatch`, Web Push and FCM working.

The suite's mocks (HTTP/2 over TLS, in this process) play the three providers. For ``--outage``
seconds APNs either refuses every connection (``--mode unreachable``) or answers every request
503 ServiceUnavailable (``--mode 503``), then answers 200 again; Web Push answers 201 and FCM 200
throughout. `reminders dispatch -v` runs as a process with sending on, over a ledger on SQLite or
on a throwaway PostgreSQL database (``--database``, dropped at the end) holding two devices of each
provider, registered through ``put_device``, and ``--reminders`` rows per provider coming due
2.4 s apart from the outage's start (the providers offset by 0.8 s, alternating between their two
devices). Alerts go to a webhook this script serves.

Printed per provider: outcomes, attempts spent, requests each mock answered during the outage and
the lateness of each send from the mock's own record of it (Web Push and FCM: after ``send_after``,
for rows due during the outage; APNs: after ``max(send_after, APNs' return)``), then the alerts and
the bar, one line each, met or MISSED: no row failed, no attempt spent on an APNs row, exactly one
alert (APNs unreachable), Web Push and FCM at most 2 s late during the outage, every APNs row sent
within 5 s of APNs' return, and every row sent exactly once. The dispatcher's stderr (timestamped
by this script) and the rows at the end are kept in the workdir printed.

    .venv/bin/python bench/drill_apns_outage.py [--mode unreachable|503] [--database sqlite|postgresql]
        [--outage 120] [--reminders 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # reminders_pipeline_testing, not installed
sys.path.insert(0, str(ROOT / "bench"))

from bench_ledger import fresh  # noqa: E402
from sqlalchemy import select  # noqa: E402

from reminders_pipeline.config.settings import Settings  # noqa: E402
from reminders_pipeline.devices.registration import DeviceSpec, put_device  # noqa: E402
from reminders_pipeline.domain.times import Instant  # noqa: E402
from reminders_pipeline.ledger import migrate  # noqa: E402
from reminders_pipeline.ledger.db import Database  # noqa: E402
from reminders_pipeline.ledger.schema import notification_queue  # noqa: E402
from reminders_pipeline.planning.build import queue_rows  # noqa: E402
from reminders_pipeline.providers.webpush import generate_key  # noqa: E402
from reminders_pipeline_testing.mock_apns import MockApns  # noqa: E402
from reminders_pipeline_testing.mock_fcm import MockFcm  # noqa: E402
from reminders_pipeline_testing.mock_webpush import MockWebPush  # noqa: E402

PROVIDERS = ("apns", "webpush", "fcm")
SPACING, OFFSET = 2.4, 0.8  # seconds between one provider's rows; between the providers' series
LEAD = 10.0  # seconds from seeding to the first row due: the dispatcher process starts meanwhile
APNS_TOKENS = ("ab" * 32, "cd" * 32)
FCM_TOKENS = tuple(f"fcm-drill-{i}-" + "x" * 40 for i in range(2))
ON_TIME, AFTER_RETURN = 2.0, 5.0  # the bars, seconds


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


def ledger(kind: str, workdir: Path) -> tuple[Database, Callable[[], None]]:
    """A migrated, empty ledger: a SQLite file in the workdir, or a throwaway PostgreSQL database
    on 127.0.0.1:5432 (``bench_ledger.fresh``) dropped by the returned function."""
    if kind == "postgresql":
        return fresh("postgresql")
    db = Database(f"sqlite:///{workdir / 'ledger.sqlite3'}")
    migrate.upgrade(db)
    return db, db.dispose


def register(db: Database, settings: Settings, push: MockWebPush) -> dict[str, str]:
    """Two devices of each provider, through the core's registration path; their ids by provider."""
    specs = [DeviceSpec(f"apns-{i}", apns_token=token) for i, token in enumerate(APNS_TOKENS)]
    specs += [DeviceSpec(f"webpush-{i}", apns_token="", webpush=push.subscribe()) for i in range(2)]
    specs += [DeviceSpec(f"fcm-{i}", apns_token="", fcm_token=token) for i, token in enumerate(FCM_TOKENS)]
    for spec in specs:
        put_device(db, settings, spec)
    return {spec.id: spec.id.split("-")[0] for spec in specs}


def seed(db: Database, start: float, n: int) -> None:
    """``n`` rows per provider, one every ``SPACING`` s, alternating between its two devices."""
    stamp = Instant.from_unix(start - LEAD)
    due = {(p, k): start + SPACING * k + OFFSET * i for i, p in enumerate(PROVIDERS) for k in range(n)}
    with db.write() as conn:
        queue_rows(conn, [
            {"device_id": f"{p}-{k % 2}", "source_id": None, "item_id": f"1:{p}{k}", "rule": "lead:3600",
             "send_after": Instant.from_unix(t), "event_at": Instant.from_unix(t + 3600),
             "expires_at": Instant.from_unix(t + 5400), "title": f"E{k}", "body": None}
            for (p, k), t in due.items()
        ], stamp)  # fmt: skip


def stamp_lines(stream: IO[str], out: Path, t0: float) -> None:
    """Copy the dispatcher's stderr to ``out``, each line prefixed with seconds since the outage began."""
    with out.open("w") as f:
        for line in stream:
            f.write(f"{time.time() - t0:+9.3f} {line}")
            f.flush()


def accepted(apns: MockApns, push: MockWebPush, fcm: MockFcm) -> dict[str, list[tuple[int, float]]]:
    """(row id, when the mock received it) of every send each mock accepted, from its own records."""
    return {
        "apns": [(r.payload["reminder"]["id"], r.received_at) for r in apns.requests if r.status == 200],
        "webpush": [(r.payload["reminder"]["id"], r.at) for r in push.requests if r.status == 201],
        "fcm": [
            (json.loads(r.message["data"]["reminder"])["id"], r.at)
            for r in fcm.requests
            if r.status == 200 and r.message
        ],
    }


def requests_of(apns: MockApns, push: MockWebPush, fcm: MockFcm, t0: float) -> dict[str, list]:
    """Every request each mock saw: [seconds since the outage began, row id or None, status]."""

    def row_of(payload: Any) -> Any:
        return payload.get("reminder", {}).get("id") if isinstance(payload, dict) else None

    return {
        "apns": [[round(r.received_at - t0, 3), row_of(r.payload), r.status] for r in apns.requests],
        "webpush": [[round(r.at - t0, 3), row_of(r.payload), r.status] for r in push.requests],
        "fcm": [
            [round(r.at - t0, 3), r.message and json.loads(r.message.get("data", {}).get("reminder", "{}")).get("id"),
             r.status]
            for r in fcm.requests
        ],
    }  # fmt: skip


def answered_during(apns: MockApns, push: MockWebPush, fcm: MockFcm, start: float, back: float) -> dict[str, Any]:
    """Requests each mock answered between the first row due and APNs' return, by status."""
    return {
        "apns": dict(Counter(r.status for r in apns.requests if start <= r.received_at < back)),
        "webpush": dict(Counter(r.status for r in push.requests if start <= r.at < back)),
        "fcm": dict(Counter(r.status for r in fcm.requests if start <= r.at < back)),
    }


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "max": None}
    return {"n": len(values), "p50": round(statistics.median(values), 3), "max": round(max(values), 3)}


def outcome_of(row: dict) -> str:
    """``sent``, ``failed:<detail>``, or the status of a row not settled (``pending:<detail>``)."""
    shown = str(row["outcome"] or row["status"])
    return f"{shown}:{row['outcome_detail']}" if row["outcome_detail"] else shown


def report(rows: list[dict], provider_of: dict[str, str], sends: dict, during: dict, start: float, back: float) -> dict:
    by_id = {r["id"]: r for r in rows}
    out: dict[str, Any] = {}
    for provider in PROVIDERS:
        mine = [r for r in rows if provider_of[r["device_id"]] == provider]
        times = {}
        repeats = 0
        for row_id, at in sends[provider]:
            repeats += row_id in times
            times.setdefault(row_id, at)
        entry: dict[str, Any] = {
            "rows": len(mine),
            "outcomes": dict(Counter(outcome_of(r) for r in mine)),
            "attempts_spent": sum(r["attempts"] or 0 for r in mine),
            "answered_during_outage": during[provider],
            "not_sent_by_mock": sum(r["id"] not in times for r in mine),
            "sent_twice": repeats,
        }
        if provider == "apns":
            entry["late_after_return_s"] = spread(
                [at - max(by_id[i]["send_after"].unix, back) for i, at in times.items()]
            )
        else:
            late_during = [at - by_id[i]["send_after"].unix for i, at in times.items()
                           if by_id[i]["send_after"].unix < back]  # fmt: skip
            entry["sent_during_outage"] = sum(start <= at < back for at in times.values())
            entry["late_during_outage_s"] = spread(late_during)
            entry["late_after_s"] = spread(
                [at - by_id[i]["send_after"].unix for i, at in times.items() if by_id[i]["send_after"].unix >= back]
            )
        out[provider] = entry
    return out


def bar(providers: dict, alerts: list[str]) -> list[tuple[str, str, bool]]:
    """(the bar, what the run measured, met)."""
    failed = {p: sum(n for o, n in e["outcomes"].items() if o.startswith("failed")) for p, e in providers.items()}
    titles = [a.splitlines()[0] for a in alerts]
    lines = [
        ("no row failed", json.dumps(failed), not any(failed.values())),
        ("no attempt spent on an APNs row", str(providers["apns"]["attempts_spent"]),
         providers["apns"]["attempts_spent"] == 0),
        ("exactly 1 alert, APNs unreachable", f"{len(alerts)}: {titles}",
         len(alerts) == 1 and "APNs unreachable" in titles[0]),
    ]  # fmt: skip
    for p, name in (("webpush", "Web Push"), ("fcm", "FCM")):
        late = providers[p]["late_during_outage_s"]
        lines.append((f"{name} at most {ON_TIME:g} s late during the outage",
                      f"p50 {late['p50']} s, max {late['max']} s over {late['n']}",
                      late["max"] is not None and late["max"] <= ON_TIME))  # fmt: skip
    late = providers["apns"]["late_after_return_s"]
    unsent = {p: e["not_sent_by_mock"] for p, e in providers.items()}
    twice = {p: e["sent_twice"] for p, e in providers.items()}
    lines += [
        (f"every APNs row within {AFTER_RETURN:g} s of APNs' return",
         f"p50 {late['p50']} s, max {late['max']} s over {late['n']}",
         late["max"] is not None and late["max"] <= AFTER_RETURN and unsent["apns"] == 0),
        ("every row sent exactly once", f"unsent {json.dumps(unsent)}, twice {json.dumps(twice)}",
         not any(unsent.values()) and not any(twice.values())),
    ]  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("unreachable", "503"), default="unreachable")
    parser.add_argument("--database", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--outage", type=float, default=120.0)
    parser.add_argument("--reminders", type=int, default=60, help="per provider")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix=f"drill-apns-{args.mode}-{args.database}-"))
    db, drop = ledger(args.database, workdir)
    hook = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    for name in ("webpush", "fcm"):
        (workdir / name).mkdir()
    apns, push, fcm = MockApns(), MockWebPush(workdir=workdir / "webpush"), MockFcm(workdir=workdir / "fcm")
    for mock in (apns, push, fcm):
        mock.start()
    generate_key(str(workdir / "vapid.pem"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")}
    env.update(apns.env())
    env.update({
        "REMINDERS_DATABASE_URL": db.url, "REMINDERS_ENABLED": "true",
        "REMINDERS_ALERT_WEBHOOK_URL": f"http://127.0.0.1:{hook.server_port}/hook",
        "REMINDERS_VAPID_PRIVATE_KEY_FILE": str(workdir / "vapid.pem"),
        "REMINDERS_VAPID_SUBJECT": "mailto:ops@example.org",
        "REMINDERS_WEBPUSH_CA_FILE": str(push.ca_file), "REMINDERS_WEBPUSH_ALLOW_NETWORKS": "127.0.0.0/8",
        "REMINDERS_FCM_CREDENTIALS_FILE": str(fcm.service_account_file()),
        "REMINDERS_FCM_URL": fcm.url, "REMINDERS_FCM_CA_FILE": str(fcm.ca_file),
    })  # fmt: skip
    provider_of = register(db, Settings.from_env(env), push)
    if args.mode == "unreachable":
        apns.refuse("connect")
    else:
        apns.script_default(status=503, reason="ServiceUnavailable")
    start = time.time() + LEAD
    seed(db, start, args.reminders)
    stderr = workdir / "dispatch.stderr"
    dispatcher = subprocess.Popen(
        [sys.executable, "-m", "reminders_pipeline.cli", "-v", "dispatch"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert dispatcher.stderr is not None
    copier = threading.Thread(target=stamp_lines, args=(dispatcher.stderr, stderr, start), daemon=True)
    copier.start()
    try:
        time.sleep(max(0.0, start + args.outage - time.time()))
        if args.mode == "unreachable":
            apns.refuse(None)
        else:
            apns.script_default()
        back = time.time()
        last_due = start + SPACING * (args.reminders - 1) + OFFSET * (len(PROVIDERS) - 1)
        time.sleep(max(10.0, last_due - time.time() + 10))
    finally:
        dispatcher.terminate()
        out, _ = dispatcher.communicate(timeout=60)
        copier.join(timeout=10)
        sends, during = accepted(apns, push, fcm), answered_during(apns, push, fcm, start, back)
        (workdir / "requests.json").write_text(json.dumps(requests_of(apns, push, fcm, start)))
        for mock in (apns, push, fcm):
            mock.stop()
        hook.shutdown()
        with db.engine.connect() as conn:
            rows = [dict(r) for r in conn.execute(select(notification_queue)).mappings().all()]
        drop()
    (workdir / "rows.json").write_text(json.dumps(rows, default=str, indent=1))
    providers = report(rows, provider_of, sends, during, start, back)
    lines = bar(providers, Hook.posts)
    log = stderr.read_text().splitlines()
    result = {
        "mode": args.mode,
        "database": args.database,
        "outage_s": round(back - start, 2),
        "providers": providers,
        "alerts": [a.splitlines()[0] for a in Hook.posts],
        "halted": (json.loads(out) if out.strip() else {}).get("halted"),
        "stderr_lines": len(log),
        "stderr_lines_above_info": sum(" INFO:" not in line for line in log),
        "workdir": str(workdir),
        "bar": [{"bar": b, "measured": m, "met": ok} for b, m, ok in lines],
        "met": all(ok for _, _, ok in lines),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(json.dumps({k: v for k, v in result.items() if k != "bar"}, indent=1))
    print("\n".join(Hook.posts))
    for b, m, ok in lines:
        print(f"{'met   ' if ok else 'MISSED'}  {b}: {m}")
    print("met" if result["met"] else "MISSED")


if __name__ == "__main__":
    main()
