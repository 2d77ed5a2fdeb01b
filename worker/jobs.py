"""The one job function a worker runs, its failure callback, and their context.

A job is `run_lines(batch_id, line_keys)`: one to JOB_LINES_MAX lines of one batch
and model alias. It reads their validated requests from `P:batch:B:requests` in one
round trip, runs each on the pair loaded at start-up (set once with `set_context`,
never loaded inside a job) under its own timeout, and stores each line and its counters
once per (batch, line key) as soon as it is done (worker.storing: lines that finish in
quick succession share one call); all are stored before the job ends. So a job that runs
again (its worker was killed, or it was delivered twice) skips the lines already
answered: a line with a result has no request record any more, a line with an error
line is skipped too.

A line that raises or passes its timeout does not stop the others: they are answered,
and the job then fails with `LinesFailed` naming the lines that did, so RQ runs it again
(two retries, spaced like any retry) for those lines only. With no retry left,
`on_job_failure` writes each unanswered line's error line (`timeout`, `worker_lost`,
`internal_error`). A cancelled batch's lines that have not started are stored as
`cancelled` error lines instead of being run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from rq.exceptions import AbandonedJobError
from rq.job import get_current_job
from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

from jobstore import config, store
from jobstore.jobfile import JobLine
from jobstore.keys import Keys, custom_id_of
from jobstore.lines import dumps, error_line
from worker.execute import Outcome, context_overflow, execute, failure
from worker.storing import LineStore

log = logging.getLogger("specfleet.worker")


@dataclass
class WorkerContext:
    """What every job needs, made once at worker start-up."""

    pair: Any
    alias: str
    worker_name: str
    conn: Redis
    keys: Keys
    ttl_s: int = 0
    #: True once the worker was asked to stop after its current line (a first SIGTERM).
    stopping: Callable[[], bool] = field(default=lambda: False)
    #: Where finished lines go (worker.storing.LineStore); made on first use.
    sink: Any = None

    def lines(self) -> LineStore:
        """The worker's LineStore."""
        if self.sink is None:
            self.sink = LineStore(self)
        return self.sink


_context: WorkerContext | None = None


def set_context(context: WorkerContext | None) -> None:
    global _context
    _context = context


def get_context() -> WorkerContext:
    if _context is None:
        raise RuntimeError("run_lines needs a worker context (set_context at start-up)")
    return _context


@dataclass(frozen=True)
class Line:
    """One unanswered line of a job, as its worker found it."""

    key: str
    line: JobLine | None  # None when its stored request cannot be read
    timeout: int  # seconds it may run
    unreadable: str | None = None  # why the stored request cannot be parsed
    code: str = "internal_error"  # the error code of an unreadable one


@dataclass(frozen=True)
class JobLines:
    """A job's lines still to answer (in the job's order), and the batch's cancel flag."""

    todo: list[Line]
    cancelled: bool
    #: The batch has no record (created_at) any more: Redis lost it; nothing is run.
    gone: bool = False


class LinesFailed(Exception):
    """Some lines of a job raised or passed their timeout (the others were answered).
    `failures`: line key -> (error code, message) for the error line, should no retry
    be left."""

    def __init__(self, failures: dict[str, tuple[str, str]]):
        self.failures = failures
        first = next(iter(failures.items()))
        super().__init__(f"{len(failures)} line(s) failed, first {first[0]}: {first[1][1]}"[:1000])


class PutBack(BaseException):
    """The worker was asked to stop: the job's remaining lines go back to the queue
    (BaseException: nothing may treat it as the job's failure)."""


def read_lines(ctx: WorkerContext, batch_id: str, line_keys: list[str]) -> JobLines:
    """One round trip: the job's lines that have neither a result (their request record
    is gone then) nor an error line, their requests parsed, and the cancel flag."""
    conn, keys = ctx.conn, ctx.keys
    limit = config.MAX_RECORD_BYTES
    with conn.pipeline(transaction=False) as pipe:
        store.read_requests(pipe, keys, batch_id, line_keys, limit)  # none over the cap
        pipe.hmget(keys.errors(batch_id), line_keys)
        pipe.hexists(keys.batch(batch_id), "cancelled")
        pipe.hexists(keys.batch(batch_id), "created_at")
        records, errors, cancelled, known = pipe.execute()
    if not known:
        return JobLines([], bool(cancelled), gone=True)
    ctx.lines().known(batch_id)  # submitted again since a store found it gone
    todo = []
    for key, record, error in zip(line_keys, records, errors, strict=True):
        if record is None or error is not None:
            continue  # answered (or the batch was deleted): nothing to do
        if isinstance(record, int):  # its size: never read, parsed or tokenized
            why = (
                f"the request record is {record} bytes, over the limit of {limit} bytes "
                "(a job-file line may have at most "
                f"{config.MAX_LINE_BYTES} bytes)"
            )
            todo.append(Line(key, None, 0, why, code="invalid_request"))
            continue
        todo.append(_parse(key, record))
    return JobLines(todo, bool(cancelled))


def _parse(key: str, record: bytes) -> Line:
    try:
        data = json.loads(record)
        line = JobLine.from_record(data)
        timeout = int(data.get("timeout") or config.job_timeout_s(1, 0))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return Line(key, None, 0, f"{type(exc).__name__}: {exc}")
    return Line(key, line, max(1, timeout))


def drop_gone(batch_id: str, job_id: str | None, lines_left: int) -> None:
    """The one log line of a job whose batch lost its record (a Redis restarted without
    persistence): nothing more of it is run or stored."""
    log.warning(
        "%s: the batch has no record in Redis any more (restarted without persistence?): "
        "dropped job %s, %d line(s) not run; re-submit its file with --batch-id %s",
        batch_id,
        job_id,
        lines_left,
        batch_id,
    )


def settle(ctx: WorkerContext, batch_id: str, line: Line, cancelled: bool) -> Outcome | None:
    """The outcome of a line that needs no engine (an unreadable request, a cancelled
    batch, another model), else None."""
    if line.unreadable is not None:
        outcome = _unreadable(ctx, batch_id, line.key, line.unreadable, line.code)
        log.error("%s %s: %s", batch_id, line.key, outcome.line["error"]["message"])
        return outcome
    job = line.line
    if cancelled:
        return failure(batch_id, job, "cancelled", "the batch was cancelled before it started")
    if job.model != ctx.alias:
        return failure(
            batch_id,
            job,
            "model_not_served",
            f"model {job.model!r} reached a worker serving {ctx.alias!r}; it was not run",
        )
    return context_overflow(ctx.pair, batch_id, job)


def _unreadable(
    ctx: WorkerContext, batch_id: str, line_key: str, reason: str, code: str = "internal_error"
) -> Outcome:
    """The error line of a request whose stored record cannot be parsed (or is too large
    to be read: `code` invalid_request): written at once (a retry would read the same
    bytes)."""
    number = int(ctx.conn.zscore(ctx.keys.order(batch_id), line_key) or 0)
    custom_id = custom_id_of(line_key)
    message = (
        f"the stored request cannot be read ({ctx.keys.requests(batch_id)} field "
        f"{line_key!r}: {reason[:200]}); it was not run"
    )
    line = error_line(batch_id, number, custom_id, code, message)
    return Outcome(False, line, {})


def store_outcome(
    ctx: WorkerContext, batch_id: str, line: Line, outcome: Outcome, took_s: float = 0.0
) -> None:
    """Hand a line's outcome to the worker's LineStore (stored once per line key)."""
    number = line.line.line if line.line is not None else outcome.line["error"]["line"]
    ctx.lines().add(batch_id, line.key, number, outcome, took_s)


def started(ctx: WorkerContext, batch_id: str) -> None:
    """A job of the batch starts decoding: note when the batch's first line did, and
    count the job for this worker (so spec-status lists a worker that holds lines
    before it has answered any, and still once it has gone quiet)."""
    with ctx.conn.pipeline(transaction=False) as pipe:
        pipe.hsetnx(ctx.keys.batch(batch_id), "started_at", f"{time.time():.3f}")
        pipe.hincrby(ctx.keys.batch_workers(batch_id), f"jobs:{ctx.worker_name}", 1)
        pipe.execute()


def line_failed(batch_id: str, line: Line, exc: BaseException) -> tuple[str, str]:
    """(code, message) of a line that raised or passed its timeout, logged with the
    attempt it was."""
    if isinstance(exc, JobTimeoutException):
        code, message = "timeout", f"did not finish within {line.timeout} s"
    else:
        code, message = "internal_error", f"{type(exc).__name__}: {exc}"
    job = get_current_job()
    left = getattr(job, "retries_left", None)
    attempt = config.JOB_RETRIES + 1 - left if left is not None else 1
    log.warning(
        "%s line %d (%s): attempt %d of %d failed: %s",
        batch_id,
        line.line.line,
        line.line.custom_id,
        attempt,
        config.JOB_RETRIES + 1,
        message,
    )
    return code, message


def run_lines(batch_id: str, line_keys: list[str], precomputed: Any = None) -> dict:
    """Run a job's lines one by one and store each line's result or error line.

    `precomputed` is what a batched run (worker.rqbatch, through SafeJob) already did
    with the job: its lines are stored; an exception here is raised as the job's.
    Raises LinesFailed when lines raised or timed out (RQ retries the job for them),
    PutBack when the worker was asked to stop with lines left.
    """
    ctx = get_context()
    if isinstance(precomputed, BaseException):
        raise precomputed
    if precomputed is not None:
        return {"lines": len(line_keys)}
    found = read_lines(ctx, batch_id, line_keys)
    job = get_current_job()
    if found.gone:
        drop_gone(batch_id, job.id if job else None, len(line_keys))
        return {"lines": len(line_keys), "answered": 0}
    sink = ctx.lines()
    failures: dict[str, tuple[str, str]] = {}
    noted = False
    try:
        for i, line in enumerate(found.todo):
            if sink.gone(batch_id):
                drop_gone(batch_id, job.id if job else None, len(found.todo) - i)
                break
            if i and ctx.stopping():
                raise PutBack(f"{len(found.todo) - i} line(s) of the job not started")
            cancelled = found.cancelled or sink.cancelled(batch_id)
            outcome = settle(ctx, batch_id, line, cancelled)
            began = time.monotonic()
            if outcome is None:
                if not noted:
                    started(ctx, batch_id)
                    noted = True
                try:
                    with UnixSignalDeathPenalty(line.timeout, JobTimeoutException):
                        outcome = execute(ctx.pair, ctx.alias, batch_id, line.line, ctx.worker_name)
                except Exception as exc:  # JobTimeoutException is one too
                    failures[line.key] = line_failed(batch_id, line, exc)
                    continue
            store_outcome(ctx, batch_id, line, outcome, time.monotonic() - began)
    finally:
        sink.flush()  # every line stored before RQ hears how the job ended
    if failures:
        raise LinesFailed(failures)
    return {"lines": len(line_keys), "answered": len(found.todo)}


def on_job_failure(job, connection: Redis, exc_type, exc_value, traceback) -> None:
    """RQ failure callback: once a job has no retries left, write the error line of
    each of its lines still unanswered (`timeout`, `worker_lost` or `internal_error`).
    Runs in a worker process."""
    if job.retries_left:
        return  # RQ runs it again
    batch_id, line_keys = job.args
    keys = _context.keys if _context is not None else Keys.default()
    with connection.pipeline(transaction=False) as pipe:
        pipe.hmget(keys.requests(batch_id), line_keys)
        pipe.hmget(keys.errors(batch_id), line_keys)
        records, errors = pipe.execute()
    tries = f"{config.JOB_RETRIES + 1} attempts"  # every job is enqueued with these retries
    own = exc_value.failures if isinstance(exc_value, LinesFailed) else {}
    if exc_type is not None and issubclass(exc_type, AbandonedJobError):
        code, message = "worker_lost", "the worker running it stopped responding"
    elif exc_type is not None and issubclass(exc_type, JobTimeoutException):
        code, message = "timeout", f"did not finish within {job.timeout} s"
    else:
        name = exc_type.__name__ if exc_type is not None else "error"
        code, message = "internal_error", f"{name}: {exc_value}"
    worker = _context.worker_name if _context is not None else None
    for key, record, error in zip(line_keys, records, errors, strict=True):
        if record is None or error is not None:
            continue  # answered, or the batch was deleted meanwhile
        # The custom_id is in the line key and the line number in the order zset, so
        # even a request that cannot be read back gets its error line.
        try:
            number = int(json.loads(record)["line"])
        except (ValueError, KeyError, TypeError):
            number = int(connection.zscore(keys.order(batch_id), key) or 0)
        custom_id = custom_id_of(key)
        line_code, line_message = own.get(key, (code, message))
        store.store_line(
            connection,
            keys,
            batch_id,
            key,
            dumps(error_line(batch_id, number, custom_id, line_code, f"{line_message} ({tries})")),
            ok=False,
            worker=worker,
            ttl_s=_context.ttl_s if _context is not None else 0,
        )
        log.warning(
            "%s line %d (%s): error %s: %s (%s)",
            batch_id,
            number,
            custom_id,
            line_code,
            line_message,
            tries,
        )
