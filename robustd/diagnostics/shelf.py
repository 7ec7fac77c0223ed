"""The diagnostics' shelf: their reports and golden digests, kept in the event log's database file.

All the manager needs of persistence, and nothing more (it never sees the store or the engine). A
write is held by the journal (robustd/journal.py) and goes with its next commit, in one transaction
with whatever events that commit carries, on the writer thread: saving a report never waits on the
state disk, and one the disk cannot take yet waits in memory like the events. Reads see a held write
at once, so a report is listed the moment it is saved, disk or no disk.

Reads of reports go to the reader thread (robustd/reads.py), each within its deadline, so a frozen
state disk makes Get and List answer UNAVAILABLE rather than stall the event loop. The golden digests
(a few, one per model and GPU kind) are read once at start and kept in memory: a MiniGPT run is
judged against them whatever the disk does.

A shelf without a journal (tools and tests that open a Store on its own) writes at once, on the
caller's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from robustd.reads import InlineReads, ThreadReads
from robustd.store import Store

if TYPE_CHECKING:
    from robustd.journal import Journal


class Shelf:
    def __init__(self, store: Store, journal: Journal | None = None, reads: InlineReads | ThreadReads | None = None):
        self._store = store
        self._journal = journal
        self._reads = reads or InlineReads()
        self._goldens = {key: (digest, report_id, at) for key, digest, report_id, at in store.goldens()}

    # -- reports -------------------------------------------------------------------------------
    def save_report(self, report_id: str, started: float, outcome: str, text: str, keep: int) -> None:
        """Insert or replace one report (its JSON); the log keeps the newest `keep`."""
        self._put("report", report_id, (started, outcome, text, keep))

    async def report(self, report_id: str) -> str | None:
        """One report's JSON, or None; reads.Unreadable if the log does not answer in time."""
        held = self._held("report").get(report_id)
        if held is not None:
            return str(held[2])
        store = self._store
        return await self._reads(lambda: store.report(report_id))

    async def reports(self, limit: int, outcome: str | None = None) -> list[str]:
        """The newest reports' JSON, newest first; only those with `outcome` (a name) if given;
        reads.Unreadable if the log does not answer in time."""
        held = self._held("report")
        store = self._store
        stored = await self._reads(lambda: store.reports(limit + len(held), outcome))
        found = {report_id: (started, out, text) for report_id, started, out, text in stored}
        for report_id, value in held.items():  # a held write replaces what the log has (RUNNING -> PASS)
            found[report_id] = (float(value[0]), str(value[1]), str(value[2]))
        rows = sorted(found.values(), key=lambda r: r[0], reverse=True)
        return [text for _started, out, text in rows if outcome is None or out == outcome][:limit]

    # -- golden digests ------------------------------------------------------------------------
    def set_golden(self, key: str, digest: str, report_id: str, at: float) -> None:
        self._goldens[key] = (digest, report_id, at)
        self._put("golden", key, (digest, report_id, at))

    def goldens(self) -> list[tuple[str, str, str, float]]:
        """(key, digest, report id, recorded at), by key, from memory."""
        return [(k, *self._goldens[k]) for k in sorted(self._goldens)]

    # -- internals -----------------------------------------------------------------------------
    def _put(self, kind: str, key: str, value: tuple[Any, ...]) -> None:
        if self._journal is not None:
            self._journal.put(kind, key, value)
        else:
            self._store.commit([], None, {(kind, key): value})

    def _held(self, kind: str) -> dict[str, tuple[Any, ...]]:
        return {} if self._journal is None else self._journal.waiting(kind)
