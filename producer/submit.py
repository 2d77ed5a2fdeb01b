"""Submitting a job file: validate every line, then enqueue in bulk, idempotently.

Two passes keep memory bounded whatever the file's size: the first (producer.spool)
validates every line, reports every problem and keeps each line's verdict in a
temporary file; the second (here, only when the file is acceptable) reads the verdicts
back and enqueues about CHUNK_LINES lines per Redis transaction (MULTI/EXEC), so a chunk
is written whole or not at all: a Redis that fills up (maxmemory) mid-file leaves whole
jobs only, and says how many lines went in. One RQ job carries
`config.job_lines(total)` lines of one model alias (one per job for a small file, up to
JOB_LINES_MAX for a large one): RQ's own bookkeeping, about 1 KB and 70 commands a job,
is shared by its lines. Each request record names its job's number and its time limit.

Re-submitting a batch id skips lines that already have a result or whose job is still
queued or running, and runs again the lines that ended in an error line, so the same
command run again completes the batch (a batch new to Redis skips that look). Until a
submission of the batch completes, its `submitting` flag stays set and the batch cannot
look finished.

A batch may carry a TTL (`result_ttl` in its hash): every key of the batch gets it at
submit time, and every line stored later renews it (jobstore.store), so a batch that
nobody collects frees its memory by itself.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from redis import Redis
from redis.exceptions import OutOfMemoryError
from rq import Callback, Queue, Retry
from rq.serializers import JSONSerializer

from jobstore import config, store
from jobstore.keys import FAILURE_CALLBACK, JOB_FUNCTION, JOBS_FIELD, Keys, job_id
from jobstore.lines import dumps, error_line
from producer.errors import SubmitError
from producer.spool import Queued, Rejected

#: While a file is being enqueued the batch is flagged for this long (refreshed per chunk).
SUBMITTING_TTL_S = 600


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


class ChangedLines(SubmitError):
    """Lines already known under their custom_ids ask for something else now; nothing
    was enqueued."""


#: What a re-submit does with a line whose custom_id is known with another request:
#: refuse the submission (default), run it again (its old answer dropped), keep the old.
CHANGED_CHOICES = ("refuse", "rerun", "keep")


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
    #: Known lines whose request changed: answers dropped and run again / answers kept.
    replaced: int = 0
    kept_changed: int = 0
    models: dict[str, int] = field(default_factory=dict)


def enqueue_file(
    conn: Redis,
    keys: Keys,
    lines: Iterable[Queued | Rejected],
    source: str,
    batch_id: str,
    result_ttl: int | None = None,
    total_lines: int | None = None,
    changed: str = "refuse",
    total_rows: int | None = None,
) -> SubmitReport:
    """Second pass: enqueue the valid lines of a validated file (a producer.spool.Spool,
    or any iterable of its entries) and store the rejected ones as `invalid_request`
    error lines. `source`: the file's name, kept with the batch.

    result_ttl: seconds every key of the batch lives after its last write (0: until
    `spec-collect --delete`; None: as SPEC_RESULT_TTL_S says, else as before).
    total_lines: the file's line count from the first pass; total_rows: its rows (each
    line's choices; Spool.rows), which set the rows per job (else total_lines does).
    changed: what to do with lines already answered, queued or running under their
    custom_id whose request is different now (CHANGED_CHOICES); "refuse" raises
    ChangedLines before anything is written, and so does "rerun" for such lines still
    queued or running. Raises RedisFull when Redis refuses a write for lack of memory (the chunks before
    are in, whole; the batch keeps its `submitting` flag until a re-submit completes).
    """
    report = SubmitReport(batch_id)
    try:
        with SubmitLock(conn, keys.submit_lock(batch_id), batch_id) as lock:
            _enqueue_file(
                conn,
                keys,
                lines,
                source,
                batch_id,
                result_ttl,
                report,
                lock,
                total_rows or total_lines,
                changed,
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
    conn, keys, lines, source, batch_id, result_ttl, report, lock, total_rows, changed
) -> None:
    meta = keys.batch(batch_id)
    created = time.time()
    flag = keys.submitting(batch_id)  # the batch cannot look finished while this is set
    if result_ttl is None and config.result_ttl_s() > 0:
        result_ttl = config.result_ttl_s()
    earlier = conn.exists(keys.requests(batch_id), keys.results(batch_id), keys.errors(batch_id))
    if earlier and changed != "keep":  # checked before anything is written
        _check_changed(conn, keys, batch_id, lines, changed)
    with conn.pipeline() as pipe:
        pipe.set(flag, 1, ex=SUBMITTING_TTL_S)
        pipe.hsetnx(meta, "created_at", f"{created:.3f}")
        pipe.hset(meta, "source", source.rsplit("/", 1)[-1])
        if result_ttl is not None:
            pipe.hset(meta, "result_ttl", int(result_ttl))
        pipe.zadd(keys.batches, {batch_id: created}, nx=True)
        pipe.execute()
    ttl = int(conn.hget(meta, "result_ttl") or 0)  # this submission's, or an earlier one's
    per_job = config.job_lines(total_rows or 0)
    per_transaction = per_job * max(1, config.CHUNK_LINES // per_job)  # whole jobs
    plan = QueuePlan(conn, keys, batch_id, {}, ttl, per_job, fresh=not earlier, changed=changed)
    try:
        for chunk in _chunks(lines, per_transaction):
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


def _changed_in(chunk, states, digests) -> list[tuple[int, str]]:
    """(index in chunk, state) of the chunk's lines that are answered ('done') or queued
    or running ('pending') with a request other than the one they have now (`states`
    and `digests` from store.classify)."""
    return [
        (i, state)
        for i, (entry, old, state) in enumerate(zip(chunk, digests, states, strict=True))
        if state in ("done", "pending")
        and isinstance(entry, Queued)
        and old is not None
        and old != entry.digest
    ]


def _check_changed(conn, keys, batch_id: str, lines, changed: str) -> None:
    """Raise ChangedLines when known lines changed and `changed` is "refuse", or when
    changed lines are still queued or running and `changed` is "rerun"."""
    found: dict[str, list[str]] = {"done": [], "pending": []}
    counts = {"done": 0, "pending": 0}
    for chunk in _chunks(lines, config.CHUNK_LINES):
        states, digests = store.classify(conn, keys, batch_id, [e.key for e in chunk])
        for i, state in _changed_in(chunk, states, digests):
            counts[state] += 1
            if len(found[state]) < 3:
                found[state].append(chunk[i].custom_id)
    total = counts["done"] + counts["pending"]
    if changed == "refuse" and total:
        first = ", ".join(found["done"] + found["pending"])
        raise ChangedLines(
            f"batch {batch_id}: {total} line(s) ask for something other than the request "
            f"already submitted under their custom_id (first: {first}): pass --changed rerun "
            "to run them again (their old answers are replaced), or --changed keep to keep "
            "the old answers; nothing was enqueued"
        )
    if changed == "rerun" and counts["pending"]:
        raise ChangedLines(
            f"batch {batch_id}: {counts['pending']} changed line(s) are still queued or "
            f"running with their old request (first: {', '.join(found['pending'])}): wait "
            "until they are answered, then run this again; nothing was enqueued"
        )


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


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    """Group items into lists of `size` (the last one shorter)."""
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class QueuePlan:
    """What every transaction of one submission (or retry) shares."""

    conn: Redis
    keys: Keys
    batch_id: str
    queues: dict[str, Queue]
    ttl: int
    per_job: int  # rows (choices) per RQ job
    #: The batch had no line in Redis before: every line is new (no look needed).
    fresh: bool = False
    #: What to do with known lines whose request changed (CHANGED_CHOICES).
    changed: str = "refuse"

    def queue(self, alias: str) -> Queue:
        if alias not in self.queues:
            self.queues[alias] = Queue(
                self.keys.queue_name(alias), connection=self.conn, serializer=JSONSerializer
            )
        return self.queues[alias]


def _enqueue_chunk(plan: QueuePlan, chunk: list[Queued | Rejected], total: SubmitReport) -> None:
    """Write one chunk in one MULTI/EXEC: its lines are all in, or none (then raises)."""
    conn, keys, batch_id = plan.conn, plan.keys, plan.batch_id
    line_keys = [e.key for e in chunk]
    if plan.fresh:
        states = ["new"] * len(chunk)
    else:
        states, digests = store.classify(conn, keys, batch_id, line_keys)
    report = SubmitReport(batch_id)  # this chunk's counts, added to `total` once written
    if not plan.fresh:
        changed = _changed_in(chunk, states, digests)
        if plan.changed == "rerun":
            # Answers of changed lines go (counters taken off); the lines are then new.
            # (Changed lines still queued or running were refused before any write.)
            done = [i for i, state in changed if state == "done"]
            store.drop_results(conn, keys, batch_id, [chunk[i].key for i in done])
            for i in done:
                states[i] = "new"
            report.replaced += len(done)
        else:
            report.kept_changed += len(changed)
    runs: dict[str, list[Queued]] = {}  # alias -> lines to enqueue
    for entry, state in zip(chunk, states, strict=True):
        report.lines += 1
        if state == "done":
            report.already_done += 1
            continue
        if state == "pending":
            report.already_pending += 1
            continue
        report.rerun += state == "error"
        if isinstance(entry, Rejected):
            report.invalid += 1
            continue
        runs.setdefault(entry.model, []).append(entry)
        report.models[entry.model] = report.models.get(entry.model, 0) + 1
        report.enqueued += 1
    # Dropped before the chunk's transaction: should that fail, these lines are "new"
    # to the next submission, which enqueues them (the batch keeps its submitting flag).
    store.clear_errors(
        conn, keys, batch_id, [k for k, s in zip(line_keys, states, strict=True) if s == "error"]
    )
    with conn.pipeline(transaction=True) as pipe:
        pipe.zadd(keys.order(batch_id), {e.key: e.line for e in chunk})
        queue_lines(plan, runs, pipe)
        # Invalid lines are written after their order entries exist, so totals add up.
        for entry, state in zip(chunk, states, strict=True):
            if isinstance(entry, Rejected) and state in ("new", "error"):
                line = error_line(
                    batch_id, entry.line, entry.custom_id, "invalid_request", entry.message
                )
                store.store_line(pipe, keys, batch_id, entry.key, dumps(line), ok=False)
        pipe.execute()
    total.lines += report.lines
    total.enqueued += report.enqueued
    total.invalid += report.invalid
    total.already_done += report.already_done
    total.already_pending += report.already_pending
    total.rerun += report.rerun
    total.replaced += report.replaced
    total.kept_changed += report.kept_changed
    for alias, n in report.models.items():
        total.models[alias] = total.models.get(alias, 0) + n


def queue_lines(plan: QueuePlan, runs: dict[str, list[Queued]], pipe) -> None:
    """Add to `pipe` (a MULTI/EXEC pipeline) the writes that queue these lines (alias ->
    lines): jobs of up to `plan.per_job` rows (a line's rows are its choices; a line of
    more is a job alone), each line's request record naming its job, and the removal of
    the lines' earlier RQ jobs. Job numbers are taken from the batch's counter at once:
    if the transaction fails they are never used."""
    conn, keys, batch_id = plan.conn, plan.keys, plan.batch_id
    groups = [
        (alias, group) for alias, lines in runs.items() for group in _jobs(lines, plan.per_job)
    ]
    if not groups:
        return
    stale = {} if plan.fresh else _stale_jobs(conn, keys, batch_id, runs)
    last = conn.hincrby(keys.batch(batch_id), JOBS_FIELD, len(groups))
    for stale_job, alias in stale.items():  # an earlier run's RQ job, forgotten
        pipe.delete(keys.rq_job(stale_job))
        pipe.zrem(keys.rq_failed(alias), stale_job)
    records: dict[str, str] = {}
    datas: dict[str, list] = {}
    for number, (alias, lines) in enumerate(groups, last - len(groups) + 1):
        for entry in lines:
            records[entry.key] = entry.stored(number)
        datas.setdefault(alias, []).append(_job_data(batch_id, number, lines, plan.ttl))
    pipe.hset(keys.requests(batch_id), mapping=records)
    pipe.hset(keys.batch(batch_id), mapping={f"model:{a}": 1 for a in runs})
    pipe.hdel(keys.batch(batch_id), "completed_at", "cancelled")
    for alias, alias_datas in datas.items():
        plan.queue(alias).enqueue_many(alias_datas, pipeline=pipe)


def _jobs(lines: list[Queued], rows: int) -> Iterator[list[Queued]]:
    """Consecutive lines grouped into jobs of at most `rows` rows (at least one line)."""
    job: list[Queued] = []
    taken = 0
    for entry in lines:
        if job and taken + entry.rows > rows:
            yield job
            job, taken = [], 0
        job.append(entry)
        taken += entry.rows
    if job:
        yield job


def _stale_jobs(conn, keys, batch_id, runs: dict[str, list[Queued]]) -> dict[str, str]:
    """job id -> alias of the earlier jobs of lines about to be enqueued again (an error
    line, or a job that is gone): they may sit in a failed registry."""
    again = [entry.key for lines in runs.values() for entry in lines]
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


def _job_data(batch_id: str, number: int, lines: list[Queued], ttl: int = 0):
    """RQ's data for one job of `lines` of one alias. Its timeout is the sum of its
    lines' (the worker stops each line at its own); a batch with a TTL keeps its failed
    RQ records no longer than its lines."""
    failure_ttl = min(config.FAILURE_TTL_S, ttl) if ttl > 0 else config.FAILURE_TTL_S
    first = lines[0]
    if len(lines) == 1:
        description = f"{batch_id} line {first.line} ({first.custom_id})"
    else:
        description = f"{batch_id} {len(lines)} lines from line {first.line} ({first.custom_id})"
    return Queue.prepare_data(
        JOB_FUNCTION,
        args=[batch_id, [entry.key for entry in lines]],
        timeout=sum(entry.timeout for entry in lines),
        result_ttl=0,
        failure_ttl=failure_ttl,
        description=description,
        job_id=job_id(batch_id, number),
        retry=Retry(max=config.JOB_RETRIES),
        on_failure=Callback(FAILURE_CALLBACK),
    )
