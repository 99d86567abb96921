"""A crash-and-restart drill: the whole system under load for ``--minutes``, its processes killed at random.

It starts the real processes, each restarted a second after it dies, as a supervisor would:
``reminders dispatch`` twice, the Dagster daemon (its schedules run builds and the cron drain as
real runs, its sensor the exact-time dispatcher run), and ``reminders serve``; the three
providers' mocks and a feed server run in this process. The ledger and Dagster's instance are on
a throwaway PostgreSQL cluster of their own (``--sqlite``: the embedded default, and Dagster's
SQLite instance as ``reminders dev`` has it).

Load: ``--devices`` devices (a third each on APNs, Web Push and FCM), five to a JSON source, each
with two lead rules between 0 and an hour, and events placed from each source's longest lead on
(about 1,500 reminders a minute come due from the first, more as the short leads begin). Every minute ``--edits`` sources change: one event moved, one cancelled, one added. The
drill's phone answers some alerts with Done (the occurrence's later reminders must not come) or a
Snooze (one more alert at the time asked), over HTTP.

Faults, at random: every 20-90 s one process gets SIGKILL (a dispatcher, a Dagster run worker, the
daemon or the HTTP server); on PostgreSQL the server is crashed (``pg_ctl -m immediate``) twice;
each provider is unreachable for 60 s once and answers 2 s late for 60 s once.

The oracle (``soak_oracle``) reads the mocks' own records and the feed history, never the ledger's
word on what was sent, and prints met or MISSED for: no duplicate, none early, none stale, none
after Done, every owed reminder on time unless a fault excuses it, and every one not sent
accounted for by a fault. Everything is kept in the workdir it prints.

    .venv/bin/python bench/soak.py [--sqlite] [--minutes 20] [--devices 3000] [--edits 12]
        [--warmup 300] [--seed 1] [--json]
    .venv/bin/python bench/soak.py --judge WORKDIR     # judge a finished run's records again

On PostgreSQL it needs the server's binaries (``initdb``, ``pg_ctl``; as root they run as the
``postgres`` user), as ``bench/drill_pg_outage.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # reminders_pipeline_testing, not installed
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
import psutil  # noqa: E402
import soak_oracle as oracle  # noqa: E402
from drill_pg_outage import Cluster  # noqa: E402
from sqlalchemy import create_engine, select, text  # noqa: E402

from reminders_pipeline.config.settings import Settings  # noqa: E402
from reminders_pipeline.dev.demo import prepare_dagster_home  # noqa: E402
from reminders_pipeline.devices.registration import DeviceSpec, put_device  # noqa: E402
from reminders_pipeline.ledger import migrate  # noqa: E402
from reminders_pipeline.ledger.db import Database  # noqa: E402
from reminders_pipeline.ledger.schema import notification_queue  # noqa: E402
from reminders_pipeline.providers.webpush import generate_key  # noqa: E402
from reminders_pipeline_testing import mock_fcm, mock_webpush  # noqa: E402
from reminders_pipeline_testing.mock_apns import MockApns  # noqa: E402
from reminders_pipeline_testing.stack import BIN, dagster_url, free_port  # noqa: E402

PROVIDERS = ("apns", "webpush", "fcm")
LONG_LEADS, SHORT_LEADS = (3600, 1800, 900, 300), (0, 60, 120, 600)
PER_SOURCE = 5
DUE_PER_SECOND = 50.0  # both rules' reminders a second once short leads are reached; half that before
BUILD_CRON, DRAIN_CRON, BUILD_CADENCE = "*/2 * * * *", "1-59/2 * * * *", 120
WARMUP = 300.0  # seconds from the feeds' making to the first reminder due: registration, first build, start-up
TAIL = 60.0  # quiet seconds at the end: no faults, edits or actions
RECOVER = 30.0  # seconds after a fault ends that reminders due may still be late from it
BAR = 3.0  # seconds: the lateness bar of bench_timeliness (max), for reminders no fault touches
GRACE = 2 * BUILD_CADENCE + 60.0  # read to ledger: a tick, plus one killed build's next tick
KILL_EVERY = (20.0, 90.0)
TARGETS = ("dispatch-1", "dispatch-2", "daemon", "serve", "run-worker")


class Feeds:
    """The sources' documents, their history, and a server that records which version it served when."""

    def __init__(self, sources: int, t0: float, end: float, rng: random.Random) -> None:
        self.rng, self.lock, self.version = rng, threading.Lock(), [0] * sources
        self.timelines = {str(n): oracle.Timeline() for n in range(sources)}
        self.end = end + 3600 + 600
        rate = DUE_PER_SECOND / (sources * PER_SOURCE * 2)  # events a second per source: 2 rules x 5 devices each
        self.next_id = [0] * sources
        for n in range(sources):
            first = t0 + self.leads(n)[0]  # no reminder comes due before t0
            events = {
                self._new_id(n): int(rng.uniform(first, self.end)) for _ in range(round((self.end - first) * rate))
            }
            self._commit(n, events, time.time())
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_port}"

    @staticmethod
    def leads(n: int) -> tuple[int, int]:
        """The two leads of every device on source ``n``: a long one, then a short one."""
        return LONG_LEADS[n % len(LONG_LEADS)], SHORT_LEADS[n // len(LONG_LEADS) % len(SHORT_LEADS)]

    def _new_id(self, n: int) -> str:
        self.next_id[n] += 1
        return f"s{n}-e{self.next_id[n]}"

    def _commit(self, n: int, events: dict[str, int], at: float) -> None:
        line = self.timelines[str(n)]
        line.versions.append(events)
        line.since.append(at)
        self.version[n] = len(line.versions) - 1

    def body(self, n: int) -> tuple[int, bytes]:
        with self.lock:
            k = self.version[n]
            events = self.timelines[str(n)].versions[k]
        items = [{"id": e, "title": f"Event {e}", "startsAt": s, "expiresAt": s + 1800} for e, s in events.items()]
        return k, json.dumps({"items": items}).encode()

    def edit(self, count: int, now: float) -> int:
        """``count`` sources change: one event moved 2-20 minutes, one cancelled, one added."""
        edited = 0
        for n in self.rng.sample(range(len(self.version)), count):
            with self.lock:
                events = dict(self.timelines[str(n)].versions[self.version[n]])
                future = sorted(e for e, s in events.items() if s > now + 60)
                if len(future) >= 2:
                    moved, cancelled = self.rng.sample(future, 2)
                    shift = self.rng.choice((-1, 1)) * self.rng.randint(120, 1200)
                    events[moved] = max(int(now) + 90, events[moved] + shift)
                    del events[cancelled]
                events[self._new_id(n)] = int(self.rng.uniform(now + 300 + self.leads(n)[0], self.end))
                self._commit(n, events, time.time())
                edited += 1
        return edited

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        feeds = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                n = int(self.path.removeprefix("/s/").removesuffix(".json"))
                k, body = feeds.body(n)
                tag = f'"{n}-{k}"'
                feeds.timelines[str(n)].served.setdefault(k, time.time())
                if self.headers.get("If-None-Match") == tag:
                    self.send_response(304)
                    self.send_header("ETag", tag)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("ETag", tag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


class Supervised:
    """A process restarted a second after it dies, its output appended to one log."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.name, self.args, self.env = name, args, env
        self.log = (logs / f"{name}.log").open("ab")
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def tend(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            self.log.write(f"--- soak: exited {self.process.returncode}, restarting\n".encode())
            self.log.flush()
            self.restarts += 1
            self.start()

    def kill(self) -> int:
        assert self.process is not None
        pid = self.process.pid
        self.process.kill()
        self.process.wait()
        time.sleep(1.0)  # the supervisor's restart delay
        return pid

    def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def processes_of(home: str) -> list[psutil.Process]:
    """Every process of this drill's Dagster instance."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("DAGSTER_HOME") == home:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def run_workers(home: str) -> list[psutil.Process]:
    """Dagster run workers of this drill's instance: the code server starts each run in a process
    of its own (``multiprocessing`` spawn), or ``dagster api execute_run``/``execute_step``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            command = " ".join(p.info["cmdline"] or ())
            worker = any(mark in command for mark in ("spawn_main", "execute_run", "execute_step"))
            if worker and p.environ().get("DAGSTER_HOME") == home:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class Phone:
    """Reads what the mocks accepted as the devices would get it, and answers some alerts with
    Done or Snooze over HTTP, recording when the server answered."""

    def __init__(self, mocks: dict[str, Any], device_of: dict[str, str], api: str, token: str,
                 rng: random.Random, short_rule: dict[str, str]) -> None:  # fmt: skip
        self.mocks, self.device_of, self.api, self.rng = mocks, device_of, api, rng
        self.short_rule = short_rule  # device -> its shorter lead rule (what a Done must cancel)
        self.client = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=15)
        self.seen = dict.fromkeys(PROVIDERS, 0)
        self.deliveries: list[oracle.Delivery] = []
        self.dones: list[dict[str, Any]] = []
        self.snoozes: list[dict[str, Any]] = []
        self.action_failures: list[str] = []
        self.acting = True

    def poll(self) -> list[tuple[oracle.Delivery, str | None]]:
        """New accepted deliveries, each with its action token."""
        new = []
        for provider in PROVIDERS:
            records = self.mocks[provider].requests
            for r in records[self.seen[provider] :]:
                got = self._read(provider, r)
                if got is not None:
                    new.append(got)
            self.seen[provider] = len(records)
        self.deliveries += [d for d, _ in new]
        return new

    def _read(self, provider: str, r: Any) -> tuple[oracle.Delivery, str | None] | None:
        if provider == "apns":
            ok, key, reminder, at = r.status == 200, r.token, (r.payload or {}).get("reminder"), r.received_at
        elif provider == "webpush":
            ok, key, reminder, at = r.status == 201, r.endpoint, (r.payload or {}).get("reminder"), r.at
        else:
            data = (r.message or {}).get("data", {})
            ok, key, at = r.status == 200, r.token, r.at
            reminder = json.loads(data["reminder"]) if "reminder" in data else None
        if not ok or reminder is None or key not in self.device_of:
            return None
        d = oracle.Delivery(self.device_of[key], reminder["item_id"], reminder["rule"], int(reminder["starts_at"]),
                            int(reminder["id"]), at, provider)  # fmt: skip
        return d, reminder.get("token")

    def act(self, delivery: oracle.Delivery, token: str | None) -> None:
        """Done on 4% of a device's first (longer-lead) alerts, Snooze on 3% of any."""
        if token is None or not self.acting:
            return
        roll = self.rng.random()
        is_long = delivery.rule != self.short_rule[delivery.device] and delivery.rule.startswith("lead:")
        if is_long and roll < 0.04:
            self._post(delivery, "done", {"token": token})
        elif 0.04 <= roll < 0.07 and delivery.starts_at + 1800 > time.time() + 300:
            self._post(delivery, "snooze", {"token": token, "until": int(time.time()) + self.rng.randint(60, 240)})

    def _post(self, d: oracle.Delivery, action: str, body: dict[str, Any]) -> None:
        url = f"{self.api}/v1/devices/{d.device}/reminders/{d.row_id}/{action}"
        for _ in range(20):  # the server may be down for its restart
            try:
                answer = self.client.post(url, json=body)
            except httpx.TransportError:
                time.sleep(0.5)
                continue
            if answer.status_code >= 500:
                time.sleep(0.5)
                continue
            break
        else:
            self.action_failures.append(json.dumps({"device": d.device, "row_id": d.row_id, "code": "unreachable"}))
            return
        record = {"device": d.device, "event": d.event, "starts_at": d.starts_at, "row_id": d.row_id,
                  "provider": d.provider, "answered_at": time.time(), "status": answer.status_code}  # fmt: skip
        if answer.status_code != 200:
            record["error"] = answer.text[:200]
            record["code"] = refusal_code(record)
            self.action_failures.append(json.dumps(record))
        elif action == "done":
            self.dones.append(record)
        else:
            snooze = answer.json()["snooze"]
            self.snoozes.append({**record, "until": snooze["send_after"], "rule": snooze["rule"], "id": snooze["id"]})

    def run(self, until: float) -> None:
        while time.time() < until:
            for delivery, token in self.poll():
                self.act(delivery, token)
            time.sleep(0.5)


def refusal_code(record: dict[str, Any]) -> str:
    """The error code of a refused action (the JSON error's ``error``), or its HTTP status."""
    try:
        return str(json.loads(record["error"])["error"])
    except (KeyError, TypeError, ValueError):
        return str(record.get("status"))


# Refusals that say the alert the phone holds was never sent, or is not the device's: each a break.
WRONG_REFUSALS = frozenset({"not_sent", "no_reminder", "wrong_action_token", "unreachable"})


def fault_plan(t0: float, end: float, rng: random.Random, postgres: bool) -> list[tuple[float, str, str]]:
    """(when, kind, target): kills every 20-90 s, two database crashes, each provider down and slow once."""
    plan = []
    t = t0 + 30
    while True:
        t += rng.uniform(*KILL_EVERY)
        if t > end - 90:
            break
        plan.append((t, "kill", rng.choice(TARGETS)))
    span = end - t0
    if postgres:
        plan += [(t0 + span * rng.uniform(0.2, 0.4), "db_restart", "database"),
                 (t0 + span * rng.uniform(0.6, 0.8), "db_restart", "database")]  # fmt: skip
    slots = [(kind, p) for p in PROVIDERS for kind in ("provider_down", "provider_slow")]
    rng.shuffle(slots)
    width = (span - 150) / len(slots)
    plan += [(t0 + 30 + i * width + rng.uniform(0, max(0.0, width - 75)), kind, p) for i, (kind, p) in enumerate(slots)]
    return sorted(plan)


def provider_fault(mock: Any, provider: str, kind: str, on: bool) -> None:
    if kind == "provider_down":
        mock.refuse("connect" if on else None)
    elif provider == "apns":
        mock.script_default(delay=2.0 if on else 0.0)
    else:
        module = mock_webpush if provider == "webpush" else mock_fcm
        mock.script_default(module.Answer(delay=2.0 if on else 0.0))


class Drill:
    """The stack under test: database, mocks, feeds, devices and the supervised processes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rng = args, random.Random(args.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"soak-{'sqlite' if args.sqlite else 'postgresql'}-"))
        self.cluster: Cluster | None = None
        self.faults: list[oracle.Fault] = []
        self.kills: list[dict[str, Any]] = []
        self.edits = 0

    def database(self) -> tuple[str, dict[str, str]]:
        """The ledger's URL, and Dagster's instance settings."""
        if self.args.sqlite:
            return f"sqlite:///{self.workdir / 'ledger.sqlite3'}", {}
        self.cluster = Cluster()
        self.cluster.start()
        admin = create_engine(self.cluster.url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("CREATE DATABASE dagster"))
        admin.dispose()
        dagster = dagster_url(self.cluster.url.rsplit("/", 1)[0] + "/dagster")
        return self.cluster.url, {"DAGSTER_POSTGRES_URL": dagster}

    def start_mocks(self) -> None:
        for name in ("webpush", "fcm"):
            (self.workdir / name).mkdir()
        self.mocks = {
            "apns": MockApns(),
            "webpush": mock_webpush.MockWebPush(workdir=self.workdir / "webpush"),
            "fcm": mock_fcm.MockFcm(workdir=self.workdir / "fcm"),
        }
        for mock in self.mocks.values():
            mock.start()

    def environment(self, ledger_url: str, instance: dict[str, str]) -> dict[str, str]:
        generate_key(str(self.workdir / "vapid.pem"))
        self.token, self.port = secrets.token_urlsafe(32), free_port()
        apns, push, fcm = self.mocks["apns"], self.mocks["webpush"], self.mocks["fcm"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REMINDERS_", "DAGSTER_"))}
        env.update(apns.env())
        env.update({
            "REMINDERS_DATABASE_URL": ledger_url, "REMINDERS_ENABLED": "true", "REMINDERS_TOKEN": self.token,
            "REMINDERS_BUILD_CRON": BUILD_CRON, "REMINDERS_DRAIN_CRON": DRAIN_CRON,
            "REMINDERS_SOURCE_ALLOW_NETWORKS": "127.0.0.0/8",
            "REMINDERS_VAPID_PRIVATE_KEY_FILE": str(self.workdir / "vapid.pem"),
            "REMINDERS_VAPID_SUBJECT": "mailto:ops@example.org",
            "REMINDERS_WEBPUSH_CA_FILE": str(push.ca_file), "REMINDERS_WEBPUSH_ALLOW_NETWORKS": "127.0.0.0/8",
            "REMINDERS_FCM_CREDENTIALS_FILE": str(fcm.service_account_file()),
            "REMINDERS_FCM_URL": fcm.url, "REMINDERS_FCM_CA_FILE": str(fcm.ca_file),
            **instance,
        })  # fmt: skip
        (self.workdir / "logs").mkdir()
        env["DAGSTER_HOME"] = str(prepare_dagster_home(self.workdir, env))
        return env

    def register(self, db: Database, settings: Settings, feeds: Feeds) -> list[dict[str, Any]]:
        """The devices, through the core's registration path, as the HTTP and CLI shells register them."""
        devices = []
        self.device_of: dict[str, str] = {}
        for i in range(self.args.devices):
            n, provider, device = i // PER_SOURCE, PROVIDERS[i % len(PROVIDERS)], f"d{i}"
            long, short = Feeds.leads(n)
            target: dict[str, Any] = {}
            if provider == "apns":
                target["apns_token"] = key = secrets.token_hex(32)
            elif provider == "webpush":
                target["webpush"] = subscription = self.mocks["webpush"].subscribe()
                key = subscription["endpoint"]
            else:
                target["fcm_token"] = key = f"soak-{i}-" + secrets.token_urlsafe(40)
            spec = DeviceSpec.requested(settings, device, lead=long, rules=[f"lead:{short}"],
                                        sources=[f"{feeds.base}/s/{n}.json"], **target)  # fmt: skip
            put_device(db, settings, spec)
            self.device_of[key] = device
            devices.append({"id": device, "source": str(n), "provider": provider,
                            "rules": [f"lead:{long}", f"lead:{short}"]})  # fmt: skip
        return devices

    def processes(self, env: dict[str, str]) -> dict[str, Supervised]:
        cli = [sys.executable, "-m", "reminders_pipeline.cli", "-v"]
        logs = self.workdir / "logs"
        return {
            "dispatch-1": Supervised("dispatch-1", [*cli, "dispatch"], env, logs),
            "dispatch-2": Supervised("dispatch-2", [*cli, "dispatch"], env, logs),
            "serve": Supervised("serve", [*cli, "serve", "--port", str(self.port)], env, logs),
            "daemon": Supervised("daemon", [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"], env, logs),
        }

    def kill(self, target: str, procs: dict[str, Supervised], home: str) -> None:
        if target == "run-worker":
            workers = run_workers(home)
            if workers:
                victim = self.rng.choice(workers)
                command = " ".join(victim.cmdline())[-80:]
                victim.kill()
                self.kills.append({"at": time.time(), "target": target, "pid": victim.pid, "run": command})
                return
            target = self.rng.choice(TARGETS[:-1])
        pid = procs[target].kill()
        self.kills.append({"at": time.time(), "target": target, "pid": pid})

    def db_restart(self) -> None:
        assert self.cluster is not None
        start = time.time()
        self.cluster.stop("immediate")
        time.sleep(5)
        self.cluster.start()
        self.faults.append(oracle.Fault("db_restart", "database", start, time.time()))

    def run(self) -> dict[str, Any]:
        ledger_url, instance = self.database()
        db = Database(ledger_url)
        migrate.upgrade(db)
        self.start_mocks()
        env = self.environment(ledger_url, instance)
        settings = Settings.from_env(env)
        made = time.time()
        end = made + self.args.warmup + self.args.minutes * 60
        feeds = Feeds(self.args.devices // PER_SOURCE, made + self.args.warmup, end, self.rng)
        devices = self.register(db, settings, feeds)
        first = time.time()
        subprocess.run([sys.executable, "-m", "reminders_pipeline.cli", "build", "--all"], cwd=ROOT, env=env,
                       capture_output=True, text=True, check=True)  # fmt: skip
        first_build_seconds = round(time.time() - first, 1)
        procs = self.processes(env)
        started = time.time()
        end = started + self.args.minutes * 60
        plan = fault_plan(started, end - TAIL, self.rng, self.cluster is not None)
        short = {d["id"]: d["rules"][1] for d in devices}
        phone = Phone(self.mocks, self.device_of, f"http://127.0.0.1:{self.port}", self.token, self.rng, short)
        watcher = threading.Thread(target=phone.run, args=(end + 15,), daemon=True)
        watcher.start()
        pending: dict[tuple[str, str], float] = {}
        next_edit = started + 60
        try:
            while time.time() < end:
                now = time.time()
                for proc in procs.values():
                    proc.tend()
                while plan and plan[0][0] <= now:
                    _, kind, target = plan.pop(0)
                    if kind == "kill":
                        self.kill(target, procs, env["DAGSTER_HOME"])
                    elif kind == "db_restart":
                        self.db_restart()
                    else:
                        provider_fault(self.mocks[target], target, kind, True)
                        pending[(kind, target)] = time.time()
                for (kind, target), since in list(pending.items()):
                    if now - since >= 60:
                        provider_fault(self.mocks[target], target, kind, False)
                        self.faults.append(oracle.Fault(kind, target, since, time.time()))
                        del pending[(kind, target)]
                if now >= next_edit and now < end - TAIL:
                    self.edits += feeds.edit(self.args.edits, now)
                    next_edit += 60
                if now >= end - TAIL:
                    phone.acting = False
                time.sleep(0.2)
            time.sleep(10)  # sends in flight land
        finally:
            for proc in procs.values():
                proc.stop()
            for left in processes_of(env["DAGSTER_HOME"]):  # run workers, and code servers orphaned by a kill
                left.kill()
            watcher.join(timeout=30)
            phone.poll()
            with db.engine.connect() as conn:
                rows = [dict(r) for r in conn.execute(select(notification_queue)).mappings()]
            db.dispose()
            for mock in self.mocks.values():
                mock.stop()
            feeds.server.shutdown()
            if self.cluster is not None:
                self.cluster.destroy()
        self.faults += [oracle.Fault("kill", k["target"], k["at"], k["at"] + 1) for k in self.kills]
        records = {
            "database": "sqlite" if self.args.sqlite else "postgresql",
            "minutes": self.args.minutes,
            "window": [max(started + 60, made + self.args.warmup), end - TAIL],
            "rearm_seconds": settings.rearm_threshold_seconds,
            "devices": devices,
            "timelines": {n: line.__dict__ for n, line in feeds.timelines.items()},
            "deliveries": [d.__dict__ for d in phone.deliveries],
            "dones": phone.dones,
            "snoozes": phone.snoozes,
            "action_failures": phone.action_failures,
            "faults": [f.__dict__ for f in self.faults],
            "kills": self.kills,
            "feed_edits": self.edits,
            "first_build_seconds": first_build_seconds,
            "rows": [{**{k: row[k] for k in ROW_FIELDS}, "event_at": row["event_at"].unix} for row in rows],
            "workdir": str(self.workdir),
        }
        (self.workdir / "records.json").write_text(json.dumps(records))
        return judge(records)


ROW_FIELDS = ("device_id", "item_id", "rule", "status", "outcome", "outcome_detail", "claimed_by")


def judge(records: dict[str, Any]) -> dict[str, Any]:
    """The oracle's lines over a run's records (``records.json`` in its workdir)."""
    devices, rows, kills = records["devices"], records["rows"], records["kills"]
    timelines = {
        n: oracle.Timeline(line["versions"], line["since"], {int(k): t for k, t in line["served"].items()})
        for n, line in records["timelines"].items()
    }
    sent = [oracle.Delivery(**d) for d in records["deliveries"]]
    faults = [oracle.Fault(**f) for f in records["faults"]]
    dones, snoozes = records["dones"], records["snoozes"]
    source_of = {d["id"]: d["source"] for d in devices}
    by_key = {}
    for row in rows:
        match = oracle.EVENT.search(row["item_id"])
        by_key[(row["device_id"], match.group(0) if match else row["item_id"], row["rule"])] = row
    snooze_until = {(s["device"], s["id"]): s["until"] for s in snoozes}
    rearm = records["rearm_seconds"]
    dups = oracle.duplicates(sent, rearm)
    early = oracle.early(sent, snooze_until)
    stale = oracle.stale(sent, timelines, source_of, GRACE)
    replaced = oracle.stale(sent, timelines, source_of, 0.0)
    late_done = oracle.after_done(sent, dones, rearm)
    owed = oracle.expected(devices, timelines, tuple(records["window"]), GRACE, dones, snoozes, rearm)
    accounts = oracle.account(
        owed, sent, by_key, faults, BAR, RECOVER, rearm, lambda device: timelines[source_of[device]], GRACE
    )
    abandoned = [r for r in rows if oracle.lost_with_claimer(r)]
    claimers = len({r["claimed_by"] for r in abandoned})
    claimer_kills = sum(k["target"] not in ("serve", "daemon") for k in kills)
    refusals = [json.loads(a) for a in records["action_failures"]]
    codes = Counter(a.get("code") or refusal_code(a) for a in refusals)
    refused = sum(n for code, n in codes.items() if code in WRONG_REFUSALS)
    counted = {
        "kills": len(kills),
        "db_restarts": sum(f.kind == "db_restart" for f in faults),
        "provider_outages": sum(f.kind == "provider_down" for f in faults),
        "provider_slow": sum(f.kind == "provider_slow" for f in faults),
    }
    postgres = records["database"] == "postgresql"
    lines = [
        ("0 duplicates", len(dups), not dups),
        ("0 early", len(early), not early),
        (f"0 stale (a version replaced and served more than {GRACE:g} s before)", len(stale), not stale),
        ("0 after Done", len(late_done), not late_done),
        (f"owed reminders on time (<= {BAR:g} s) unless a fault excuses it", len(accounts["late_unexcused"]),
         not accounts["late_unexcused"]),
        ("0 unaccounted", len(accounts["unaccounted"]), not accounts["unaccounted"]),
        ("abandoned claims from at most the killed claimers", f"{claimers} claimers, {claimer_kills} claimer kills",
         claimers <= claimer_kills),
        ("0 Done or Snooze on a delivered alert refused as never sent, not the device's, or unanswered", refused,
         not refused),
        (">= 15 kills in 20 minutes", counted["kills"], counted["kills"] >= 15 * records["minutes"] / 20),
        (">= 2 database restarts" if postgres else "database restarts (none on SQLite)", counted["db_restarts"],
         counted["db_restarts"] >= 2 or not postgres),
        (">= 3 provider outages", counted["provider_outages"], counted["provider_outages"] >= 3),
    ]  # fmt: skip
    result = {
        "database": records["database"],
        "minutes": records["minutes"],
        "devices": len(devices),
        "deliveries": len(sent),
        "owed": accounts["owed"],
        "outcomes": accounts["outcomes"],
        "lateness_all_s": accounts["lateness_all_s"],
        "lateness_no_fault_s": accounts["lateness_no_fault_s"],
        "counts": counted,
        "kills_by_target": {t: sum(k["target"] == t for k in kills) for t in TARGETS},
        "feed_edits": records["feed_edits"],
        "first_build_seconds": records.get("first_build_seconds"),
        "dones": len(dones),
        "snoozes": len(snoozes),
        "actions_refused": dict(codes),
        "sent_after_a_newer_version_was_served": oracle.spread([d.at - t for d, t in replaced]),
        "abandoned_rows": len(abandoned),
        "workdir": records["workdir"],
        "bar": [{"line": b, "measured": m, "met": ok} for b, m, ok in lines],
        "met": all(ok for _, _, ok in lines),
    }
    detail = {"duplicates": [[a.__dict__, b.__dict__] for a, b in dups], "early": [d.__dict__ for d in early],
              "stale": [[d.__dict__, t] for d, t in stale], "after_done": [[d.__dict__, a] for d, a in late_done],
              "late_unexcused": accounts["late_unexcused"], "unaccounted": accounts["unaccounted"],
              "kills": kills, "faults": records["faults"], "action_failures": records["action_failures"]}  # fmt: skip
    workdir = Path(records["workdir"])
    (workdir / "detail.json").write_text(json.dumps(detail, indent=1, default=str))
    (workdir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqlite", action="store_true", help="the embedded default instead of PostgreSQL")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--devices", type=int, default=3000)
    parser.add_argument("--edits", type=int, default=12, help="sources edited each minute")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=WARMUP, help="seconds before the first reminder comes due")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--judge", metavar="WORKDIR", help="judge a finished run's records.json again")
    args = parser.parse_args()
    result = judge(json.loads((Path(args.judge) / "records.json").read_text())) if args.judge else Drill(args).run()
    if args.json:
        print(json.dumps(result))
        return
    print(json.dumps({k: v for k, v in result.items() if k != "bar"}, indent=1))
    for line in result["bar"]:
        print(f"{'met   ' if line['met'] else 'MISSED'}  {line['line']}: {line['measured']}")
    print("met" if result["met"] else "MISSED")


if __name__ == "__main__":
    main()
