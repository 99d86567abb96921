"""What one build or one drain did, counted as it goes and merged across batches.

``as_dict()`` is the summary the CLI prints, Dagster records as metadata and the HTTP routes
answer, times in it as stored text; ``http/contract.py`` (``BuildSummary``, ``DrainSummary``)
declares the fields clients rely on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from reminders_pipeline.domain.times import Instant


@dataclass
class BuildResult:
    now: Instant
    devices_built: int = 0
    devices_skipped_newer: int = 0  # a build that started later already wrote them
    devices_unchanged: int = 0  # of those built, planned only where the horizon moved (``plan_key.plan_key``)
    devices_items_replanned: int = 0  # of those built, planned again only in the items their feeds changed
    rows_inserted: int = 0
    rows_updated: int = 0
    rows_voided: Counter[str] = field(default_factory=Counter)
    items_rejected: Counter[str] = field(default_factory=Counter)
    sources_read: int = 0
    sources_failed: list[dict[str, str]] = field(default_factory=list)
    sources_not_modified: int = 0
    sources_alerted: list[str] = field(default_factory=list)
    oldest_built_at: Instant | None = None
    duration_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **_fields_of(self),
            "rows_voided": dict(self.rows_voided),
            "items_rejected": dict(self.items_rejected),
            "duration_seconds": round(self.duration_seconds, 3),
        }


@dataclass
class DrainResult:
    now: Instant
    abandoned: int = 0
    due: int = 0
    claimed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    details: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)  # ``kind:outcome``: settled rows by rule kind
    providers: Counter[str] = field(default_factory=Counter)  # ``provider:outcome``: settled rows by provider
    lateness_seconds: list[float] = field(default_factory=list)
    tokens_invalidated: int = 0
    voided_by_token: int = 0
    halted: str | None = None  # the first halt's reason: a provider's configuration fault or outage
    halts: dict[str, str] = field(default_factory=dict)  # provider -> why its rows stopped being claimed
    returned_to_pending: int = 0  # certainly not delivered: pending again, one attempt more
    duration_seconds: float = 0.0

    def merge(self, other: DrainResult) -> DrainResult:
        self.abandoned += other.abandoned
        self.claimed += other.claimed
        self.outcomes.update(other.outcomes)
        self.details.update(other.details)
        self.kinds.update(other.kinds)
        self.providers.update(other.providers)
        self.lateness_seconds.extend(other.lateness_seconds)
        self.tokens_invalidated += other.tokens_invalidated
        self.voided_by_token += other.voided_by_token
        for provider, reason in other.halts.items():
            self.halt(provider, reason)
        self.returned_to_pending += other.returned_to_pending
        return self

    def halt(self, provider: str, reason: str) -> bool:
        """Stop claiming ``provider``'s rows (the other providers' go on); True if it is new."""
        if provider in self.halts:
            return False
        self.halts[provider] = reason
        self.halted = self.halted or reason
        return True

    def lateness_percentiles(self) -> dict[str, float | None]:
        values = sorted(self.lateness_seconds)
        if not values:
            return {"p50": None, "p95": None, "p99": None, "max": None}

        def pct(p: float) -> float:
            return round(values[min(len(values) - 1, int(p * len(values)))], 3)

        return {"p50": pct(0.50), "p95": pct(0.95), "p99": pct(0.99), "max": round(values[-1], 3)}

    def as_dict(self) -> dict[str, Any]:
        return {
            **_fields_of(self),
            "outcomes": dict(self.outcomes),
            "details": dict(self.details),
            "kinds": dict(self.kinds),
            "providers": dict(self.providers),
            "halts": dict(self.halts),
            "lateness_seconds": self.lateness_percentiles(),
            "duration_seconds": round(self.duration_seconds, 3),
        }


def _fields_of(result: BuildResult | DrainResult) -> dict[str, Any]:
    """A result's fields in declaration order (the order the summary's keys are printed in), an
    instant as its stored text."""
    values = {f.name: getattr(result, f.name) for f in fields(result)}
    return {k: v.stored if isinstance(v, Instant) else v for k, v in values.items()}
