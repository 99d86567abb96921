"""Items of a source feed: validation of the wire format (Unix seconds) item by item.

A malformed item is rejected with a reason and counted; the rest of the feed still counts. Items
keep the wire's seconds (they are cached as the feed read them); ``Item.starts`` and
``Item.expires`` are where their times enter the core as instants.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from reminders_pipeline.domain.times import MAX_UNIX, Instant
from reminders_pipeline.domain.zones import Zone

MAX_ID_LENGTH = 256
MAX_TITLE_LENGTH = 256
MAX_BODY_LENGTH = 2048
MIN_PLAUSIBLE_UNIX = 946684800  # 2000-01-01: anything earlier is a unit or epoch mistake


@dataclass(frozen=True)
class Item:
    id: str
    title: str
    body: str | None
    starts_at: int  # Unix seconds
    expires_at: int  # Unix seconds, at least starts_at + 1
    floating: bool = False  # local wall time read as UTC (iCalendar floating/all-day): resolved per device
    all_day: bool = False  # an iCalendar DATE: day rules apply, not lead rules
    tail_seconds: int = 0  # floating only: the exact (hours, minutes, seconds) part of a DURATION, in expires_at
    alarms: tuple[str, ...] = ()  # the calendar's own alarms as rule names (VALARM), for devices that use them
    declined: tuple[str, ...] = ()  # ``address_digest`` of each attendee that declined (``PARTSTAT=DECLINED``), sorted
    travel_seconds: int = 0  # the calendar's travel time to it (``X-APPLE-TRAVEL-DURATION``): a ``leave`` reminder

    def declined_by(self, addresses: frozenset[str]) -> bool:
        """Whether one of a device's attendee addresses (as ``address_digest``) declined this invitation."""
        return bool(addresses) and not addresses.isdisjoint(self.declined)

    @property
    def starts(self) -> Instant:
        """The start as an instant; an item fixed in time only (``for_local`` fixes a floating one)."""
        return Instant.from_unix(self._fixed(self.starts_at))

    @property
    def expires(self) -> Instant:
        """The end as an instant, like ``starts``."""
        return Instant.from_unix(self._fixed(self.expires_at))

    def _fixed(self, seconds: int) -> int:
        if self.floating:
            raise ValueError(f"item {self.id!r} is floating: its times are wall times until a zone fixes them")
        return seconds

    def for_local(self, zone: Zone) -> Item:
        """Fixed to a device's zone (IANA zone, else offset, else UTC); a fixed item is unchanged.

        A DURATION's days were added to the wall time (nominal, RFC 5545); its exact part is added
        to the resolved instant, so an event across a DST change lasts what it says.
        """
        if not self.floating:
            return self
        starts = zone.to_unix(self.starts_at)
        expires = max(zone.to_unix(self.expires_at - self.tail_seconds) + self.tail_seconds, starts + 1)
        return replace(self, starts_at=starts, expires_at=expires, floating=False, tail_seconds=0)

    def to_json(self) -> list[Any]:
        return [
            self.id,
            self.title,
            self.body,
            self.starts_at,
            self.expires_at,
            self.floating,
            self.all_day,
            self.tail_seconds,
            list(self.alarms),
            list(self.declined),
            self.travel_seconds,
        ]

    @classmethod
    def from_json(cls, data: list[Any]) -> Item:
        return cls(*data[:8], *(tuple(marks) for marks in data[8:10]), *data[10:11])


ASIDE_CAPS = 10  # past the cap, items are set aside whole (calendars: counted at all) up to this many caps


@dataclass
class ParsedFeed:
    items: list[Item] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)
    _ids: set[str] = field(default_factory=set, repr=False, compare=False)
    # Items the feed holds but does not carry, whose pending rows are not voided ``left_feed``:
    # those the item cap cut (by id), those of a rejected calendar series (by UID, see
    # ``series_key``), and, where counting past the cap stopped, every item starting from then.
    cut_ids: set[str] = field(default_factory=set)
    partial_series: set[str] = field(default_factory=set)
    cut_from: int | None = None
    aside: list[Item] = field(default_factory=list)  # the cut items read whole: they re-time rows, never add any
    # Where the cap cut anything: the first instant a kept item stops counting under it (over, or
    # for a calendar's floating item 14 h after its wall-time end). From then a cut item may belong
    # among the soonest, so the feed is read and parsed again, never reused on 304.
    cap_until: int | None = None
    # Unix seconds the read's window started at: a calendar expands no occurrence before it, and
    # the cap counts none over by then. A read for an earlier window cannot reuse this parse.
    read_from: int | None = None
    # Set only on a newer build's parse planned by an older, overlapping build whose window starts
    # earlier (``reader.SourceReader.stored_reads``): an item starting before it may be in the
    # source unseen. Never stored.
    held_before: int | None = field(default=None, compare=False)

    _aside_index: dict[str, Item] | None = field(default=None, repr=False, compare=False)

    def add(self, raw: Any, marks: Mapping[str, Any] | None = None) -> None:
        """Validate one wire-format item: keep it, or count why it was rejected (duplicates too).
        ``marks``: what a calendar states of it beyond the wire format (``checked_item``). The cap
        is applied by the caller (``keep_soonest``, or a calendar's expansion)."""
        checked = checked_item(raw, marks or {})
        if isinstance(checked, str):
            self.rejected[checked] += 1
        elif checked.id in self._ids:
            self.rejected["duplicate_id"] += 1
        else:
            self._ids.add(checked.id)
            self.items.append(checked)

    def set_aside(self, item: Item | None, item_id: str) -> None:
        """An item the cap cut: counted, its id kept, and, when it was read whole, the item itself
        in ``aside``, which only brings rows already queued for it in line (never queues anew)."""
        self.rejected["over_item_cap"] += 1
        self.cut_ids.add(item_id)
        if item is not None:
            self.aside.append(item)

    def keep_soonest(self, max_items: int | None, now: int | None) -> None:
        """The cap, applied to a whole feed in any order: items over by ``now`` are kept and not
        counted (they make no rows), and of the rest the ``max_items`` soonest stay."""
        future = sorted((i for i in self.items if now is None or i.expires_at > now), key=lambda i: (i.starts_at, i.id))
        if max_items is None or len(future) <= max_items:
            return
        cut = future[max_items:]
        dropped = {i.id for i in cut}
        self.items = [i for i in self.items if i.id not in dropped]
        self._ids -= dropped
        for n, item in enumerate(cut):  # set aside whole as far as a calendar's cut is built; past that, by id
            self.set_aside(item if n < max_items * ASIDE_CAPS else None, item.id)
        self.cap_until = min(i.expires_at for i in future[:max_items])

    @property
    def whole(self) -> bool:
        """Nothing left out: neither the item cap nor a dropped series, so an absent item is not in
        the source, or for a calendar not within the window expanded (and the same content gives
        the same items, ``plan_key.plan_key``)."""
        return not (self.cut_ids or self.partial_series or self.cut_from is not None or self.held_before is not None)

    def changed_since(self, before: ParsedFeed) -> frozenset[str] | None:
        """The ids of the items that differ from an earlier parse of the source: added, gone, or
        changed in any field. None when either parse left something out: an absent item may then
        be only unseen, which the whole feed's plan decides (``queued.void_reason``)."""
        if not (self.whole and before.whole):
            return None
        now = {i.id: i for i in self.items}
        then = {i.id: i for i in before.items}
        return frozenset(i for i in now.keys() | then.keys() if now.get(i) != then.get(i))

    def set_aside_item(self, item_id: str) -> Item | None:
        """An item the cap set aside, by id (the index is built once, on first use)."""
        if self._aside_index is None:
            self._aside_index = {i.id: i for i in self.aside}
        return self._aside_index.get(item_id)

    def holds(self, item_id: str, starts_at: int) -> bool:
        """Whether an item absent from ``items`` may still be in the source: cut by the cap, in a
        rejected series, or past where counting stopped. Any other absent item left the feed."""
        return (
            item_id in self.cut_ids
            or series_key(item_id) in self.partial_series
            or (self.cut_from is not None and starts_at >= self.cut_from)
            or (self.held_before is not None and starts_at < self.held_before)
        )

    def with_earlier(self, own: ParsedFeed) -> ParsedFeed:
        """This parse, which holds what starts before ``held_before``, with the items of an earlier
        window's parse (``own``) that start before then: a build for an earlier ``now`` plans those
        from its own read, and the rest from this newer one."""
        if self.held_before is None:
            return self
        ids = {i.id for i in self.items}
        early = [i for i in own.items if i.starts_at < self.held_before and i.id not in ids]
        return replace(self, items=[*early, *self.items], _ids=ids | {i.id for i in early})

    def to_json(self) -> str:
        """The cache kept beside a source's ETag, reused on 304 without parsing."""
        doc: dict[str, Any] = {"items": [i.to_json() for i in self.items], "rejected": dict(self.rejected)}
        if self.cut_from is not None:
            doc["cut_from"] = self.cut_from
        if self.cut_ids:
            doc["cut_ids"] = sorted(self.cut_ids)
        if self.cap_until is not None:
            doc["cap_until"] = self.cap_until
        if self.aside:
            doc["aside"] = [i.to_json() for i in self.aside]
        if self.partial_series:
            doc["partial_series"] = sorted(self.partial_series)
        if self.read_from is not None:
            doc["read_from"] = self.read_from
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ParsedFeed:
        doc = json.loads(text)
        return cls(
            [Item.from_json(i) for i in doc["items"]],
            Counter(doc["rejected"]),
            cut_ids=set(doc.get("cut_ids", ())),
            partial_series=set(doc.get("partial_series", ())),
            cut_from=doc.get("cut_from"),
            cap_until=doc.get("cap_until"),
            aside=[Item.from_json(i) for i in doc.get("aside", ())],
            read_from=doc.get("read_from"),
        )


def checked_item(raw: Any, marks: Mapping[str, Any]) -> Item | str:
    """A wire-format item validated and marked as its calendar states it (``marks``: ``Item``
    fields the wire format has not, as ``floating``, ``alarms``, ``declined``), or why it is rejected."""
    checked = validate_item(raw)
    if isinstance(checked, str) or not any(marks.values()):
        return checked
    return replace(checked, **marks)


MAX_ADDRESS_LENGTH = 254  # a mailbox (RFC 5321), without ``mailto:``
ADDRESS_TEXT_LENGTH = MAX_ADDRESS_LENGTH + len("mailto:")


def address_of(text: str) -> str:
    """A calendar user address compared as its mailbox: ``MAILTO:Ann@X.org`` is ``ann@x.org``."""
    text = text.strip().lower()
    return (text[7:] if text.startswith("mailto:") else text).strip()


def address_digest(address: str) -> str:
    """What an item keeps of a declined address (``Item.declined``) and a plan compares a device's
    against: 48 bits of its hash, so a calendar listing long addresses costs its cache little."""
    return hashlib.blake2b(address_of(address).encode(), digest_size=6).hexdigest()


def series_key(item_id: str) -> str:
    """The series an iCalendar occurrence id belongs to: its id is ``<series>/<original start>``
    (``ics_items._occurrence_id``). A JSON item's id has no series; its key matches no calendar UID."""
    return item_id.rsplit("/", 1)[0]


class FeedError(ValueError):
    """The whole feed is unusable (not JSON, no ``items`` list): the source read failed.

    The message is a short code (``not_json``, ``no_items``, ``not_icalendar``, ...) and nothing
    else: a parser's own message can quote the body, and what a source answered must never reach
    ``sources.last_error``, the feed route, summaries or alerts (the source may be an attacker's).
    """

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _unix(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def validate_item(raw: Any) -> Item | str:
    """An ``Item``, or the reason it is rejected."""
    if not isinstance(raw, dict):
        return "not_an_object"
    item_id, title, body = raw.get("id"), raw.get("title"), raw.get("body")
    if not isinstance(item_id, str) or not item_id.strip():
        return "missing_id"
    if len(item_id) > MAX_ID_LENGTH:
        return "id_too_long"
    if not isinstance(title, str) or not title.strip():
        return "missing_title"
    if len(title) > MAX_TITLE_LENGTH:
        return "title_too_long"
    if body is not None and not isinstance(body, str):
        return "bad_body"
    if isinstance(body, str) and len(body) > MAX_BODY_LENGTH:
        return "body_too_long"
    starts, expires = _unix(raw.get("startsAt")), _unix(raw.get("expiresAt"))
    if starts is None:
        return "bad_starts_at"
    if expires is None:
        return "bad_expires_at"
    if not (MIN_PLAUSIBLE_UNIX <= starts <= MAX_UNIX and MIN_PLAUSIBLE_UNIX <= expires <= MAX_UNIX):
        return "time_out_of_range"
    if expires < starts + 1:
        return "expires_not_after_start"
    return Item(item_id, title, body or None, starts, expires)


def parse_items(raw_items: Any, max_items: int | None = None, now: int | None = None) -> ParsedFeed:
    """Every item validated, then the cap: the ``max_items`` soonest of those not over by ``now``
    (Unix seconds; None: every item counts), whatever order the source lists them in."""
    if not isinstance(raw_items, list):
        raise FeedError("items_not_a_list")
    feed = ParsedFeed()
    for raw in raw_items:
        feed.add(raw)
    feed.keep_soonest(max_items, now)
    return feed


def parse_json_feed(body: bytes, max_items: int | None = None, now: int | None = None) -> ParsedFeed:
    """The JSON source protocol: ``{"items": [{"id", "title", "body"?, "startsAt", "expiresAt"}]}``."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise FeedError("not_json") from None
    if not isinstance(doc, dict) or "items" not in doc:
        raise FeedError("no_items")
    return parse_items(doc["items"], max_items, now)
