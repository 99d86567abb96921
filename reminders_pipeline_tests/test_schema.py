"""The migrations build exactly the schema the code queries, and the schema defends the time format."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Text, insert, text, type_coerce
from sqlalchemy.exc import IntegrityError, StatementError

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import metadata, notification_queue

from .support import NOW


def test_migrations_match_the_table_definitions(db):
    with db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": False})
        diffs = compare_metadata(ctx, metadata)
    # Alembic cannot read partial-index predicates back from SQLite/PostgreSQL reliably; compare the rest.
    assert [d for d in diffs if not (isinstance(d, tuple) and d[0] in ("add_index", "remove_index"))] == []


def _queue_row(**over):
    row = dict(
        device_id="d",
        item_id="1:x",
        rule="lead:60",
        send_after=NOW,
        event_at=NOW,
        expires_at=NOW,
        title="t",
        status="pending",
        created_at=NOW,
        updated_at=NOW,
    )
    row.update(over)
    return row


def _stored(row: dict[str, Any]) -> dict[str, Any]:
    """A row for a raw statement of an older schema: each instant as its stored text."""
    return {k: v.stored if isinstance(v, Instant) else v for k, v in row.items()}


@pytest.mark.parametrize(
    "bad", ["2026-09-10 08:00:00.000Z", "2026-09-10T08:00:00Z", "2026-09-10T08:00:00.000+00:00", "1789000000"]
)
def test_a_time_in_any_other_shape_is_refused_by_the_database(db, bad):
    """Past the column type (which binds only instants), straight into the table: the CHECK refuses it."""
    with pytest.raises(IntegrityError):
        with db.write() as conn:
            conn.execute(insert(notification_queue).values(**_queue_row(send_after=type_coerce(bad, Text))))


def test_the_time_columns_bind_instants_only(db):
    with pytest.raises(StatementError, match="bound as an Instant"):
        with db.write() as conn:
            conn.execute(insert(notification_queue).values(**_queue_row(send_after=NOW.stored)))


def test_settled_rows_must_have_an_outcome(db):
    with pytest.raises(IntegrityError):
        with db.write() as conn:
            conn.execute(insert(notification_queue).values(**_queue_row(status="settled")))


def test_one_row_per_device_item_rule(db):
    with db.write() as conn:
        conn.execute(insert(notification_queue).values(**_queue_row()))
    with pytest.raises(IntegrityError):
        with db.write() as conn:
            conn.execute(insert(notification_queue).values(**_queue_row()))


def test_the_due_query_uses_the_partial_index(db):
    with db.write() as conn:
        conn.execute(insert(notification_queue), [_queue_row(item_id=f"1:{i}") for i in range(200)])
    with db.read() as conn:
        if db.dialect == "sqlite":
            plan = " ".join(
                str(r)
                for r in conn.exec_driver_sql(
                    "EXPLAIN QUERY PLAN SELECT id FROM notification_queue WHERE status = 'pending' AND send_after <= ? ORDER BY send_after, id",
                    (NOW.stored,),
                )
            )
        else:
            conn.execute(text("SET LOCAL enable_seqscan = off"))
            plan = " ".join(
                r[0]
                for r in conn.execute(
                    text(
                        "EXPLAIN SELECT id FROM notification_queue WHERE status = 'pending' AND send_after <= :now ORDER BY send_after, id"
                    ),
                    {"now": NOW.stored},
                )
            )
    assert "ix_queue_due" in plan


def test_time_columns_are_collate_c_on_postgresql(postgres_url):
    """SQLite compares text bytewise already; PostgreSQL must not use a locale's order."""
    db = Database(postgres_url)
    with db.read() as conn:
        collations = dict(
            conn.execute(
                text(
                    "SELECT column_name, collation_name FROM information_schema.columns "
                    "WHERE table_name = 'notification_queue' AND column_name IN ('send_after', 'claimed_at', 'event_at')"
                )
            ).all()
        )
    db.dispose()
    assert collations == {"send_after": "C", "claimed_at": "C", "event_at": "C"}


def test_migration_0007_keeps_rows_adds_device_columns_and_the_quiet_hours_outcome(db):
    """Down to 0004 and up again on a ledger with rows: nothing lost, defaults filled, the outcome
    CHECK widened (on SQLite by copying the table, whose partial due index must survive)."""
    from sqlalchemy import select, update

    from reminders_pipeline.ledger import migrate
    from reminders_pipeline.ledger.schema import devices

    device = dict(id="d", apns_token="ab" * 32, chunk=0, created_at=NOW, updated_at=NOW)
    try:
        migrate.downgrade(db, "0004")
        with db.write() as conn:
            conn.execute(
                text(
                    "INSERT INTO devices (id, apns_token, chunk, created_at, updated_at) "
                    "VALUES (:id, :apns_token, :chunk, :created_at, :updated_at)"
                ),
                _stored(device),
            )
            conn.execute(
                text(
                    "INSERT INTO notification_queue (device_id, item_id, rule, send_after, event_at, expires_at, title, status, created_at, updated_at) VALUES (:device_id, :item_id, :rule, :send_after, :event_at, :expires_at, :title, :status, :created_at, :updated_at)"
                ),
                _stored(_queue_row()),
            )
        with pytest.raises(IntegrityError):
            with db.write() as conn:
                conn.execute(text("UPDATE notification_queue SET status = 'settled', outcome = 'quiet_hours'"))
    finally:
        migrate.upgrade(db)
    with db.write() as conn:
        conn.execute(update(notification_queue).values(status="settled", outcome="quiet_hours"))
        assert conn.execute(select(devices.c.all_day_rules, devices.c.tz_name, devices.c.quiet_hours)).one() == (
            "day:0@09:00",
            None,
            None,
        )
        assert conn.execute(select(notification_queue.c.item_id, notification_queue.c.outcome)).all() == [
            ("1:x", "quiet_hours")
        ]
    test_the_due_query_uses_the_partial_index(db)


def test_upgrading_a_first_release_database_keeps_every_subscription(db_url):
    """0002 rebuilds ``sources`` on SQLite (copy, drop, rename): with foreign keys on, the drop
    cascaded and deleted every ``device_sources`` row. Migrations run with them off, checked after."""
    from sqlalchemy import text

    from reminders_pipeline.ledger import migrate
    from reminders_pipeline.ledger.db import Database

    db = Database(db_url)
    try:
        migrate.downgrade(db, "0001")
        now = "2026-11-30T10:00:00.000Z"
        with db.write() as conn:
            conn.execute(
                text(
                    "INSERT INTO devices (id, apns_token, chunk, created_at, updated_at) VALUES ('d', 'ab', 0, :n, :n)"
                ),
                {"n": now},
            )
            conn.execute(
                text("INSERT INTO sources (url, created_at) VALUES ('https://example.com/a.ics', :n)"), {"n": now}
            )
            conn.execute(text("INSERT INTO device_sources (device_id, source_id) SELECT 'd', id FROM sources"))
        migrate.upgrade(db)
        with db.read() as conn:
            assert conn.execute(text("SELECT count(*) FROM device_sources")).scalar() == 1
            assert migrate.current_revision(db) == migrate.head_revision()
    finally:
        with db.write() as conn:
            conn.execute(text("DELETE FROM device_sources"))
            conn.execute(text("DELETE FROM sources"))
            conn.execute(text("DELETE FROM devices"))
        migrate.upgrade(db)
        db.dispose()


def test_migration_0008_keeps_stored_payloads_and_a_downgrade_restores_new_rows_payloads(db):
    """Rows settled before 0008 keep their whole payloads (no rewrite of the table under the
    migration's lock; retention prunes them); rows settled after it store their body, and a
    downgrade writes their whole payload back."""
    from sqlalchemy import select, update

    from reminders_pipeline import ledger
    from reminders_pipeline.domain.notification import as_shown, compose, stored_payload
    from reminders_pipeline.ledger import migrate

    base = dict(
        _queue_row(),
        status="settled",
        outcome="sent",
        attempts=2,
        body=None,
        event_at=Instant.from_stored("2026-09-10T10:00:00.000Z"),
    )
    rows = [dict(base, item_id=f"1:{i}", title=f"Meeting {i}") for i in range(3)]
    device = {"target": "ab", "tz_name": "Europe/Berlin", "last_tz_offset_seconds": None}
    # As an earlier release sent them (``sent_format`` None): "Starts at 12:00", and another level.
    sent = base["event_at"] - 3600
    rows[0]["payload"] = stored_payload(compose({**rows[0], "id": 1, **device}, sent_format=None, now=sent))
    rows[1]["payload"] = stored_payload(compose({**rows[1], "id": 2, **device}, "active", sent_format=None, now=sent))
    rows[2]["payload"] = "{}"  # not a payload this release writes
    columns = ", ".join(rows[0])
    try:
        migrate.downgrade(db, "0007")
        with db.write() as conn:
            conn.execute(
                text(
                    f"INSERT INTO notification_queue (id, {columns}) VALUES "
                    f"(:id, {', '.join(':' + c for c in rows[0])})"
                ),
                [_stored(dict(r, id=i + 1)) for i, r in enumerate(rows)],
            )
    finally:
        migrate.upgrade(db)
    q = notification_queue
    with db.write() as conn:
        held = conn.execute(select(q.c.payload, q.c.sent_body, q.c.attempts).order_by(q.c.id)).all()
        shown = [as_shown(r)["payload"] for r in ledger.list_queue(conn)]
        # Row 1 as a settlement after 0008 records it: its body only.
        conn.execute(update(q).where(q.c.id == 1).values(payload=None, sent_body="Starts at 12:00"))
        assert [as_shown(r)["payload"] for r in ledger.list_queue(conn)] == shown
    assert [tuple(h) for h in held] == [(r["payload"], None, 2) for r in rows]
    assert shown == [r["payload"] for r in rows]
    try:
        migrate.downgrade(db, "0007")
        with db.read() as conn:
            assert conn.execute(text("SELECT payload FROM notification_queue ORDER BY id")).scalars().all() == shown
    finally:
        migrate.upgrade(db)


def test_migration_0011_keeps_a_drain_hold_as_the_rows_held_until(db):
    """A row the drain held to the end of quiet hours before 0011 (pending, outcome_detail
    quiet_hours, a not_before) keeps that end as its lateness base; a retry's backoff is no hold."""
    from reminders_pipeline.ledger import migrate

    end, backoff = Instant.from_stored("2026-09-11T07:30:00.000Z"), Instant.from_stored("2026-09-11T07:30:04.000Z")
    held = dict(_queue_row(item_id="1:held"), outcome_detail="quiet_hours", not_before=end)
    retried = dict(_queue_row(item_id="1:retried"), outcome_detail="InternalServerError", not_before=backoff)
    try:
        migrate.downgrade(db, "0010")
        with db.write() as conn:
            conn.execute(insert(notification_queue).values([held, retried]))
    finally:
        migrate.upgrade(db)
    with db.read() as conn:
        got = conn.execute(text("SELECT item_id, held_until FROM notification_queue ORDER BY item_id")).all()
    assert [tuple(r) for r in got] == [("1:held", end.stored), ("1:retried", None)]


def test_an_upgrade_behind_a_held_transaction_holds_up_no_claim(postgres_url):
    """Issue 20: a transaction left open on the queue while ``reminders db upgrade`` runs. Each
    attempt waits at most its lock timeout (0.2 s) for the ALTER's lock, so writes to the queue,
    which queue behind that request, finish within about that too, never for the transaction's
    3 s (a033bef had no lock timeout: every claim waited until the holder ended). Out of attempts,
    the upgrade fails with one clear line and has changed nothing; once the holder ends it completes."""
    import time

    from reminders_pipeline.ledger import migrate

    db = Database(postgres_url)
    try:
        migrate.downgrade(db, "0010")
        holder = db.engine.connect()
        held = holder.begin()
        holder.execute(text("SELECT count(*) FROM notification_queue"))  # ACCESS SHARE until it ends
        upgrading, outcome = _upgrading(db, lock_timeout=0.2, attempts=4)
        waits = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            started = time.monotonic()
            with db.engine.begin() as conn:  # a claim's lock: ROW EXCLUSIVE on the queue
                conn.execute(text("UPDATE notification_queue SET updated_at = updated_at WHERE id = -1"))
            waits.append(time.monotonic() - started)
            time.sleep(0.05)
        upgrading.join(timeout=30)
        held.rollback()
        holder.close()
        (error,) = outcome
        assert isinstance(error, migrate.MigrationBlocked) and "could not take a table lock" in str(error)
        assert migrate.current_revision(db) == "0010"
        assert len(waits) > 10 and max(waits) < 1.5, waits
        migrate.upgrade(db, lock_timeout=0.2, attempts=4)
        assert migrate.current_revision(db) == migrate.head_revision()
    finally:
        migrate.upgrade(db)
        db.dispose()


def _pg_state(db: Database) -> tuple[list[str], dict[str, bool]]:
    """The CHECKs not yet validated, and every index's validity."""
    with db.engine.connect() as conn:
        unchecked = (
            conn.execute(text("SELECT conname FROM pg_constraint WHERE NOT convalidated ORDER BY 1")).scalars().all()
        )
        valid = dict(
            conn.execute(
                text(
                    "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE c.relnamespace = current_schema()::regnamespace"
                )
            ).all()
        )
    return list(unchecked), valid


def test_a_new_check_is_validated_after_its_migration_commits_not_under_its_lock(postgres_url):
    """Issue 20: 0007 replaces the queue's outcome CHECK. PostgreSQL validates an inline CHECK by
    reading every row under the ALTER's ACCESS EXCLUSIVE lock; here it is added NOT VALID and
    validated afterwards, under a lock no claim waits for. A row that breaks it shows the order:
    0007 commits, its validation stops the upgrade with one line naming the rows, and once they are
    corrected the upgrade completes with every CHECK validated."""
    from reminders_pipeline.ledger import migrate

    db = Database(postgres_url)
    try:
        migrate.downgrade(db, "0005")
        with db.engine.begin() as conn:
            conn.execute(
                text(  # a row the new CHECK refuses, let in by a looser one of the same name
                    "ALTER TABLE notification_queue DROP CONSTRAINT ck_queue_outcome, ADD CONSTRAINT ck_queue_outcome CHECK (true)"
                )
            )
            conn.execute(
                insert(notification_queue).values(**_queue_row(item_id="1:odd", status="settled", outcome="bogus"))
            )
        with pytest.raises(migrate.MigrationBlocked) as blocked:
            migrate.upgrade(db)
        assert "VALIDATE CONSTRAINT ck_queue_outcome" in str(blocked.value) and "correct those rows" in str(
            blocked.value
        )
        assert "\n" not in str(blocked.value)
        assert migrate.current_revision(db) == "0007"
        assert _pg_state(db)[0] == ["ck_queue_outcome"]
        with db.engine.begin() as conn:
            with pytest.raises(IntegrityError):  # NOT VALID still checks every new write
                conn.execute(
                    insert(notification_queue).values(**_queue_row(item_id="1:new", status="settled", outcome="bogus"))
                )
        with db.engine.begin() as conn:
            conn.execute(text("UPDATE notification_queue SET outcome = 'failed' WHERE outcome = 'bogus'"))
        migrate.upgrade(db)
        assert migrate.current_revision(db) == migrate.head_revision()
        unchecked, valid = _pg_state(db)
        assert unchecked == [] and all(valid.values())
        with db.engine.begin() as conn:
            conn.execute(text("DELETE FROM notification_queue"))
    finally:
        migrate.upgrade(db)
        db.dispose()


def test_the_not_before_index_is_built_concurrently_beside_claims_and_rebuilt_if_left_invalid(
    postgres_url, monkeypatch
):
    """Issue 20: 0010's partial index is built CONCURRENTLY after 0010 commits. A transaction that
    holds a snapshot (no lock on the queue) makes the build wait; claims go on meanwhile. With the
    wait bounded at 1 s the upgrade stops with one line and leaves the index invalid, as an
    interrupted build does; the next upgrade drops and builds it again, then applies 0011."""
    import time

    from reminders_pipeline.ledger import migrate

    db = Database(postgres_url)
    monkeypatch.setattr(migrate, "FINISH_WAIT_SECONDS", 1.0)
    try:
        migrate.downgrade(db, "0009")
        assert "ix_queue_not_before" not in _pg_state(db)[1]
        holder = db.engine.connect().execution_options(isolation_level="REPEATABLE READ")
        held = holder.begin()
        holder.execute(text("SELECT 1"))  # a snapshot that an index build must outwait
        upgrading, outcome = _upgrading(db)
        waits = []
        while upgrading.is_alive():
            started = time.monotonic()
            with db.engine.begin() as conn:
                conn.execute(text("UPDATE notification_queue SET updated_at = updated_at WHERE id = -1"))
            waits.append(time.monotonic() - started)
            time.sleep(0.02)
        held.rollback()
        holder.close()
        (error,) = outcome
        assert isinstance(error, migrate.MigrationBlocked), error
        assert "CREATE INDEX CONCURRENTLY ix_queue_not_before" in str(error) and "claims were not held up" in str(error)
        assert migrate.current_revision(db) == "0010"
        assert _pg_state(db)[1]["ix_queue_not_before"] is False
        assert len(waits) > 5 and max(waits) < 0.5, waits
        migrate.upgrade(db)
        assert migrate.current_revision(db) == migrate.head_revision()
        unchecked, valid = _pg_state(db)
        assert unchecked == [] and valid["ix_queue_not_before"] is True
    finally:
        migrate.upgrade(db)
        db.dispose()


def test_an_upgrade_builds_every_index_the_schema_declares(db):
    """The migrations (and, on PostgreSQL, the concurrent builds after them) leave exactly the
    schema's indexes: compare_metadata cannot read partial predicates back, so names are compared."""
    from sqlalchemy import inspect

    declared = {(t.name, i.name) for t in metadata.sorted_tables for i in t.indexes}
    inspector = inspect(db.engine)
    built = {
        (t.name, i["name"])
        for t in metadata.sorted_tables
        for i in inspector.get_indexes(t.name)
        if not i.get("duplicates_constraint")
    }
    assert declared == built


def test_two_upgrades_at_once_wait_for_each_other_and_both_succeed(postgres_url):
    """Three `reminders db upgrade` processes side by side (a deploy job retried while the first
    runs): each waits for the advisory lock of the one before, then finds the database further on.
    Without it, one adds a column another already added, or drops the index another is building."""
    import os
    import subprocess
    import sys

    from reminders_pipeline.ledger import migrate

    db = Database(postgres_url)
    try:
        migrate.downgrade(db, "0005")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")}
        env["REMINDERS_DATABASE_URL"] = postgres_url
        runs = [
            subprocess.Popen(
                [sys.executable, "-m", "reminders_pipeline.cli", "db", "upgrade"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        results = [(r.wait(120), r.stderr.read()) for r in runs]  # type: ignore[union-attr]
        assert [code for code, _ in results] == [0, 0, 0], results
        assert migrate.current_revision(db) == migrate.head_revision()
        unchecked, valid = _pg_state(db)
        assert unchecked == [] and all(valid.values())
    finally:
        migrate.upgrade(db)
        db.dispose()


def _upgrading(db: Database, **options: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    """``migrate.upgrade`` started in a thread; the list gets None or what it raised."""
    from reminders_pipeline.ledger import migrate

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            migrate.upgrade(db, **options)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - asserted by the caller
            outcome.append(exc)

    upgrading = threading.Thread(target=run)
    upgrading.start()
    return upgrading, outcome


def test_migration_0017_adds_acknowledged_and_a_downgrade_leaves_what_0016_reads(db):
    """Up: ``acknowledged`` is an outcome and a snooze names its origin, once (the SQLite CHECK
    by copying the table, its indexes kept). Down: snooze and agenda rows and agenda rules go, and
    an acknowledged row stays settled (``event_expired``), so the release before queues nothing again."""
    from sqlalchemy import select, update

    from reminders_pipeline.ledger import migrate
    from reminders_pipeline.ledger.schema import devices

    q = notification_queue
    device = dict(
        id="d", target="ab" * 32, chunk=0, created_at=NOW, updated_at=NOW, extra_rules="lead:600 agenda@07:00"
    )
    with db.write() as conn:
        conn.execute(insert(devices).values(**device))
        conn.execute(insert(q).values(**_queue_row(status="settled", outcome="sent")))
        conn.execute(insert(q).values(**_queue_row(rule="lead:30", status="settled", outcome="acknowledged")))
        conn.execute(insert(q).values(**_queue_row(rule="snooze:1", snoozed_from=1)))
        conn.execute(insert(q).values(**_queue_row(item_id="agenda:2026-09-10", rule="agenda")))
    with pytest.raises(IntegrityError):
        with db.write() as conn:
            conn.execute(insert(q).values(**_queue_row(rule="snooze:2", snoozed_from=1)))
    try:
        migrate.downgrade(db, "0016")
        with db.read() as conn:
            assert conn.execute(
                text("SELECT rule, outcome, outcome_detail FROM notification_queue ORDER BY id")
            ).all() == [
                ("lead:60", "sent", None),
                ("lead:30", "event_expired", "acknowledged"),
            ]
            assert conn.execute(text("SELECT extra_rules FROM devices")).scalar_one() == "lead:600"
        with pytest.raises(IntegrityError):
            with db.write() as conn:
                conn.execute(text("UPDATE notification_queue SET outcome = 'acknowledged' WHERE rule = 'lead:30'"))
    finally:
        migrate.upgrade(db)
    with db.write() as conn:
        conn.execute(update(q).where(q.c.rule == "lead:30").values(outcome="acknowledged"))
        assert conn.execute(select(q.c.rule, q.c.outcome).order_by(q.c.id)).all() == [
            ("lead:60", "sent"),
            ("lead:30", "acknowledged"),
        ]
    test_the_due_query_uses_the_partial_index(db)


def test_migration_0019_keeps_every_row_and_id_and_gives_no_id_twice(db):
    """Issue 38 finding 7: a ledger at 0018 with rows in every state, and its highest row pruned
    after a re-arm left its history. Upgraded, every row is as it was with its id, and new ids go
    on above the highest the ledger still names, the pruned row's included; a new row deleted
    never gives its id to the next (SQLite reused both without AUTOINCREMENT)."""
    from sqlalchemy import delete, select

    from reminders_pipeline.ledger import migrate
    from reminders_pipeline.ledger.schema import notification_history

    q, h = notification_queue, notification_history
    states = [
        dict(status="pending"),
        dict(status="pending", not_before=NOW, held_until=NOW, attempts=2),
        dict(status="claimed", claimed_by="drainer", claimed_at=NOW),
        *(dict(status="settled", outcome=o, settled_at=NOW) for o in ("sent", "failed", "voided", "acknowledged")),
        dict(rule="agenda", item_id="agenda:2026-09-10"),
    ]
    try:
        migrate.downgrade(db, "0018")
        with db.write() as conn:
            for n, state in enumerate(states):
                conn.execute(insert(q).values(**{**_queue_row(item_id=f"1:{n}"), **state}))
            sent = conn.execute(select(q.c.id).where(q.c.outcome == "sent")).scalar_one()
            conn.execute(insert(q).values(**_queue_row(item_id="1:0", rule="snooze:1", snoozed_from=sent)))
            pruned = conn.execute(
                insert(q).values(**_queue_row(item_id="1:gone", status="settled", outcome="sent", settled_at=NOW))
            ).inserted_primary_key[0]
            history = dict(queue_id=pruned, device_id="d", item_id="1:gone", rule="lead:60", send_after=NOW)
            conn.execute(insert(h).values(**history, outcome="sent", settled_at=NOW, rearmed_at=NOW))
            conn.execute(delete(q).where(q.c.id == pruned))
            kept = conn.execute(select(q).order_by(q.c.id)).all()
    finally:
        migrate.upgrade(db)
    with db.write() as conn:
        assert conn.execute(select(q).order_by(q.c.id)).all() == kept
        made = conn.execute(insert(q).values(**_queue_row(item_id="1:new"))).inserted_primary_key[0]
        conn.execute(delete(q).where(q.c.id == made))
        again = conn.execute(insert(q).values(**_queue_row(item_id="1:new"))).inserted_primary_key[0]
    assert len(kept) == len(states) + 1 and pruned > max(r.id for r in kept)
    assert pruned < made < again
    test_an_upgrade_builds_every_index_the_schema_declares(db)


@pytest.fixture
def sqlite_ledger(sqlite_template, tmp_path) -> str:
    """A migrated SQLite ledger file of its own (the lock tests are about SQLite's write lock)."""
    import shutil

    target = tmp_path / "ledger.sqlite3"
    shutil.copy(sqlite_template, target)
    return f"sqlite:///{target}"


def _writing(url: str):
    """Another process's write transaction on the ledger, as a dispatcher's heartbeat holds it:
    the write lock taken and a row written, uncommitted. ``commit()`` ends it."""
    import sqlite3

    from sqlalchemy.engine import make_url

    holder = sqlite3.connect(make_url(url).database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute(
        "INSERT INTO dispatchers (name, started_at, beat_at) VALUES ('other', ?, ?)", (NOW.stored, NOW.stored)
    )
    return holder


def test_a_sqlite_upgrade_waits_for_the_write_lock_and_says_so_once(sqlite_ledger, caplog):
    """Issue 38 finding 20: a dispatcher holds the write lock for about a second while the upgrade
    starts. The upgrade waits for it (each migration begins by taking the lock), says so in one
    line, and completes once it is free; a deferred transaction failed at once, "database is locked"."""
    import logging
    import time

    from reminders_pipeline.ledger import migrate

    db = Database(sqlite_ledger)
    try:
        migrate.downgrade(db, "0016")
        holder = _writing(sqlite_ledger)
        release = threading.Timer(1.0, holder.commit)
        release.start()
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="reminders_pipeline.ledger.migrate"):
            migrate.upgrade(db)
        waited = time.monotonic() - started
        release.join()
        holder.close()
        assert migrate.current_revision(db) == migrate.head_revision()
        assert 0.8 < waited < 10, waited
        lines = [r.getMessage() for r in caplog.records if "write lock" in r.getMessage()]
        assert lines == [
            f"waiting for the SQLite write lock held by another process (at most {migrate.SQLITE_LOCK_WAIT_SECONDS:.0f} s)"
        ]
    finally:
        db.dispose()


def test_a_sqlite_upgrade_behind_a_lock_never_released_stops_with_one_line(sqlite_ledger, monkeypatch):
    """Issue 38 finding 20: the holder never lets go. ``reminders db upgrade`` gives up after its
    bound (1 s here) with exit 1 and one line, no traceback, and the ledger stays where it was."""
    import time

    from click.testing import CliRunner

    from reminders_pipeline.cli import main
    from reminders_pipeline.ledger import migrate

    monkeypatch.setattr(migrate, "SQLITE_LOCK_WAIT_SECONDS", 1.0, raising=False)  # none before the fix
    db = Database(sqlite_ledger)
    try:
        migrate.downgrade(db, "0016")
        holder = _writing(sqlite_ledger)
        started = time.monotonic()
        result = CliRunner().invoke(main, ["db", "upgrade"], env={"REMINDERS_DATABASE_URL": sqlite_ledger})
        took = time.monotonic() - started
        holder.rollback()
        holder.close()
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert result.exit_code == 1 and result.stdout == ""
        assert result.stderr == (
            "Error: the SQLite write lock stayed held by another process for 1 s (a transaction left open, or "
            "another upgrade copying a large table); the database stays at revision 0016, run the upgrade "
            "again once it ends\n"
        )
        assert 0.9 < took < 10, took
        assert migrate.current_revision(db) == "0016"
    finally:
        db.dispose()


def test_migration_0021_renames_the_target_and_keeps_every_row(db):
    """A ledger at 0020 with a device and rows pending, claimed and settled: after the upgrade the
    device's token is its ``target``, every row is as it was, and no older head may run on."""
    from sqlalchemy import select

    from reminders_pipeline.ledger import migrate
    from reminders_pipeline.ledger.schema import devices

    def queue_rows(conn):
        return conn.execute(text("SELECT id, status, outcome, claimed_by FROM notification_queue ORDER BY id")).all()

    try:
        migrate.downgrade(db, "0020")
        with db.write() as conn:
            conn.execute(
                text(
                    "INSERT INTO devices (id, apns_token, provider, chunk, created_at, updated_at) "
                    "VALUES ('d', :token, 'apns', 0, :n, :n)"
                ),
                {"token": "ab" * 32, "n": NOW.stored},
            )
            for i, (status, outcome, claimed_by) in enumerate(
                [("pending", None, None), ("claimed", None, "run-1"), ("settled", "sent", None)]
            ):
                row = _queue_row(item_id=f"1:{i}", status=status, outcome=outcome, claimed_by=claimed_by)
                if status == "claimed":
                    row["claimed_at"] = NOW
                conn.execute(insert(notification_queue).values(**row))
            before = queue_rows(conn)
        migrate.upgrade(db)
        with db.read() as conn:
            assert conn.execute(select(devices.c.id, devices.c.target, devices.c.provider)).all() == [
                ("d", "ab" * 32, "apns")
            ]
            assert queue_rows(conn) == before
            assert conn.scalar(text("SELECT oldest_head FROM schema_readers")) == "0021"
    finally:
        migrate.upgrade(db)
