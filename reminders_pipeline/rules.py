"""Reminder rules: ``lead:N`` (N seconds before the start) and ``lead:N@expiry`` (before expiresAt).

A rule names a policy, not a column: an expiry-anchored reminder extends the value rather than
adding a column, because ``UNIQUE(device_id, item_id, rule)`` is what lets distinct rules coexist
for one item.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Literal

Anchor = Literal["start", "expiry"]

_RULE = re.compile(r"^lead:(?P<lead>[^@]*)(?:@(?P<anchor>.*))?$")
MAX_LEAD_SECONDS = 366 * 86400


class RuleError(ValueError):
    """A rule string that cannot be used; the message says why."""


@dataclass(frozen=True, order=True)
class Rule:
    lead_seconds: int
    anchor: Anchor = "start"

    @property
    def name(self) -> str:
        """The canonical text stored in ``notification_queue.rule``."""
        suffix = "" if self.anchor == "start" else "@expiry"
        return f"lead:{self.lead_seconds}{suffix}"

    def anchor_unix(self, starts_at: int, expires_at: int) -> int:
        return starts_at if self.anchor == "start" else expires_at

    def send_after_unix(self, starts_at: int, expires_at: int) -> int:
        return self.anchor_unix(starts_at, expires_at) - self.lead_seconds

    def __str__(self) -> str:
        return self.name


def parse_rule(text: str) -> Rule:
    """Parse ``lead:N`` / ``lead:N@expiry`` / ``lead:N@start`` with an error that names the fault."""
    if not isinstance(text, str):
        raise RuleError(f"rule must be text like 'lead:3600', got {text!r}")
    match = _RULE.match(text.strip())
    if not match:
        raise RuleError(f"unknown rule {text!r}: expected 'lead:N' or 'lead:N@expiry'")
    lead_text, anchor = match.group("lead"), match.group("anchor")
    if not re.fullmatch(r"-?\d+", lead_text):
        raise RuleError(f"rule {text!r}: lead must be a whole number of seconds, got {lead_text!r}")
    lead = int(lead_text)
    if lead < 0:
        raise RuleError(f"rule {text!r}: lead must not be negative")
    if lead > MAX_LEAD_SECONDS:
        raise RuleError(f"rule {text!r}: lead is longer than a year")
    if anchor not in (None, "start", "expiry"):
        raise RuleError(f"rule {text!r}: unknown anchor {anchor!r} (use 'expiry' or leave it out)")
    return Rule(lead, "expiry" if anchor == "expiry" else "start")


def device_rules(reminder_lead_seconds: int, extra_rules: Iterable[str]) -> list[Rule]:
    """A device's rules: ``lead:<reminder_lead_seconds>`` plus its extra rules, deduplicated."""
    rules = {Rule(int(reminder_lead_seconds))}
    rules.update(parse_rule(r) for r in extra_rules)
    return sorted(rules)
