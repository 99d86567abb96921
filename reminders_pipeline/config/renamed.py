"""Settings renamed, read by their old name for one release with a deprecation line, so an operator
who upgrades without editing the environment keeps the setting and is told to rename it."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Settings renamed, by their old name: accepted for one release, with a deprecation line, where the
# new name is not set. Those that apply to every provider are REMINDERS_SEND_*.
RENAMED = {"REMINDERS_APNS_HALT_AFTER": "REMINDERS_SEND_HALT_AFTER"}


def with_renamed(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with each old name's value under its new name, unless the new name is set too."""
    moved = {}
    for old, new in RENAMED.items():
        if env.get(old, "") == "":
            continue
        if env.get(new, "") == "":
            moved[new] = env[old]
            _warn_once(f"{old} is deprecated and will be refused in the next release: set {new} instead")
        else:
            _warn_once(f"{old} is deprecated and ignored: {new} is set")
    return {**env, **moved} if moved else env


@functools.cache
def _warn_once(line: str) -> None:
    """Once per process: settings are read by every run, sensor tick and resource."""
    log.warning("%s", line)
