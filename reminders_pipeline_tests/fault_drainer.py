"""A drainer process for the fault tests: the real ``drain()`` in a process of its own.

The fault tests need drainers that can race each other on several cores, be killed with SIGKILL
mid-send, or lose their database under them, none of which a thread in the test process can do.
Configuration is the production path: ``Settings.from_env`` (``REMINDERS_DATABASE_URL``,
``REMINDERS_ENABLED=true``, the mock's ``REMINDERS_APNS_*``, batch sizes, timeouts).

    python -m reminders_pipeline_tests.fault_drainer --claimer NAME [--wait-go]

Protocol on stdout, one JSON object per line: ``{"ready": pid}`` once imports are done and the
database answered (so a race starts fair), then, after ``go`` on stdin when ``--wait-go`` is
given, ``{"claimer": NAME, "summary": {...}}`` when the drain returns. A drain that raises prints
its traceback on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline.sending import drain as drain_module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--claimer", required=True, help="claimed_by of every row this drainer claims")
    parser.add_argument("--wait-go", action="store_true", help="wait for a line 'go' on stdin before draining")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    settings = Settings.from_env()
    # drain() names its claimer with new_claimer(); a known name lets the test tie rows to processes.
    drain_module.new_claimer = lambda: args.claimer
    db = Database(settings.database_url)
    with db.read() as conn:
        ledger.ping(conn)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    if args.wait_go and sys.stdin.readline().strip() != "go":
        return 2
    summary = drain_module.drain(db, settings, checked_sender_factory(db, settings))
    print(json.dumps({"claimer": args.claimer, "summary": summary.as_dict()}), flush=True)
    db.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
