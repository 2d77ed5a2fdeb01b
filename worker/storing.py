"""Storing finished lines, several in one call when they finish in quick succession.

Each stored line costs Redis a Lua call and the read and write of the batch's counters;
lines that finish within STORE_GROUP_WAIT_S of each other (short answers, a batch of
rows ending together) are stored by one `put_lines` call, which writes each line once
per line key as always and adds the summed counters of the lines it wrote once. A line
that took longer than STORE_GROUP_WAIT_S to decode is stored at once (with any line
waiting), and a side thread stores what has waited STORE_GROUP_WAIT_S, so no line waits
longer than that. `flush` stores everything now: a job's lines are flushed before RQ
hears that the job is done, so a job never ends with a line still in memory.
"""

from __future__ import annotations

import logging
import threading
import time

from jobstore import config, store
from jobstore.keys import custom_id_of
from jobstore.lines import dumps
from worker.execute import Outcome

log = logging.getLogger("specfleet.worker")


class LineStore:
    """Pending finished lines of one worker, by batch; see the module docstring.
    `ctx` is the worker's WorkerContext. Use as a context manager (the side thread)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._pending: dict[str, list[tuple[store.LineToStore, int, str]]] = {}
        self._count = 0
        self._since = 0.0  # when the oldest pending line finished
        self._cancelled: set[str] = set()
        self._gone: set[str] = set()  # batches found without their record
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="line-store", daemon=True)

    def __enter__(self) -> LineStore:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def add(
        self,
        batch_id: str,
        key: str,
        number: int,
        outcome: Outcome,
        took_s: float,
        digest: str | None = None,
    ) -> None:
        """A finished line (`number`: its line number, for the log; `digest`: its
        request's, kept with a result). Stored now when it took long, when enough lines
        wait, or when the oldest has waited long enough."""
        entry = store.LineToStore(key, dumps(outcome.line), outcome.ok, outcome.counters, digest)
        said = (
            f"{outcome.completion_tokens} tokens"
            if outcome.ok
            else (f"error {outcome.line['error']['code']}")
        )
        with self._lock:
            if not self._count:
                self._since = time.monotonic()
            self._pending.setdefault(batch_id, []).append((entry, number, said))
            self._count += 1
            wait = config.STORE_GROUP_WAIT_S
            if (
                took_s >= wait
                or self._count >= config.STORE_GROUP_LINES
                or time.monotonic() - self._since >= wait
            ):
                self.flush()

    def cancelled(self, batch_id: str) -> bool:
        """Whether a store of this batch's lines found it cancelled."""
        return batch_id in self._cancelled

    def gone(self, batch_id: str) -> bool:
        """Whether a store of this batch's lines found its record gone (nothing stored)."""
        return batch_id in self._gone

    def known(self, batch_id: str) -> None:
        """The batch has its record (again): a job read it."""
        self._gone.discard(batch_id)

    def flush(self) -> None:
        """Store every pending line now (each once per line key) and log them."""
        with self._lock:
            pending, self._pending, self._count = self._pending, {}, 0
            try:
                self._store(pending)
            except BaseException:  # kept for the next flush: never dropped
                for batch_id, lines in pending.items():
                    self._pending[batch_id] = lines + self._pending.get(batch_id, [])
                    self._count += len(lines)
                raise

    def _store(self, pending: dict) -> None:
        """Store each batch's lines in one call; a batch stored is taken out of
        `pending` at once, so a failure keeps only what was not stored."""
        for batch_id in list(pending):
            lines = pending[batch_id]
            done = store.put_lines(
                self.ctx.conn,
                self.ctx.keys,
                batch_id,
                [entry for entry, _, _ in lines],
                worker=self.ctx.worker_name,
                ttl_s=self.ctx.ttl_s,
            )
            del pending[batch_id]
            if done.cancelled:
                self._cancelled.add(batch_id)
            if done.gone:  # nothing stored; the job that holds them drops the rest
                self._gone.add(batch_id)
                continue
            for (entry, number, said), wrote in zip(lines, done.written, strict=True):
                custom_id = custom_id_of(entry.key)
                log.info(
                    "%s line %d (%s): %s%s",
                    batch_id,
                    number,
                    custom_id,
                    said,
                    "" if wrote else " (already stored by another run)",
                )

    def _run(self) -> None:
        wait = config.STORE_GROUP_WAIT_S
        while not self._stop.wait(wait / 2):
            with self._lock:
                due = self._count and time.monotonic() - self._since >= wait
                if due:
                    try:
                        self.flush()
                    except Exception as exc:  # Redis away: the next add or flush retries
                        log.warning("storing finished lines failed: %s", exc)
