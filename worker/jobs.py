"""What a job is to the worker: its lines, their outcomes, its failure callback, and
the context they run in.

A job names `worker.jobs.run_lines` (jobstore.keys.JOB_FUNCTION) with (batch id,
[line keys]): one to JOB_LINES_MAX lines of one batch and model alias. The worker never
imports that name: its job runner (worker.runner.JobRunner) reads the lines' validated
requests from `P:batch:B:requests` in one round trip (`read_lines`), runs each on the
pair loaded at start-up (in the `WorkerContext`, made once and passed in, never loaded
inside a job) under its own timeout, and stores each line and its counters once per
(batch, line key) as soon as it is done (worker.storing: lines that finish in quick
succession share one call); all are stored before the job ends. So a job that runs
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
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq.exceptions import AbandonedJobError
from rq.job import Job
from rq.timeouts import JobTimeoutException

from jobstore import config, store
from jobstore.jobfile import JobLine
from jobstore.keys import Keys, custom_id_of
from jobstore.lines import dumps, error_line, is_digest
from worker.audit import Auditor
from worker.execute import Outcome, context_overflow, failure, unusable_constraint
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
    #: Audit mode (spec-worker --audit): re-runs some greedy lines target-only.
    auditor: Auditor | None = None
    #: Where finished lines go (worker.storing.LineStore); made on first use.
    sink: Any = None

    def line_store(self) -> LineStore:
        """The worker's LineStore."""
        if self.sink is None:
            self.sink = LineStore(self)
        return self.sink


@dataclass(frozen=True)
class PendingLine:
    """One unanswered line of a job, as its worker found it: its line key and the
    request stored for it."""

    key: str
    request: JobLine | None  # None when its stored request cannot be read
    timeout: int  # seconds it may run
    unreadable: str | None = None  # why the stored request cannot be parsed
    code: str = "internal_error"  # the error code of an unreadable one
    digest: str | None = None  # its request's digest, kept with its result


@dataclass(frozen=True)
class JobLines:
    """A job's lines still to answer (in the job's order), and the batch's cancel flag."""

    todo: list[PendingLine]
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


def read_lines(ctx: WorkerContext, batch_id: str, line_keys: list[str]) -> JobLines:
    """One call (store.read_job): the job's lines that have neither a result (their request record
    is gone then) nor an error line, their requests parsed, and the cancel flag."""
    limit = config.MAX_RECORD_BYTES
    found = store.read_job(ctx.conn, ctx.keys, batch_id, line_keys, limit)  # none over it
    if not found.known:
        return JobLines([], found.cancelled, gone=True)
    ctx.line_store().known(batch_id)  # submitted again since a store found it gone
    todo = []
    for key, record in zip(line_keys, found.records, strict=True):
        if record is None:
            continue  # answered, or has an error line (or the batch was deleted)
        if isinstance(record, int):  # its size: never read, parsed or tokenized
            why = (
                f"the request record is {record} bytes, over the limit of {limit} bytes "
                "(a job-file line may have at most "
                f"{config.MAX_LINE_BYTES} bytes)"
            )
            todo.append(PendingLine(key, None, 0, why, code="invalid_request"))
            continue
        todo.append(_parse(key, record))
    return JobLines(todo, found.cancelled)


def _parse(key: str, record: bytes) -> PendingLine:
    try:
        data = json.loads(record)
        request = JobLine.from_record(data)
        timeout = int(data.get("timeout") or config.job_timeout_s(1, 0))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return PendingLine(key, None, 0, f"{type(exc).__name__}: {exc}")
    digest = data.get("digest")  # a record queued before digests were kept has none
    return PendingLine(key, request, max(1, timeout), digest=digest if is_digest(digest) else None)


def drop_gone(batch_id: str, job_id: str | None, lines_left: int, unstored: int = 0) -> None:
    """The one log line of a job whose batch lost its record (a Redis restarted without
    persistence): nothing more of it is run or stored (`unstored`: lines it answered
    that may not have reached this Redis)."""
    answered = f", {unstored} answered but not stored" if unstored else ""
    log.warning(
        "%s: the batch has no record in Redis any more (restarted without persistence?): "
        "dropped job %s, %d line(s) not run%s; re-submit its file with --batch-id %s",
        batch_id,
        job_id,
        lines_left,
        answered,
        batch_id,
    )


def settle(ctx: WorkerContext, batch_id: str, line: PendingLine, cancelled: bool) -> Outcome | None:
    """The outcome of a line that needs no engine (an unreadable request, a cancelled
    batch, another model), else None."""
    if line.unreadable is not None:
        outcome = _unreadable(ctx, batch_id, line.key, line.unreadable, line.code)
        log.error("%s %s: %s", batch_id, line.key, outcome.line["error"]["message"])
        return outcome
    request = line.request
    if cancelled:
        return failure(batch_id, request, "cancelled", "the batch was cancelled before it started")
    if request.model != ctx.alias:
        return failure(
            batch_id,
            request,
            "model_not_served",
            f"model {request.model!r} reached a worker serving {ctx.alias!r}; it was not run",
        )
    return unusable_constraint(batch_id, request) or context_overflow(ctx.pair, batch_id, request)


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
    ctx: WorkerContext, batch_id: str, line: PendingLine, outcome: Outcome, took_s: float = 0.0
) -> None:
    """Hand a line's outcome to the worker's LineStore (stored once per line key)."""
    number = line.request.line if line.request is not None else outcome.line["error"]["line"]
    ctx.line_store().add(batch_id, line.key, number, outcome, took_s, line.digest)


def note_started(ctx: WorkerContext, batch_id: str) -> None:
    """A job of the batch starts decoding: note when the batch's first line did, and
    count the job for this worker (so spec-status lists a worker that holds lines
    before it has answered any, and still once it has gone quiet)."""
    with ctx.conn.pipeline(transaction=False) as pipe:
        pipe.hsetnx(ctx.keys.batch(batch_id), "started_at", f"{time.time():.3f}")
        pipe.hincrby(ctx.keys.batch_workers(batch_id), f"jobs:{ctx.worker_name}", 1)
        pipe.execute()


def line_failed(job: Job, batch_id: str, line: PendingLine, exc: BaseException) -> tuple[str, str]:
    """(code, message) of a line of `job` that raised or passed its timeout, logged with
    the attempt it was."""
    if isinstance(exc, JobTimeoutException):
        code, message = "timeout", f"did not finish within {line.timeout} s"
    else:
        code, message = "internal_error", f"{type(exc).__name__}: {exc}"
    left = getattr(job, "retries_left", None)
    attempt = config.JOB_RETRIES + 1 - left if left is not None else 1
    log.warning(
        "%s line %d (%s): attempt %d of %d failed: %s",
        batch_id,
        line.request.line,
        line.request.custom_id,
        attempt,
        config.JOB_RETRIES + 1,
        message,
    )
    return code, message


def on_job_failure(
    ctx: WorkerContext | None, job, connection: Redis, exc_type, exc_value, traceback
) -> None:
    """RQ failure callback (bound to the worker's context by worker.guard.job_class):
    once a job has no retries left, write the error line of each of its lines still
    unanswered (`timeout`, `worker_lost` or `internal_error`). Runs in a worker process."""
    if job.retries_left:
        return  # RQ runs it again
    batch_id, line_keys = job.args
    keys = ctx.keys if ctx is not None else Keys.default()
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
    worker = ctx.worker_name if ctx is not None else None
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
            ttl_s=ctx.ttl_s if ctx is not None else 0,
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
