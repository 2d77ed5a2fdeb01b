"""`spec-cancel`: mark a batch cancelled and answer its waiting lines `cancelled`."""

from __future__ import annotations

import time

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from jobstore import store
from jobstore.keys import Keys, custom_id_of
from jobstore.lines import dumps, error_line
from producer.errors import redis_refusals
from producer.meta import job_lines, models_of, read_meta


@redis_refusals
def cancel(conn: Redis, keys: Keys, batch_id: str) -> int:
    """Mark the batch cancelled and take its waiting jobs out of the queues; each of
    their lines gets a `cancelled` error line. Lines already running finish; the lines
    of a running job that have not started are cancelled by its worker. Returns how
    many lines were cancelled here."""
    meta = read_meta(conn, keys, batch_id)
    conn.hset(keys.batch(batch_id), "cancelled", f"{time.time():.3f}")
    removed = 0
    for alias in models_of(meta):
        queue = Queue(keys.queue_name(alias), connection=conn, serializer=JSONSerializer)
        for removed_id in store.remove_queued(conn, queue.key, batch_id):
            line_keys = job_lines(_fetch(conn, removed_id))
            conn.delete(keys.rq_job(removed_id))
            records = conn.hmget(keys.requests(batch_id), line_keys) if line_keys else []
            for key, record in zip(line_keys, records, strict=True):
                if record is None:
                    continue  # answered already
                line = store.line_number(conn, keys, batch_id, key, record)
                custom_id = custom_id_of(key)
                line_json = dumps(
                    error_line(
                        batch_id, line, custom_id, "cancelled", "cancelled before it started"
                    )
                )
                removed += store.store_line(conn, keys, batch_id, key, line_json, ok=False)
    return removed


def _fetch(conn: Redis, job: str) -> Job | None:
    try:
        return Job.fetch(job, connection=conn, serializer=JSONSerializer)
    except (NoSuchJobError, ValueError, TypeError):
        return None
