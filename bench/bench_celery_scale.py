"""Scale-out: the same latency-bound build of 16 chunks (per-chunk runs) by one and by two Celery workers.

Each case gets a fresh PostgreSQL ledger with ``--per-chunk`` devices in each of the 16 chunks, each
device with its own iCalendar source answered after 150 ms (``feed_server.py --delay 0.15``), and
``REMINDERS_SOURCE_CONCURRENCY`` low enough (``--source-concurrency``) that a chunk's build waits on
the network, not the CPU. Workers run one step at a time (``--concurrency=1``) on this machine's
RabbitMQ, on a queue of their own; ``--launchers`` processes (default 4) launch the 16 runs, so a
step is always waiting in the queue for a free worker (with fewer, the launchers' own per-run
overhead, not the workers, sets the pace). Reported: the wall time of the 16 runs and chunks/s per case; bar: two
workers >= 1.7x one.

    .venv/bin/python bench/bench_celery_scale.py [--per-chunk 150] [--source-concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_build import FAST_HOSTS, register, start_server  # noqa: E402
from bench_ledger import PG_SERVER  # noqa: E402

from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings  # noqa: E402
from reminders_pipeline.devices.registration import chunk_of  # noqa: E402
from reminders_pipeline.domain.times import Instant  # noqa: E402
from reminders_pipeline.ledger import migrate  # noqa: E402
from reminders_pipeline.ledger.db import Database  # noqa: E402
from reminders_pipeline_testing.celery_workers import (  # noqa: E402
    Worker,
    celery_config,
    delete_queue,
    worker_command,
)
from reminders_pipeline_testing.stack import BIN, ROOT, ThrowawayDatabases, dagster_url, wait_for  # noqa: E402

CHUNKS = 16


def devices_per_chunk(per_chunk: int, base: str) -> dict[str, list[str]]:
    port = base.rsplit(":", 1)[1]
    counts = [0] * CHUNKS
    subs: dict[str, list[str]] = {}
    i = 0
    while min(counts) < per_chunk:
        d = f"own-{i}"
        c = chunk_of(d, CHUNKS)
        if counts[c] < per_chunk:
            counts[c] += 1
            subs[d] = [f"http://{FAST_HOSTS[i % len(FAST_HOSTS)]}:{port}/c/{i}.ics"]
        i += 1
    return subs


def one_case(
    workers: int, subs: dict[str, list[str]], dbs: ThrowawayDatabases, env: dict[str, str], tmp: Path, launchers: int
) -> dict:
    ledger_url = dbs.create("bench_scale_ledger")
    db = Database(ledger_url)
    migrate.upgrade(db)
    register(db, Settings(database_url=ledger_url, source_allow_networks=LOOPBACK_NETWORKS), subs)
    db.dispose()
    queue = f"bench_scale_{uuid.uuid4().hex[:8]}"
    config = tmp / f"celery-{queue}.yaml"
    celery_config(config, queue)
    env = {**env, "REMINDERS_DATABASE_URL": ledger_url}
    started: list[Worker] = []
    try:
        for k in range(workers):
            name = f"s{workers}w{k}"
            args = worker_command(config, queue, name)
            started.append(Worker(name, args, env, tmp))
        for w in started:
            wait_for(f"worker {w.name}", lambda w=w: " ready." in w.output(), 120)
        launch = [str(BIN / "python"), "-m", "reminders_pipeline_testing.celery_runs", str(config), "build"]
        t = time.perf_counter()
        procs = [
            subprocess.Popen(
                [*launch, *map(str, range(k, CHUNKS, launchers))],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for k in range(launchers)
        ]
        lines = [
            json.loads(line)
            for p in procs
            for line in p.communicate(timeout=1800)[0].splitlines()
            if line.startswith("{")
        ]
        seconds = time.perf_counter() - t
        assert sorted(x["status"] for x in lines) == ["SUCCESS"] * CHUNKS, lines
        return {
            "workers": workers,
            "seconds": round(seconds, 1),
            "chunks_per_s": round(CHUNKS / seconds, 3),
            "devices_per_s": round(len(subs) / seconds, 1),
        }
    finally:
        for w in started:
            w.stop()
        delete_queue(queue)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-chunk", type=int, default=150)
    ap.add_argument("--source-concurrency", type=int, default=4)
    ap.add_argument("--launchers", type=int, default=4)
    args = ap.parse_args()
    t0 = Instant.now().whole_seconds
    dbs = ThrowawayDatabases(PG_SERVER)
    proc, base = start_server(
        0, CHUNKS * args.per_chunk * 2, t0, "--delay", "0.15", "--hosts", ",".join(FAST_HOSTS), "--light-ics"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench-celery-"))
    try:
        home = tmp / "dagster_home"
        home.mkdir()
        (home / "dagster.yaml").write_bytes((ROOT / "deploy/celery/dagster.yaml").read_bytes())
        instance_url = dagster_url(dbs.create("bench_scale_dagster"))
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")},
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
            "DAGSTER_HOME": str(home),
            "DAGSTER_POSTGRES_URL": instance_url,
            "REMINDERS_DAGSTER_EXECUTOR": "celery",
            "REMINDERS_SOURCE_ALLOW_NETWORKS": "127.0.0.0/8",
            "REMINDERS_SOURCE_CONCURRENCY": str(args.source_concurrency),
        }
        os.environ.update(DAGSTER_HOME=str(home), DAGSTER_POSTGRES_URL=instance_url)
        import dagster as dg

        with dg.DagsterInstance.from_config(str(home)):  # its tables exist before workers race to create them
            pass
        subs = devices_per_chunk(args.per_chunk, base)
        cases = [one_case(k, subs, dbs, env, tmp, args.launchers) for k in (1, 2)]
        ratio = cases[1]["chunks_per_s"] / cases[0]["chunks_per_s"]
        print(
            json.dumps(
                {
                    "chunks": CHUNKS,
                    "devices_per_chunk": args.per_chunk,
                    "read_latency_s": 0.15,
                    "source_concurrency": args.source_concurrency,
                    "launchers": args.launchers,
                    "cpus": os.cpu_count(),
                    "cases": cases,
                    "speedup_2_over_1": round(ratio, 2),
                    "bar": 1.7,
                    "passes": ratio >= 1.7,
                },
                indent=2,
            )
        )
    finally:
        proc.kill()
        dbs.drop_all()


if __name__ == "__main__":
    main()
