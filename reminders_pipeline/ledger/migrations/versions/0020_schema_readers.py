"""``schema_readers``: the oldest release head that may still run against this schema.

A migration that only adds what older code neither reads nor must write (a table, a nullable
column, a column with a default, an index) says ``ADDITIVE = True``; ``migrate.upgrade`` then
records, after each upgrade, the oldest head from which every later migration is additive. A
release that finds the ledger at a revision it does not know accepts it when that head is one of
its own (``migrate.schema_problem``): during a rolling upgrade, or after a rollback of the code,
the older dispatcher keeps sending instead of refusing the ledger.

This revision is itself additive: a release at 0019 runs against it unchanged, but knows nothing of
the table, so it is releases from this one on that read it.

Revision ID: 0020
Revises: 0019
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

ADDITIVE = True


def upgrade() -> None:
    op.execute("CREATE TABLE schema_readers (oldest_head TEXT NOT NULL, PRIMARY KEY (oldest_head))")


def downgrade() -> None:
    op.execute("DROP TABLE schema_readers")
