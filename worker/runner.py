"""The job runner: every job a worker takes runs here, one at a time or several decoded
together (`spec-worker --batch N`), with RQ's semantics kept.

A single job is a batch of one. The runner claims the worker's job and feeds its lines
to the engine; with --batch N, when they are all given out and a row is free, it claims
another job from the same queue (non-blocking), so new lines join as others finish.
Every claimed job gets an RQ execution at once, so it sits in the started registry with
a heartbeat like any running job: if this process dies, the reaper of another worker
puts the job back, and whoever runs it again skips the lines already stored. Each line
is stored as soon as it finishes (worker.jobs.store_outcome); once all lines of a job
are done and stored, the job is finished in RQ (worker.rqcompat.finish_job: success,
or LinesFailed naming the lines that failed, so retries, the failure callback and
clean-up are RQ's own).

Decoding: with one row, each line runs alone under its own time limit (an alarm);
with N rows, lines run through worker.batching.decode_together, and a line past its
time limit leaves the batch. Either way such a line counts as a failed line of its job
(the job is retried for it, like any timeout). An unexpected engine error in a batch
runs the claimed jobs' remaining lines one by one, so a poison request fails alone. A
first stop signal stops giving out lines, finishes those running and puts back the jobs
with lines left; a second one puts back every claimed job at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator

from rq.queue import Queue
from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

from jobstore.jobfile import JobLine
from worker import rqcompat
from worker.batching import decode_together
from worker.execute import Outcome, execute
from worker.guard import Heartbeat, SafeJob, vet
from worker.jobs import (
    LinesFailed,
    PendingLine,
    WorkerContext,
    drop_gone,
    line_failed,
    note_started,
    read_lines,
    settle,
    store_outcome,
)

log = logging.getLogger("specfleet.worker")


class ClaimedJob:
    """One claimed job: its RQ execution, its lines not given out yet, how many are
    with the engine, and the lines that failed."""

    def __init__(self, job: SafeJob, execution, todo: list[PendingLine]):
        self.job, self.execution = job, execution
        self.batch_id: str = job.args[0]
        self.left: deque[PendingLine] = deque(todo)
        self.running = 0
        self.started = False
        self.answered = 0  # lines stored by this run
        self.dropped = False  # its batch lost its record: said once (drop_gone)
        self.failures: dict[str, tuple[str, str]] = {}

    @property
    def finished(self) -> bool:
        return not self.left and not self.running


class JobRunner:
    """Claim, decode, and finish jobs in RQ; see the module docstring. `worker` is the
    SpecWorker (its context, queue access, put_back and refuse)."""

    def __init__(self, worker, queue: Queue, max_batch: int, limit: int | None = None):
        self.worker, self.queue, self.max_batch = worker, queue, max_batch
        self.ctx: WorkerContext = worker.context
        self.limit = limit  # most lines to take from the queue (--max-jobs), None: no limit
        self.taken = 0  # lines of the jobs taken from the queue
        self.active: dict[str, ClaimedJob] = {}  # job id -> claimed, not yet finished
        self.cancelled: dict[str, bool] = {}  # batch id -> cancelled, as last seen
        self._lock = threading.Lock()
        self.decoded = 0  # lines the engine answered in this run
        self.peak = 0

    # -- claiming ------------------------------------------------------------------
    def _claim(self, job: SafeJob) -> ClaimedJob:
        """Give a vetted job its execution and read its lines."""
        execution = self.worker.prepare_execution(job)
        self.worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
        self.taken += len(job.args[1])
        found = read_lines(self.ctx, *job.args)
        claimed = ClaimedJob(job, execution, found.todo)
        if found.gone:
            drop_gone(claimed.batch_id, job.id, len(job.args[1]))
            claimed.dropped = True
        self.cancelled[claimed.batch_id] = found.cancelled or self.cancelled.get(
            claimed.batch_id, False
        )
        with self._lock:
            self.active[job.id] = claimed
        return claimed

    def _more(self) -> ClaimedJob | None:
        """Claim the next job of the queue, if rows may be shared and we may."""
        while self.max_batch > 1 and not rqcompat.stop_requested(self.worker):
            if self.limit is not None and self.taken >= self.limit:
                return None
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
                return None
            job, _ = found
            reason = vet(job)
            if reason is not None:
                self.worker.refuse(job.id, self.queue, reason)
                continue
            return self._claim(job)
        return None

    def _next_lines(self, jobs: deque[ClaimedJob]) -> Iterator[tuple[ClaimedJob, PendingLine]]:
        """(claimed, line) for the engine: the lines of `jobs`, then the lines of jobs
        claimed while rows are free. Lines that need no engine are stored on the way."""
        sink = self.ctx.line_store()
        while True:
            if rqcompat.stop_requested(self.worker):
                return  # the lines not given out go back with their jobs
            if not jobs:
                claimed = self._more()
                if claimed is None:
                    return
                jobs.append(claimed)
            claimed = jobs[0]
            if claimed.left and sink.gone(claimed.batch_id):
                drop_gone(claimed.batch_id, claimed.job.id, len(claimed.left), claimed.answered)
                claimed.dropped = True
                claimed.left.clear()
            if not claimed.left:
                jobs.popleft()
                self._finish_if_done(claimed)
                continue
            line = claimed.left.popleft()
            cancelled = self.cancelled[claimed.batch_id] or sink.cancelled(claimed.batch_id)
            outcome = settle(self.ctx, claimed.batch_id, line, cancelled)
            if outcome is not None:
                self._store(claimed, line, outcome, 0.0)
                continue
            if not claimed.started:
                note_started(self.ctx, claimed.batch_id)
                claimed.started = True
            claimed.running += 1
            yield claimed, line

    # -- decoding ------------------------------------------------------------------
    def _one_by_one(self, lines) -> Iterator[tuple[ClaimedJob, PendingLine, object]]:
        """(claimed, line, outcome or exception) for each line, run alone under its
        own time limit."""
        ctx = self.ctx
        for claimed, line in lines:
            began = time.monotonic()
            try:
                with UnixSignalDeathPenalty(line.timeout, JobTimeoutException):
                    outcome = execute(
                        ctx.pair,
                        ctx.alias,
                        claimed.batch_id,
                        line.request,
                        ctx.worker_name,
                        auditor=ctx.auditor,
                    )
            except Exception as exc:  # JobTimeoutException is one too
                yield claimed, line, exc
                continue
            yield claimed, line, (outcome, time.monotonic() - began)

    def _together(self, lines) -> Iterator[tuple[ClaimedJob, PendingLine, object]]:
        """(claimed, line, outcome or JobTimeoutException) for each line, decoded in
        rows of up to max_batch; raises what the engine raises for the batch."""
        ctx = self.ctx
        by_line: dict[int, tuple[ClaimedJob, PendingLine, float]] = {}  # id(JobLine) -> ...

        def requests():
            for claimed, line in lines:
                by_line[id(line.request)] = (claimed, line, time.monotonic() + line.timeout)
                self.peak = max(self.peak, len(by_line))
                yield claimed.batch_id, line.request

        def expired(request: JobLine) -> bool:
            return time.monotonic() > by_line[id(request)][2]

        last = time.monotonic()
        decoded = decode_together(
            ctx.pair, ctx.alias, requests(), self.max_batch, expired, ctx.worker_name, ctx.auditor
        )
        for request, outcome in decoded:
            now = time.monotonic()
            took, last = now - last, now
            claimed, line, _ = by_line.pop(id(request))
            if isinstance(outcome, Exception):  # past its deadline in the batch
                yield claimed, line, JobTimeoutException(f"past {line.timeout} s")
                continue
            yield claimed, line, (outcome, took)

    def _decode(self, decoded) -> None:
        """Store each decoded line, or count it failed, and finish jobs as they end."""
        for claimed, line, result in decoded:
            self.decoded += 1
            claimed.running -= 1
            if isinstance(result, BaseException):
                claimed.failures[line.key] = line_failed(
                    claimed.job, claimed.batch_id, line, result
                )
                self._finish_if_done(claimed)
                continue
            outcome, took = result
            self._store(claimed, line, outcome, took)

    # -- running -------------------------------------------------------------------
    def run(self, first: SafeJob) -> None:
        """Run the first job's lines and those of every job claimed after it; return
        when all are done (finished in RQ) or put back."""
        with Heartbeat(self.worker, self.running):
            try:
                if self.max_batch > 1:
                    self._run_together(first)
                else:
                    self._run_alone(self._claim(first))
            except BaseException as stop:  # a second stop signal: give every job back
                self._put_back_all()
                signum = getattr(stop, "signum", None)
                if signum is not None:
                    raise SystemExit(128 + signum) from stop
                raise
            self._put_back_all()  # jobs with lines never given out (a first stop signal)

    def _run_together(self, first: SafeJob) -> None:
        """The first job's lines and those of the jobs claimed while rows are free,
        decoded together; if the batch fails, every claimed job's unanswered lines, read
        again, run one by one (no more jobs are claimed)."""
        try:
            self._decode(self._together(self._next_lines(deque([self._claim(first)]))))
        except Exception:
            log.exception("batched run failed; running its remaining lines one by one")
            self.ctx.line_store().flush()
            self.max_batch = 1
            for claimed in list(self.active.values()):
                found = read_lines(self.ctx, claimed.batch_id, claimed.job.args[1])
                claimed.left, claimed.running, claimed.failures = deque(found.todo), 0, {}
                claimed.started = False  # counted again for this worker, as a new run
                self._run_alone(claimed)
        log.info("decoded %d line(s) together, up to %d at once", self.decoded, self.peak)

    def _run_alone(self, claimed: ClaimedJob) -> None:
        """A job's lines one by one; a job that fails outside its lines (Redis refusing
        a write, say) is finished in RQ as failed with that error."""
        try:
            self._decode(self._one_by_one(self._next_lines(deque([claimed]))))
        except Exception as exc:
            self.ctx.line_store().flush()
            if claimed.job.id in self.active:
                self._finish(claimed, exc)

    def running(self) -> list:
        """(job, execution) of every claimed job not yet finished: kept alive."""
        with self._lock:
            return [(c.job, c.execution) for c in self.active.values()]

    def _store(self, claimed: ClaimedJob, line: PendingLine, outcome: Outcome, took_s: float):
        store_outcome(self.ctx, claimed.batch_id, line, outcome, took_s)
        claimed.answered += 1
        self._finish_if_done(claimed)

    def _finish_if_done(self, claimed: ClaimedJob) -> None:
        if claimed.finished and claimed.job.id in self.active:
            sink = self.ctx.line_store()
            sink.flush()  # its lines stored before RQ hears it is done
            if sink.gone(claimed.batch_id) and not claimed.dropped:
                # Every line was given out before a store found the batch gone.
                drop_gone(claimed.batch_id, claimed.job.id, 0, claimed.answered)
                claimed.dropped = True
            if claimed.failures:
                self._finish(claimed, LinesFailed(claimed.failures))
            else:
                self._finish(
                    claimed, {"lines": len(claimed.job.args[1]), "answered": claimed.answered}
                )

    def _finish(self, claimed: ClaimedJob, outcome) -> None:
        """Finish the job in RQ with `outcome` (its return value, or an exception)."""
        rqcompat.finish_job(self.worker, claimed.job, self.queue, claimed.execution, outcome)
        self._forget(claimed)

    def _put_back_all(self) -> None:
        if self.active:
            self.ctx.line_store().flush()  # what finished stays done
        for claimed in list(self.active.values()):
            if claimed.left:
                log.info(
                    "job %s: %d line(s) of the job not started, put back",
                    claimed.job.id,
                    len(claimed.left),
                )
            self.worker.put_back(claimed.job, self.queue, claimed.execution)
            self._forget(claimed)

    def _forget(self, claimed: ClaimedJob) -> None:
        with self._lock:
            self.active.pop(claimed.job.id, None)
