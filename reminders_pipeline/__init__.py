"""Reminders pipeline: a visible push alert a configurable time before each event in a device's feed.

The core (times, rules, schema, ledger, build, drain, policy) is plain Python on SQLAlchemy Core;
`defs/` (Dagster), the HTTP app and the CLI are thin shells over it.
"""
