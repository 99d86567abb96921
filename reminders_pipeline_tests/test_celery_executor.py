"""The Celery executor for real: two ``dagster-celery`` workers on this machine's RabbitMQ, a
PostgreSQL Dagster instance (``deploy/celery/dagster.yaml`` as is), a PostgreSQL ledger and the mock
APNs over real HTTP/2 TLS, reached by the workers at its address.

* 16 per-chunk build runs and a drain of 5,000 due rows in batches run on both workers; the ledger
  ends exactly as the same work run in-process leaves it, and every row reached APNs exactly once.
* A configuration fault found by one batch stops the batches on the other worker (``drain_halts``).
* A worker process SIGKILLed while it holds a drain batch: the next drain fails its claimed rows as
  abandoned and nothing is sent twice. A build step killed mid-chunk leaves the chunk's rows as they
  were; the next run rebuilds it.

The workers listen on a queue of their own, deleted at the end, and are stopped by their own process
group. Bounded: every wait has a deadline. Marked ``celery`` (``pytest -m celery`` selects it alone).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs.resources import AlertingResource, LedgerResource, SenderResource, SourcesResource
from reminders_pipeline.devices.registration import DeviceSpec, chunk_of, put_device
from reminders_pipeline.domain.notification import as_shown, collapse_id
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline_testing.celery_workers import BROKER, Worker, celery_config, delete_queue, worker_command
from reminders_pipeline_testing.mock_apns import MockApns
from reminders_pipeline_testing.stack import BIN, ROOT, ThrowawayDatabases, dagster_url, wait_for

from .http_sources import FeedServer
from .test_dagster_support import definitions_for, live_item

pytestmark = [pytest.mark.celery, pytest.mark.timeout(900)]

CHUNKS = 16
ITEMS = 25  # per device
DEVICES = 200  # x ITEMS = 5,000 due rows
FAULT_DEVICES = 80  # 2,000 rows for the configuration-fault drain
KILL_DEVICES = 40  # 1,000 rows for the killed worker
BATCH = 500  # REMINDERS_DRAIN_BATCH_SIZE: 10 batches for 5,000 rows
STABLE = (
    "send_after",
    "event_at",
    "expires_at",
    "title",
    "body",
    "status",
    "outcome",
    "outcome_detail",
    "payload",
    "attempts",
)


def token_of(device_id: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_OID, device_id).hex * 2  # 64 hex digits, one per device


def due_items(prefix: str) -> list[dict[str, Any]]:
    """Items starting 50-58 minutes from now: with the default 60-minute lead every row is due,
    2-10 minutes late, well inside REMINDERS_MAX_LATENESS_SECONDS."""
    return [live_item(f"{prefix}-{i}", 3000 + 20 * i) for i in range(ITEMS)]


def add_devices(db: Database, settings: Settings, prefix: str, count: int, url: str) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(count)]
    for device_id in ids:
        put_device(db, settings, DeviceSpec(device_id, token_of(device_id), 3600, (), (url,)))
    return ids


def snapshot(db: Database, prefix: str = "") -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """The queue as the outcome sees it: every column but ids, claimers and wall-clock stamps (and
    the row's id the payload carries for Snooze and Done)."""
    with db.read() as conn:
        rows = [as_shown(r) for r in ledger.list_queue(conn)]
    return {
        (r["device_id"], r["item_id"], r["rule"]): tuple(_without_row_id(r) if c == "payload" else r[c] for c in STABLE)
        + (r["sent_at"] is not None, r["apns_id"] is not None)
        for r in rows
        if r["device_id"].startswith(prefix)
    }


def _without_row_id(row: dict[str, Any]) -> Any:
    if row["payload"] is None:
        return None
    shown = json.loads(row["payload"])
    assert shown["payload"]["reminder"].pop("id") == row["id"]
    return shown


def apns_keys(mock: MockApns) -> Counter:
    """(device token, collapse id) per request the mock received: one per row sent."""
    return Counter((r.token, r.headers.get("apns-collapse-id")) for r in mock.requests)


def row_keys(db: Database, prefix: str, **filters: Any) -> set[tuple[str, str]]:
    with db.read() as conn:
        rows = ledger.list_queue(conn, **filters)
    return {
        (token_of(r["device_id"]), collapse_id(r["device_id"], r["item_id"]))
        for r in rows
        if r["device_id"].startswith(prefix)
    }


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc: no extra dependency)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


class Cluster:
    def __init__(
        self,
        home: Path,
        config: Path,
        env: dict[str, str],
        ledger_url: str,
        reference_url: str,
        workers: list[Worker],
        mock: MockApns,
        feeds: FeedServer,
        instance: dg.DagsterInstance,
    ) -> None:
        self.home, self.config, self.env = home, config, env
        self.db, self.reference = Database(ledger_url), Database(reference_url)
        self.ledger_url, self.reference_url = ledger_url, reference_url
        self.settings = Settings.from_env(env)
        self.workers, self.mock, self.feeds, self.instance = workers, mock, feeds, instance
        self.items: list[dict[str, Any]] = []  # the first test's feed, kept for the build-kill test

    def runs(self, *args: str, timeout: float = 300) -> list[dict[str, Any]]:
        """Runs launched by ``celery_runs`` (the deployment's job pointer), one JSON line each."""
        try:
            done = subprocess.run(
                [str(BIN / "python"), "-m", "reminders_pipeline_testing.celery_runs", str(self.config), *args],
                cwd=ROOT,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{args} timed out: {str(exc.stderr)[-3000:]}{self.logs()}") from None
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and lines, done.stderr[-4000:] + self.logs()
        return lines

    def start_runs(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(BIN / "python"), "-m", "reminders_pipeline_testing.celery_runs", str(self.config), *args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def step_workers(self, run_id: str) -> dict[str, tuple[str, int | None]]:
        """step key -> (Celery worker hostname, pid of the process that ran it), from the run's events."""
        hosts: dict[str, str] = {}
        pids: dict[str, int] = {}
        for record in self.instance.all_logs(run_id):
            event = record.dagster_event
            if event is None or not event.step_key:
                continue
            if event.event_type_value == "ENGINE_EVENT":
                worker = (getattr(event.event_specific_data, "metadata", None) or {}).get("Celery worker")
                if worker is not None:
                    hosts[event.step_key] = worker.value
            elif event.event_type_value == "STEP_START":
                pids[event.step_key] = event.pid
        return {key: (host, pids.get(key)) for key, host in hosts.items()}

    def worker_of(self, pid: int | None) -> str | None:
        for worker in self.workers:
            if pid is not None and pid in descendants(worker.process.pid):
                return worker.name
        return None

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n{w.output()[-3000:]}" for w in self.workers)


def worker_names(queue: str) -> tuple[str, str]:
    """Node names unique to this session: Celery gives each node an exclusive control queue on the
    broker (``<name>@<host>.celery.pidbox``), so a second suite beside this one on the same RabbitMQ
    could not start a worker of the same name."""
    suffix = queue.rsplit("_", 1)[-1]
    return f"w1-{suffix}", f"w2-{suffix}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, postgres_server_url: str) -> Iterator[Cluster]:
    """On the session's PostgreSQL (missing: a failure) and RabbitMQ on 127.0.0.1:5672 (missing: a
    skip on a laptop, a failure under CI=true, where .ci/run starts it)."""
    try:
        databases = ThrowawayDatabases(postgres_server_url)
        instance_url = dagster_url(databases.create("dagster_celery"))
        ledger_url = databases.create("reminders_celery")
        reference_url = databases.create("reminders_inproc")
    except Exception as exc:  # noqa: BLE001 - no PostgreSQL here
        pytest.fail(f"PostgreSQL unavailable: {exc}")
    try:
        delete_queue("reminders_celery_probe")
    except Exception as exc:  # noqa: BLE001 - no broker here
        databases.drop_all()
        if os.environ.get("CI") == "true":  # .ci/run starts RabbitMQ: missing there is a failure
            pytest.fail(f"RabbitMQ unavailable on {BROKER}: {exc}")
        pytest.skip(f"RabbitMQ unavailable on {BROKER} (a laptop without a broker): {exc}")
    tmp = tmp_path_factory.mktemp("celery")
    home = tmp / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_bytes((ROOT / "deploy/celery/dagster.yaml").read_bytes())  # as deployed
    queue = f"reminders_test_{uuid.uuid4().hex[:8]}"
    config = tmp / "celery.yaml"
    celery_config(config, queue)
    mock, feeds = MockApns(), FeedServer()
    mock.start()
    feeds.start()
    workers: list[Worker] = []
    saved_env = dict(os.environ)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")},
        **mock.env(),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # dagster-celery execs `celery`
        "PYTHONPATH": str(ROOT),
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": instance_url,
        "REMINDERS_DATABASE_URL": ledger_url,
        "REMINDERS_DAGSTER_EXECUTOR": "celery",
        "REMINDERS_ENABLED": "true",
        "REMINDERS_SOURCE_ALLOW_NETWORKS": "127.0.0.0/8",
        "REMINDERS_DRAIN_BATCH_SIZE": str(BATCH),
        # Short, so the killed worker's claims are abandoned within the test. The send timeout
        # outlasts the kill test's 4 s answers, and the claim's fence (abandon-after minus send
        # timeout minus margin: 5 s) still leaves every slice time to go out.
        "REMINDERS_ABANDON_AFTER_SECONDS": "12",
        "REMINDERS_SEND_TIMEOUT_SECONDS": "6",
        "REMINDERS_FENCE_MARGIN_SECONDS": "1",
    }
    try:
        for url in (ledger_url, reference_url):
            db = Database(url)
            migrate.upgrade(db)
            db.dispose()
        os.environ.update(DAGSTER_HOME=str(home), DAGSTER_POSTGRES_URL=instance_url)
        # The instance's tables exist before two workers race to create them.
        with dg.DagsterInstance.from_config(str(home)) as instance:
            for name in worker_names(queue):
                args = worker_command(config, queue, name)
                workers.append(Worker(name, args, env, tmp))
            for w in workers:
                wait_for(f"worker {w.name}", lambda w=w: f"{w.name}@" in w.output() and " ready." in w.output(), 90)
            yield Cluster(home, config, env, ledger_url, reference_url, workers, mock, feeds, instance)
    finally:
        for worker in workers:
            worker.stop()
        try:
            delete_queue(queue)
        finally:
            mock.stop()
            feeds.stop()
            os.environ.clear()
            os.environ.update(saved_env)
            databases.drop_all()


def in_process_reference(c: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same work with the in-process executor: per-chunk builds, then one drain."""
    for key, value in c.env.items():
        if key.startswith("REMINDERS_") and key not in ("REMINDERS_DAGSTER_EXECUTOR", "REMINDERS_DATABASE_URL"):
            monkeypatch.setenv(key, value)
    defs = definitions_for(
        {
            "ledger": LedgerResource(database_url=c.reference_url),
            "sender": SenderResource(enabled="true"),  # APNs: the mock, from the environment
            "sources": SourcesResource(),
            "alerting": AlertingResource(),
        }
    )
    with dg.DagsterInstance.ephemeral() as instance:
        builder = defs.resolve_job_def("build_notification_queue")
        for chunk in range(CHUNKS):
            assert builder.execute_in_process(partition_key=f"{chunk:03d}", instance=instance).success
        assert defs.resolve_job_def("drain_job").execute_in_process(instance=instance).success


def test_builds_and_a_drain_run_on_both_workers_and_end_as_in_process(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
):
    c = cluster
    c.items = due_items("standup")
    url = c.feeds.items("/due.json", c.items)
    for db in (c.db, c.reference):
        devices = add_devices(db, c.settings, "dev", DEVICES, url)
    assert len({chunk_of(d, CHUNKS) for d in devices}) == CHUNKS

    in_process_reference(c, monkeypatch)
    reference_sent = apns_keys(c.mock)
    assert len(reference_sent) == DEVICES * ITEMS and set(reference_sent.values()) == {1}
    c.mock.reset()

    builds = c.runs("build", *map(str, range(CHUNKS)), "--parallel", "2")
    assert [b["status"] for b in builds] == ["SUCCESS"] * CHUNKS, builds
    drain = c.runs("drain")[0]
    assert drain["status"] == "SUCCESS", c.logs()

    # Both workers executed steps: Celery's own hostname in each step's engine event, and the pid of
    # the process that ran it is one of that worker's.
    steps = {}
    for run in [*builds, drain]:
        steps.update({(run["run_id"], k): v for k, v in c.step_workers(run["run_id"]).items()})
    assert len(steps) == CHUNKS + 13, steps  # a build step per run; fail_abandoned, find_due, 10 batches, summarize
    hosts = Counter(host.split("@")[0] for host, _ in steps.values())
    assert set(hosts) == {w.name for w in c.workers} and len(hosts) == 2, hosts
    assert all(c.worker_of(pid) == host.split("@")[0] for host, pid in steps.values())
    batches = [v for (run, key), v in steps.items() if run == drain["run_id"] and key.startswith("send_batch[")]
    assert len(batches) == 10 and len({host for host, _ in batches}) == 2

    # The ledger ends exactly as the in-process run left it, and every row reached APNs exactly once.
    celery_rows, reference_rows = snapshot(c.db), snapshot(c.reference)
    assert len(celery_rows) == DEVICES * ITEMS
    assert celery_rows == reference_rows
    assert {v[STABLE.index("outcome")] for v in celery_rows.values()} == {"sent"}
    sent = apns_keys(c.mock)
    assert set(sent.values()) == {1} and set(sent) == row_keys(c.db, "dev-")


def test_a_configuration_fault_found_by_one_batch_stops_the_batches_on_the_other_worker(cluster: Cluster):
    c = cluster
    c.mock.reset()
    url = c.feeds.items("/fault.json", due_items("review"))
    devices = add_devices(c.db, c.settings, "fault", FAULT_DEVICES, url)
    build(c.db, c.settings)  # only the new devices have anything to add
    poison = devices[0]  # its rows are the earliest due: the first slice of batch_000 holds one
    c.mock.script(token_of(poison), status=403, reason="InvalidProviderToken")
    c.mock.script_default(delay=2.0)  # every batch is on the wire long enough to meet the halt (2 s of start skew)

    drain = c.runs("drain")[0]
    assert drain["status"] == "FAILURE"  # summarize turns a halt into a red run

    with c.db.read() as conn:
        halt = ledger.halts_of(conn, drain["run_id"]).get("apns")
        rows = [r for r in ledger.list_queue(conn) if r["device_id"].startswith("fault-")]
    assert halt and "InvalidProviderToken" in halt
    workers = {key: host.split("@")[0] for key, (host, _) in c.step_workers(drain["run_id"]).items()}
    claimed = Counter(r["claimed_by"].rsplit(":", 1)[1] for r in rows if r["claimed_by"])
    halter = workers["send_batch[batch_000]"]
    other_batches = [k for k, w in workers.items() if k.startswith("send_batch[") and w != halter]
    assert other_batches, workers  # the other worker ran batches of this run ...
    # ... and each stopped short of its 500 rows: the halt in the ledger stopped it before a claim.
    assert all(claimed.get(k[len("send_batch[") : -1], 0) < BATCH for k in other_batches), (claimed, workers)
    pending = [r for r in rows if r["status"] == "pending"]
    assert len(pending) >= FAULT_DEVICES * ITEMS - 2 * BATCH
    assert {r["attempts"] for r in pending} == {0}
    # Nothing unclaimed reached APNs; nothing reached it twice.
    sent = apns_keys(c.mock)
    assert set(sent.values()) == {1}
    assert not set(sent) & {(token_of(r["device_id"]), collapse_id(r["device_id"], r["item_id"])) for r in pending}
    c.mock.reset()
    c.mock.script_default()
    _settle_leftovers(c)


def test_a_worker_killed_holding_a_batch_leaves_rows_failed_as_abandoned_never_resent(cluster: Cluster):
    c = cluster
    c.mock.reset()
    _settle_leftovers(c)
    url = c.feeds.items("/kill.json", due_items("retro"))
    add_devices(c.db, c.settings, "kill", KILL_DEVICES, url)
    build(c.db, c.settings)
    c.mock.script_default(delay=4.0)  # answers come late: a batch holds its claim a while

    known = {r.run_id for r in c.instance.get_runs(dg.RunsFilter(job_name="drain_job"))}
    background = c.start_runs("drain")
    try:
        run_id = wait_for(
            "the drain run",
            lambda: next(
                (r.run_id for r in c.instance.get_runs(dg.RunsFilter(job_name="drain_job")) if r.run_id not in known),
                None,
            ),
            60,
            0.2,
        )

        def held_batch() -> tuple[str, int] | None:
            with c.db.read() as conn:
                holders = {r["claimed_by"] for r in ledger.list_queue(conn, status="claimed")}
            for key, (_, pid) in c.step_workers(run_id).items():
                if key.startswith("send_batch[") and f"{run_id}:{key[11:-1]}" in holders and c.worker_of(pid):
                    return key[11:-1], pid  # type: ignore[return-value]
            return None

        batch, pid = wait_for("a worker to hold a claimed batch", held_batch, 120, 0.2)
        with c.db.read() as conn:
            held = {
                (token_of(r["device_id"]), collapse_id(r["device_id"], r["item_id"]))
                for r in ledger.list_queue(conn, status="claimed")
                if r["claimed_by"] == f"{run_id}:{batch}"
            }
        wait_for("its sends to be on the wire", lambda: held & set(apns_keys(c.mock)), 30, 0.1)
        os.kill(pid, signal.SIGKILL)
        out, _ = background.communicate(timeout=240)
    finally:
        if background.poll() is None:
            background.kill()
            background.wait()
    assert json.loads(out.strip().splitlines()[-1])["status"] == "FAILURE"  # the lost step fails the run
    with c.db.read() as conn:
        killed = [r for r in ledger.list_queue(conn) if r["claimed_by"] == f"{run_id}:{batch}"]
    assert killed and {r["status"] for r in killed} == {"claimed"}  # nobody settled them

    c.mock.script_default()
    time.sleep(12.5)  # REMINDERS_ABANDON_AFTER_SECONDS=12
    assert c.runs("drain")[0]["status"] == "SUCCESS"
    with c.db.read() as conn:
        rows = [r for r in ledger.list_queue(conn) if r["device_id"].startswith("kill-")]
    by_id = {r["id"]: r for r in rows}
    assert {(by_id[r["id"]]["outcome"], by_id[r["id"]]["outcome_detail"]) for r in killed} == {("failed", "abandoned")}
    assert {r["outcome"] for r in rows if r["id"] not in {k["id"] for k in killed}} == {"sent"}
    sent = apns_keys(c.mock)
    assert set(sent.values()) == {1}  # the abandoned rows, on the wire when killed, were never sent again
    keys = lambda rs: {(token_of(r["device_id"]), collapse_id(r["device_id"], r["item_id"])) for r in rs}  # noqa: E731
    killed_ids = {k["id"] for k in killed}
    assert keys(r for r in rows if r["id"] not in killed_ids) <= set(sent) <= keys(rows)


def test_a_build_step_killed_mid_chunk_leaves_the_chunk_and_the_next_run_rebuilds_it(cluster: Cluster):
    c = cluster
    chunk = chunk_of("dev-0", CHUNKS)
    in_chunk = {d for d in (f"dev-{i}" for i in range(DEVICES)) if chunk_of(d, CHUNKS) == chunk}
    before = snapshot(c.db, "dev-")
    items = c.items + [live_item("planning", 7 * 3600)]
    c.feeds.items("/due.json", items, delay=30.0)  # a new item, and a source slow enough to kill the read

    known = {r.run_id for r in c.instance.get_runs(dg.RunsFilter(job_name="build_notification_queue"))}
    background = c.start_runs("build", str(chunk))
    try:

        def reading() -> int | None:
            runs = [
                r
                for r in c.instance.get_runs(dg.RunsFilter(job_name="build_notification_queue"))
                if r.run_id not in known
            ]
            if not runs or not c.feeds.hits.get("/due.json"):
                return None
            return next((pid for key, (_, pid) in c.step_workers(runs[0].run_id).items() if pid), None)

        hits = c.feeds.hits.get("/due.json", 0)
        pid = wait_for(
            "the build step to read the slow source",
            lambda: c.feeds.hits.get("/due.json", 0) > hits and reading(),
            120,
            0.2,
        )
        os.kill(pid, signal.SIGKILL)
        out, _ = background.communicate(timeout=120)
    finally:
        if background.poll() is None:
            background.kill()
            background.wait()
    assert json.loads(out.strip().splitlines()[-1])["status"] == "FAILURE"
    assert snapshot(c.db, "dev-") == before  # the chunk's rows are as they were

    c.feeds.items("/due.json", items)
    assert c.runs("build", str(chunk))[0]["status"] == "SUCCESS"
    after = snapshot(c.db, "dev-")
    added = {key[0] for key in set(after) - set(before)}
    assert added == in_chunk  # the chunk was rebuilt: its devices, and only they, have the new item


def _settle_leftovers(c: Cluster) -> None:
    """Rows the fault test left pending would join the next drain; settle them out of its way."""
    with c.db.read() as conn:
        pending = [r["id"] for r in ledger.list_queue(conn, status="pending")]
    if pending:
        from reminders_pipeline.sending import drain as core

        summary = core.drain(
            c.db, c.settings.with_(enabled=False), checked_sender_factory(c.db, c.settings.with_(enabled=False))
        )
        assert summary.claimed >= len(pending)
