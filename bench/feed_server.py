"""A standalone process serving many synthetic JSON and iCalendar sources, for build benchmarks.

``python bench/feed_server.py PORT JSON_COUNT ICS_COUNT T0 [ZONED_COUNT]`` serves ``/j/<n>.json``,
``/c/<n>.ics`` and ``/z/<n>.ics`` (a person's calendar in a zone), each with ETag support, until
killed. A separate process so serving does not share the build's GIL.

Latency where calendar providers have it (options after the four positional arguments):
``--delay S`` answers every request S seconds late; ``--slow-share F --slow-delay S`` makes that share
of the sources (the same ones every read, chosen by a hash of the path) answer S seconds late;
``--fail-share F`` makes that share answer 503 (after the delay); ``--hosts A,B`` listens on several
loopback addresses (each its own "host" for the reader's per-host limit) and ``--slow-host A``
makes every answer from A take ``--slow-delay``. ``GET /_stats`` returns per host: requests and the
wall time the last answer finished.

Between ticks, ``GET /_mode?validators=0`` serves every body with no ETag (a server without
validators: every read a 200), ``validators=1`` with one again, ``change=F`` moves every item of
that share of the sources (a fresh share each time) by a minute: their next read is a changed body,
and ``edit=F`` retitles one event (the second title or SUMMARY) of that share, as a person editing
one event would.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import zlib
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs


def json_body(n: int, t0: int) -> bytes:
    """A busy calendar's worth: an event every 3 hours for three days (8 within a 24 h horizon)."""
    items = [
        {
            "id": f"e{k}",
            "title": f"Source {n} event {k}",
            "startsAt": t0 + 1800 + k * 3 * 3600 + n,
            "expiresAt": t0 + 3600 + k * 3 * 3600 + n,
        }
        for k in range(24)
    ]
    return json.dumps({"items": items}).encode()


def ics_body(n: int, t0: int) -> bytes:
    start = datetime.fromtimestamp(t0 + 1800 + n * 7, UTC).strftime("%Y%m%dT%H%M%SZ")
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


ZONES = [
    "America/New_York",
    "Europe/Berlin",
    "Australia/Lord_Howe",
    "Asia/Kolkata",
    "Pacific/Chatham",
    "America/Los_Angeles",
]


def zoned_body(n: int, t0: int) -> bytes:
    """A person's calendar: weekly series in the owner's zone with a deleted and a moved instance,
    a floating daily stand-up, a weekly all-day item and a few one-off events."""
    zone = ZONES[n % len(ZONES)]
    day = datetime.fromtimestamp(t0 - 14 * 86400, UTC)
    d = day.strftime("%Y%m%d")
    ex = datetime.fromtimestamp(t0 + 7 * 86400, UTC).strftime("%Y%m%d")
    events = []
    for k, (hh, byday) in enumerate((("0930", "MO,WE,FR"), ("1400", "TU,TH"), ("1700", "MO"))):
        events += [
            "BEGIN:VEVENT",
            f"UID:w{n}-{k}@bench",
            f"DTSTART;TZID={zone}:{d}T{hh}00",
            "DURATION:PT45M",
            f"RRULE:FREQ=WEEKLY;BYDAY={byday};COUNT=60",
            f"EXDATE;TZID={zone}:{ex}T{hh}00",
            f"SUMMARY:Series {k} of {n}",
            "END:VEVENT",
            "BEGIN:VEVENT",
            f"UID:w{n}-{k}@bench",
            f"RECURRENCE-ID;TZID={zone}:{d}T{hh}00",
            f"DTSTART;TZID={zone}:{d}T{int(hh[:2]) + 1:02d}{hh[2:]}00",
            "DURATION:PT45M",
            f"SUMMARY:Series {k} moved",
            "END:VEVENT",
        ]
    events += [
        "BEGIN:VEVENT",
        f"UID:f{n}@bench",
        f"DTSTART:{d}T090000",
        "DURATION:PT15M",
        "RRULE:FREQ=DAILY;COUNT=120",
        "SUMMARY:Stand-up",
        "END:VEVENT",
    ]
    events += [
        "BEGIN:VEVENT",
        f"UID:a{n}@bench",
        f"DTSTART;VALUE=DATE:{d}",
        "RRULE:FREQ=WEEKLY;COUNT=20",
        "SUMMARY:Bins out",
        "END:VEVENT",
    ]
    for k in range(5):
        at = datetime.fromtimestamp(t0 + 3600 + k * 5 * 3600 + n, UTC).strftime("%Y%m%dT%H%M%SZ")
        events += [
            "BEGIN:VEVENT",
            f"UID:o{n}-{k}@bench",
            f"DTSTART:{at}",
            "DURATION:PT30M",
            f"SUMMARY:One-off {k}",
            "END:VEVENT",
        ]
    return "\r\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//bench//EN", *events, "END:VCALENDAR", ""]).encode()


def edit_one(body: bytes) -> bytes:
    """The body with one event retitled: its second JSON title or iCalendar SUMMARY (a person's
    calendar: its second one-off event), the first that a tick an hour after the first build
    still has ahead."""
    for marker in (b'"title": "', b"SUMMARY:One-off", b"SUMMARY:"):
        at = body.find(marker, body.find(marker) + 1)
        if at >= 0:
            return body[: at + len(marker)] + b"Edited " + body[at + len(marker) :]
    return body


def share(path: str, salt: str) -> float:
    """A stable number in [0, 1) per path: the same sources are slow (or failing) on every read."""
    return (zlib.crc32(f"{salt}{path}".encode()) % 10_000) / 10_000


def light_ics_body(n: int, t0: int) -> bytes:
    """A person's calendar: six single meetings over the next two days and one weekly series."""

    def stamp(t: int) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y%m%dT%H%M%SZ")

    events = []
    for k in range(6):
        start = t0 + 1800 + k * 8 * 3600 + n % 600
        events += [
            "BEGIN:VEVENT",
            f"UID:s{n}-m{k}@bench",
            f"DTSTART:{stamp(start)}",
            "DURATION:PT30M",
            f"SUMMARY:Meeting {k}",
            "END:VEVENT",
        ]
    events += [
        "BEGIN:VEVENT",
        f"UID:s{n}-weekly@bench",
        f"DTSTART:{stamp(t0 + 5400 + n % 600)}",
        "DURATION:PT1H",
        "RRULE:FREQ=WEEKLY;COUNT=52",
        "SUMMARY:Weekly",
        "END:VEVENT",
    ]
    return "\r\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//bench//EN", *events, "END:VCALENDAR", ""]).encode()


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("port", "json_count", "ics_count", "t0"):
        ap.add_argument(name, type=int)
    ap.add_argument("zoned_count", type=int, nargs="?", default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--slow-share", type=float, default=0.0)
    ap.add_argument("--slow-delay", type=float, default=3.0)
    ap.add_argument("--fail-share", type=float, default=0.0)
    ap.add_argument("--hosts", default="127.0.0.1")
    ap.add_argument("--slow-host", default=None)
    ap.add_argument("--light-ics", action="store_true", help="/c/<n>.ics: a person's calendar, not two hourly series")
    args = ap.parse_args()
    port, json_count, ics_count, t0 = args.port, args.json_count, args.ics_count, args.t0
    lock = threading.Lock()
    stats: dict[str, dict[str, float]] = {}
    bodies = {f"/j/{n}.json": (json_body(n, t0), "application/json") for n in range(json_count)}
    ics = light_ics_body if args.light_ics else ics_body
    bodies |= {f"/c/{n}.ics": (ics(n, t0), "text/calendar") for n in range(ics_count)}
    bodies |= {f"/z/{n}.ics": (zoned_body(n, t0), "text/calendar") for n in range(args.zoned_count)}
    makers = {"j": json_body, "c": ics, "z": zoned_body}
    mode = {"validators": True, "changes": 0}

    def set_mode(query: dict[str, list[str]]) -> None:
        if "validators" in query:
            mode["validators"] = query["validators"][0] == "1"
        if "change" in query:
            mode["changes"] += 1
            salt, share_changed = f"change{mode['changes']}", float(query["change"][0])
            for path, (_, kind) in list(bodies.items()):
                if share(path, salt) < share_changed:
                    group, n = path[1], int(path[3:].split(".")[0])
                    bodies[path] = (makers[group](n, t0 + 60 * mode["changes"]), kind)
        if "edit" in query:
            mode["changes"] += 1
            salt, share_edited = f"edit{mode['changes']}", float(query["edit"][0])
            for path, (body, kind) in list(bodies.items()):
                if share(path, salt) < share_edited:
                    bodies[path] = (edit_one(body), kind)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go in two writes: no 40 ms delayed-ACK stall

        def do_GET(self) -> None:  # noqa: N802
            if self.path.startswith("/_mode?"):
                with lock:
                    set_mode(parse_qs(self.path.split("?", 1)[1]))
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path == "/_stats":
                with lock:
                    body = json.dumps(stats).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            host = self.server.server_address[0]
            slow = host == args.slow_host or share(self.path, "slow") < args.slow_share
            time.sleep(args.slow_delay if slow else args.delay)
            try:
                self._answer(share(self.path, "fail") < args.fail_share)
            finally:
                with lock:
                    entry = stats.setdefault(host, {"requests": 0, "last_answer_at": 0.0})
                    entry["requests"] += 1
                    entry["last_answer_at"] = time.time()

        def _answer(self, fail: bool) -> None:
            if fail:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body, kind = bodies.get(self.path, (b"", "text/plain"))
            etag = f'"{hash(body) & 0xFFFFFFFF:x}"' if mode["validators"] else None
            if etag is not None and self.headers.get("If-None-Match") == etag:
                self.send_response(304)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", kind)
            if etag is not None:
                self.send_header("ETag", etag)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # hundreds of connections open at once

    servers = []
    for host in args.hosts.split(","):
        servers.append(Server((host, port), Handler))
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    servers[0].serve_forever()


if __name__ == "__main__":
    main()
