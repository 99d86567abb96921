import ast
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reminders_pipeline.times import ISO_PATTERN, iso_from_unix, now_utc, parse_when, shift, unix_from_iso

PACKAGE = Path(__file__).resolve().parents[1] / "reminders_pipeline"


def test_format_matches_javascript_to_iso_string():
    assert iso_from_unix(1789029000) == "2026-09-10T08:30:00.000Z"
    assert iso_from_unix(0) == "1970-01-01T00:00:00.000Z"
    assert iso_from_unix(1789029000.5) == "2026-09-10T08:30:00.500Z"
    assert ISO_PATTERN.match(now_utc())


@given(st.floats(min_value=0, max_value=253402300799, allow_nan=False))
def test_fixed_width_and_round_trip(seconds):
    text = iso_from_unix(seconds)
    assert len(text) == 24 and text[10] == "T" and text.endswith("Z")
    assert abs(unix_from_iso(text) - round(seconds * 1000) / 1000) < 1e-6


@given(st.integers(0, 253402300799999), st.integers(0, 253402300799999))
def test_text_order_is_chronological_order_including_milliseconds(a_ms, b_ms):
    a, b = iso_from_unix(a_ms / 1000), iso_from_unix(b_ms / 1000)
    assert (a < b) == (a_ms < b_ms)
    assert (a == b) == (a_ms == b_ms)


def test_sqlite_datetime_style_would_sort_wrong_which_is_why_t_matters():
    # SQLite's datetime() writes a space; ' ' < 'T' so a later instant would sort first.
    assert "2026-09-10 09:00:00" < "2026-09-10T08:00:00.000Z"


def test_out_of_range_is_refused():
    with pytest.raises(ValueError):
        iso_from_unix(-1)
    with pytest.raises(ValueError):
        iso_from_unix(253402300800)
    with pytest.raises(ValueError):
        unix_from_iso("2026-09-10 08:30:00")


@pytest.mark.parametrize(
    "given_text, expected",
    [
        ("2026-09-10T08:30:00Z", "2026-09-10T08:30:00.000Z"),
        ("2026-09-10T10:30:00+02:00", "2026-09-10T08:30:00.000Z"),
        ("2026-09-10T08:30:00.250Z", "2026-09-10T08:30:00.250Z"),
        ("1789029000", "2026-09-10T08:30:00.000Z"),
    ],
)
def test_parse_when(given_text, expected):
    assert parse_when(given_text) == expected


@pytest.mark.parametrize("bad", ["2026-09-10T08:30:00", "tomorrow", "", "2026-13-01T00:00:00Z"])
def test_parse_when_refuses(bad):
    with pytest.raises(ValueError):
        parse_when(bad)


def test_shift():
    assert shift("2026-09-10T08:30:00.000Z", -3600) == "2026-09-10T07:30:00.000Z"


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
    start = datetime(2026, 10, 25, 1, 30, tzinfo=UTC).timestamp()
    assert unix_from_iso(iso_from_unix(start)) - unix_from_iso(iso_from_unix(start - 3600)) == 3600


def test_seconds_between_is_exact_to_the_millisecond_across_days_and_years():
    from reminders_pipeline.times import seconds_between

    assert seconds_between("2026-09-10T08:30:00.000Z", "2026-09-10T08:30:01.001Z") == 1.001
    assert seconds_between("2026-12-31T23:59:59.999Z", "2027-01-01T00:00:00.000Z") == 0.001
    assert seconds_between("2026-09-10T08:30:00.000Z", "2026-09-10T08:29:00.000Z") == -60
    for a, b in [
        ("2026-03-29T00:59:59.500Z", "2026-03-29T01:00:00.250Z"),
        ("1970-01-01T00:00:00.000Z", "2999-01-01T00:00:00.123Z"),
    ]:
        assert seconds_between(a, b) == pytest.approx(unix_from_iso(b) - unix_from_iso(a), abs=1e-6)
