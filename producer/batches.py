"""Following a batch after submission: status, collect, retry, cancel.

All reads are chunked (CHUNK_LINES keys per round trip), so memory stays bounded
however many lines a batch has.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Literal

from redis import Redis
from rq import Queue
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from jobstore import config, store
from jobstore.jobfile import JobLine
from jobstore.keys import AUDIT_CHECKED, AUDIT_MISMATCHES, Keys
from jobstore.limits import TERMINAL_STATUSES
from jobstore.lines import dumps, error_line, line_id
from producer.submit import _job_data

TERMINAL = TERMINAL_STATUSES


class BatchError(Exception):
    """A batch operation cannot be done as asked; the message says why."""


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _meta(conn: Redis, keys: Keys, batch_id: str) -> dict[str, str]:
    raw = conn.hgetall(keys.batch(batch_id))
    if not raw:
        raise BatchError(f"no batch {batch_id!r} in this Redis (prefix {keys.prefix!r})")
    return {_text(k): _text(v) for k, v in raw.items()}


def models_of(meta: dict[str, str]) -> list[str]:
    return sorted(k.split(":", 1)[1] for k in meta if k.startswith("model:"))


def _is_batch_job(job_id: str, batch_id: str) -> bool:
    prefix = f"{batch_id}-"
    return job_id.startswith(prefix) and job_id[len(prefix) :].isdigit()


def running_jobs(conn: Redis, keys: Keys, batch_id: str, models: list[str]) -> list[str]:
    """Job ids of this batch that a worker has started and not finished."""
    out = []
    for alias in models:
        registry = StartedJobRegistry(keys.queue_name(alias), connection=conn)
        out += [j for j in registry.get_job_ids(cleanup=False) if _is_batch_job(j, batch_id)]
    return out


def status(conn: Redis, keys: Keys, batch_id: str) -> dict:
    """The batch status object of FORMATS.md. Raises BatchError for an unknown batch."""
    meta = _meta(conn, keys, batch_id)
    now = time.time()
    total = conn.zcard(keys.order(batch_id))
    completed, failed = int(meta.get("completed", 0)), int(meta.get("failed", 0))
    running = len(running_jobs(conn, keys, batch_id, models_of(meta)))
    done = completed + failed
    queued = max(0, total - done - running)
    finished = total > 0 and done >= total and not conn.exists(keys.submitting(batch_id))
    if meta.get("cancelled"):
        state = "cancelled"
    elif finished:
        state = "failed" if completed == 0 else "completed"
    elif done or running:
        state = "in_progress"
    else:
        state = "queued"

    started = float(meta["started_at"]) if "started_at" in meta else None
    completed_at = float(meta["completed_at"]) if finished and "completed_at" in meta else None
    end = completed_at or (float(meta.get("last_done_at", now)) if finished else now)
    completion_tokens = int(meta.get("completion_tokens", 0))
    elapsed = (end - started) if started is not None else 0.0
    throughput = completion_tokens / elapsed if elapsed > 0 else 0.0
    eta = None
    if finished:
        eta = 0.0
    elif done and elapsed > 0 and state == "in_progress":
        eta = round((total - done) * elapsed / done, 1)
    return {
        "id": batch_id,
        "status": state,
        "created_at": int(float(meta.get("created_at", 0))),
        "completed_at": int(completed_at) if completed_at else None,
        "request_counts": {
            "total": total,
            "queued": queued,
            "running": running,
            "completed": completed,
            "failed": failed,
        },
        "usage": {
            "prompt_tokens": int(meta.get("prompt_tokens", 0)),
            "completion_tokens": completion_tokens,
        },
        "speculative_decoding": store.spec_summary(meta),
        "throughput_tokens_per_second": round(throughput, 2),
        "eta_seconds": eta,
        "workers": _workers(conn, keys, batch_id),
        "audit": audit_summary(meta),
    }


def audit_summary(meta: dict[str, str]) -> dict[str, int]:
    """{"checked", "mismatches"}: requests re-run target-only by audit mode, and how
    many of them came out different from the speculative output."""
    return {
        "checked": int(meta.get(AUDIT_CHECKED, 0)),
        "mismatches": int(meta.get(AUDIT_MISMATCHES, 0)),
    }


def _workers(conn: Redis, keys: Keys, batch_id: str) -> list[dict]:
    by_name: dict[str, dict[str, int]] = {}
    for field, value in conn.hgetall(keys.batch_workers(batch_id)).items():
        counter, name = _text(field).split(":", 1)
        by_name.setdefault(name, {})[counter] = int(value)
    out = []
    for name in sorted(by_name):
        c = by_name[name]
        busy = c.get("busy_ms", 0) / 1000
        model = conn.hget(keys.worker(name), "model")
        out.append(
            {
                "name": name,
                "model": _text(model) if model else None,
                "completed": c.get("completed", 0),
                "failed": c.get("failed", 0),
                "tokens_per_second": round(c.get("completion_tokens", 0) / busy, 2)
                if busy
                else 0.0,
            }
        )
    return out


def _line_keys(conn: Redis, keys: Keys, batch_id: str, order: str) -> Iterator[list[str]]:
    step = config.CHUNK_LINES
    start = 0
    while True:
        if order == "input":
            chunk = conn.zrange(keys.order(batch_id), start, start + step - 1)
        else:
            chunk = conn.lrange(keys.done(batch_id), start, start + step - 1)
        if not chunk:
            return
        yield [_text(k) for k in chunk]
        start += step


def collect(
    conn: Redis,
    keys: Keys,
    batch_id: str,
    out_path: str,
    errors_path: str | None = None,
    order: Literal["input", "completion"] = "input",
    delete: bool = False,
) -> dict[str, int]:
    """Write the batch's lines: results to out_path, error lines to errors_path (or also
    to out_path when it is None). Files are written whole or not at all (temporary
    file, then rename). Returns counts {"results", "errors", "pending"}.

    With delete, the batch must be finished; its keys are removed after the files are
    written. Raises BatchError.
    """
    meta = _meta(conn, keys, batch_id)
    if delete and status(conn, keys, batch_id)["status"] not in TERMINAL:
        raise BatchError(f"batch {batch_id} is not finished: collect without --delete, or wait")
    counts = {"results": 0, "errors": 0, "pending": 0}
    with _AtomicWriter(out_path) as out, _AtomicWriter(errors_path) as err:
        for chunk in _line_keys(conn, keys, batch_id, order):
            with conn.pipeline(transaction=False) as pipe:
                pipe.hmget(keys.results(batch_id), chunk)
                pipe.hmget(keys.errors(batch_id), chunk)
                results, errors = pipe.execute()
            for result, error in zip(results, errors, strict=True):
                if result is not None:
                    out.write(result)
                    counts["results"] += 1
                elif error is not None:
                    (err if errors_path else out).write(error)
                    counts["errors"] += 1
                else:
                    counts["pending"] += 1
    if delete:
        _delete(conn, keys, batch_id, models_of(meta))
    return counts


class _AtomicWriter:
    """Lines to a temporary file beside `path`, renamed over it on success."""

    def __init__(self, path: str | None):
        self.path = path
        self._file = None

    def __enter__(self):
        if self.path:
            directory = os.path.dirname(os.path.abspath(self.path))
            fd, self._tmp = tempfile.mkstemp(prefix=".spec-collect-", dir=directory)
            self._file = os.fdopen(fd, "wb")
        return self

    def write(self, line: bytes | str) -> None:
        data = line if isinstance(line, bytes) else line.encode()
        self._file.write(data + b"\n")

    def __exit__(self, exc_type, exc, tb):
        if self._file is None:
            return
        self._file.close()
        if exc_type is None:
            os.replace(self._tmp, self.path)
        else:
            os.unlink(self._tmp)


def _delete(conn: Redis, keys: Keys, batch_id: str, models: list[str]) -> None:
    for chunk in _scores(conn, keys, batch_id):
        with conn.pipeline(transaction=False) as pipe:
            for line in chunk:
                job_id = line_id(batch_id, line)
                pipe.delete(keys.rq_job(job_id))
                for alias in models:
                    pipe.zrem(keys.rq_failed(alias), job_id)
            pipe.execute()
    with conn.pipeline() as pipe:
        pipe.delete(*keys.batch_keys(batch_id))
        pipe.zrem(keys.batches, batch_id)
        pipe.execute()


def _scores(conn: Redis, keys: Keys, batch_id: str) -> Iterator[list[int]]:
    start, step = 0, config.CHUNK_LINES
    while True:
        chunk = conn.zrange(keys.order(batch_id), start, start + step - 1, withscores=True)
        if not chunk:
            return
        yield [int(score) for _, score in chunk]
        start += step


def retry(conn: Redis, keys: Keys, batch_id: str) -> int:
    """Queue again every line that ended in an error line and has a request (lines
    rejected at submit time have none: fix and re-submit those). Returns the count."""
    ttl = int(_meta(conn, keys, batch_id).get("result_ttl", 0))  # raises for an unknown batch
    failed = [_text(k) for k in conn.hkeys(keys.errors(batch_id))]
    retryable = []
    for i in range(0, len(failed), config.CHUNK_LINES):
        chunk = failed[i : i + config.CHUNK_LINES]
        found = conn.hmget(keys.requests(batch_id), chunk)
        retryable += [k for k, record in zip(chunk, found, strict=True) if record is not None]
    conn.hdel(keys.batch(batch_id), "cancelled")
    queues: dict[str, Queue] = {}
    for i in range(0, len(retryable), config.CHUNK_LINES):
        chunk = retryable[i : i + config.CHUNK_LINES]
        records = conn.hmget(keys.requests(batch_id), chunk)
        store.clear_errors(conn, keys, batch_id, chunk)
        jobs: dict[str, list] = {}
        with conn.pipeline(transaction=False) as pipe:
            for key, record in zip(chunk, records, strict=True):
                job = JobLine.from_record(json.loads(record))
                job_id = line_id(batch_id, job.line)
                pipe.delete(keys.rq_job(job_id))
                pipe.zrem(keys.rq_failed(job.model), job_id)
                jobs.setdefault(job.model, []).append(_job_data(batch_id, key, job, ttl))
            for alias, datas in jobs.items():
                queue = queues.setdefault(
                    alias, Queue(keys.queue_name(alias), connection=conn, serializer=JSONSerializer)
                )
                queue.enqueue_many(datas, pipeline=pipe)
            pipe.execute()
    return len(retryable)


def cancel(conn: Redis, keys: Keys, batch_id: str) -> int:
    """Mark the batch cancelled and take its waiting jobs out of the queues; each gets a
    `cancelled` error line. Jobs already running finish. Returns how many were removed."""
    meta = _meta(conn, keys, batch_id)
    conn.hset(keys.batch(batch_id), "cancelled", f"{time.time():.3f}")
    removed = 0
    for alias in models_of(meta):
        queue = Queue(keys.queue_name(alias), connection=conn, serializer=JSONSerializer)
        job_ids = store.remove_queued(conn, queue.key, batch_id)
        for job_id in job_ids:
            line = int(job_id.rsplit("-", 1)[1])
            found = conn.zrangebyscore(keys.order(batch_id), line, line)
            conn.delete(keys.rq_job(job_id))
            if not found:
                continue
            key = _text(found[0])
            custom_id = key[2:] if key.startswith("c:") else None
            line_json = dumps(
                error_line(batch_id, line, custom_id, "cancelled", "cancelled before it started")
            )
            removed += store.store_line(conn, keys, batch_id, key, line_json, ok=False)
    return removed
