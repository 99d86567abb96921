"""Sends per second against the mock APNs: raw aioapns vs AioApnsSender.send_many, same mock, same run.

The mock runs in its own process by default, so it does not share the GIL with the client being
measured (``--in-process`` puts it in a thread instead). Each measurement opens its own
connections, so connection setup and the 1-stream start are included, as in a drain run.

    .venv/bin/python bench/bench_apns_raw.py [--n 5000] [--concurrency 200] [--rounds 3]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aioapns import APNs, NotificationRequest, PushType  # noqa: E402
from aioapns.connection import APNsProductionClientProtocol  # noqa: E402

from reminders_pipeline.config.settings import Settings  # noqa: E402
from reminders_pipeline.domain.wire import Notification  # noqa: E402
from reminders_pipeline.providers.apns import AioApnsSender  # noqa: E402


class MockHandle:
    """The mock APNs in a child process (or a thread): its address, counters and reset."""

    def __init__(self, in_process: bool) -> None:
        self._mock = None
        self._proc: subprocess.Popen[str] | None = None
        if in_process:
            from reminders_pipeline_testing.mock_apns import MockApns

            self._mock = MockApns()
            self._mock.start()
            self.info = {
                "host": self._mock.host,
                "port": self._mock.port,
                "ca_file": str(self._mock.ca_file),
                "key_file": str(self._mock.key_file),
                "key_id": self._mock.key_id,
                "team_id": self._mock.team_id,
                "topic": self._mock.topic,
            }
        else:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "reminders_pipeline_testing.mock_apns"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self.info = json.loads(self._readline())

    def _readline(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("mock APNs process exited")
        return line

    def _command(self, command: str) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return json.loads(self._readline())

    def stats(self) -> dict[str, Any]:
        return self._mock.stats() if self._mock else self._command("stats")

    def delay(self, seconds: float) -> None:
        """Every answer ``seconds`` after its request (Apple's servers are tens of ms away)."""
        if self._mock:
            self._mock.latency = seconds
        else:
            self._command(f"delay {seconds}")

    def reset(self) -> None:
        if self._mock:
            self._mock.reset()
        else:
            self._command("reset")

    def settings(self, concurrency: int) -> Settings:
        i = self.info
        return Settings().with_(
            apns_key_file=i["key_file"],
            apns_key_id=i["key_id"],
            apns_team_id=i["team_id"],
            apns_topic=i["topic"],
            apns_url=f"https://{i['host']}:{i['port']}",
            apns_ca_file=i["ca_file"],
            apns_concurrency=concurrency,
        )

    def close(self) -> None:
        if self._mock:
            self._mock.stop()
        elif self._proc:
            assert self._proc.stdin is not None
            self._proc.stdin.write("stop\n")
            self._proc.stdin.close()
            self._proc.wait(timeout=10)


def notifications(n: int) -> list[Notification]:
    expires = int(time.time()) + 3600
    return [
        Notification(
            row_id=i,
            device_id=f"device-{i}",
            device_token=f"{i:064x}",
            payload={
                "aps": {
                    "alert": {"title": f"Standup {i}", "body": "Starts at 14:30"},
                    "sound": "default",
                    "interruption-level": "time-sensitive",
                    "thread-id": f"item-{i}",
                },
                "reminder": {"item_id": f"item-{i}", "rule": "lead:3600", "starts_at": expires},
            },
            collapse_id=f"collapse-{i}",
            expiration=expires,
        )
        for i in range(n)
    ]


async def send_raw(mock: MockHandle, batch: list[Notification], concurrency: int) -> tuple[float, int]:
    """aioapns as documented (defaults), pointed at the mock; our semaphore only bounds in-flight."""
    i = mock.info

    class MockProtocol(APNsProductionClientProtocol):
        APNS_SERVER = i["host"]
        APNS_PORT = i["port"]

    apns = APNs(
        key=Path(i["key_file"]).read_text(),  # noqa: ASYNC240 - once, before the timed part
        key_id=i["key_id"],
        team_id=i["team_id"],
        topic=i["topic"],
        ssl_context=ssl.create_default_context(cafile=i["ca_file"]),
    )
    apns.pool.protocol_class = MockProtocol
    slots = asyncio.Semaphore(concurrency)

    async def one(n: Notification) -> bool:
        async with slots:
            result = await apns.send_notification(
                NotificationRequest(
                    device_token=n.device_token,
                    message=n.payload,
                    time_to_live=max(0, n.expiration - int(time.time())),
                    priority=n.priority,
                    collapse_key=n.collapse_id,
                    push_type=PushType.ALERT,
                )
            )
            return result.is_successful

    started = time.perf_counter()
    ok = await asyncio.gather(*(one(n) for n in batch))
    elapsed = time.perf_counter() - started
    apns.pool.close()
    await asyncio.sleep(0.05)
    return elapsed, sum(ok)


async def send_with_sender(mock: MockHandle, batch: list[Notification], concurrency: int) -> tuple[float, int]:
    sender = AioApnsSender(mock.settings(concurrency))
    started = time.perf_counter()
    results = await sender.send_many(batch)
    elapsed = time.perf_counter() - started
    await sender.aclose()
    return elapsed, sum(r.ok for r in results)


def measure(mock: MockHandle, name: str, n: int, concurrency: int) -> dict[str, Any]:
    runner = send_raw if name == "raw_aioapns" else send_with_sender
    batch = notifications(n)
    mock.reset()
    elapsed, ok = asyncio.run(runner(mock, batch, concurrency))
    stats = mock.stats()
    return {
        "seconds": round(elapsed, 3),
        "sends_per_s": round(n / elapsed, 1),
        "ok": ok,
        "connections": stats["connections_opened"],
        "distinct_jwts": stats["distinct_jwts"],
        "peak_in_flight": stats["max_in_flight"],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"median_sends_per_s": statistics.median(r["sends_per_s"] for r in runs), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="run the mock in a thread of this process")
    args = parser.parse_args()

    mock = MockHandle(args.in_process)
    try:
        raw, ours = [], []
        for _ in range(args.rounds):  # alternate, so drift on the machine hits both alike
            raw.append(measure(mock, "raw_aioapns", args.n, args.concurrency))
            ours.append(measure(mock, "sender", args.n, args.concurrency))
    finally:
        mock.close()
    print(
        json.dumps(
            {
                "n": args.n,
                "concurrency": args.concurrency,
                "mock": "thread" if args.in_process else "process",
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "raw_aioapns": summary(raw),
                "sender": summary(ours),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
