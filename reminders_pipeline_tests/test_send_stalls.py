"""Issue 38 (12): a send that stalls before its request was written (connect, TLS, a wait for a
pooled connection or for its push service's slot) is "never written": back to pending, never
failed as ``timeout``; only a stall after the request's headers began to leave may have been
delivered and fails ``timeout``, never sent again. Against the suite's HTTP/2 TLS mocks, and
local ports that accept TCP and never answer TLS (``stalling``), over the real clock.

The Web Push and FCM fixtures are ``test_providers``' own, bound here under their names."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.wire import Notification
from reminders_pipeline.providers.base import FENCE_EXPIRED, SendResult
from reminders_pipeline.providers.fcm import FcmSender
from reminders_pipeline.providers.webpush import WebPushSender
from reminders_pipeline_testing.mock_fcm import Answer as FcmAnswer
from reminders_pipeline_testing.mock_webpush import Answer, MockWebPush

from . import test_providers as providers
from .support import TOKEN, rows

push, fcm, env, run = providers.push, providers.fcm, providers.env, providers.run
soon, FCM_TOKEN = providers.soon, providers.FCM_TOKEN
QUICK = {"REMINDERS_SEND_TIMEOUT_SECONDS": "1"}


@contextmanager
def stalling(count: int = 1) -> Iterator[list[int]]:
    """``count`` local ports that take a TCP connection (the kernel completes it into the listen
    backlog) and never say a word: a TLS handshake with one waits until the client gives up."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            listener = stack.enter_context(socket.socket())
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            ports.append(int(listener.getsockname()[1]))
        yield ports


def put_web(run: Callable[..., Result], push: MockWebPush, tmp_path: Path, device: str, url: str,
            port: int | None = None, **answer: Any) -> dict:  # fmt: skip
    """Register ``device`` with a new subscription of ``push``, its endpoint moved to ``port``
    (a stalling one) when given: the browser's keys are real, the push service is not."""
    subscription = push.subscribe(Answer(**answer) if answer else None)
    if port is not None:
        subscription["endpoint"] = subscription["endpoint"].replace(push.origin, f"https://127.0.0.1:{port}")
    (tmp_path / f"{device}.json").write_text(json.dumps(subscription))
    run("device", "put", device, "--webpush-subscription", str(tmp_path / f"{device}.json"), "--lead", "1800",
        "--source", url)  # fmt: skip
    return subscription


def test_a_web_push_endpoint_that_never_answers_tls_is_never_written(run, push, feeds, tmp_path, db):
    """The connection is taken, the TLS handshake never answered: nothing was written, so the
    row is pending again (``not-sent:…``), not failed ``timeout``."""
    with stalling() as (port,):
        put_web(run, push, tmp_path, "web", soon(feeds), port)
        run("build", "--all")
        summary = json.loads(run("drain", **QUICK).output)
    (row,) = rows(db, device_id="web")
    assert (row["status"], row["outcome"]) == ("pending", None), row
    assert row["outcome_detail"].startswith("not-sent:"), row["outcome_detail"]
    assert summary["outcomes"] == {} and summary["returned_to_pending"] == 1
    assert summary["halted"] is None  # a user's endpoint: no outage of ours


def test_an_fcm_front_end_that_never_answers_tls_is_fcms_outage_and_the_iphone_is_sent(run, fcm, fresh_mock, feeds, db):
    """FCM's front end is our provider: its connections stalling before the request is written
    send its rows back to pending, spending no attempt, and halt FCM (``fcm_unreachable``); the
    iPhone beside them is sent."""
    url = soon(feeds)
    for i in range(3):
        run("device", "put", f"droid{i}", "--fcm-token", f"{FCM_TOKEN}{i}", "--lead", "1800", "--source", url)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    run("build", "--all")
    with stalling() as (port,):
        summary = json.loads(
            run("drain", REMINDERS_FCM_URL=f"https://127.0.0.1:{port}", REMINDERS_SEND_HALT_AFTER="2", **QUICK).output
        )
    assert summary["providers"] == {"apns:sent": 1}, summary
    assert summary["halts"].keys() == {"fcm"} and summary["halts"]["fcm"].startswith("fcm_unreachable"), summary
    droids = [r for r in rows(db) if r["device_id"].startswith("droid")]
    assert [(r["status"], r["attempts"]) for r in droids] == [("pending", 0)] * 3, droids
    assert all(r["outcome_detail"].startswith("not-sent:") for r in droids), droids
    assert fcm.requests == []


@pytest.mark.parametrize("provider", ["webpush", "fcm"])
def test_a_request_written_and_then_unanswered_fails_timeout_and_is_never_sent_again(
    run, push, fcm, feeds, tmp_path, db, provider
):
    """Its headers left and the answer stalls past the send timeout: it may have been delivered,
    so it fails ``timeout`` and no later drain sends it again."""
    url = soon(feeds)
    if provider == "webpush":
        put_web(run, push, tmp_path, "dev", url, delay=3.0)
    else:
        run("device", "put", "dev", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
        fcm.script(FCM_TOKEN, FcmAnswer(delay=3.0))
    run("build", "--all")
    summary = json.loads(run("drain", **QUICK).output)
    (row,) = rows(db, device_id="dev")
    assert (row["status"], row["outcome"], row["outcome_detail"]) == ("settled", "failed", "timeout")
    assert summary["returned_to_pending"] == 0 and summary["halted"] is None
    time.sleep(3.0)  # past the mock's delay and any backoff a wrongly returned row would wait
    assert json.loads(run("drain", **QUICK).output)["claimed"] == 0
    mock = push if provider == "webpush" else fcm
    assert len(mock.wait_for_requests(1)) == 1


def test_one_subscribers_stalling_push_services_fail_no_one_elses_row_timeout(run, push, feeds, tmp_path, db):
    """One subscriber's 10 push services (4 subscriptions each) take connections and never answer
    TLS; there are fewer connections than that (``REMINDERS_WEBPUSH_CONCURRENCY``) and one slot per
    push service. Rows waiting for a connection or for their push service's slot were never
    written: pending again, none failed ``timeout``. Another person's row to a healthy push service
    that takes half a second to answer is sent, or pending again if no connection came in time,
    never failed for the stalls, nor spending an attempt on them (a wait for the pool is others'
    doing); and the drain is not held by each push service's stalls in turn."""
    url = soon(feeds)
    with stalling(10) as ports:
        for i, port in enumerate(ports * 4):
            put_web(run, push, tmp_path, f"mallory{i}", url, port)
        put_web(run, push, tmp_path, "zoe", url, delay=0.5)
        run("build", "--all")
        started = time.monotonic()
        summary = json.loads(
            run("drain", REMINDERS_WEBPUSH_CONCURRENCY="4", REMINDERS_WEBPUSH_PER_HOST="1", **QUICK).output
        )
        took = time.monotonic() - started
    got = {r["device_id"]: r for r in rows(db)}
    zoe = got.pop("zoe")
    assert zoe["outcome"] == "sent" or (zoe["outcome_detail"], zoe["attempts"]) == ("not-sent:pool_timeout", 0), zoe
    assert {(r["status"], r["outcome_detail"].split(":", 1)[0]) for r in got.values()} == {("pending", "not-sent")}
    assert summary["halted"] is None
    assert took < 3.5  # a slot's wait, then a request's: not four stalls one after another


@pytest.mark.parametrize("provider", ["webpush", "fcm"])
def test_a_request_whose_fence_passes_before_its_headers_leave_is_never_written(push, fcm, env, provider):
    """The send timeout is given again once a request is written, so the claim's fence is checked
    again as its headers are about to leave: one that reached that point past the fence (a long
    connect, a paused process) goes back to pending, and nothing reaches the provider."""
    ticks = iter([0.0])  # the look before the request: in time; every later one: past the fence

    def monotonic() -> float:
        return next(ticks, 1000.0)

    if provider == "webpush":
        subscription = push.subscribe()
        target = json.dumps({"endpoint": subscription["endpoint"], **subscription["keys"]})
    else:
        target = FCM_TOKEN
    note = Notification(1, "dev", target, providers.PAYLOAD, "collapse", int(time.time()) + 600, provider=provider)
    sender_class = WebPushSender if provider == "webpush" else FcmSender

    async def send() -> list[SendResult]:
        sender = sender_class(Settings.from_env(env), monotonic=monotonic)
        try:
            return await sender.send_many([note.fenced(500.0)])
        finally:
            await sender.aclose()

    (result,) = asyncio.run(send())
    assert (result.ok, result.retry, result.reason) == (False, True, FENCE_EXPIRED)
    time.sleep(0.2)
    assert push.requests == [] and fcm.requests == []
