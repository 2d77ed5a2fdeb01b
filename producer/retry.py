"""`spec-retry`: queue again the lines of a batch that ended in an error line."""

from __future__ import annotations

import json

from redis import Redis

from jobstore import config, store
from jobstore.keys import Keys
from producer.errors import CorruptBatch, redis_refusals
from producer.meta import read_meta, text
from producer.spool import Queued
from producer.submit import QueuePlan, queue_lines


@redis_refusals
def retry(conn: Redis, keys: Keys, batch_id: str) -> int:
    """Queue again every line that ended in an error line and has a request (lines
    rejected at submit time have none: fix and re-submit those). Returns the count."""
    ttl = int(read_meta(conn, keys, batch_id).get("result_ttl", 0))  # raises for an unknown batch
    failed = [text(k) for k in conn.hkeys(keys.errors(batch_id))]
    retryable = []
    for i in range(0, len(failed), config.CHUNK_LINES):
        chunk = failed[i : i + config.CHUNK_LINES]
        found = conn.hmget(keys.requests(batch_id), chunk)
        for key, record in zip(chunk, found, strict=True):
            if record is not None:
                _request(keys.requests(batch_id), key, record)  # damage found before any change
                retryable.append(key)
    conn.hdel(keys.batch(batch_id), "cancelled")
    from jobstore.jobfile import JobLine  # pydantic: not for status or collect

    plan = QueuePlan(conn, keys, batch_id, {}, ttl, config.job_lines(len(retryable)))
    step = plan.per_job * max(1, config.CHUNK_LINES // plan.per_job)
    for i in range(0, len(retryable), step):
        chunk = retryable[i : i + step]
        records = conn.hmget(keys.requests(batch_id), chunk)
        runs: dict[str, list[Queued]] = {}
        for record in records:
            entry = Queued.of(JobLine.from_record(json.loads(record)), config.DEFAULT_MODEL)
            runs.setdefault(entry.model, []).append(entry)
        store.clear_errors(conn, keys, batch_id, chunk)
        with conn.pipeline(transaction=True) as pipe:
            queue_lines(plan, runs, pipe)
            pipe.execute()
    return len(retryable)


@redis_refusals
def _request(hash_key: str, field: str, record: bytes):
    """A stored request record as a JobLine. Raises CorruptBatch naming key and field."""
    from jobstore.jobfile import JobLine

    try:
        return JobLine.from_record(json.loads(record))
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptBatch(
            f"key {hash_key} field {field}: not a request record ({type(exc).__name__}: {exc})"
        ) from exc
