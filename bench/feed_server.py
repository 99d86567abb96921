"""A standalone process serving many synthetic JSON and iCalendar sources, for build benchmarks.

``python bench/feed_server.py PORT JSON_COUNT ICS_COUNT T0 [ZONED_COUNT]`` serves ``/j/<n>.json``,
``/c/<n>.ics`` and ``/z/<n>.ics`` (a person's calendar in a zone), each with ETag support, until killed. A separate process so serving does not share the build's GIL.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def json_body(n: int, t0: int) -> bytes:
    """A busy calendar's worth: an event every 3 hours for three days (8 within a 24 h horizon)."""
    items = [
        {"id": f"e{k}", "title": f"Source {n} event {k}", "startsAt": t0 + 1800 + k * 3 * 3600 + n, "expiresAt": t0 + 3600 + k * 3 * 3600 + n}
        for k in range(24)
    ]
    return json.dumps({"items": items}).encode()


def ics_body(n: int, t0: int) -> bytes:
    start = datetime.fromtimestamp(t0 + 1800 + n * 7, timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    events = []
    for k, interval in enumerate((3, 6)):  # about 12 occurrences within a 24 h horizon
        events += [
            "BEGIN:VEVENT",
            f"UID:s{n}-e{k}@bench",
            f"DTSTART:{start}",
            "DURATION:PT45M",
            f"RRULE:FREQ=HOURLY;INTERVAL={interval};COUNT=200",
            f"SUMMARY:Calendar {n} series {k}",
            "END:VEVENT",
        ]
    return "\r\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//bench//EN", *events, "END:VCALENDAR", ""]).encode()


ZONES = ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kolkata", "Pacific/Chatham", "America/Los_Angeles"]


def zoned_body(n: int, t0: int) -> bytes:
    """A person's calendar: weekly series in the owner's zone with a deleted and a moved instance,
    a floating daily stand-up, a weekly all-day item and a few one-off events."""
    zone = ZONES[n % len(ZONES)]
    day = datetime.fromtimestamp(t0 - 14 * 86400, timezone.utc)
    d = day.strftime("%Y%m%d")
    ex = datetime.fromtimestamp(t0 + 7 * 86400, timezone.utc).strftime("%Y%m%d")
    events = []
    for k, (hh, byday) in enumerate((("0930", "MO,WE,FR"), ("1400", "TU,TH"), ("1700", "MO"))):
        events += [
            "BEGIN:VEVENT", f"UID:w{n}-{k}@bench", f"DTSTART;TZID={zone}:{d}T{hh}00", "DURATION:PT45M",
            f"RRULE:FREQ=WEEKLY;BYDAY={byday};COUNT=60", f"EXDATE;TZID={zone}:{ex}T{hh}00",
            f"SUMMARY:Series {k} of {n}", "END:VEVENT",
            "BEGIN:VEVENT", f"UID:w{n}-{k}@bench", f"RECURRENCE-ID;TZID={zone}:{d}T{hh}00",
            f"DTSTART;TZID={zone}:{d}T{int(hh[:2]) + 1:02d}{hh[2:]}00", "DURATION:PT45M", f"SUMMARY:Series {k} moved", "END:VEVENT",
        ]
    events += ["BEGIN:VEVENT", f"UID:f{n}@bench", f"DTSTART:{d}T090000", "DURATION:PT15M", "RRULE:FREQ=DAILY;COUNT=120",
               "SUMMARY:Stand-up", "END:VEVENT"]
    events += ["BEGIN:VEVENT", f"UID:a{n}@bench", f"DTSTART;VALUE=DATE:{d}", "RRULE:FREQ=WEEKLY;COUNT=20", "SUMMARY:Bins out", "END:VEVENT"]
    for k in range(5):
        at = datetime.fromtimestamp(t0 + 3600 + k * 5 * 3600 + n, timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        events += ["BEGIN:VEVENT", f"UID:o{n}-{k}@bench", f"DTSTART:{at}", "DURATION:PT30M", f"SUMMARY:One-off {k}", "END:VEVENT"]
    return "\r\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//bench//EN", *events, "END:VCALENDAR", ""]).encode()


def main() -> None:
    port, json_count, ics_count, t0 = (int(a) for a in sys.argv[1:5])
    zoned_count = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    bodies = {f"/j/{n}.json": (json_body(n, t0), "application/json") for n in range(json_count)}
    bodies |= {f"/c/{n}.ics": (ics_body(n, t0), "text/calendar") for n in range(ics_count)}
    bodies |= {f"/z/{n}.ics": (zoned_body(n, t0), "text/calendar") for n in range(zoned_count)}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go in two writes: no 40 ms delayed-ACK stall

        def do_GET(self) -> None:  # noqa: N802
            body, kind = bodies.get(self.path, (b"", "text/plain"))
            etag = f'"{hash(body) & 0xFFFFFFFF:x}"'
            if self.headers.get("If-None-Match") == etag:
                self.send_response(304)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", kind)
            self.send_header("ETag", etag)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
