"""`spec-worker --batch N`: the lines of queued jobs decoded together, RQ semantics kept.

The worker takes its first job as usual and feeds its lines to the engine; when they
are all given out and a row is free, it claims another job from the same queue
(non-blocking), so new lines join as others finish. Every claimed job gets an RQ
execution at once, so it sits in the started registry with a heartbeat like any
running job: if this process dies, the reaper of another worker puts the job back,
and whoever runs it again skips the lines already stored. Each line is stored as soon
as it finishes (worker.jobs.store_outcome); once all lines of a job are done, the job
is handed to RQ's own `perform_job` with what happened (`SafeJob.precomputed`: True,
or LinesFailed naming the lines that failed), so success, retries, failure callbacks
and clean-up go through exactly the same path as a job run line by line.

Faults: a line past its timeout leaves the batch and counts as a failed line of its job
(the job is retried for it, like any timeout); an unexpected engine error runs the
claimed jobs' remaining lines one by one, so a poison request fails alone; a first stop
signal stops giving out lines, finishes those running and puts back the jobs with
lines left; a second one puts back every claimed job at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from rq.queue import Queue
from rq.timeouts import JobTimeoutException

from jobstore.jobfile import JobLine
from worker import rqcompat
from worker.batching import run_lines
from worker.guard import Heartbeat, SafeJob, vet
from worker.jobs import (
    Line,
    LinesFailed,
    drop_gone,
    get_context,
    line_failed,
    read_lines,
    settle,
    started,
    store_outcome,
)

log = logging.getLogger("specfleet.worker")


class _Claimed:
    """One claimed job: its RQ execution, its lines not given out yet, how many are
    with the engine, and the lines that failed."""

    def __init__(self, job: SafeJob, execution, todo: list[Line]):
        self.job, self.execution = job, execution
        self.batch_id: str = job.args[0]
        self.left: deque[Line] = deque(todo)
        self.running = 0
        self.started = False
        self.failures: dict[str, tuple[str, str]] = {}

    @property
    def finished(self) -> bool:
        return not self.left and not self.running


class BatchSession:
    """Claim, decode together, and hand jobs back to RQ; see the module docstring."""

    def __init__(self, worker, queue: Queue, max_batch: int, limit: int | None = None):
        self.worker, self.queue, self.max_batch = worker, queue, max_batch
        self.limit = limit  # most lines to take from the queue (--max-jobs), None: no limit
        self.taken = 0  # lines of the jobs taken from the queue
        self.active: dict[str, _Claimed] = {}  # job id -> claimed, not yet performed
        self.cancelled: dict[str, bool] = {}  # batch id -> cancelled, as last seen
        self._lock = threading.Lock()
        self.lines = 0
        self.peak = 0

    # -- claiming ------------------------------------------------------------------
    def _claim(self, job: SafeJob) -> _Claimed:
        """Give a vetted job its execution and read its lines."""
        execution = self.worker.prepare_execution(job)
        self.worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
        self.taken += len(job.args[1])
        found = read_lines(get_context(), *job.args)
        claimed = _Claimed(job, execution, found.todo)
        if found.gone:
            drop_gone(claimed.batch_id, job.id, len(job.args[1]))
        self.cancelled[claimed.batch_id] = found.cancelled or self.cancelled.get(
            claimed.batch_id, False
        )
        with self._lock:
            self.active[job.id] = claimed
        return claimed

    def _more(self) -> _Claimed | None:
        """Claim the next job of the queue, if there is one and we may."""
        while not rqcompat.stop_requested(self.worker):
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

    def _next_lines(self, first: SafeJob):
        """(claimed, line) for the engine: the first job's lines, then the lines of jobs
        claimed while rows are free. Lines that need no engine are stored on the way."""
        ctx = get_context()
        queue = deque([self._claim(first)])
        while True:
            if rqcompat.stop_requested(self.worker):
                return  # the lines not given out go back with their jobs
            if not queue:
                claimed = self._more()
                if claimed is None:
                    return
                queue.append(claimed)
            claimed = queue[0]
            if claimed.left and ctx.lines().gone(claimed.batch_id):
                drop_gone(claimed.batch_id, claimed.job.id, len(claimed.left))
                claimed.left.clear()
            if not claimed.left:
                queue.popleft()
                self._maybe_perform(claimed)
                continue
            line = claimed.left.popleft()
            cancelled = self.cancelled[claimed.batch_id] or ctx.lines().cancelled(claimed.batch_id)
            outcome = settle(ctx, claimed.batch_id, line, cancelled)
            if outcome is not None:
                self._store(claimed, line, outcome, 0.0)
                continue
            if not claimed.started:
                started(ctx, claimed.batch_id)
                claimed.started = True
            claimed.running += 1
            yield claimed, line

    # -- running -------------------------------------------------------------------
    def run(self, first: SafeJob) -> None:
        """Decode the first job's lines and those of every job claimed after it; return
        when all are done (or put back)."""
        ctx = get_context()
        by_line: dict[int, tuple[_Claimed, Line, float]] = {}  # id(JobLine) -> ...

        def lines():
            for claimed, line in self._next_lines(first):
                by_line[id(line.line)] = (claimed, line, time.monotonic() + line.timeout)
                self.lines += 1
                self.peak = max(self.peak, len(by_line))
                yield claimed.batch_id, line.line

        def expired(job_line: JobLine) -> bool:
            return time.monotonic() > by_line[id(job_line)][2]

        with Heartbeat(self.worker, self.running):
            last = time.monotonic()
            try:
                for job_line, outcome in run_lines(
                    ctx.pair, ctx.alias, lines(), self.max_batch, expired, ctx.worker_name
                ):
                    now = time.monotonic()
                    took, last = now - last, now
                    claimed, line, _ = by_line.pop(id(job_line))
                    claimed.running -= 1
                    if isinstance(outcome, Exception):  # past its deadline in the batch
                        late = JobTimeoutException(f"past {line.timeout} s")
                        claimed.failures[line.key] = line_failed(claimed.batch_id, line, late)
                        self._maybe_perform(claimed)
                        continue
                    self._store(claimed, line, outcome, took)
            except Exception:
                log.exception("batched run failed; running its remaining lines one by one")
                ctx.lines().flush()
                for claimed in list(self.active.values()):
                    self._perform(claimed, None)
            except BaseException as stop:  # a second stop signal: give every job back
                self._put_back_all()
                signum = getattr(stop, "signum", None)
                if signum is not None:
                    raise SystemExit(128 + signum) from stop
                raise
            self._put_back_all()  # jobs with lines never given out (a first stop signal)
        log.info("decoded %d line(s) together, up to %d at once", self.lines, self.peak)

    def running(self) -> list:
        """(job, execution) of every claimed job not yet performed: kept alive."""
        with self._lock:
            return [(c.job, c.execution) for c in self.active.values()]

    def _store(self, claimed: _Claimed, line: Line, outcome, took_s: float) -> None:
        store_outcome(get_context(), claimed.batch_id, line, outcome, took_s)
        self._maybe_perform(claimed)

    def _maybe_perform(self, claimed: _Claimed) -> None:
        if claimed.finished and claimed.job.id in self.active:
            get_context().lines().flush()  # its lines stored before RQ hears it is done
            outcome = LinesFailed(claimed.failures) if claimed.failures else True
            self._perform(claimed, outcome)

    def _perform(self, claimed: _Claimed, outcome) -> None:
        """Let RQ perform the job: with `outcome` (True: its lines are stored; an
        exception: raised as the job's), else run_lines runs its lines one by one."""
        claimed.job.precomputed = outcome
        try:
            self.worker.perform_job(claimed.job, self.queue, claimed.execution)
        finally:  # also when a stop signal ended it: it was put back by the worker
            self._forget(claimed)

    def _put_back_all(self) -> None:
        if self.active:
            get_context().lines().flush()  # what finished stays done
        for claimed in list(self.active.values()):
            self.worker.put_back(claimed.job, self.queue, claimed.execution)
            self._forget(claimed)

    def _forget(self, claimed: _Claimed) -> None:
        with self._lock:
            self.active.pop(claimed.job.id, None)
