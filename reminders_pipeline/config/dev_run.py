"""The settings a running ``reminders dev`` uses, kept beside its ledger so commands typed next to it agree.

``reminders dev`` runs with settings of its own choosing (one device chunk, loopback sources, the
demo's VAPID key, an absolute ledger URL). ``reminders check`` or ``queue list`` typed in a second
terminal would otherwise judge 16 chunks against its 1. So the run writes those settings, and only
those (``KEPT``), to ``./var/dev.env`` with its process's identity, and removes the file when it
ends. The CLI started in that folder takes them as defaults while that process still runs, says so
on stderr, and lets its own environment win. It ignores the file when the command names another
ledger, when the run that wrote it is gone, or when anyone but the user could have written it: a
folder's file must not be able to switch on sending or point a provider elsewhere.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import psutil

from reminders_pipeline.config.setting_types import normalize_database_url

DATABASE_URL = "REMINDERS_DATABASE_URL"
KEPT = (
    DATABASE_URL,
    "REMINDERS_CHUNK_COUNT",
    "REMINDERS_SOURCE_ALLOW_NETWORKS",
    "REMINDERS_VAPID_PRIVATE_KEY_FILE",
    "REMINDERS_VAPID_SUBJECT",
)
WRITER = "REMINDERS_DEV_RUN"  # "pid started": the run that wrote the file


def env_file(root: Path) -> Path:
    return root / "var" / "dev.env"


def write(root: Path, env: Mapping[str, str]) -> Path:
    """Record the dev run's own settings under ``root``: owner-only (a database URL may carry a
    password), never through a link, one printable value per line."""
    path = env_file(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    lines = [f"{WRITER}={me.pid} {me.create_time()!r}\n"]
    kept = {name: env[name] for name in KEPT if name in env and env[name].isprintable()}
    if DATABASE_URL in kept:
        kept[DATABASE_URL] = normalize_database_url(kept[DATABASE_URL])  # as compared in ``with_dev_run``
    lines += [f"{name}={value}\n" for name, value in kept.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("# Written by `reminders dev`: its settings, for commands typed beside it while it runs.\n")
        f.writelines(lines)
    return path


def remove(root: Path) -> None:
    env_file(root).unlink(missing_ok=True)


def read(path: Path) -> dict[str, str]:
    """The file's settings, when the user alone could have written it and its run still runs."""
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        return {}
    values = {}
    for line in path.read_text(encoding="utf-8").split("\n"):
        name, sep, value = line.partition("=")
        if sep and (name in KEPT or name == WRITER):
            values[name] = value
    return {k: v for k, v in values.items() if k != WRITER} if _running(values.get(WRITER, "")) else {}


def _running(writer: str) -> bool:
    pid, _, started = writer.partition(" ")
    try:
        return bool(psutil.Process(int(pid)).create_time() == float(started))
    except (ValueError, psutil.Error):
        return False


def with_dev_run(env: Mapping[str, str], root: Path) -> tuple[dict[str, str], Path | None]:
    """``env`` over the settings of the dev run under ``root``, when one runs and ``env`` names no
    other ledger; and the file used (None when none was)."""
    path = env_file(root)
    if not path.is_file():
        return dict(env), None
    recorded = read(path)
    named = env.get(DATABASE_URL)
    if not recorded or (named and normalize_database_url(named) != recorded.get(DATABASE_URL)):
        return dict(env), None
    return {**recorded, **env}, path
