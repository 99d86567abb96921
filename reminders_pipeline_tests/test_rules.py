import pytest

from reminders_pipeline.domain.rules import Rule, RuleError, device_rules, parse_rule
from reminders_pipeline.domain.times import Instant


@pytest.mark.parametrize(
    "text, rule",
    [
        ("lead:3600", Rule(3600, "start")),
        ("lead:0", Rule(0, "start")),
        ("lead:0@expiry", Rule(0, "expiry")),
        ("lead:90@expiry", Rule(90, "expiry")),
        ("lead:60@start", Rule(60, "start")),
        ("lead:1", Rule(1, "start")),
    ],
)
def test_parse(text, rule):
    assert parse_rule(text) == rule


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("lead:-5", "negative"),
        ("lead:1.5", "whole number"),
        ("lead:abc", "whole number"),
        ("lead:60@end", "unknown anchor"),
        ("remind:60", "unknown rule"),
        ("lead:", "whole number"),
        ("lead:99999999999", "longer than a year"),
    ],
)
def test_errors_say_why(text, fragment):
    with pytest.raises(RuleError, match=fragment):
        parse_rule(text)


def test_canonical_names_and_send_after():
    assert parse_rule("lead:60@start").name == "lead:60"
    assert Rule(0, "expiry").name == "lead:0@expiry"
    starts, expires = Instant.from_unix(10_000), Instant.from_unix(20_000)
    assert Rule(600).anchor_time(starts, expires) - 600 == Instant.from_unix(9_400)
    assert Rule(600, "expiry").anchor_time(starts, expires) == expires


def test_device_rules_include_the_lead_and_dedupe():
    assert [r.name for r in device_rules(3600, ["lead:0@expiry", "lead:3600", "lead:60@start"])] == [
        "lead:0@expiry",
        "lead:60",
        "lead:3600",
    ]
