"""An exception on any thread the model test (test_model.py) starts fails the test: a broken
promise found while another process acts must not end as a warning."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from reminders_pipeline.ledger.db import Database
from reminders_pipeline.sources import reader as sources_mod

from .model_support import JSON_URL, Aside
from .test_model import CURRENT, STARTS, PromiseBroken, ReminderMachine, model_settings

ROOT = Path(__file__).resolve().parent.parent


def test_what_a_function_run_aside_raises_is_raised_again() -> None:
    def breaks() -> None:
        raise PromiseBroken("DUPLICATE: found on the other thread")

    aside = Aside(breaks)
    aside.run()
    with pytest.raises(PromiseBroken, match="found on the other thread"):
        aside.reraise()


def test_a_promise_broken_while_a_drain_is_paused_fails_the_step(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build another process runs while a drain is paused past its claim's abandon threshold
    finds a broken promise: the paused drain step raises it, whatever the sender does with it."""
    monkeypatch.setattr(sources_mod, "GuardedTransport", CURRENT)
    db = Database(db_url)
    monkeypatch.setattr(ReminderMachine, "db", db, raising=False)
    monkeypatch.setattr(ReminderMachine, "settings", model_settings(db_url), raising=False)
    try:
        machine = ReminderMachine()
        machine.now = machine.clock_now = STARTS[0].unix
        machine.put("d0", 300, (), ("day:0@09:00",), None, None, False, (JSON_URL,), False, None, "apns")
        machine.add_event(False, "utc", 900, 90, 0, 1800, None, None, None)
        machine.build()
        machine.advance(600)

        def build() -> None:
            raise PromiseBroken("DUPLICATE: planted in the build another process runs")

        machine.build = build  # type: ignore[method-assign]
        with pytest.raises(PromiseBroken, match="planted"):
            machine.paused_drain(abandoned=True)
    finally:
        db.dispose()


INNER = """
import threading


def test_starts_a_thread_that_raises():
    def broken():
        raise AssertionError("DUPLICATE: lost on its thread")

    thread = threading.Thread(target=broken)
    thread.start()
    thread.join()
"""


def _ini(filters: list[str]) -> str:
    return "[pytest]\nfilterwarnings =\n" + "".join(f"    {f}\n" for f in filters)


def test_an_exception_left_on_any_thread_fails_the_test(pytester: pytest.Pytester) -> None:
    """Under the suite's own warning filters a test whose thread raised fails; without them the
    same test passes with a warning, which is what the filter is there for."""
    filters = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    pytester.makepyfile(test_inner=INNER)
    pytester.makeini(_ini([f for f in filters if "dagster" not in f]))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*lost on its thread*"])
    pytester.makeini(_ini(["default"]))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)
