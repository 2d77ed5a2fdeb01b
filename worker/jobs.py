"""The one job function a worker runs, its failure callback, and their context.

A job is `run_request(batch_id, line_key)`: it reads the validated line from
`P:batch:B:requests`, runs it on the pair loaded at start-up (set once with
`set_context`, never loaded inside a job) and stores its line and counters with
`store_line`, once per (batch, line key): a job that runs twice writes nothing the
second time.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq.exceptions import AbandonedJobError
from rq.timeouts import JobTimeoutException

from jobstore import config, store
from jobstore.jobfile import JobLine
from jobstore.keys import Keys
from jobstore.lines import dumps, error_line
from worker.execute import Outcome, execute, failure

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


_context: WorkerContext | None = None


def set_context(context: WorkerContext | None) -> None:
    global _context
    _context = context


def get_context() -> WorkerContext:
    if _context is None:
        raise RuntimeError("run_request needs a worker context (set_context at start-up)")
    return _context


@dataclass(frozen=True)
class Request:
    """A line's state in Redis when a job comes to run it."""

    answered: bool  # it has a result or error line already
    line: JobLine | None  # None: no such request (batch deleted?), or unreadable
    cancelled: bool
    unreadable: str | None = None  # why the stored request cannot be parsed


def read_request(ctx: WorkerContext, batch_id: str, line_key: str) -> Request:
    """One look at a line: answered already, cancelled, and its parsed request."""
    conn, keys = ctx.conn, ctx.keys
    with conn.pipeline(transaction=False) as pipe:
        pipe.hexists(keys.results(batch_id), line_key)
        pipe.hexists(keys.errors(batch_id), line_key)
        pipe.hget(keys.requests(batch_id), line_key)
        pipe.hget(keys.batch(batch_id), "cancelled")
        has_result, has_error, record, cancelled = pipe.execute()
    line, unreadable = None, None
    if record is not None:
        try:
            line = JobLine.from_record(json.loads(record))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            unreadable = f"{type(exc).__name__}: {exc}"
    return Request(bool(has_result or has_error), line, bool(cancelled), unreadable)


def _unreadable(ctx: WorkerContext, batch_id: str, line_key: str, reason: str) -> Outcome:
    """The error line of a request whose stored record cannot be parsed: written at once
    (a retry would read the same bytes)."""
    number = int(ctx.conn.zscore(ctx.keys.order(batch_id), line_key) or 0)
    custom_id = line_key[2:] if line_key.startswith("c:") else None
    message = (
        f"the stored request cannot be read ({ctx.keys.requests(batch_id)} field "
        f"{line_key!r}: {reason[:200]}); it was not run"
    )
    line = error_line(batch_id, number, custom_id, "internal_error", message)
    return Outcome(False, line, {})


def run_request(
    batch_id: str, line_key: str, precomputed: Outcome | BaseException | None = None
) -> dict:
    """Run one line of a batch and store its result or error line.

    `precomputed` is what a batch computed for the line (worker.rqbatch, through
    SafeJob): stored instead of running the line, or raised when an exception.
    Returns a small summary (stored by RQ only briefly). Raises on unexpected errors,
    so RQ retries the job; the last failure becomes an error line in on_job_failure.
    """
    ctx = get_context()
    conn, keys = ctx.conn, ctx.keys
    if isinstance(precomputed, BaseException):
        raise precomputed  # e.g. the job's timeout, met while it ran in a batch
    request = read_request(ctx, batch_id, line_key)
    job = request.line
    if request.answered:
        return {"stored": False, "reason": "already has a line"}
    if request.unreadable is not None:
        outcome = _unreadable(ctx, batch_id, line_key, request.unreadable)
        log.error("%s %s: %s", batch_id, line_key, outcome.line["error"]["message"])
    elif job is None:
        log.warning("batch %s has no request %s (deleted?): nothing to do", batch_id, line_key)
        return {"stored": False, "reason": "no such request"}
    elif request.cancelled:
        outcome = failure(batch_id, job, "cancelled", "the batch was cancelled before it started")
    elif job.model != ctx.alias:
        outcome = failure(
            batch_id,
            job,
            "model_not_served",
            f"model {job.model!r} reached a worker serving {ctx.alias!r}; it was not run",
        )
    else:
        conn.hsetnx(keys.batch(batch_id), "started_at", f"{time.time():.3f}")
        outcome = (
            precomputed
            if precomputed is not None
            else execute(ctx.pair, ctx.alias, batch_id, job, ctx.worker_name)
        )
    stored = store.store_line(
        conn,
        keys,
        batch_id,
        line_key,
        dumps(outcome.line),
        ok=outcome.ok,
        counters=outcome.counters,
        worker=ctx.worker_name,
        ttl_s=ctx.ttl_s,
    )
    if job is None:
        return {"stored": stored, "ok": False}
    code = None if outcome.ok else outcome.line["error"]["code"]
    log.info(
        "%s line %d (%s): %s%s",
        batch_id,
        job.line,
        job.custom_id,
        f"{outcome.completion_tokens} tokens" if outcome.ok else f"error {code}",
        "" if stored else " (already stored by another run)",
    )
    return {"stored": stored, "ok": outcome.ok}


def on_job_failure(job, connection: Redis, exc_type, exc_value, traceback) -> None:
    """RQ failure callback: once a job has no retries left, write its error line
    (`timeout`, `worker_lost` or `internal_error`). Runs in a worker process."""
    if job.retries_left:
        return  # RQ runs it again
    batch_id, line_key = job.args
    keys = _context.keys if _context is not None else Keys.default()
    if not connection.hexists(keys.requests(batch_id), line_key):
        return  # the batch was deleted meanwhile
    # The line number is in the job id and the custom_id in the line key, so even a
    # request that cannot be read back gets its error line.
    line = int(job.id.rsplit("-", 1)[1])
    custom_id = line_key[2:] if line_key.startswith("c:") else None
    tries = f"{config.JOB_RETRIES + 1} attempts"  # every job is enqueued with these retries
    if exc_type is not None and issubclass(exc_type, JobTimeoutException):
        code, message = "timeout", f"did not finish within {job.timeout} s ({tries})"
    elif exc_type is not None and issubclass(exc_type, AbandonedJobError):
        code, message = "worker_lost", f"the worker running it stopped responding ({tries})"
    else:
        name = exc_type.__name__ if exc_type is not None else "error"
        code, message = "internal_error", f"{name}: {exc_value} ({tries})"
    worker = _context.worker_name if _context is not None else None
    store.store_line(
        connection,
        keys,
        batch_id,
        line_key,
        dumps(error_line(batch_id, line, custom_id, code, message)),
        ok=False,
        worker=worker,
        ttl_s=_context.ttl_s if _context is not None else 0,
    )
    log.warning("%s line %d (%s): error %s: %s", batch_id, line, custom_id, code, message)
