"""`spec-worker --batch N`: several queued lines decoded together, RQ semantics kept.

The worker takes its first job as usual, then claims more from the same queue
(non-blocking) while rows are free, so new lines join as others finish. Every
claimed job gets an RQ execution at once, so it sits in the started registry
with a heartbeat like any running job: if this process dies, the reaper of
another worker puts the job back. Each finished line is handed to RQ's own
`perform_job` as a precomputed outcome (set on the job as `SafeJob.precomputed` right
before, and given to run_request as an argument), so success, failure callbacks,
retries and result storage go through exactly the same path as a single job.

Faults: a job past its timeout leaves the batch and fails with RQ's timeout
exception (retried like any timeout); an unexpected engine error runs the
remaining lines one by one, so a poison request fails alone; a second stop
signal puts every unfinished claimed job back at the front of the queue.
"""

from __future__ import annotations

import logging
import threading
import time

from rq.queue import Queue
from rq.timeouts import JobTimeoutException

from jobstore.jobfile import JobLine
from worker import rqcompat
from worker.batching import run_lines
from worker.guard import Heartbeat, SafeJob, vet
from worker.jobs import get_context, read_request

log = logging.getLogger("specfleet.worker")


class _Claimed:
    """One claimed job: its RQ execution and, once read, its line."""

    def __init__(self, job: SafeJob, execution, line: JobLine | None):
        self.job, self.execution, self.line = job, execution, line
        self.deadline = time.monotonic() + (job.timeout or 180)


class BatchSession:
    """Claim, decode together, and hand results to RQ; see the module docstring."""

    def __init__(self, worker, queue: Queue, max_batch: int, limit: int | None = None):
        self.worker, self.queue, self.max_batch = worker, queue, max_batch
        self.limit = limit  # most jobs to take from the queue (--max-jobs), None: no limit
        self.taken = 1  # jobs taken from the queue, the first one included
        self.active: dict[str, _Claimed] = {}  # job id -> claimed, not yet performed
        self._lock = threading.Lock()
        self.lines = 0
        self.peak = 0

    # -- claiming ------------------------------------------------------------------
    def _claim(self, job: SafeJob) -> _Claimed | None:
        """Give a vetted job its execution; None if it needs no engine (performed now)."""
        execution = self.worker.prepare_execution(job)
        self.worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
        claimed = _Claimed(job, execution, self._line_for(job))
        if claimed.line is None:  # already answered, cancelled, other model: no engine
            self._perform(claimed)
            return None
        with self._lock:
            self.active[job.id] = claimed
            self.lines += 1
            self.peak = max(self.peak, len(self.active))
        return claimed

    def _line_for(self, job: SafeJob) -> JobLine | None:
        """The line to decode, or None when the job needs no engine: already answered,
        cancelled, deleted, for another model, or a request that cannot be read."""
        ctx = get_context()
        request = read_request(ctx, *job.args)
        if request.answered or request.cancelled or request.line is None:
            return None
        return request.line if request.line.model == ctx.alias else None

    def _next_jobs(self, first: SafeJob):
        """Lines for the engine: the first job's, then more while the queue has them."""
        claimed = self._claim(first)
        if claimed is not None:
            yield claimed
        while not rqcompat.stop_requested(self.worker):
            if self.limit is not None and self.taken >= self.limit:
                return
            try:
                found = Queue.dequeue_any(
                    [self.queue],
                    None,
                    connection=self.worker.connection,
                    job_class=self.worker.job_class,
                    serializer=self.worker.serializer,
                )
            except Exception as exc:  # a job hash RQ cannot read: refuse it, go on
                if getattr(exc, "job_id", None) is None:
                    raise
                self.worker.refuse(exc.job_id, self.queue, f"unreadable job ({exc})")
                continue
            if found is None:
                return
            self.taken += 1
            job, _ = found
            reason = vet(job)
            if reason is not None:
                self.worker.refuse(job.id, self.queue, reason)
                continue
            claimed = self._claim(job)
            if claimed is not None:
                yield claimed

    # -- running -------------------------------------------------------------------
    def run(self, first: SafeJob) -> None:
        """Decode the first job and every job claimed after it; return when all are done."""
        ctx = get_context()
        by_line: dict[int, _Claimed] = {}  # id(line object) -> its claimed job

        def lines():
            for claimed in self._next_jobs(first):
                by_line[id(claimed.line)] = claimed
                yield claimed.job.args[0], claimed.line

        def expired(line: JobLine) -> bool:
            return time.monotonic() > by_line[id(line)].deadline

        with Heartbeat(self.worker, self.running):
            try:
                for line, outcome in run_lines(
                    ctx.pair, ctx.alias, lines(), self.max_batch, expired, ctx.worker_name
                ):
                    claimed = by_line.pop(id(line))
                    if isinstance(outcome, Exception):  # past its deadline in the batch
                        outcome = JobTimeoutException(
                            f"Task exceeded maximum timeout value ({claimed.job.timeout} seconds)"
                        )
                    self._perform(claimed, outcome)
            except Exception:
                log.exception("batched run failed; running its remaining lines one by one")
                for claimed in list(self.active.values()):
                    self._perform(claimed)
            except BaseException as stop:  # a second stop signal: give every job back
                for claimed in list(self.active.values()):
                    self.worker.put_back(claimed.job, self.queue, claimed.execution)
                    self._forget(claimed)
                signum = getattr(stop, "signum", None)
                if signum is not None:
                    raise SystemExit(128 + signum) from stop
                raise
        log.info("decoded %d line(s) together, up to %d at once", self.lines, self.peak)

    def running(self) -> list:
        """(job, execution) of every claimed job not yet performed: kept alive."""
        with self._lock:
            return [(c.job, c.execution) for c in self.active.values()]

    def _perform(self, claimed: _Claimed, outcome=None) -> None:
        """Let RQ perform the job: with `outcome` (what the batch computed for it, or an
        exception to raise), run_request stores that instead of running the line."""
        claimed.job.precomputed = outcome
        try:
            self.worker.perform_job(claimed.job, self.queue, claimed.execution)
        finally:  # also when a stop signal ended it: it was put back by the worker
            self._forget(claimed)

    def _forget(self, claimed: _Claimed) -> None:
        with self._lock:
            self.active.pop(claimed.job.id, None)
