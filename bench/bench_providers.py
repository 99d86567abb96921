"""The full drain (abandoned sweep, due query, claim, policy, send, settle) per provider, beside the
raw library sending the same number of alerts to the same mock in the same round: for Web Push,
http-ece and a VAPID header from py-vapid over one HTTP/2 httpx client; for FCM, one google-auth
access token and one HTTP/2 httpx client. Median of paired rounds (each drain over the raw run of
its own round, so drift on the machine cancels); bound: at least 0.8 of raw.

    .venv/bin/python bench/bench_providers.py [--n 2000] [--rounds 3] [--db postgresql,sqlite]

The mocks run in this process (each its own thread and event loop), so they share the GIL with
the drain and the raw sender alike; the mock push service decrypts every payload, as a browser
would, which is most of its work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import http_ece
import httpx
import requests
from cryptography.hazmat.primitives.asymmetric import ec
from google.auth.transport.requests import Request
from google.oauth2 import service_account
from py_vapid import Vapid02
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # reminders_pipeline_testing, not installed
sys.path.insert(0, str(Path(__file__).parent))
from bench_ledger import T0, fresh, load_due  # noqa: E402

from reminders_pipeline.config.settings import Settings  # noqa: E402
from reminders_pipeline.domain import b64url  # noqa: E402
from reminders_pipeline.domain.times import Instant  # noqa: E402
from reminders_pipeline.providers.push_subscription import parse_subscription  # noqa: E402
from reminders_pipeline.providers.routing import default_sender_factory  # noqa: E402
from reminders_pipeline.providers.webpush import generate_key  # noqa: E402
from reminders_pipeline.sending.drain import drain  # noqa: E402
from reminders_pipeline_testing.mock_fcm import MockFcm  # noqa: E402
from reminders_pipeline_testing.mock_webpush import MockWebPush  # noqa: E402

BAR = 0.8
CONCURRENCY = 200
# What the drain's payload carries, so the raw sender's body is the same size.
ALERT = {"title": "Standup in room 4", "body": "Starts at 09:30", "tag": "x" * 43, "category": "REMINDER"}
REMINDER = {"item_id": "7:standup/20260910T093000Z", "rule": "lead:3600", "starts_at": T0 + 9000, "id": 1}
FCM_TOKEN = "bench-" + "f" * 140


def raw_webpush(push: MockWebPush, subscription: dict, key_file: str, n: int) -> float:
    """Sends/s of http-ece + py-vapid + httpx: the raw libraries' best case (one VAPID JWT)."""
    vapid = Vapid02.from_file(key_file)
    auth = vapid.sign({"aud": push.origin, "sub": "mailto:bench@example.org", "exp": int(time.time()) + 3600})
    sub = parse_subscription(subscription)
    body = json.dumps({**ALERT, "reminder": REMINDER}, separators=(",", ":")).encode()

    async def run() -> float:
        slots = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(http2=True, verify=str(push.ca_file), timeout=30) as client:

            async def one() -> None:
                async with slots:
                    data = http_ece.encrypt(
                        body,
                        private_key=ec.generate_private_key(ec.SECP256R1()),
                        dh=b64url.decode(sub.p256dh),
                        auth_secret=b64url.decode(sub.auth),
                        version="aes128gcm",
                    )
                    headers = {"TTL": "3600", "Content-Encoding": "aes128gcm", "Urgency": "high", **auth}
                    response = await client.post(sub.endpoint, content=data, headers=headers)
                    assert response.status_code == 201, response.text

            started = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(n)))
            return n / (time.perf_counter() - started)

    return asyncio.run(run())


def raw_fcm(fcm: MockFcm, key_file: str, n: int) -> float:
    """Sends/s of one google-auth token and httpx posting FCM v1 messages."""
    session = requests.Session()
    session.verify, session.trust_env = str(fcm.ca_file), False
    credentials = service_account.Credentials.from_service_account_file(
        key_file, scopes=["https://www.googleapis.com/auth/firebase.messaging"]
    )
    credentials.refresh(Request(session))
    message = {
        "message": {
            "token": FCM_TOKEN,
            "notification": {"title": ALERT["title"], "body": ALERT["body"]},
            "data": {"reminder": json.dumps(REMINDER), "tag": ALERT["tag"]},
            "android": {"ttl": "3600s", "collapse_key": ALERT["tag"], "priority": "HIGH"},
        }
    }

    async def run() -> float:
        slots = asyncio.Semaphore(CONCURRENCY)
        headers = {"Authorization": f"Bearer {credentials.token}"}
        async with httpx.AsyncClient(http2=True, verify=str(fcm.ca_file), timeout=30) as client:

            async def one() -> None:
                async with slots:
                    response = await client.post(fcm.send_url(), json=message, headers=headers)
                    assert response.status_code == 200, response.text

            started = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(n)))
            return n / (time.perf_counter() - started)

    return asyncio.run(run())


def full_drain(kind: str, settings: Settings, provider: str, target: str, n: int) -> float:
    """Sends/s of the drain over ``n`` due rows whose devices deliver by ``provider``."""
    db, close = fresh(kind)
    try:
        ids = load_due(db, n)
        with db.write() as conn:
            conn.execute(text("UPDATE devices SET provider = :p, target = :t"), {"p": provider, "t": target})
        settings = settings.with_(database_url=db.url, enabled=True, max_lateness_seconds=10**9)
        started = time.perf_counter()
        summary = drain(db, settings, default_sender_factory(settings), now=Instant.from_unix(T0 + 7210))
        elapsed = time.perf_counter() - started
        assert summary.outcomes == {"sent": len(ids)}, summary.as_dict()
        return len(ids) / elapsed
    finally:
        close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--db", default="postgresql,sqlite")
    args = parser.parse_args()
    kinds = args.db.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-providers-"))
    (work / "push").mkdir()
    (work / "fcm").mkdir()
    with MockWebPush(workdir=work / "push") as push, MockFcm(workdir=work / "fcm") as fcm:
        key_file = str(work / "vapid.pem")
        generate_key(key_file)
        subscription = push.subscribe()
        fcm_key = str(fcm.service_account_file())
        settings = Settings(
            vapid_private_key_file=key_file,
            vapid_subject="mailto:bench@example.org",
            webpush_ca_file=str(push.ca_file),
            webpush_allow_networks=("127.0.0.0/8",),
            webpush_concurrency=CONCURRENCY,
            webpush_per_host=CONCURRENCY,
            fcm_credentials_file=fcm_key,
            fcm_url=fcm.url,
            fcm_ca_file=str(fcm.ca_file),
            fcm_concurrency=CONCURRENCY,
        )
        target = parse_subscription(subscription).canonical
        runs: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # interleaved: drift hits every column alike
            push.reset()
            fcm.reset()
            runs.setdefault("raw_webpush", []).append(raw_webpush(push, subscription, key_file, args.n))
            for kind in kinds:
                runs.setdefault(f"webpush_drain_{kind}", []).append(
                    full_drain(kind, settings, "webpush", target, args.n)
                )
            runs.setdefault("raw_fcm", []).append(raw_fcm(fcm, fcm_key, args.n))
            for kind in kinds:
                runs.setdefault(f"fcm_drain_{kind}", []).append(full_drain(kind, settings, "fcm", FCM_TOKEN, args.n))
    out: dict = {
        "n": args.n,
        "concurrency": CONCURRENCY,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": Instant.now().stored[:10],
        "sends_per_s": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        "bars": {},
    }
    for provider in ("webpush", "fcm"):
        for kind in kinds:
            paired = [d / r for d, r in zip(runs[f"{provider}_drain_{kind}"], runs[f"raw_{provider}"])]
            ratio = statistics.median(paired)
            out["bars"][f"{provider}_{kind}"] = {
                "paired_ratios": [round(p, 2) for p in paired],
                "median": round(ratio, 2),
                "verdict": f"{'met' if ratio >= BAR else 'missed'}: {ratio:.2f}x raw (bound {BAR}x)",
            }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
