"""Alembic environment: always driven programmatically by ``reminders_pipeline.ledger.migrate``."""

from alembic import context

from reminders_pipeline.ledger.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
