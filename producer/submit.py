"""Submitting a job file: validate every line, then enqueue in bulk, idempotently.

Two passes over the file keep memory bounded whatever its size: the first validates
every line and reports every problem; the second (only when the file is acceptable)
re-reads it and enqueues CHUNK_LINES lines per Redis pipeline. Re-submitting a batch
id skips lines that already have a result or whose job is still queued or running,
and runs again the lines that ended in an error line.

A batch may carry a TTL (`result_ttl` in its hash): every key of the batch gets it at
submit time, and every line stored later renews it (jobstore.store), so a batch that
nobody collects frees its memory by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from redis import Redis
from rq import Callback, Queue, Retry
from rq.serializers import JSONSerializer

from jobstore import config, store
from jobstore.jobfile import JobLine, LineError, validate_file
from jobstore.keys import FAILURE_CALLBACK, JOB_FUNCTION, Keys, line_key
from jobstore.lines import dumps, error_line, line_id

#: While a file is being enqueued the batch is flagged for this long (refreshed per chunk).
SUBMITTING_TTL_S = 600


@dataclass
class SubmitReport:
    batch_id: str
    lines: int = 0
    enqueued: int = 0
    invalid: int = 0
    already_done: int = 0
    already_pending: int = 0
    rerun: int = 0
    models: dict[str, int] = field(default_factory=dict)


def enqueue_file(
    conn: Redis,
    keys: Keys,
    path: str,
    batch_id: str,
    default_model: str,
    model_override: str | None,
    check: Callable[[JobLine], LineError | None] | None,
    result_ttl: int | None = None,
) -> SubmitReport:
    """Second pass: enqueue the valid lines of a validated file and store the invalid
    ones as `invalid_request` error lines.

    result_ttl: seconds every key of the batch lives after its last write (0: until
    `spec-collect --delete`; None: as SPEC_RESULT_TTL_S says, else as before).
    """
    report = SubmitReport(batch_id)
    meta = keys.batch(batch_id)
    created = time.time()
    flag = keys.submitting(batch_id)  # the batch cannot look finished while this is set
    if result_ttl is None and config.result_ttl_s() > 0:
        result_ttl = config.result_ttl_s()
    with conn.pipeline() as pipe:
        pipe.set(flag, 1, ex=SUBMITTING_TTL_S)
        pipe.hsetnx(meta, "created_at", f"{created:.3f}")
        pipe.hset(meta, "source", path.rsplit("/", 1)[-1])
        if result_ttl is not None:
            pipe.hset(meta, "result_ttl", int(result_ttl))
        pipe.zadd(keys.batches, {batch_id: created}, nx=True)
        pipe.execute()
    ttl = int(conn.hget(meta, "result_ttl") or 0)  # this submission's, or an earlier one's
    queues: dict[str, Queue] = {}
    try:
        for chunk in _chunks(validate_file(path, model_override, check)):
            conn.expire(flag, SUBMITTING_TTL_S)
            _enqueue_chunk(conn, keys, batch_id, default_model, chunk, queues, report, ttl)
    finally:
        conn.delete(flag)
    _mark_if_finished(conn, keys, batch_id)
    if result_ttl is not None:
        apply_ttl(conn, keys, batch_id, ttl)
    return report


def apply_ttl(conn: Redis, keys: Keys, batch_id: str, ttl: int) -> None:
    """Give every key of the batch this TTL in seconds (0: remove any TTL)."""
    with conn.pipeline(transaction=False) as pipe:
        for key in keys.batch_keys(batch_id):
            if key == keys.submitting(batch_id):
                continue
            if ttl > 0:
                pipe.expire(key, ttl)
            else:
                pipe.persist(key)
        pipe.execute()


def _mark_if_finished(conn: Redis, keys: Keys, batch_id: str) -> None:
    """Set completed_at when every line already has its line (e.g. a re-submission of a
    finished batch, or lines finished while later chunks were still being enqueued)."""
    meta = keys.batch(batch_id)
    completed, failed = conn.hmget(meta, "completed", "failed")
    if int(completed or 0) + int(failed or 0) >= conn.zcard(keys.order(batch_id)):
        conn.hsetnx(meta, "completed_at", f"{time.time():.3f}")


def _chunks(items: Iterator[JobLine | LineError]) -> Iterator[list[JobLine | list[LineError]]]:
    """Group a validation stream into chunks of lines (a line is a JobLine or the list
    of its LineErrors)."""
    chunk: list = []
    current: list[LineError] = []
    for item in items:
        if isinstance(item, LineError):
            if current and current[0].line != item.line:
                chunk.append(current)
                current = []
            current.append(item)
            continue
        if current:
            chunk.append(current)
            current = []
        chunk.append(item)
        if len(chunk) >= config.CHUNK_LINES:
            yield chunk
            chunk = []
    if current:
        chunk.append(current)
    if chunk:
        yield chunk


def _key_of(entry: JobLine | list[LineError]) -> str:
    if isinstance(entry, JobLine):
        return line_key(entry.custom_id, entry.line)
    return line_key(entry[0].custom_id, entry[0].line)


def _enqueue_chunk(conn, keys, batch_id, default_model, chunk, queues, report, ttl) -> None:
    line_keys = [_key_of(e) for e in chunk]
    states = store.classify(conn, keys, batch_id, line_keys)
    store.clear_errors(
        conn, keys, batch_id, [k for k, s in zip(line_keys, states, strict=True) if s == "error"]
    )
    jobs: dict[str, list] = {}
    with conn.pipeline(transaction=False) as pipe:
        for entry, key, state in zip(chunk, line_keys, states, strict=True):
            report.lines += 1
            line = entry.line if isinstance(entry, JobLine) else entry[0].line
            pipe.zadd(keys.order(batch_id), {key: line})
            if state == "done":
                report.already_done += 1
                continue
            if state == "pending":
                report.already_pending += 1
                continue
            report.rerun += state == "error"
            if isinstance(entry, list):
                report.invalid += 1
                continue
            job = entry if entry.model else entry.with_model(default_model)
            if state == "error":  # forget the failed run's RQ job before enqueueing anew
                job_id = line_id(batch_id, job.line)
                pipe.delete(keys.rq_job(job_id))
                pipe.zrem(keys.rq_failed(job.model), job_id)
            pipe.hset(keys.requests(batch_id), key, dumps(job.to_record()))
            pipe.hset(keys.batch(batch_id), f"model:{job.model}", 1)
            jobs.setdefault(job.model, []).append(_job_data(batch_id, key, job, ttl))
            report.models[job.model] = report.models.get(job.model, 0) + 1
            report.enqueued += 1
        if jobs:
            pipe.hdel(keys.batch(batch_id), "completed_at", "cancelled")
        for alias, datas in jobs.items():
            if alias not in queues:
                queues[alias] = Queue(
                    keys.queue_name(alias), connection=conn, serializer=JSONSerializer
                )
            queues[alias].enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    # Invalid lines are written after their order entries exist, so totals add up.
    for entry, key, state in zip(chunk, line_keys, states, strict=True):
        if isinstance(entry, list) and state in ("new", "error"):
            message = "; ".join(f"{e.field}: {e.message}" if e.field else e.message for e in entry)
            line = error_line(
                batch_id, entry[0].line, entry[0].custom_id, "invalid_request", message
            )
            store.store_line(conn, keys, batch_id, key, dumps(line), ok=False)


def _job_data(batch_id: str, key: str, job: JobLine, ttl: int = 0):
    """RQ's data for one line's job. A batch with a TTL keeps its failed RQ records no
    longer than its lines."""
    failure_ttl = min(config.FAILURE_TTL_S, ttl) if ttl > 0 else config.FAILURE_TTL_S
    return Queue.prepare_data(
        JOB_FUNCTION,
        args=[batch_id, key],
        timeout=config.job_timeout_s(job.params["max_tokens"], job.prompt_chars()),
        result_ttl=0,
        failure_ttl=failure_ttl,
        description=f"{batch_id} line {job.line} ({job.custom_id})",
        job_id=line_id(batch_id, job.line),
        retry=Retry(max=config.JOB_RETRIES),
        on_failure=Callback(FAILURE_CALLBACK),
    )
