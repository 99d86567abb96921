"""The soak's oracle: what the providers' mocks received, judged against the feed history the drill wrote.

Nothing here reads the ledger's word on what was sent: deliveries are the mocks' own records.
The ledger is read only to account for a reminder that was *not* delivered on time (its outcome
and the reason it gives), which is the question the ledger exists to answer.

Terms, as ``bench/soak.py`` records them:

- a **delivery**: one request a mock accepted, with the device it was for, the payload's
  ``item_id``, ``rule`` and ``starts_at``, and when the mock received it;
- a source's **timeline**: every version of its feed, from the moment the drill made it current,
  and the first time the feed server served each version to a reader;
- an **action**: a Done or Snooze the drill's phone posted, with when the server answered it.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reminders_pipeline.domain.outcomes import ABANDONED

EVENT = re.compile(r"s(?P<source>\d+)-e(?P<event>\d+)")
IN_FLIGHT_SECONDS = 1.0  # a claim taken just before a Done is on its way: it reaches the mock within this


@dataclass(frozen=True)
class Delivery:
    device: str
    item_id: str
    rule: str
    starts_at: int
    row_id: int
    at: float
    provider: str

    @property
    def event(self) -> str:
        match = EVENT.search(self.item_id)
        return match.group(0) if match else self.item_id


@dataclass
class Timeline:
    """One source's versions: ``versions[k]`` maps event id to start (Unix seconds), current from
    ``since[k]``; ``served[k]`` is when a reader first got version ``k``."""

    versions: list[dict[str, int]] = field(default_factory=list)
    since: list[float] = field(default_factory=list)
    served: dict[int, float] = field(default_factory=dict)

    def state(self, event: str, at: float) -> int | None:
        """The event's start in the version current at ``at`` (None: not in the feed then)."""
        k = max((i for i, t in enumerate(self.since) if t <= at), default=0)
        return self.versions[k].get(event)

    def steady(self, event: str, start: float, end: float) -> int | None:
        """The event's start if no version current within [start, end] changed it, else None."""
        states = {self.state(event, start)} | {
            v.get(event) for v, t in zip(self.versions, self.since, strict=True) if start < t <= end
        }
        return states.pop() if len(states) == 1 else None

    def stale_since(self, event: str, starts_at: int) -> float | None:
        """When the first version newer than every version placing ``event`` at ``starts_at`` was
        served to a reader: from then on the ledger could know it had moved or gone."""
        holding = [k for k, v in enumerate(self.versions) if v.get(event) == starts_at]
        if not holding:
            return None
        newer = [t for k, t in self.served.items() if k > max(holding)]
        return min(newer, default=None)


@dataclass(frozen=True)
class Fault:
    kind: str  # kill, db_restart, provider_down, provider_slow
    target: str  # the process, "database", or the provider
    start: float
    end: float


@dataclass(frozen=True)
class Expected:
    device: str
    item_id_suffix: str  # the drill's event id; the ledger's item_id ends with it
    rule: str
    starts_at: int
    due: float
    provider: str


def lead_of(rule: str) -> int | None:
    match = re.fullmatch(r"lead:(\d+)", rule)
    return int(match.group(1)) if match else None


def spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"n": len(values), "p50": round(statistics.median(ordered), 3), "p99": round(p99, 3),
            "max": round(ordered[-1], 3)}  # fmt: skip


def duplicates(deliveries: list[Delivery], rearm_seconds: int) -> list[tuple[Delivery, Delivery]]:
    """Deliveries of one (device, item, rule) whose start lies closer than the re-arm threshold to
    the one delivered before it: one occurrence alerted twice. A move of at least the threshold
    from the last alert is another appointment, and its alert is due again."""
    by_key: dict[tuple[str, str, str], list[Delivery]] = defaultdict(list)
    for d in deliveries:
        by_key[(d.device, d.item_id, d.rule)].append(d)
    pairs = []
    for group in by_key.values():
        group.sort(key=lambda d: d.at)
        pairs += [(a, b) for a, b in zip(group, group[1:]) if abs(a.starts_at - b.starts_at) < rearm_seconds]
    return pairs


def done_on(dones: list[dict[str, Any]], device: str, event: str, starts_at: int, rearm: int) -> dict | None:
    """The first answered Done of this occurrence on this device: Done settles the reminders of
    the instant its alert showed and of any start within the re-arm threshold of it."""
    found = [
        a for a in dones if (a["device"], a["event"]) == (device, event) and abs(a["starts_at"] - starts_at) < rearm
    ]
    return min(found, key=lambda a: a["answered_at"], default=None)


def early(deliveries: Iterable[Delivery], snooze_until: Mapping[tuple[str, int], float]) -> list[Delivery]:
    """Deliveries received before their ``send_after``: start − lead, or the snooze's time."""
    out = []
    for d in deliveries:
        lead = lead_of(d.rule)
        due = d.starts_at - lead if lead is not None else snooze_until.get((d.device, d.row_id))
        if due is not None and d.at < due:
            out.append(d)
    return out


def stale(deliveries: Iterable[Delivery], timelines: Mapping[str, Timeline], source_of: Mapping[str, str],
          grace: float) -> list[tuple[Delivery, float]]:  # fmt: skip
    """Deliveries of a version the feed had replaced and served more than ``grace`` before: by then
    a build had read it (``grace`` is the longest a read takes to reach the ledger)."""
    out = []
    for d in deliveries:
        since = timelines[source_of[d.device]].stale_since(d.event, d.starts_at)
        if since is not None and d.at > since + grace:
            out.append((d, since))
    return out


def after_done(deliveries: Iterable[Delivery], dones: list[dict[str, Any]], rearm: int) -> list[tuple[Delivery, dict]]:
    """Deliveries of an occurrence, on the device that marked it Done, received after the Done was
    answered (a claim taken before it may still arrive within ``IN_FLIGHT_SECONDS``)."""
    out = []
    for d in deliveries:
        done = done_on(dones, d.device, d.event, d.starts_at, rearm)
        if done is not None and d.at > done["answered_at"] + IN_FLIGHT_SECONDS and d.row_id != done["row_id"]:
            out.append((d, done))
    return out


def excused(faults: list[Fault], provider: str, due: float, recover: float) -> Fault | None:
    """The fault that may make a reminder due at ``due`` late: the database or its provider out at
    that time, or within ``recover`` seconds before it."""
    for f in faults:
        hits = f.kind == "db_restart" or (f.kind.startswith("provider") and f.target == provider)
        if hits and f.start - 1 <= due <= f.end + recover:
            return f
    return None


def expected(devices: list[Mapping[str, Any]], timelines: Mapping[str, Timeline], window: tuple[float, float],
             grace: float, dones: list[dict[str, Any]], snoozes: list[dict[str, Any]], rearm: int) -> list[Expected]:  # fmt: skip
    """Every reminder the drill can say was owed: a rule's reminder due within ``window`` for an
    event whose start no edit touched in the ``grace`` before it was due (a build had read it), and
    each answered snooze. None after a Done on that occurrence."""

    def acked(device: str, event: str, start: int) -> float:
        done = done_on(dones, device, event, start, rearm)
        return float("inf") if done is None else done["answered_at"]

    out = []
    for dev in devices:
        line = timelines[dev["source"]]
        events = {e for v in line.versions for e in v}
        for event in events:
            for start in {v[event] for v in line.versions if event in v}:
                for rule in dev["rules"]:
                    due = start - (lead_of(rule) or 0)
                    if not window[0] <= due <= window[1] or line.steady(event, due - grace, due) != start:
                        continue
                    if acked(dev["id"], event, start) <= due:
                        continue
                    out.append(Expected(dev["id"], event, rule, start, due, dev["provider"]))
    source_of = {dev["id"]: dev["source"] for dev in devices}
    for s in snoozes:
        done = acked(s["device"], s["event"], s["starts_at"])
        # A pending snooze follows its event's moves and goes with it when it leaves the feed.
        start = timelines[source_of[s["device"]]].steady(s["event"], s["until"] - grace, s["until"])
        if start is not None and window[0] <= s["until"] <= window[1] and done > s["until"]:
            out.append(Expected(s["device"], s["event"], s["rule"], start, s["until"], s["provider"]))
    return out


def lost_with_claimer(row: Mapping[str, Any]) -> bool:
    """A row whose claimer died with it: failed by the abandoned sweep, or still claimed at the end."""
    return row["outcome_detail"] == ABANDONED or row["status"] == "claimed"


def held_until(faults: list[Fault], provider: str, due: float, recover: float) -> float | None:
    """When the outages around a reminder due at ``due`` let it go: the latest end, plus
    ``recover``, of its provider's outage or the database's crash that covers it. None when none
    does: a slow provider (2 s answers) holds nothing back for long."""
    ends = [
        f.end + recover
        for f in faults
        if (f.kind == "db_restart" or (f.kind == "provider_down" and f.target == provider))
        and f.start - 1 <= due <= f.end + recover
    ]
    return max(ends, default=None)


def versions_between(line: Timeline, start: float, end: float) -> list[Mapping[str, Any]]:
    """The feed versions made current from ``start`` to ``end``."""
    return [v for v, since in zip(line.versions, line.since) if start <= since <= end]


def changed_by(line: Timeline, e: Expected, until: float, rearm: int) -> bool:
    """The reminder's event left the feed, or moved by the re-arm threshold or more, in a version
    made current between its due time and ``until``."""
    return any(
        e.item_id_suffix not in v or abs(v[e.item_id_suffix] - e.starts_at) >= rearm
        for v in versions_between(line, e.due, until)
    )


def held_by_a_fault(row: Mapping[str, Any], e: Expected, until: float | None, line: Timeline, grace: float,
                    rearm: int, delivered: list[Delivery]) -> str | None:  # fmt: skip
    """Why a row an outage held settled unsent, if the outage explains it; else None. The hold
    outlasted the event's start (``event_started``), or the event was cancelled or moved during
    the hold, as the next read after it shows (``voided`` ``left_feed``; or the row re-armed for
    the new start: its ``event_at`` that far from the owed one, or, in records kept before rows
    had it, a delivery of the same key, which is the same row, for a start the move made)."""
    if until is None:
        return None
    if row["outcome"] == "event_started" and until >= e.starts_at:
        return "its event started during the hold"
    if not changed_by(line, e, until + grace, rearm):
        return None
    if row["outcome"] == "voided" and row["outcome_detail"] == "left_feed":
        return "its event cancelled or moved during the hold"
    if "event_at" in row:
        rearmed = abs(row["event_at"] - e.starts_at) >= rearm
    else:
        moved_to = {v.get(e.item_id_suffix) for v in versions_between(line, e.due, until + grace)}
        rearmed = any(d.starts_at in moved_to and abs(d.starts_at - e.starts_at) >= rearm for d in delivered)
    return "its event moved during the hold and the row was re-armed for it" if rearmed else None


def account(owed: list[Expected], deliveries: list[Delivery], rows: Mapping[tuple[str, str, str], Mapping[str, Any]],
            faults: list[Fault], bar: float, recover: float, rearm: int, timeline_of: Callable[[str], Timeline],
            grace: float) -> dict[str, Any]:  # fmt: skip
    """Each owed reminder: on time, late with the fault that excuses it, not sent with the ledger's
    outcome naming a fault, or unaccounted. ``rows`` is the ledger's row by (device, event, rule).
    An owed reminder is met by a delivery of a start within the re-arm threshold of its own: an
    event moved by less after its alert went is not alerted again."""
    sent: dict[tuple[str, str, str], list[Delivery]] = defaultdict(list)
    for d in sorted(deliveries, key=lambda d: d.at):
        sent[(d.device, d.event, d.rule)].append(d)
    late_all, late_clean = [], []
    counts: dict[str, int] = defaultdict(int)
    unaccounted, late_unexcused = [], []

    def until(e: Expected) -> float | None:
        return held_until(faults, e.provider, e.due, recover)

    for e in owed:
        near = [d for d in sent[(e.device, e.item_id_suffix, e.rule)] if abs(d.starts_at - e.starts_at) < rearm]
        d = near[0] if near else None
        fault = excused(faults, e.provider, e.due, recover)
        if d is not None:
            late = d.at - e.due
            late_all.append(late)
            if fault is None:
                late_clean.append(late)
            if late <= bar:
                counts["on_time"] += 1
            elif fault is not None:
                counts[f"late: {fault.kind} {fault.target}"] += 1
            else:
                late_unexcused.append({**e.__dict__, "late": round(late, 3)})
            continue
        row = rows.get((e.device, e.item_id_suffix, e.rule))
        outcome = f"{row['outcome'] or row['status']}:{row['outcome_detail'] or ''}" if row else "no row"
        if row and lost_with_claimer(row):
            counts["not sent: abandoned, or claimed by a killed claimer not yet swept"] += 1
        elif row and fault is not None and row["outcome"] == "failed":
            counts[f"not sent: {outcome} during {fault.kind} {fault.target}"] += 1
        elif row and (
            why := held_by_a_fault(
                row, e, until(e), timeline_of(e.device), grace, rearm, sent[(e.device, e.item_id_suffix, e.rule)]
            )
        ):
            counts[f"not sent: {outcome}, {why}"] += 1
        else:
            unaccounted.append({**e.__dict__, "ledger": outcome, "fault": fault and fault.kind})
    return {
        "owed": len(owed),
        "outcomes": dict(counts),
        "lateness_all_s": spread(late_all),
        "lateness_no_fault_s": spread(late_clean),
        "late_unexcused": late_unexcused,
        "unaccounted": unaccounted,
    }
