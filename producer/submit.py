"""Submitting a job file: validate every line, then enqueue in bulk, idempotently.

Two passes over the file keep memory bounded whatever its size: the first validates
every line and reports every problem; the second (only when the file is acceptable)
re-reads it and enqueues CHUNK_LINES lines per Redis transaction (MULTI/EXEC), so a
chunk is written whole or not at all: a Redis that fills up (maxmemory) mid-file
leaves whole jobs only, and says how many lines went in. Re-submitting a batch id
skips lines that already have a result or whose job is still queued or running, and
runs again the lines that ended in an error line, so the same command run again
completes the batch. Until a submission of the batch completes, its `submitting`
flag stays set and the batch cannot look finished.

A batch may carry a TTL (`result_ttl` in its hash): every key of the batch gets it at
submit time, and every line stored later renews it (jobstore.store), so a batch that
nobody collects frees its memory by itself.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from redis import Redis
from redis.exceptions import OutOfMemoryError
from rq import Callback, Queue, Retry
from rq.serializers import JSONSerializer

from jobstore import config, store
from jobstore.jobfile import JobLine, LineError, validate_file
from jobstore.keys import FAILURE_CALLBACK, JOB_FUNCTION, Keys, job_id, line_key
from jobstore.lines import dumps, error_line

#: While a file is being enqueued the batch is flagged for this long (refreshed per chunk).
SUBMITTING_TTL_S = 600


class SubmitError(Exception):
    """The file cannot be submitted as asked; the message says why."""


class RedisFull(SubmitError):
    """Redis refused a write (maxmemory reached, noeviction): the lines before it are
    in, whole; the rest are not."""

    def __init__(self, batch_id: str, handled: int, total: int | None):
        self.handled = handled
        of = f" of {total}" if total is not None else ""
        super().__init__(
            f"Redis is full (maxmemory reached): {handled}{of} lines enqueued; raise maxmemory "
            f"or free memory, then run the same command with --batch-id {batch_id} to "
            "enqueue the rest"
        )


class BatchBusy(SubmitError):
    """Another spec-submit of the same batch held its submit lock for as long as we
    were willing to wait."""

    def __init__(self, batch_id: str, waited_s: float):
        super().__init__(
            f"another spec-submit of batch {batch_id} is running (waited {waited_s:.0f} s); "
            "run this one again once it has finished"
        )


class LostSubmitLock(SubmitError):
    """Our submit lock expired or was taken while enqueueing (Redis too slow to renew it)."""


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
    total_lines: int | None = None,
) -> SubmitReport:
    """Second pass: enqueue the valid lines of a validated file and store the invalid
    ones as `invalid_request` error lines.

    result_ttl: seconds every key of the batch lives after its last write (0: until
    `spec-collect --delete`; None: as SPEC_RESULT_TTL_S says, else as before).
    total_lines: the file's line count from the first pass, for messages.
    Raises RedisFull when Redis refuses a write for lack of memory (the chunks before
    are in, whole; the batch keeps its `submitting` flag until a re-submit completes).
    """
    report = SubmitReport(batch_id)
    try:
        with SubmitLock(conn, keys.submit_lock(batch_id), batch_id) as lock:
            _enqueue_file(
                conn,
                keys,
                path,
                batch_id,
                default_model,
                model_override,
                check,
                result_ttl,
                report,
                lock,
            )
    except OutOfMemoryError as exc:
        raise RedisFull(batch_id, report.lines, total_lines) from exc
    return report


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class SubmitLock:
    """The per-batch submit lock: `SET key token NX PX`, renewed by a thread every third
    of its TTL, released (only if still ours) on exit. Entering waits up to
    SPEC_SUBMIT_LOCK_WAIT_S for another holder, then raises BatchBusy."""

    def __init__(self, conn: Redis, key: str, batch_id: str, wait_s: float | None = None):
        self.conn, self.key, self.batch_id = conn, key, batch_id
        self.wait_s = config.submit_lock_wait_s() if wait_s is None else wait_s
        self.token = secrets.token_hex(16)
        self.ttl_ms = int(config.SUBMIT_LOCK_TTL_S * 1000)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SubmitLock:
        started = time.monotonic()
        while not self.conn.set(self.key, self.token, nx=True, px=self.ttl_ms):
            waited = time.monotonic() - started
            if waited >= self.wait_s:
                raise BatchBusy(self.batch_id, waited)
            time.sleep(min(0.2, self.wait_s - waited))
        self._thread = threading.Thread(target=self._renew, name="submit-lock", daemon=True)
        self._thread.start()
        return self

    def check(self) -> None:
        """Raise LostSubmitLock if the lock stopped being ours."""
        if self._lost.is_set():
            raise LostSubmitLock(
                f"lost the submit lock of batch {self.batch_id} (Redis too slow to renew it "
                f"within {config.SUBMIT_LOCK_TTL_S} s); run the same command again"
            )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if not self.conn.eval(_RENEW, 1, self.key, self.token, self.ttl_ms):
                    self._lost.set()
                    return
            except Exception:  # Redis hiccup: the next round tries again
                continue

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.conn.eval(_RELEASE, 1, self.key, self.token)
        except Exception:  # Redis gone: the lock expires by itself
            pass


def _enqueue_file(
    conn, keys, path, batch_id, default_model, model_override, check, result_ttl, report, lock
) -> None:
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
            lock.check()
            conn.expire(flag, SUBMITTING_TTL_S)
            _enqueue_chunk(conn, keys, batch_id, default_model, chunk, queues, report, ttl)
    except BaseException:
        # Part of the file is in: the batch must not look finished before the rest is.
        # (PERSIST needs no memory, so this works on a full Redis too.)
        _keep_flag(conn, flag)
        raise
    conn.delete(flag)
    _mark_if_finished(conn, keys, batch_id)
    if result_ttl is not None:
        apply_ttl(conn, keys, batch_id, ttl)


def _keep_flag(conn: Redis, flag: str) -> None:
    try:
        conn.persist(flag)
    except Exception:  # Redis gone as well: the flag's TTL still covers a while
        pass


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


def _enqueue_chunk(conn, keys, batch_id, default_model, chunk, queues, total, ttl) -> None:
    """Write one chunk in one MULTI/EXEC: its lines are all in, or none (then raises)."""
    line_keys = [_key_of(e) for e in chunk]
    states = store.classify(conn, keys, batch_id, line_keys)
    stale = _stale_jobs(conn, keys, batch_id, chunk, line_keys, states)
    report = SubmitReport(batch_id)  # this chunk's counts, added to `total` once written
    jobs: dict[str, list] = {}
    # Dropped before the chunk's transaction: should that fail, these lines are "new"
    # to the next submission, which enqueues them (the batch keeps its submitting flag).
    store.clear_errors(
        conn, keys, batch_id, [k for k, s in zip(line_keys, states, strict=True) if s == "error"]
    )
    with conn.pipeline(transaction=True) as pipe:
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
            if key in stale:  # forget an earlier run's RQ job before enqueueing anew
                pipe.delete(keys.rq_job(stale[key]))
                pipe.zrem(keys.rq_failed(job.model), stale[key])
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
        # Invalid lines are written after their order entries exist, so totals add up.
        for entry, key, state in zip(chunk, line_keys, states, strict=True):
            if isinstance(entry, list) and state in ("new", "error"):
                message = "; ".join(
                    f"{e.field}: {e.message}" if e.field else e.message for e in entry
                )
                line = error_line(
                    batch_id, entry[0].line, entry[0].custom_id, "invalid_request", message
                )
                store.store_line(pipe, keys, batch_id, key, dumps(line), ok=False)
        pipe.execute()
    total.lines += report.lines
    total.enqueued += report.enqueued
    total.invalid += report.invalid
    total.already_done += report.already_done
    total.already_pending += report.already_pending
    total.rerun += report.rerun
    for alias, n in report.models.items():
        total.models[alias] = total.models.get(alias, 0) + n


def _stale_jobs(conn, keys, batch_id, chunk, line_keys, states) -> dict[str, str]:
    """line key -> job id of an earlier submission's job, for the lines about to be
    enqueued again (an error line, or a job that is gone): it may sit in a registry."""
    again = [
        k
        for e, k, s in zip(chunk, line_keys, states, strict=True)
        if s in ("error", "new") and isinstance(e, JobLine)
    ]
    if not again:
        return {}
    records = conn.hmget(keys.requests(batch_id), again)
    return {
        k: job_id(batch_id, k, int(json.loads(r)["line"]))
        for k, r in zip(again, records, strict=True)
        if r is not None
    }


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
        job_id=job_id(batch_id, key, job.line),
        retry=Retry(max=config.JOB_RETRIES),
        on_failure=Callback(FAILURE_CALLBACK),
    )
