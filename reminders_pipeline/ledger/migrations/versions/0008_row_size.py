"""A smaller queue row: the sent payload kept only where the row cannot re-render it.

* ``notification_queue.sent_body``: the alert body as sent. With it, a settled row re-renders its
  whole payload (``notification.sent_payload``), so ``payload`` is stored only where the re-render
  would differ (a title cut to fit, another interruption level).
* ``fillfactor`` stays 85 on PostgreSQL. No claim or settlement is HOT (each changes ``status``,
  which the partial indexes' predicates read), yet 100 halved ``ledger.claim`` + ``settle``
  throughput in bench_ledger (new row versions no longer fit on their own page) for 80 bytes a row.

Rows settled before this revision keep their whole payloads until retention prunes them: folding
them here would rewrite the table inside the migration's transaction, holding its exclusive lock
(every claim, settlement and build waiting) for about an hour per 30 million rows. The new column
is catalog-only, so the upgrade takes no time whatever the queue holds. A downgrade writes
the payload back into every row that holds only its body.

Revision ID: 0008
Revises: 0007
"""

import json

import sqlalchemy as sa
from alembic import op

from reminders_pipeline.domain.notification import sent_payload
from reminders_pipeline.ledger.schema import IsoTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BATCH = 5000
ROW_COLUMNS = "id, device_id, item_id, rule, event_at, expires_at, title, body, payload, sent_body"


def _batches(conn: sa.Connection, where: str):  # type: ignore[no-untyped-def]
    """The queue rows matching ``where``, ``BATCH`` at a time in id order (a keyset walk)."""
    last = 0
    while True:
        rows = (
            conn.execute(
                sa.text(
                    f"SELECT {ROW_COLUMNS} FROM notification_queue WHERE {where} AND id > :last ORDER BY id LIMIT :n"
                ).columns(event_at=IsoTime, expires_at=IsoTime),  # read as instants, as sent_payload takes them
                {"last": last, "n": BATCH},
            )
            .mappings()
            .all()
        )
        if not rows:
            return
        last = rows[-1]["id"]
        yield rows


def upgrade() -> None:
    op.add_column("notification_queue", sa.Column("sent_body", sa.Text))


def _update(conn: sa.Connection, assignments: str, guard: str) -> sa.TextClause:
    """One UPDATE per batch, its rows (``id``, ``value``) in one JSON parameter as the ledger sends them."""
    if conn.dialect.name == "postgresql":
        rows = "SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS r(id bigint, value text)"
    else:
        rows = "SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.value') AS value FROM json_each(:rows)"
    return sa.text(
        f"UPDATE notification_queue AS q SET {assignments} FROM ({rows}) AS r WHERE q.id = r.id AND q.{guard}"
    )


def downgrade() -> None:
    conn = op.get_bind()
    unfold = _update(conn, "payload = r.value", "payload IS NULL")
    for rows in _batches(conn, "payload IS NULL AND sent_body IS NOT NULL"):
        conn.execute(unfold, {"rows": json.dumps([{"id": r["id"], "value": sent_payload(r)} for r in rows])})
    op.drop_column("notification_queue", "sent_body")
