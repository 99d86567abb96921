"""Ending every process a command started, including those its children left behind.

``dagster dev`` stops its webserver and daemon on SIGINT, but its code server waits for the runs in
flight, and a run's worker is a grandchild that outlives them all: stopping ``dagster dev`` alone
leaves a dispatcher claiming and sending. ``reminders dev`` therefore owns the whole tree: it becomes
the subreaper of its descendants (Linux), so one whose parent died is re-parented to it instead of
to init, and on a stop it signals whatever is left under it, then kills what outlives the grace.

The process table is read through psutil (``/proc`` on Linux, ``sysctl`` elsewhere).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
import time
from collections.abc import Sequence

import psutil

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_ENDED = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)

Identity = tuple[int, float]  # (pid, start time): a pid alone may be reused by an unrelated process


def become_subreaper() -> bool:
    """Have orphaned descendants re-parented here (Linux), so a stop can still find and end them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        status: int = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # ctypes' default restype: C int
        return status == 0
    except (OSError, AttributeError):
        return False


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a supervisor, the terminal closed
_PARENT_DEATH_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"  # PR_SET_PDEATHSIG: kept across exec
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent died before the prctl
    "    sys.exit(143)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def ended_with_parent(command: Sequence[str]) -> list[str]:
    """``command`` run so that it gets SIGTERM if this process dies without stopping it (Linux).

    A child in a process group of its own misses what is sent to this one's group, SIGKILL
    included; the parent-death signal still reaches it. Set through a short shim that execs the
    command, since ``preexec_fn`` is unsafe while threads run (the demo source serves in one)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _PARENT_DEATH_SHIM, str(os.getpid()), command[0], *command[1:]]


def _table() -> dict[int, tuple[int, float, bool]]:
    """pid -> (parent pid, start time, still running) for every process visible here."""
    table = {}
    for proc in psutil.process_iter(["ppid", "create_time", "status"]):  # skips what exits meanwhile
        info = proc.info
        table[proc.pid] = (info["ppid"], info["create_time"], info["status"] not in _ENDED)
    return table


def descendants(root: int) -> set[Identity]:
    """Every running process below ``root`` (children, their children, ...)."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[Identity] = set()
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        _, started, running = table[pid]
        if running:
            found.add((pid, started))
        todo.extend(children.get(pid, []))
    return found


def _alive(procs: set[Identity]) -> set[Identity]:
    table = _table()
    return {(pid, started) for pid, started in procs if pid in table and table[pid][1] == started and table[pid][2]}


def _signal_all(procs: set[Identity], sig: int) -> None:
    for pid, _ in procs:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# Dagster's compute-log mirror of a run's output: a ``tail -F`` and the script watching it for
# orphaning. The run worker ends both with SIGTERM when its step ends; a SIGINT would make the
# watcher print a KeyboardInterrupt traceback instead.
COMPUTE_LOG_HELPERS = ("watch_orphans.py", "tail")


def _is_compute_log_helper(pid: int) -> bool:
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return bool(argv) and any(os.path.basename(arg) in COMPUTE_LOG_HELPERS for arg in argv[:2])


def signal_tree(root: int, sig: int) -> set[Identity]:
    """Send ``sig`` at once to every process below ``root`` but Dagster's compute-log helpers, which
    their run worker ends; returns every process below ``root``, helpers included."""
    procs = descendants(root)
    _signal_all({p for p in procs if not _is_compute_log_helper(p[0])}, sig)
    return procs


def reap_children() -> None:
    """Collect the exit status of every child that has ended (orphans re-parented here included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        except OSError as exc:  # pragma: no cover - EINTR is retried by Python itself
            if exc.errno != errno.EINTR:
                return
            continue
        if pid == 0:
            return


def end_tree(
    root: int, known: set[Identity], grace_until: float, *, spare: frozenset[int] = frozenset(), poll: float = 0.1
) -> set[Identity]:
    """SIGTERM every process still below ``root`` (and any of ``known`` still running), wait until
    ``grace_until`` (``time.monotonic()``) for them to end, then SIGKILL the rest.

    SIGTERM first because a run worker in the middle of a send settles what is on the wire when
    asked; SIGKILL only for what outlives the grace. ``spare``: pids left to end by themselves once
    the others are gone (a supervisor waiting for its children), killed only at the deadline.
    Returns the processes that had to be killed.
    """
    targets: set[Identity] = set()
    while True:
        reap_children()
        found = _alive(targets | known | descendants(root))
        _signal_all({p for p in found - targets if p[0] not in spare}, signal.SIGTERM)  # each once, late arrivals too
        targets |= found
        if not found or time.monotonic() >= grace_until:
            break
        time.sleep(poll)
    killed: set[Identity] = set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # what a killed process started meanwhile is killed too
        left = _alive(targets | descendants(root))
        if not left:
            break
        _signal_all(left - killed, signal.SIGKILL)
        killed |= left
        reap_children()
        time.sleep(poll)
    reap_children()
    return killed
