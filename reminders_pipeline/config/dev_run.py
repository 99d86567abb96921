"""The settings a ``reminders dev`` run uses, kept beside its ledger so commands typed next to it agree.

``reminders dev`` runs with settings of its own (one device chunk, loopback sources, the demo's
VAPID key, an absolute ledger URL). ``reminders check`` or ``queue list`` typed in a second
terminal would otherwise judge 16 chunks against its 1. So the run writes them to
``./var/dev.env``, and the CLI started in that folder takes them as defaults, says so on stderr,
and lets its own environment win. A command given another ledger (``REMINDERS_DATABASE_URL``)
ignores the file: those settings were the dev ledger's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PREFIX = "REMINDERS_"
DATABASE_URL = "REMINDERS_DATABASE_URL"


def env_file(root: Path) -> Path:
    return root / "var" / "dev.env"


def write(root: Path, env: Mapping[str, str]) -> Path:
    """Record the ``REMINDERS_*`` settings of a dev run under ``root`` (owner-only: a database URL
    may carry a password)."""
    path = env_file(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"{name}={value}\n" for name, value in sorted(env.items()) if name.startswith(PREFIX) and "\n" not in value
    ]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("# Written by `reminders dev`: the settings it runs with, for commands typed beside it.\n")
        f.writelines(lines)
    return path


def read(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, sep, value = line.partition("=")
        if sep and name.startswith(PREFIX):
            values[name] = value
    return values


def with_dev_run(env: Mapping[str, str], root: Path) -> tuple[dict[str, str], Path | None]:
    """``env`` over the settings of the dev run under ``root``, when there is one and ``env`` names
    no other ledger; and the file used (None when none was)."""
    path = env_file(root)
    if not path.is_file():
        return dict(env), None
    recorded = read(path)
    if env.get(DATABASE_URL) and env[DATABASE_URL] != recorded.get(DATABASE_URL):
        return dict(env), None
    return {**recorded, **env}, path
