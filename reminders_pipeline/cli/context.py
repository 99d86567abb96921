"""What every ``reminders`` command shares: the settings and ledger it runs against (``Ctx``,
refused with one line when either is not usable), its JSON output, the time option's type, and
progress on a terminal."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from reminders_pipeline.config import dev_run
from reminders_pipeline.config.settings import Settings, SettingsError
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database

T = TypeVar("T")


def emit(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def known(result: T | None, device_id: str) -> T:
    """A device command's result; None means there is no such device, a bad argument (exit 2)."""
    if result is None:
        raise click.BadParameter(f"no device {device_id!r}", param_hint="DEVICE_ID")
    return result


class When(click.ParamType):
    name = "TIME"

    def convert(self, value: Any, param: Any, ctx: Any) -> Instant:
        try:
            return Instant.parse(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Ctx:
    def __init__(self) -> None:
        env, dev_env = dev_run.with_dev_run(os.environ, Path.cwd())
        if dev_env is not None:
            click.echo(
                f"reminders: with the settings of `reminders dev` in {dev_env} (the environment overrides them)",
                err=True,
            )
        try:
            self.settings = Settings.from_env(env)
        except SettingsError as exc:
            raise click.UsageError(f"configuration: {exc}") from None
        self._db: Database | None = None

    @property
    def db(self) -> Database:
        """The ledger, refused with one line (exit 1) unless it is at this release's migration head."""
        db = self.unchecked_db
        try:
            migrate.require_head(db)
        except migrate.SchemaNotCurrent as exc:
            raise click.ClickException(str(exc)) from None
        return db

    @property
    def unchecked_db(self) -> Database:
        """The ledger's engine (one per process), made on first use, at whatever revision it is."""
        if self._db is None:
            self._db = Database.for_settings(self.settings)
        return self._db


Progress = Callable[[int, "int | None"], None]


@contextmanager
def progress(label: str, unit: str) -> Iterator[Progress | None]:
    """A counter rewritten in place on stderr while the core works, only when stderr is a terminal:
    stdout stays exactly one JSON summary, and logs or pipes get no control characters."""
    if not sys.stderr.isatty():
        yield None
        return
    shown = False

    def show(done: int, total: int | None) -> None:
        nonlocal shown
        shown = True
        counted = f"{done}/{total}" if total is not None else str(done)
        click.echo(f"\r{label}: {counted} {unit}", err=True, nl=False)

    try:
        yield show
    finally:
        if shown:
            click.echo(err=True)


pass_ctx = click.make_pass_decorator(Ctx, ensure=True)
