import ast
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reminders_pipeline.domain.times import ISO_PATTERN, Instant

PACKAGE = Path(__file__).resolve().parents[1] / "reminders_pipeline"


def test_format_matches_javascript_to_iso_string():
    assert Instant.from_unix(1789029000).stored == "2026-09-10T08:30:00.000Z"
    assert Instant.from_unix(0).stored == "1970-01-01T00:00:00.000Z"
    assert Instant.from_unix(1789029000.5).stored == "2026-09-10T08:30:00.500Z"
    assert ISO_PATTERN.match(Instant.now().stored)


@given(st.floats(min_value=0, max_value=253402300799, allow_nan=False))
def test_fixed_width_and_round_trip(seconds):
    when = Instant.from_unix(seconds)
    text = when.stored
    assert len(text) == 24 and text[10] == "T" and text.endswith("Z")
    assert Instant.from_stored(text) == when
    assert abs(when.unix - round(seconds * 1000) / 1000) < 1e-6


@given(st.integers(0, 253402300799999), st.integers(0, 253402300799999))
def test_text_order_is_chronological_order_including_milliseconds(a_ms, b_ms):
    a, b = Instant(a_ms), Instant(b_ms)
    assert (a.stored < b.stored) == (a_ms < b_ms) == (a < b)
    assert (a.stored == b.stored) == (a_ms == b_ms) == (a == b)


def test_sqlite_datetime_style_would_sort_wrong_which_is_why_t_matters():
    # SQLite's datetime() writes a space; ' ' < 'T' so a later instant would sort first.
    assert "2026-09-10 09:00:00" < "2026-09-10T08:00:00.000Z"


def test_out_of_range_is_refused():
    with pytest.raises(ValueError):
        Instant.from_unix(-1)
    with pytest.raises(ValueError):
        Instant.from_unix(253402300800)
    with pytest.raises(ValueError):
        Instant.from_stored("2026-09-10 08:30:00")
    with pytest.raises(ValueError):
        Instant.from_unix(253402300799) + 1


@pytest.mark.parametrize(
    "given_text, expected",
    [
        ("2026-09-10T08:30:00Z", "2026-09-10T08:30:00.000Z"),
        ("2026-09-10T10:30:00+02:00", "2026-09-10T08:30:00.000Z"),
        ("2026-09-10T08:30:00.250Z", "2026-09-10T08:30:00.250Z"),
        ("1789029000", "2026-09-10T08:30:00.000Z"),
    ],
)
def test_parse(given_text, expected):
    assert Instant.parse(given_text).stored == expected


@pytest.mark.parametrize("bad", ["2026-09-10T08:30:00", "tomorrow", "", "2026-13-01T00:00:00Z"])
def test_parse_refuses(bad):
    with pytest.raises(ValueError):
        Instant.parse(bad)


def test_seconds_move_an_instant_and_two_instants_differ_by_seconds():
    at = Instant.from_stored("2026-09-10T08:30:00.000Z")
    assert (at - 3600).stored == "2026-09-10T07:30:00.000Z"
    assert (at + 0.25).stored == "2026-09-10T08:30:00.250Z"
    assert Instant.from_stored("2026-09-10T08:30:01.001Z") - at == 1.001


def test_an_instant_is_immutable_and_never_equal_to_its_text():
    at = Instant.from_stored("2026-09-10T08:30:00.000Z")
    with pytest.raises(AttributeError):
        at.ms = 0  # type: ignore[misc]
    assert at != "2026-09-10T08:30:00.000Z"
    assert {at: 1}[Instant.from_unix(at.unix)] == 1


def test_the_clock_never_runs_ahead():
    import time

    before = time.time()
    now = Instant.now()
    assert now.unix <= time.time() and now.unix >= before - 0.001
    assert Instant.floor(1.9999).stored == "1970-01-01T00:00:01.999Z"


def _code_strings_and_names(tree: ast.AST) -> list[tuple[int, str]]:
    """String literals (docstrings excluded) and dotted names: where SQL or ``func.now`` could hide."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Attribute) and re.fullmatch(r"[\w.]+", ast.unparse(node)):
            found.append((node.lineno, ast.unparse(node) + "("))
    return found


def test_no_sql_in_the_package_computes_a_stored_time():
    forbidden = re.compile(
        r"datetime\(|unixepoch\(|CURRENT_TIMESTAMP|\bnow\(\)|func\.now|func\.datetime|strftime\(\'|julianday\(", re.I
    )
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for lineno, text in _code_strings_and_names(ast.parse(path.read_text())):
            if forbidden.search(text):
                offenders.append(f"{path.relative_to(PACKAGE)}:{lineno}: {text}")
    assert offenders == []


def test_dst_does_not_touch_absolute_instants():
    # 2026-10-25 01:00 UTC is the EU DST end; a 1h lead across it stays exactly 3600 s.
    start = Instant.from_unix(datetime(2026, 10, 25, 1, 30, tzinfo=UTC).timestamp())
    assert start - (start - 3600) == 3600


def test_differences_are_exact_to_the_millisecond_across_days_and_years():
    at = Instant.from_stored
    assert at("2026-09-10T08:30:01.001Z") - at("2026-09-10T08:30:00.000Z") == 1.001
    assert at("2027-01-01T00:00:00.000Z") - at("2026-12-31T23:59:59.999Z") == 0.001
    assert at("2026-09-10T08:29:00.000Z") - at("2026-09-10T08:30:00.000Z") == -60
    a, b = at("1970-01-01T00:00:00.000Z"), at("2999-01-01T00:00:00.123Z")
    assert b - a == 32472144000.123
