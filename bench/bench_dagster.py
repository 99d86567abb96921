"""What Dagster costs around the core, for the two choices docs/dagster.md records.

(a) Build: one run per tick (a partition range, ``BackfillPolicy.single_run()``) against one run per
    chunk (what ``build_schedule_from_partitioned_job`` would launch). Each run is a fresh
    ``dagster asset materialize`` process, as a launched run is a fresh process; the same ledger
    and sources each time; baseline: the core ``build()`` over every chunk with no Dagster at all.
(b) Drain: Dagster events per drain run for due rows and batch settings, to show they grow with
    batches (bounded by REMINDERS_DRAIN_MAX_BATCHES), not rows. Baseline: the core ``drain()``.

    .venv/bin/python bench/bench_dagster.py [--devices 800] [--due 10000] [--skip-build]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg

from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings
from reminders_pipeline.dev.demo import DEV_INSTANCE_YAML
from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline.sending.drain import drain

CHUNKS = Settings.from_env().chunk_count
TOKEN = "ab" * 32


@contextmanager
def feed_server(sources: int, items: int, start_in: int, step: int = 60) -> Iterator[str]:
    """``/s/<n>.json``: ``items`` events ``step`` seconds apart, the first starting ``start_in`` from now."""
    t0 = int(time.time()) + start_in
    bodies = {
        f"/s/{n}.json": json.dumps(
            {
                "items": [
                    {"id": f"e{k}", "title": f"S{n} E{k}", "startsAt": t0 + k * step, "expiresAt": t0 + k * step + 1800}
                    for k in range(items)
                ]
            }
        ).encode()
        for n in range(sources)
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            body = bodies.get(self.path, b"{}")
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def ledger_with_devices(path: Path, base: str, devices: int, sources: int, lead: int = 3600) -> Settings:
    settings = Settings(database_url=f"sqlite:///{path}", source_allow_networks=LOOPBACK_NETWORKS)
    db = Database(settings.database_url)
    migrate.upgrade(db)
    for i in range(devices):
        put_device(db, settings, DeviceSpec(f"dev-{i}", TOKEN, lead, (), (f"{base}/s/{i % sources}.json",)))
    db.dispose()
    return settings


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def materialize(home: Path, ledger_url: str, partition_args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "DAGSTER_HOME": str(home), "REMINDERS_DATABASE_URL": ledger_url}
    env["REMINDERS_SOURCE_ALLOW_NETWORKS"] = ",".join(LOOPBACK_NETWORKS)  # the feed server is on 127.0.0.1
    cmd = [
        sys.executable, "-W", "ignore", "-m", "dagster", "asset", "materialize",
        "-m", "reminders_pipeline.definitions", "--select", "notification_queue", *partition_args,
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]


def events_in(home: Path) -> dict[str, int]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs()
        return {"runs": len(runs), "events": sum(len(instance.all_logs(r.run_id)) for r in runs)}


def build_mode(mode: str, template: Path, tmp: Path) -> dict[str, Any]:
    work = tmp / mode
    home = work / "home"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(DEV_INSTANCE_YAML)
    events_in(home)  # create the instance's SQLite storage once, before parallel runs race to
    ledger = work / "ledger.sqlite3"
    shutil.copyfile(template, ledger)
    url = f"sqlite:///{ledger}"
    keys = [f"{c:03d}" for c in range(CHUNKS)]
    cpu, started = children_cpu(), time.perf_counter()
    if mode == "run_per_tick":
        run_all([materialize(home, url, ["--partition-range", f"{keys[0]}...{keys[-1]}"])])
    elif mode == "run_per_chunk_sequential":
        for key in keys:
            run_all([materialize(home, url, ["--partition", key])])
    else:  # run_per_chunk_2_parallel: what a 2-core launcher with a build limit of 2 would do
        for i in range(0, len(keys), 2):
            run_all([materialize(home, url, ["--partition", k]) for k in keys[i : i + 2]])
    wall, cpu = time.perf_counter() - started, children_cpu() - cpu
    counted = events_in(home)
    return {"wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2), **counted}


def core_build_baseline(template: Path, tmp: Path) -> dict[str, Any]:
    ledger = tmp / "baseline.sqlite3"
    shutil.copyfile(template, ledger)
    settings = Settings(database_url=f"sqlite:///{ledger}", source_allow_networks=LOOPBACK_NETWORKS)
    db = Database(settings.database_url)
    started = time.perf_counter()
    rows = sum(build(db, settings, chunks=[c], limit=settings.chunk_size).rows_inserted for c in range(CHUNKS))
    wall = time.perf_counter() - started
    db.dispose()
    return {"wall_seconds": round(wall, 2), "rows_inserted": rows}


def bench_build(devices: int, tmp: Path) -> dict[str, Any]:
    with feed_server(sources=20, items=10, start_in=7200) as base:
        template = tmp / "template.sqlite3"
        ledger_with_devices(template, base, devices, sources=20)
        out: dict[str, Any] = {
            "devices": devices,
            "chunks": CHUNKS,
            "core_build_baseline": core_build_baseline(template, tmp),
        }
        for mode in ("run_per_tick", "run_per_chunk_sequential", "run_per_chunk_2_parallel"):
            out[mode] = build_mode(mode, template, tmp)
    return out


def due_feed() -> Any:
    """100 events starting 34 to 59 minutes from now: every lead:3600 reminder is due, none too late."""
    return feed_server(sources=1, items=100, start_in=3540 - 99 * 15, step=15)


def drain_case(tmp: Path, due: int, batch_size: int, max_batches: int) -> dict[str, Any]:
    """``due`` rows due a minute ago (100 items per source, ``due / 100`` devices), drained by the job."""
    from reminders_pipeline.defs.drain import drain_job
    from reminders_pipeline.defs.resources import AlertingResource, LedgerResource, SenderResource

    name = f"drain_{due}_{batch_size}_{max_batches}"
    with due_feed() as base:
        settings = ledger_with_devices(tmp / f"{name}.sqlite3", base, due // 100, sources=1)
        db = Database(settings.database_url)
        built = build(db, settings)
    assert built.rows_inserted == due, built.as_dict()
    os.environ["REMINDERS_DRAIN_BATCH_SIZE"] = str(batch_size)
    os.environ["REMINDERS_DRAIN_MAX_BATCHES"] = str(max_batches)
    resources = {
        "ledger": LedgerResource(database_url=settings.database_url),
        "sender": SenderResource(enabled="false"),  # dry run: every row is decided and settled disabled
        "alerting": AlertingResource(),
    }
    with dg.instance_for_test() as instance:
        started = time.perf_counter()
        result = drain_job.execute_in_process(resources=resources, instance=instance)
        wall = time.perf_counter() - started
        assert result.success
        summary = result.output_for_node("summarize")
        events = len(instance.all_logs(result.run_id))
    batches = sum(1 for e in result.all_events if e.is_step_start and e.step_key.startswith("send_batch["))
    assert summary["outcomes"].get("disabled") == due, summary
    db.dispose()
    return {"due_rows": due, "batch_size": batch_size, "max_batches": max_batches, "batches": batches,
            "events": events, "wall_seconds": round(wall, 2)}  # fmt: skip


def core_drain_baseline(tmp: Path, due: int) -> dict[str, Any]:
    with due_feed() as base:
        settings = ledger_with_devices(tmp / "drain_baseline.sqlite3", base, due // 100, sources=1)
        db = Database(settings.database_url)
        build(db, settings)
    started = time.perf_counter()
    summary = drain(db, settings, checked_sender_factory(db, settings))
    wall = time.perf_counter() - started
    db.dispose()
    return {"due_rows": due, "settled": summary.outcomes.get("disabled", 0), "wall_seconds": round(wall, 2)}


def bench_drain(due: int, tmp: Path) -> dict[str, Any]:
    cases = [
        drain_case(tmp, 1000, 500, 40),
        drain_case(tmp, due, 500, 40),
        drain_case(tmp, due, 250, 40),
        drain_case(tmp, due, 500, 5),
    ]
    # events = fixed + per_batch * batches, from the two 10k cases with the most different batch counts
    a, b = cases[2], cases[3]
    per_batch = (a["events"] - b["events"]) / (a["batches"] - b["batches"])
    return {
        "cases": cases,
        "events_per_batch": round(per_batch, 2),
        "fixed_events": round(a["events"] - per_batch * a["batches"], 1),
        "core_drain_baseline": core_drain_baseline(tmp, due),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=800)
    parser.add_argument("--due", type=int, default=10_000)
    parser.add_argument("--skip-build", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        out: dict[str, Any] = {
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "dagster": dg.__version__,
            },
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        if not args.skip_build:
            out["build"] = bench_build(args.devices, tmp)
        out["drain"] = bench_drain(args.due, tmp)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
