"""Submitting a job file: validate every line, then enqueue in bulk, idempotently.

Two passes over the file keep memory bounded whatever its size: the first validates
every line and reports every problem; the second (only when the file is acceptable)
re-reads it and enqueues about CHUNK_LINES lines per Redis transaction (MULTI/EXEC), so a
chunk is written whole or not at all: a Redis that fills up (maxmemory) mid-file
leaves whole jobs only, and says how many lines went in. One RQ job carries
`config.job_lines(total)` lines of one model alias (one per job for a small file, up to
JOB_LINES_MAX for a large one): RQ's own bookkeeping, about 1 KB and 70 commands a
job, is shared by its lines. Each request record names its job's number and its
timeout. Re-submitting a batch id
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
from jobstore.keys import FAILURE_CALLBACK, JOB_FUNCTION, JOBS_FIELD, Keys, job_id, line_key
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
                total_lines,
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
    total_lines,
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
    per_job = config.job_lines(total_lines or 0)
    per_transaction = per_job * max(1, config.CHUNK_LINES // per_job)  # whole jobs
    plan = QueuePlan(conn, keys, batch_id, default_model, queues, ttl, per_job)
    try:
        for chunk in _chunks(validate_file(path, model_override, check), per_transaction):
            lock.check()
            conn.expire(flag, SUBMITTING_TTL_S)
            _enqueue_chunk(plan, chunk, report)
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


def _chunks(
    items: Iterator[JobLine | LineError], size: int
) -> Iterator[list[JobLine | list[LineError]]]:
    """Group a validation stream into chunks of `size` lines (a line is a JobLine or the
    list of its LineErrors)."""
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
        if len(chunk) >= size:
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


@dataclass
class QueuePlan:
    """What every transaction of one submission shares."""

    conn: Redis
    keys: Keys
    batch_id: str
    default_model: str
    queues: dict[str, Queue]
    ttl: int
    per_job: int  # lines per RQ job

    def queue(self, alias: str) -> Queue:
        if alias not in self.queues:
            self.queues[alias] = Queue(
                self.keys.queue_name(alias), connection=self.conn, serializer=JSONSerializer
            )
        return self.queues[alias]


def _enqueue_chunk(plan: QueuePlan, chunk: list, total: SubmitReport) -> None:
    """Write one chunk in one MULTI/EXEC: its lines are all in, or none (then raises)."""
    conn, keys, batch_id = plan.conn, plan.keys, plan.batch_id
    line_keys = [_key_of(e) for e in chunk]
    states = store.classify(conn, keys, batch_id, line_keys)
    report = SubmitReport(batch_id)  # this chunk's counts, added to `total` once written
    order: dict[str, int] = {}
    runs: dict[str, list[tuple[str, JobLine]]] = {}  # alias -> lines to enqueue
    for entry, key, state in zip(chunk, line_keys, states, strict=True):
        report.lines += 1
        order[key] = entry.line if isinstance(entry, JobLine) else entry[0].line
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
        job = entry if entry.model else entry.with_model(plan.default_model)
        runs.setdefault(job.model, []).append((key, job))
        report.models[job.model] = report.models.get(job.model, 0) + 1
        report.enqueued += 1
    # Dropped before the chunk's transaction: should that fail, these lines are "new"
    # to the next submission, which enqueues them (the batch keeps its submitting flag).
    store.clear_errors(
        conn, keys, batch_id, [k for k, s in zip(line_keys, states, strict=True) if s == "error"]
    )
    with conn.pipeline(transaction=True) as pipe:
        pipe.zadd(keys.order(batch_id), order)
        queue_lines(plan, runs, pipe)
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


def queue_lines(plan: QueuePlan, runs: dict[str, list[tuple[str, JobLine]]], pipe) -> None:
    """Add to `pipe` (a MULTI/EXEC pipeline) the writes that queue these lines (alias ->
    [(line key, JobLine)]): jobs of `plan.per_job` lines, each line's request record
    naming its job, and the removal of the lines' earlier RQ jobs. Job numbers are taken
    from the batch's counter at once: if the transaction fails they are never used."""
    conn, keys, batch_id = plan.conn, plan.keys, plan.batch_id
    groups = [
        (alias, lines[i : i + plan.per_job])
        for alias, lines in runs.items()
        for i in range(0, len(lines), plan.per_job)
    ]
    if not groups:
        return
    stale = _stale_jobs(conn, keys, batch_id, [k for lines in runs.values() for k, _ in lines])
    last = conn.hincrby(keys.batch(batch_id), JOBS_FIELD, len(groups))
    for stale_job, alias in stale.items():  # an earlier run's RQ job, forgotten
        pipe.delete(keys.rq_job(stale_job))
        pipe.zrem(keys.rq_failed(alias), stale_job)
    records: dict[str, str] = {}
    datas: dict[str, list] = {}
    for number, (alias, lines) in enumerate(groups, last - len(groups) + 1):
        for key, job in lines:
            timeout = config.job_timeout_s(job.params["max_tokens"], job.prompt_chars())
            records[key] = dumps({**job.to_record(), "job": number, "timeout": timeout})
        datas.setdefault(alias, []).append(_job_data(batch_id, number, lines, plan.ttl))
    pipe.hset(keys.requests(batch_id), mapping=records)
    pipe.hset(keys.batch(batch_id), mapping={f"model:{a}": 1 for a in runs})
    pipe.hdel(keys.batch(batch_id), "completed_at", "cancelled")
    for alias, alias_datas in datas.items():
        plan.queue(alias).enqueue_many(alias_datas, pipeline=pipe)


def _stale_jobs(conn, keys, batch_id, again: list[str]) -> dict[str, str]:
    """job id -> alias of the earlier jobs of lines about to be enqueued again (an error
    line, or a job that is gone): they may sit in a failed registry."""
    if not again:
        return {}
    out = {}
    for record in conn.hmget(keys.requests(batch_id), again):
        if record is None:
            continue
        try:
            old = json.loads(record)
            out[job_id(batch_id, int(old["job"]))] = str(old["model"])
        except (ValueError, KeyError, TypeError):
            continue  # damaged, or written before job numbers: nothing to forget
    return out


def _job_data(batch_id: str, number: int, lines: list[tuple[str, JobLine]], ttl: int = 0):
    """RQ's data for one job of `lines` (line key, JobLine) of one alias. Its timeout is
    the sum of its lines' (the worker stops each line at its own); a batch with a TTL
    keeps its failed RQ records no longer than its lines."""
    failure_ttl = min(config.FAILURE_TTL_S, ttl) if ttl > 0 else config.FAILURE_TTL_S
    timeout = sum(
        config.job_timeout_s(job.params["max_tokens"], job.prompt_chars()) for _, job in lines
    )
    first = lines[0][1]
    if len(lines) == 1:
        description = f"{batch_id} line {first.line} ({first.custom_id})"
    else:
        description = f"{batch_id} {len(lines)} lines from line {first.line} ({first.custom_id})"
    return Queue.prepare_data(
        JOB_FUNCTION,
        args=[batch_id, [key for key, _ in lines]],
        timeout=timeout,
        result_ttl=0,
        failure_ttl=failure_ttl,
        description=description,
        job_id=job_id(batch_id, number),
        retry=Retry(max=config.JOB_RETRIES),
        on_failure=Callback(FAILURE_CALLBACK),
    )
