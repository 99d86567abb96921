"""Celery workers for the Celery executor's test and scale-out benchmark, on this machine's RabbitMQ.

The broker is ``REMINDERS_TEST_CELERY_BROKER_URL``, else RabbitMQ's default on 127.0.0.1:5672. Each
caller gives its workers a queue of its own (``celery_config``) and deletes it at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import yaml

from .stack import BIN, ROOT, Service

BROKER = os.environ.get("REMINDERS_TEST_CELERY_BROKER_URL", "pyamqp://guest:guest@127.0.0.1:5672//")


class Worker(Service):
    """``dagster-celery worker start`` in its own process group; stopped warm (SIGTERM to the group),
    then SIGKILL of the group."""

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        super().stop()


def worker_command(config: Path, queue: str, name: str) -> list[str]:
    """One worker of one process (``--concurrency=1``) consuming ``queue``, named ``name``."""
    worker = [str(BIN / "dagster-celery"), "worker", "start", "-A", "dagster_celery.app", "-y", str(config)]
    return [*worker, "-q", queue, "--name", name, "--", "--concurrency=1"]


def celery_config(path: Path, queue: str) -> None:
    """deploy/celery's run config with the broker filled in and the caller's own queue."""
    config = yaml.safe_load((ROOT / "deploy/celery/drain_run_config.yaml").read_text())
    execution = config["execution"]["config"]
    execution["broker"], execution["backend"] = BROKER, "rpc://"
    execution["config_source"]["task_default_queue"] = queue
    path.write_text(yaml.safe_dump(config))


def delete_queue(queue: str) -> None:
    import kombu

    with kombu.Connection(BROKER, connect_timeout=5) as conn:
        conn.default_channel.queue_delete(queue)
