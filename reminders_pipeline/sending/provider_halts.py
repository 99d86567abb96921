"""The providers a dispatcher stopped sending to, and when each is tried again.

A provider halts on a configuration fault (a revoked key, a wrong sender id) or an outage; its
rows wait while the other providers' go on. One of its rows, not all of them, is tried again: soon
after an outage, after a growing backoff after a configuration fault. The first row it sends (or
answers without a halt) brings it back. The dispatcher (``dispatch.Dispatcher``) owns the batches;
this keeps only what each halt says and decides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import Connection

from reminders_pipeline import ledger
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.sending.faults import is_outage, provider_name

log = logging.getLogger(__name__)

HALT_BACKOFF_SECONDS = (60, 120, 300, 900)  # after a provider's configuration fault, probe it again this late
OUTAGE_PROBE_SECONDS = 5.0  # while a provider is unreachable, try one of its rows this often
PROBE_READ = 50  # due rows of a halted provider read for its probe (some may be in flight)
RETRY_SECONDS = 0.05  # rows due but not claimed (another claimer holds them): look again shortly


@dataclass
class ProviderHalt:
    """A provider this dispatcher stopped sending to: why, and when one of its rows is tried again."""

    reason: str
    probe_at: Instant
    faults: int = 0  # configuration faults in a row: each waits longer (``HALT_BACKOFF_SECONDS``)
    probing: bool = False  # a one-row probe batch is in flight
    probed_at: Instant | None = None  # when the last probe started: the next one counts from it


@dataclass
class ProviderHalts:
    """The halted providers of one dispatcher, named ``name`` in its log lines."""

    name: str
    halted: dict[str, ProviderHalt] = field(default_factory=dict)

    def skipped(self) -> frozenset[str]:
        """The providers whose rows the next read leaves out."""
        return frozenset(self.halted)

    def due_probes(self, now: Instant) -> list[str]:
        """Halted providers whose time to try a row again has come, and with no probe in flight."""
        return sorted(p for p, h in self.halted.items() if not h.probing and h.probe_at <= now)

    def next_probe_times(self) -> list[Instant]:
        return [h.probe_at for h in self.halted.values() if not h.probing]

    def probe_rows(self, conn: Connection, clock: Instant, busy: set[int], providers: list[str]) -> dict[str, int]:
        """One due row of each of ``providers`` not in ``busy``: its probe."""
        found = {}
        for provider in providers:
            due = ledger.due_ids(conn, clock, only_provider=provider, limit=PROBE_READ)
            free = [i for i in due if i not in busy]
            if free:
                found[provider] = free[0]
        return found

    def probe_started(self, provider: str, row: int | None, now: Instant) -> bool:
        """Note the probe of ``provider`` with ``row``; False when none of its rows is due (nothing
        to try yet: it looks again in a while)."""
        halt = self.halted[provider]
        if row is None:
            halt.probe_at = now + OUTAGE_PROBE_SECONDS
            return False
        halt.probing, halt.probed_at = True, now
        return True

    def probe_ended(self, provider: str | None) -> None:
        if provider in self.halted:
            self.halted[provider].probing = False

    def note_halt(self, provider: str, reason: str, now: Instant) -> None:
        """A provider halted: its rows wait (the others' go on), and one of them is tried again
        soon after an outage, or after a growing backoff after a configuration fault."""
        before = self.halted.get(provider)
        faults = 0 if before is None or is_outage(reason) else before.faults
        probed_at = None if before is None else before.probed_at
        if is_outage(reason):
            wait = OUTAGE_PROBE_SECONDS
            since = probed_at or now  # a refused probe may itself take a second: probes keep their pace
        else:
            wait = HALT_BACKOFF_SECONDS[min(faults, len(HALT_BACKOFF_SECONDS) - 1)]
            faults += 1
            since = now
        probing = before is not None and before.probing
        self.halted[provider] = ProviderHalt(reason, max(now, since + wait), faults, probing, probed_at)
        if before is None or not is_outage(reason):
            log.error(
                "dispatcher %s: %s halted (%s); its rows wait, one is tried again in %ss",
                self.name, provider_name(provider), reason, wait,
            )  # fmt: skip

    def note_answers(self, done: DrainResult, probe: str | None, now: Instant) -> bool:
        """A halted provider that sent a row (or whose probe it answered without a halt) is back;
        True when one is, so its rows are read again. A probe the policy settled unsent (its event
        started while it waited) heard nothing: the next probe goes now, with another row."""
        back = False
        for provider in list(self.halted):
            if provider in done.halts:
                continue
            if done.providers.get(f"{provider}:sent") or (
                provider == probe and done.providers.get(f"{provider}:failed")
            ):
                del self.halted[provider]
                back = True
                log.warning("dispatcher %s: sending %s rows again", self.name, provider_name(provider))
            elif provider == probe:
                # its row was another claimer's (look again shortly), or settled unsent (try another now)
                self.halted[provider].probe_at = now if done.claimed else now + RETRY_SECONDS
        return back
