"""Canaries for the library internals that reminders_pipeline/providers/apns_transport.py patches or reads.

aioapns, h2 and hpack are pinned to exact versions in pyproject.toml because apns_transport.py
overrides their methods and reads their attributes. Each test here checks one such internal and,
when an upgrade changes it, fails with a message naming the library, its installed version and the
attribute, so the upgrade is a conscious re-check of the patch (its docstring says what each patch
answers) rather than a silent change of behaviour. Some canaries are the other way round: they
fail when upstream *fixes* a bug a patch works around, so the patch can go.

asyncio: ``StreamSlots`` uses only the public ``asyncio.Semaphore`` API, which a test keeps so.
dagster (pinned exactly): defs/monitoring.py reads a check's history through names 1.13 does not
export; a test watches them. hypercorn (pinned exactly): the test doubles' ``tls_loop.AsgiServer``
hands each accepted connection to hypercorn's own ``TCPServer``; a test watches its constructor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
import tomllib
from datetime import UTC, date, datetime, timedelta
from importlib.metadata import version
from pathlib import Path

import pytest
from aioapns import APNs
from aioapns.common import NotificationResult
from aioapns.connection import (
    APNsBaseClientProtocol,
    APNsBaseConnectionPool,
    APNsDevelopmentClientProtocol,
    APNsKeyConnectionPool,
    APNsProductionClientProtocol,
    H2Protocol,
)
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamReset
from hpack import HeaderTuple, NeverIndexedHeaderTuple

from reminders_pipeline.providers import apns_stream_slots
from reminders_pipeline.providers.apns_stream_slots import StreamSlots
from reminders_pipeline.providers.apns_transport import LiteralEncoder

ROOT = Path(__file__).resolve().parent.parent
PATCHED = ("aioapns", "h2", "hpack")


def pins() -> dict[str, str]:
    """``name==version`` pins from pyproject.toml's runtime dependencies."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = (re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;,\s]+)", d.strip()) for d in dependencies)
    return {m[1].lower(): m[2] for m in found if m}


def changed(library: str, attribute: str, expected: str) -> str:
    """The failure message: which library, which version, which attribute, and where to look."""
    return (
        f"{library} {version(library)} (pyproject.toml pins {pins().get(library, 'nothing')}): {attribute} "
        f"is no longer {expected}. reminders_pipeline/providers/apns_transport.py relies on it: re-check the patch its "
        f"docstring lists for it before moving the pin."
    )


def source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def params(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


# -- pins ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("library", PATCHED)
def test_each_patched_library_is_pinned_to_the_installed_version(library: str) -> None:
    pinned = pins().get(library)
    assert pinned is not None, (
        f"{library} {version(library)}: pyproject.toml must pin it exactly (==), apns_transport.py patches it"
    )
    assert version(library) == pinned, f"{library} {version(library)} is installed but pyproject.toml pins {pinned}"


def test_cryptography_signs_deterministically() -> None:
    """ProviderToken's "the same token in every process" needs RFC 6979 signing (cryptography 43+)."""
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        algorithm = ec.ECDSA(hashes.SHA256(), deterministic_signing=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is the message
        pytest.fail(f"cryptography {version('cryptography')}: ECDSA(deterministic_signing=True) fails: {exc!r}")
    assert key.sign(b"x", algorithm) == key.sign(b"x", algorithm), (
        f"cryptography {version('cryptography')}: deterministic_signing=True gave two signatures"
    )


# -- aioapns: what protocol_class subclasses and the sender reads -------------------------------------


def test_aioapns_protocol_constructor_takes_topic_loop_callback_and_auth_provider() -> None:
    """ReminderApnsProtocol.__init__ replaces the pool's per-connection auth provider by the shared token."""
    assert params(APNsBaseClientProtocol.__init__) == [
        "self",
        "apns_topic",
        "loop",
        "on_connection_lost",
        "auth_provider",
    ], changed(
        "aioapns",
        "APNsBaseClientProtocol.__init__'s signature",
        "(apns_topic, loop, on_connection_lost, auth_provider)",
    )
    create = source(APNsKeyConnectionPool.create_connection)
    assert "self.apns_topic" in create and "self.discard_connection" in create and "auth_provider," in create, changed(
        "aioapns",
        "APNsKeyConnectionPool.create_connection",
        "a partial(protocol_class, topic, loop, discard_connection, auth_provider)",
    )


def test_aioapns_protocol_instance_attributes_the_patches_use() -> None:
    loop = asyncio.new_event_loop()
    try:
        protocol = APNsBaseClientProtocol("com.example.reminders", loop=loop)
    finally:
        loop.close()
    expected = {
        "conn",
        "free_channels",
        "requests",
        "request_streams",
        "request_statuses",
        "inactivity_timer",
        "loop",
        "transport",
    }
    missing = expected - set(vars(protocol))
    assert not missing, changed(
        "aioapns", f"APNsBaseClientProtocol instance attributes {sorted(missing)}", "set by __init__"
    )
    assert isinstance(protocol.conn, H2Connection), changed(
        "aioapns", "APNsBaseClientProtocol.conn", "an h2 H2Connection"
    )


def test_aioapns_endpoint_and_idle_time_are_class_attributes() -> None:
    """Endpoint (patch 14) and CONNECTION_IDLE_SECONDS (patch 9) override class attributes."""
    for cls in (APNsProductionClientProtocol, APNsDevelopmentClientProtocol):
        assert isinstance(cls.APNS_SERVER, str) and isinstance(cls.APNS_PORT, int), changed(
            "aioapns", f"{cls.__name__}.APNS_SERVER/APNS_PORT", "class attributes"
        )
    assert "self.protocol_class.APNS_SERVER" in source(APNsKeyConnectionPool._create_connection), changed(
        "aioapns", "APNsKeyConnectionPool._create_connection", "connecting to protocol_class.APNS_SERVER/APNS_PORT"
    )
    assert "self.INACTIVITY_TIME" in source(APNsBaseClientProtocol.refresh_inactivity_timer), changed(
        "aioapns", "APNsBaseClientProtocol.refresh_inactivity_timer", "timed by INACTIVITY_TIME"
    )


def test_aioapns_pool_attributes_the_sender_sets_and_reads() -> None:
    init = source(APNsBaseConnectionPool.__init__)
    assert "self.protocol_class" in init and "self.connections" in init, changed(
        "aioapns", "APNsBaseConnectionPool.protocol_class/connections", "attributes set in __init__"
    )
    assert "self.pool" in source(APNs.__init__), changed("aioapns", "APNs.pool", "set in __init__")
    expected = [
        "key",
        "key_id",
        "team_id",
        "topic",
        "max_connections",
        "max_connection_attempts",
        "use_sandbox",
        "ssl_context",
        "err_func",
    ]
    missing = [p for p in expected if p not in params(APNs.__init__)]
    assert not missing, changed("aioapns", f"APNs.__init__ parameters {missing}", "accepted")


def test_aioapns_uses_only_the_stream_slot_interface_stream_slots_provides() -> None:
    """StreamSlots stands in for ChannelPool: aioapns must use nothing else on free_channels."""
    import aioapns.connection

    used = set(re.findall(r"free_channels\.(\w+)", source(aioapns.connection)))
    assert used == {"acquire", "release", "bound", "is_busy", "destroy"}, changed(
        "aioapns", f"the free_channels members used ({sorted(used)})", "acquire, release, bound, is_busy, destroy"
    )
    assert all(hasattr(StreamSlots, name) for name in used)


def test_aioapns_send_notification_order_the_wire_patches_rely_on() -> None:
    """WireH2Connection swaps apns-expiration in send_headers and the body in send_data, and marks a
    request written once its HEADERS are encoded; aioapns must acquire, send HEADERS, DATA, then flush."""
    body = source(APNsBaseClientProtocol.send_notification)
    steps = [
        "self.free_channels.acquire()",
        '("apns-id", request.notification_id)',
        "request.time_to_live",
        "self.conn.send_headers(",
        "self.conn.send_data(",
        "self.flush()",
        "self.requests[request.notification_id] =",
        "self.request_streams[stream_id] = request.notification_id",
    ]
    positions = [body.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), changed(
        "aioapns",
        "APNsBaseClientProtocol.send_notification",
        "acquire, headers (apns-id, TTL), send_headers, send_data, flush, then register the request",
    )


def test_aioapns_result_fields_the_answer_mapping_reads() -> None:
    assert NotificationResult.__slots__ == ("notification_id", "status", "description", "timestamp"), changed(
        "aioapns", "NotificationResult's fields", "(notification_id, status, description, timestamp)"
    )


def test_aioapns_still_ignores_flow_control_credit_and_resets() -> None:
    """The other way round: if aioapns returns flow-control credit or handles RST_STREAM itself,
    patches 5 and 6 would act twice: drop them."""
    assert "acknowledge_received_data" not in source(H2Protocol), changed(
        "aioapns", "H2Protocol", "silent on flow-control credit (patch 5 returns it; upstream PR Fatal1ty/aioapns#75)"
    )
    assert "StreamReset" not in source(H2Protocol.data_received), changed(
        "aioapns", "H2Protocol.data_received", "ignoring StreamReset (patch 6)"
    )


def test_aioapns_still_keeps_ended_streams_and_overrides_what_the_protocol_overrides() -> None:
    assert "request_streams" not in source(H2Protocol.on_stream_ended), changed(
        "aioapns", "H2Protocol.on_stream_ended", "keeping request_streams' entry (patch 8 drops it)"
    )
    overridden = (
        "send_notification",
        "flush",
        "close",
        "on_stream_ended",
        "connection_lost",
        "data_received",
        "on_connection_terminated",
    )
    missing = [name for name in overridden if not callable(getattr(APNsBaseClientProtocol, name, None))]
    assert not missing, changed(
        "aioapns", f"APNsBaseClientProtocol methods {missing}", "present (ReminderApnsProtocol overrides them)"
    )


# -- h2 -------------------------------------------------------------------------------------------


def test_h2_methods_wire_h2_connection_overrides() -> None:
    assert params(H2Connection.send_headers)[:3] == ["self", "stream_id", "headers"], changed(
        "h2", "H2Connection.send_headers", "(stream_id, headers, ...)"
    )
    assert params(H2Connection.send_data)[:3] == ["self", "stream_id", "data"], changed(
        "h2", "H2Connection.send_data", "(stream_id, data, ...)"
    )
    assert params(H2Connection.acknowledge_received_data)[:3] == ["self", "acknowledged_size", "stream_id"], changed(
        "h2", "H2Connection.acknowledge_received_data", "(acknowledged_size, stream_id)"
    )
    assert H2Connection.HIGHEST_ALLOWED_STREAM_ID == 2**31 - 1, changed(
        "h2", "H2Connection.HIGHEST_ALLOWED_STREAM_ID", "2**31 - 1"
    )
    connection = H2Connection()
    assert isinstance(connection.outbound_flow_control_window, int), changed(
        "h2", "H2Connection.outbound_flow_control_window", "an int"
    )


def test_h2_configuration_switches_and_event_fields() -> None:
    config = H2Configuration(client_side=True, normalize_outbound_headers=False, validate_outbound_headers=False)
    assert (config.normalize_outbound_headers, config.validate_outbound_headers) == (False, False), changed(
        "h2", "H2Configuration(normalize_outbound_headers, validate_outbound_headers)", "accepted"
    )
    for event, names in (
        (DataReceived, ("flow_controlled_length", "stream_id")),
        (StreamReset, ("error_code", "stream_id")),
        (ConnectionTerminated, ("last_stream_id",)),
    ):
        present = {f.name for f in dataclasses.fields(event)} if dataclasses.is_dataclass(event) else set(vars(event()))
        missing = [name for name in names if name not in present]
        assert not missing, changed("h2", f"{event.__name__}.{missing}", "event attributes")


def test_h2_keeps_the_indexing_each_header_tuple_asks_for() -> None:
    """hpack_headers (patch 10) relies on h2 passing HeaderTuple/NeverIndexedHeaderTuple through
    to hpack with normalising off: the first enters the HPACK table, the second never does."""
    client = H2Connection(
        H2Configuration(client_side=True, normalize_outbound_headers=False, validate_outbound_headers=False)
    )
    server = H2Connection(H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    request = [(":method", "POST"), (":scheme", "https"), (":path", "/"), (":authority", "a")]
    client.send_headers(
        1,
        [NeverIndexedHeaderTuple(k, v) for k, v in request]
        + [HeaderTuple("x-indexed", "1"), NeverIndexedHeaderTuple("x-never", "2")],
        end_stream=True,
    )
    [received] = [e for e in server.receive_data(client.data_to_send()) if isinstance(e, RequestReceived)]
    assert [type(h) for h in received.headers[-2:]] == [HeaderTuple, NeverIndexedHeaderTuple], changed(
        "h2", "H2Connection.send_headers", "keeping each header tuple's indexing"
    )
    table = [name for name, _ in server.decoder.header_table.dynamic_entries]
    assert table == [b"x-indexed"], changed(
        "hpack",
        "Decoder.header_table.dynamic_entries (also read by test_apns_sender.py)",
        f"the indexed entries; got {table}",
    )


def test_h2_encodes_every_header_block_with_its_encoder_attribute() -> None:
    """LiteralEncoder (patch 16) is set as ``H2Connection.encoder``: h2 must still encode header
    blocks by calling that attribute's ``encode(headers)``, and hpack must keep its ``huffman``
    switch, so that the values go out plain."""
    calls: list[bool] = []

    class Recording(LiteralEncoder):
        def encode(self, headers, huffman=True):  # type: ignore[no-untyped-def]
            calls.append(huffman)
            return super().encode(headers, huffman)

    client = H2Connection(H2Configuration(client_side=True))
    client.encoder = Recording()
    client.initiate_connection()
    client.send_headers(1, [(":method", "POST"), (":scheme", "https"), (":path", "/plain-path"), (":authority", "a")])
    assert calls == [True], changed("h2", "H2Connection.encoder", "what send_headers encodes with")
    assert b"/plain-path" in client.data_to_send(), changed("hpack", "Encoder.encode(huffman=False)", "plain literals")


# -- asyncio ----------------------------------------------------------------------------------------


def test_stream_slots_use_no_private_asyncio_attribute() -> None:
    """StreamSlots was a subclass of aioapns' ChannelPool, which edits asyncio.Semaphore's private
    _value and _waiters; it now uses the public Semaphore API only. Keep it so."""
    private = set(re.findall(r"\._(?:value|waiters|wake_up_next|bound_value)\b", source(apns_stream_slots)))
    assert not private, f"apns_stream_slots.py touches asyncio.Semaphore internals again: {sorted(private)}"


# -- hypercorn (the test doubles' server) -----------------------------------------------------------


def test_hypercorn_tcp_server_and_worker_context_the_mock_server_builds() -> None:
    """``reminders_pipeline_testing/tls_loop.AsgiServer`` serves each TLS connection it accepted
    itself (its own listener, ALPN and connection counts) through these two internals."""
    from hypercorn.asyncio.tcp_server import TCPServer
    from hypercorn.asyncio.worker_context import WorkerContext

    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"hypercorn=={version('hypercorn')}" in test_extra, "pyproject.toml must pin hypercorn exactly (==)"
    assert params(TCPServer.__init__) == ["self", "app", "loop", "config", "context", "state", "reader", "writer"], (
        f"hypercorn {version('hypercorn')}: TCPServer's constructor changed; tls_loop.AsgiServer calls it"
    )
    assert inspect.iscoroutinefunction(TCPServer.run) and hasattr(TCPServer, "__await__")
    assert params(WorkerContext.__init__) == ["self", "max_requests"], (
        f"hypercorn {version('hypercorn')}: WorkerContext's constructor changed; tls_loop.AsgiServer builds one"
    )


# -- dagster ---------------------------------------------------------------------------------------


def test_dagster_check_history_the_monitoring_checks_read() -> None:
    """defs/monitoring.py's ``previous_passed`` reads a check's last completed evaluation through
    names Dagster 1.13 does not export publicly (pinned exactly in pyproject.toml)."""
    import dagster
    from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus as Status
    from dagster._core.storage.event_log.base import EventLogStorage

    where = "defs/monitoring.py previous_passed"
    message = (
        f"dagster {version('dagster')} (pyproject.toml pins {pins().get('dagster', 'nothing')}): "
        "{attribute} is no longer {expected}; " + f"{where} relies on it."
    )
    assert {"PLANNED", "SUCCEEDED", "FAILED"} <= set(Status.__members__), message.format(
        attribute="AssetCheckExecutionRecordStatus", expected="an enum with PLANNED, SUCCEEDED and FAILED"
    )
    history = EventLogStorage.get_asset_check_execution_history
    assert {"check_key", "limit", "status"} <= set(params(history)), message.format(
        attribute="EventLogStorage.get_asset_check_execution_history", expected="(check_key, limit, ..., status)"
    )
    assert dagster.__version__ == pins()["dagster"], message.format(attribute="the version", expected="the pinned one")


# -- calendar expansion (ics.py) ---------------------------------------------------------------------
# ics.py meters recurring-ical-events' series by subclassing ``Series`` and its ``RecurrenceRules``,
# reads an occurrence's source event through ``Occurrence._adapter._component``, and decides whether
# a dateutil rule can match a day of the read window from dateutil's own masks (``_iterinfo``) and
# the rule's ``_by*`` attributes, so that a rule that never matches (30 February) is not walked to
# year 9999. Both libraries are pinned exactly for it.

EXPANSION = ("python-dateutil", "recurring-ical-events")


@pytest.mark.parametrize("library", EXPANSION)
def test_each_library_the_expansion_reads_is_pinned_to_the_installed_version(library: str) -> None:
    pinned = pins().get(library)
    assert pinned is not None, (
        f"{library} {version(library)}: pyproject.toml must pin it exactly (==), ics.py reads its internals"
    )
    assert version(library) == pinned, f"{library} {version(library)} is installed but pyproject.toml pins {pinned}"


def expansion_changed(library: str, attribute: str) -> str:
    return (
        f"{library} {version(library)}: {attribute} is gone or changed. reminders_pipeline/sources/ics.py "
        "(metered_series, _bounded, _passes, _OccurrenceEvent) relies on it: re-check before moving the pin."
    )


def test_dateutil_rule_internals_the_day_filter_reads() -> None:
    from dateutil.rrule import MONTHLY, _iterinfo, rrule

    rule = rrule(MONTHLY, dtstart=datetime(2026, 1, 1), bymonthday=(30,), bymonth=(2, 3), count=3)
    for attribute in (
        "_count",
        "_bymonth",
        "_byweekno",
        "_byweekday",
        "_byeaster",
        "_bymonthday",
        "_bynmonthday",
        "_byyearday",
        "_dtstart",
        "_freq",
        "_interval",
    ):
        assert hasattr(rule, attribute), expansion_changed("python-dateutil", f"rrule.{attribute}")
    info = _iterinfo(rule)
    info.rebuild(2026, 2)
    for mask in (
        "mmask",
        "wnomask",
        "wdaymask",
        "nwdaymask",
        "eastermask",
        "mdaymask",
        "nmdaymask",
        "yearlen",
        "yearordinal",
    ):
        assert hasattr(info, mask), expansion_changed("python-dateutil", f"_iterinfo.{mask}")


@pytest.mark.parametrize(
    "rule_text",
    [
        "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=28,29,30",
        "FREQ=WEEKLY;BYDAY=MO,FR",
        "FREQ=MONTHLY;BYDAY=-1SU",
        "FREQ=YEARLY;BYYEARDAY=1,-1",
        "FREQ=DAILY;BYWEEKNO=1,53",
        "FREQ=MONTHLY;BYMONTHDAY=-1",
        "FREQ=YEARLY;BYEASTER=0",
    ],
)
def test_the_day_filter_agrees_with_dateutils_own_iteration(rule_text: str) -> None:
    """``ics._day_matches`` copies dateutil's day filter: for each day of two years it must say
    "matches" exactly on the days dateutil itself yields."""
    from dateutil.rrule import rrulestr

    from reminders_pipeline.sources.ics_expansion import _day_matches

    rule = rrulestr(rule_text, dtstart=datetime(2026, 1, 1))
    first, last = date(2026, 1, 1), date(2027, 12, 31)
    yielded = {d.date() for d in rule.between(datetime(2026, 1, 1), datetime(2027, 12, 31, 23, 59), inc=True)}
    days = [first + timedelta(days=i) for i in range((last - first).days + 1)]
    matched = {day for day, ok in zip(days, _day_matches(rule, first, last)) if ok}
    assert matched == yielded, expansion_changed("python-dateutil", f"the day filter of rrule._iter for {rule_text}")


def test_recurring_ical_events_series_internals_the_meter_subclasses() -> None:
    from recurring_ical_events import Series

    assert hasattr(Series, "RecurrenceRules"), expansion_changed("recurring-ical-events", "Series.RecurrenceRules")
    assert params(Series.RecurrenceRules.rrule_between)[1:] == ["span_start", "span_stop"], expansion_changed(
        "recurring-ical-events", "Series.RecurrenceRules.rrule_between(span_start, span_stop)"
    )
    assert params(Series.occurrence)[1:] == ["adapter", "start", "end"], expansion_changed(
        "recurring-ical-events", "Series.occurrence(adapter, start, end)"
    )
    for attribute in ("rrules", "tzinfo"):
        assert attribute in source(Series.RecurrenceRules), expansion_changed(
            "recurring-ical-events", f"RecurrenceRules.{attribute}"
        )


def test_recurring_ical_events_occurrence_keeps_its_source_event() -> None:
    """ics.py walks ``query.series`` and each series' ``between`` itself, and notes an occurrence the
    item cap cut from its source event (``Occurrence._adapter._component``) without building it."""
    import icalendar
    import recurring_ical_events

    calendar = icalendar.Calendar.from_ical(
        b"BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nUID:u1\r\nDTSTART:20260910T080000Z\r\nRRULE:FREQ=DAILY;COUNT=2\r\n"
        b"SUMMARY:Stand-up\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    query = recurring_ical_events.of(calendar)
    assert hasattr(query, "series"), expansion_changed("recurring-ical-events", "CalendarQuery.series")
    (series,) = list(query.series)
    occurrences = list(series.between(datetime(2026, 9, 10, tzinfo=UTC), datetime(2026, 9, 12, tzinfo=UTC)))
    assert len(occurrences) == 2, expansion_changed("recurring-ical-events", "Series.between")
    event = occurrences[0]._adapter._component
    assert str(event.get("UID")) == "u1", expansion_changed("recurring-ical-events", "Occurrence._adapter._component")


def test_an_occurrence_read_in_place_is_the_item_as_component_builds() -> None:
    """ics.py reads each occurrence in place (``_OccurrenceEvent``) instead of copying it with
    ``Occurrence.as_component``: both must give every item the same, moved instances, DURATION,
    DTEND, all-day, zoned and floating times and alarms included."""
    import icalendar
    import recurring_ical_events

    from reminders_pipeline.sources.ics_items import _durations, _OccurrenceEvent, _raw_item

    calendar = icalendar.Calendar.from_ical(
        "\r\n".join(
            [
                "BEGIN:VCALENDAR",
                "VERSION:2.0",
                "BEGIN:VEVENT",
                "UID:w",
                "DTSTART;TZID=Europe/Berlin:20260907T093000",
                "DURATION:PT45M",
                "RRULE:FREQ=DAILY;COUNT=5",
                "EXDATE;TZID=Europe/Berlin:20260909T093000",
                "SUMMARY:Daily",
                "LOCATION:Room 4",
                "BEGIN:VALARM",
                "ACTION:DISPLAY",
                "TRIGGER:-PT25M",
                "DESCRIPTION:x",
                "END:VALARM",
                "END:VEVENT",
                "BEGIN:VEVENT",
                "UID:w",
                "RECURRENCE-ID;TZID=Europe/Berlin:20260908T093000",
                "DTSTART;TZID=Europe/Berlin:20260908T110000",
                "DTEND;TZID=Europe/Berlin:20260908T120000",
                "SUMMARY:Moved",
                "END:VEVENT",
                "BEGIN:VEVENT",
                "UID:f",
                "DTSTART:20260908T090000",
                "RRULE:FREQ=DAILY;COUNT=3",
                "DURATION:PT15M",
                "SUMMARY:Floating",
                "END:VEVENT",
                "BEGIN:VEVENT",
                "UID:a",
                "DTSTART;VALUE=DATE:20260908",
                "RRULE:FREQ=WEEKLY;COUNT=2",
                "SUMMARY:All day",
                "END:VEVENT",
                "BEGIN:VEVENT",
                "UID:o",
                "DTSTART:20260909T120000Z",
                "DTEND:20260909T123000Z",
                "STATUS:CANCELLED",
                "END:VEVENT",
                "END:VCALENDAR",
                "",
            ]
        ).encode()
    )
    durations = _durations(calendar)
    occurrences = [
        o
        for s in recurring_ical_events.of(calendar).series
        for o in s.between(datetime(2026, 9, 1, tzinfo=UTC), datetime(2026, 9, 30, tzinfo=UTC))
    ]
    assert len(occurrences) == 10  # 5 daily less 1 EXDATE (1 moved), 3 floating, 2 all-day, 1 cancelled
    for occurrence in occurrences:
        assert _raw_item(_OccurrenceEvent(occurrence), durations) == _raw_item(
            occurrence.as_component(False), durations
        ), expansion_changed("recurring-ical-events", f"Occurrence.as_component, for {occurrence!r}")
