"""The production shape, end to end: a real ``dagster-daemon`` and ``dagster-webserver`` loading
``workspace.yaml``, with the repository's ``dagster.yaml`` as the instance on a throwaway PostgreSQL
database and a throwaway PostgreSQL ledger.

* A sensor tick launches a real run (a catch-up build for a never-built device) and rows appear.
* A backfill of two chunks launched through GraphQL (the path the UI uses) materializes exactly them.

Bounded: every wait has a deadline; the processes are stopped (SIGTERM, then SIGKILL of their own
process group) and both databases dropped, whatever happens.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline_testing.stack import (
    BIN,
    ROOT,
    Service,
    ThrowawayDatabases,
    answers,
    dagster_url,
    free_port,
    wait_for,
)

from .http_sources import FeedServer
from .test_dagster_support import add_device, device_in_chunk, live_item

START_TIMEOUT = 90
RUN_TIMEOUT = 120


class Stack:
    def __init__(self, home: Path, ledger_url: str, webserver_port: int, services: list[Service]) -> None:
        self.home = home
        self.ledger_url = ledger_url
        self.graphql = f"http://127.0.0.1:{webserver_port}/graphql"
        self.services = services
        self.db = Database(ledger_url)
        self.settings = Settings(database_url=ledger_url)

    def built_at(self) -> dict[str, str | None]:
        with self.db.read() as conn:
            return {d.id: d.reminders_built_at for d in ledger.list_devices(conn)}

    def query(self, document: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        response = httpx.post(self.graphql, json={"query": document, "variables": variables or {}}, timeout=30)
        response.raise_for_status()
        body = response.json()
        assert "errors" not in body, body
        return body["data"]

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.output()[-4000:]}" for s in self.services)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres_server_url: str) -> Iterator[Stack]:
    """On the session's PostgreSQL, whichever it is (a unix-socket URL works for psycopg2 too)."""
    try:
        databases = ThrowawayDatabases(postgres_server_url)
        instance_url = dagster_url(databases.create("dagster_e2e"))
        ledger_url = databases.create("reminders_e2e")
    except Exception as exc:  # noqa: BLE001 - no PostgreSQL here
        pytest.fail(f"PostgreSQL unavailable: {exc}")
    tmp = tmp_path_factory.mktemp("stack")
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copyfile(ROOT / "dagster.yaml", home / "dagster.yaml")  # the production instance file, as is
    feeds = FeedServer()
    feeds.start()
    services: list[Service] = []
    saved_env = dict(os.environ)
    try:
        db = Database(ledger_url)
        migrate.upgrade(db)
        settings = Settings(database_url=ledger_url)
        url = feeds.items("/feed.json", [live_item("standup", 7200), live_item("retro", 10800)])
        add_device(db, settings, device_in_chunk(2, "never"), [url])  # never built: the sensor's catch-up
        for chunk in (5, 9, 11):
            add_device(db, settings, device_in_chunk(chunk, "built"), [url])
        from reminders_pipeline.planning.build import build

        build(db, settings, chunks=[5, 9, 11])  # fresh: no breach, nothing else for the sensor to do
        db.dispose()

        env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_POSTGRES_URL": instance_url}
        env["REMINDERS_DATABASE_URL"] = ledger_url
        env.pop("REMINDERS_ALERT_WEBHOOK_URL", None)
        os.environ.update(DAGSTER_HOME=str(home), DAGSTER_POSTGRES_URL=instance_url)
        port = free_port()
        workspace = str(ROOT / "workspace.yaml")
        services.append(Service("daemon", [str(BIN / "dagster-daemon"), "run", "-w", workspace], env, tmp))
        services.append(
            Service(
                "webserver",
                [str(BIN / "dagster-webserver"), "-w", workspace, "-h", "127.0.0.1", "-p", str(port)],
                env,
                tmp,
            )
        )
        result = Stack(home, ledger_url, port, services)
        yield result
        result.db.dispose()
    finally:
        for service in services:
            service.stop()
        feeds.stop()
        os.environ.clear()
        os.environ.update(saved_env)
        databases.drop_all()


@pytest.fixture(scope="module")
def stack_instance(stack: Stack) -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.from_config(str(stack.home)) as inst:
        yield inst


@pytest.mark.timeout(240)
def test_a_sensor_tick_launches_a_real_build_run_and_rows_appear(stack: Stack, stack_instance: dg.DagsterInstance):
    never = device_in_chunk(2, "never")

    def built() -> bool:
        return bool(stack.built_at().get(never))

    try:
        wait_for("the catch-up build of chunk 002", built, START_TIMEOUT + RUN_TIMEOUT)
    except AssertionError:
        raise AssertionError(stack.logs()) from None
    with stack.db.read() as conn:
        queued = ledger.list_queue(conn, device_id=never)
    assert {r["status"] for r in queued} == {"pending"} and len(queued) == 2
    runs = wait_for(
        "the build run to finish",
        lambda: stack_instance.get_runs(
            dg.RunsFilter(job_name="build_notification_queue", statuses=[dg.DagsterRunStatus.SUCCESS])
        ),
        30,
    )
    # Normally the sensor's catch-up; if the test straddles :00/:15/:30/:45 the schedule may win
    # the race (the sensor then sees a build in flight and requests nothing).
    triggers = {(r.tags.get("dagster/sensor_name"), r.tags.get("dagster/schedule_name")) for r in runs}
    assert triggers & {("sweep_period_sensor", None), (None, "build_schedule")}, triggers


LAUNCH_BACKFILL = """
mutation Launch($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on UnauthorizedError { message }
  }
}
"""

BACKFILL_STATUS = """
query Status($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { status }
    ... on PythonError { message }
  }
}
"""


@pytest.mark.timeout(240)
def test_a_backfill_of_two_chunks_through_graphql_builds_exactly_them(stack: Stack, stack_instance: dg.DagsterInstance):
    wait_for("the webserver", lambda: answers(stack.graphql.replace("/graphql", "/server_info")), START_TIMEOUT)
    before = stack.built_at()
    launched = stack.query(
        LAUNCH_BACKFILL,
        {"params": {"assetSelection": [{"path": ["notification_queue"]}], "partitionNames": ["005", "009"]}},
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill_id = launched["backfillId"]

    def finished() -> str | None:
        status = stack.query(BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]["status"]
        return status if status not in ("REQUESTED", "CANCELING", "FAILING") else None

    try:
        assert wait_for("the backfill", finished, RUN_TIMEOUT, every=2) in ("COMPLETED_SUCCESS", "COMPLETED")
    except AssertionError:
        raise AssertionError(stack.logs()) from None

    runs = stack_instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
    assert runs and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
    records = stack_instance.fetch_materializations(dg.AssetKey("notification_queue"), limit=100).records
    partitions = {r.partition_key for r in records if r.run_id in {run.run_id for run in runs}}
    assert partitions == {"005", "009"}
    after = stack.built_at()
    for chunk in (5, 9):
        device = device_in_chunk(chunk, "built")
        assert after[device] > before[device]
