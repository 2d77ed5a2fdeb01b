"""Following a batch after submission: status, collect, retry, cancel.

All reads are chunked (CHUNK_LINES keys per round trip), so memory stays bounded
however many lines a batch has. Batch state read from Redis is checked before it is
used (key types, counters, stored lines): damage is a CorruptBatch naming the key and
field, never a traceback and never an invalid line in a collected file.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import redis
from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from jobstore import config, store
from jobstore.keys import (
    AUDIT_CHECKED,
    AUDIT_MISMATCHES,
    JOBS_FIELD,
    Keys,
    custom_id_of,
    is_job_of,
    is_line_key,
    job_id,
)
from jobstore.limits import TERMINAL_STATUSES
from jobstore.lines import dumps, error_line
from producer.spool import Queued
from producer.submit import QueuePlan, queue_lines

TERMINAL = TERMINAL_STATUSES


class BatchError(Exception):
    """A batch operation cannot be done as asked; the message says why."""


class CorruptBatch(BatchError):
    """The batch's state in Redis is damaged (a key of the wrong type, a counter that is
    not a number, a stored line that is not JSON); the message names the key and field."""


class OutputError(BatchError):
    """A collect output file cannot be written; nothing was changed on disk."""


class CorruptLines(CorruptBatch):
    """Collect wrote its files, but some stored lines were not valid JSON: each was
    written as an `internal_error` error line instead. `counts` are collect's counts."""

    def __init__(self, message: str, counts: dict[str, int]):
        super().__init__(message)
        self.counts = counts


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _first_line(exc: Exception) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0]


def _redis_refusals(func):
    """A command Redis refuses (a key of the wrong type, a script that meets damaged
    data, a full Redis) becomes one BatchError line, not a traceback."""

    @functools.wraps(func)
    def run(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except redis.exceptions.ResponseError as exc:
            error = CorruptBatch if str(exc).startswith("WRONGTYPE") else BatchError
            raise error(f"Redis refused a command: {_first_line(exc)}") from exc

    return run


def check_key_types(conn: Redis, keys: Keys, batch_id: str) -> None:
    """Raises CorruptBatch naming the first key of the batch that holds the wrong type."""
    problem = store.wrong_key_type(conn, keys, batch_id)
    if problem:
        raise CorruptBatch(problem)


#: Batch hash fields read as integers (besides every `sd:` counter) and as timestamps.
_INT_FIELDS = (
    "completed",
    "failed",
    JOBS_FIELD,
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
    "busy_ms",
    "result_ttl",
    AUDIT_CHECKED,
    AUDIT_MISMATCHES,
)
_TIME_FIELDS = ("created_at", "started_at", "last_done_at", "completed_at")


def _check_meta(key: str, meta: dict[str, str]) -> None:
    for field, value in meta.items():
        if field in _INT_FIELDS or field.startswith("sd:"):
            _integer(key, field, value)
        elif field in _TIME_FIELDS:
            _timestamp(key, field, value)
        if field.startswith(("sd:hist:", "sd:dpp:", "sd:app:")):
            index = field.split(":", 2)[2]
            if not index.isdigit():
                raise CorruptBatch(f"key {key} field {field}: position {index!r} is not a number")


def _integer(key: str, field: str, value: str) -> int:
    try:
        return int(value)
    except ValueError as exc:
        raise CorruptBatch(f"key {key} field {field}: expected an integer, got {value!r}") from exc


def _timestamp(key: str, field: str, value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        t = math.nan
    if not math.isfinite(t):
        raise CorruptBatch(f"key {key} field {field}: expected a Unix time, got {value!r}")
    return t


def _meta(conn: Redis, keys: Keys, batch_id: str) -> dict[str, str]:
    check_key_types(conn, keys, batch_id)
    problem = store.record_problem(conn, keys, batch_id)
    if problem:
        raise BatchError(problem)
    raw = conn.hgetall(keys.batch(batch_id))
    meta = {_text(k): _text(v) for k, v in raw.items()}
    _check_meta(keys.batch(batch_id), meta)
    return meta


def models_of(meta: dict[str, str]) -> list[str]:
    return sorted(k.split(":", 1)[1] for k in meta if k.startswith("model:"))


@dataclass(frozen=True)
class RunningJob:
    """A job of the batch that a worker has started and not finished."""

    job_id: str
    worker: str | None
    lines: int  # its lines with neither a result nor an error line yet


def running_jobs(conn: Redis, keys: Keys, batch_id: str, models: list[str]) -> list[RunningJob]:
    """The batch's jobs that a worker has started and not finished, with how many of
    their lines are still to answer (a job of many lines answers them one by one)."""
    ids = []
    for alias in models:
        registry = StartedJobRegistry(keys.queue_name(alias), connection=conn)
        try:
            found = registry.get_job_ids(cleanup=False)
        except redis.exceptions.ResponseError as exc:  # WRONGTYPE: not RQ's zset any more
            raise CorruptBatch(f"key {registry.key}: {_first_line(exc)}") from exc
        ids += [j for j in found if is_job_of(batch_id, j)]
    if not ids:
        return []
    jobs = _fetch_jobs(conn, ids)
    running = []
    with conn.pipeline(transaction=False) as pipe:
        for job_id_, job in zip(ids, jobs, strict=True):
            line_keys = _job_lines(job)
            if line_keys:
                store.count_unanswered(pipe, keys, batch_id, line_keys)
                running.append((job_id_, job.worker_name or None))
        counts = pipe.execute()
    return [RunningJob(j, w, int(n)) for (j, w), n in zip(running, counts, strict=True) if n]


def _fetch_jobs(conn: Redis, ids: list[str]) -> list[Job | None]:
    """RQ's jobs by id (None where gone), in one round trip without MULTI: Job.fetch_many
    wraps its reads in a transaction, which Redis refuses while it is over maxmemory,
    and spec-status must work then too."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id_ in ids:
            pipe.hgetall(Job.key_for(job_id_))
        found = pipe.execute()
    jobs: list[Job | None] = []
    for job_id_, raw in zip(ids, found, strict=True):
        job = None
        if raw:
            job = Job(job_id_, connection=conn, serializer=JSONSerializer)
            job.restore(raw)
        jobs.append(job)
    return jobs


def _job_lines(job: Job | None) -> list[str]:
    """The line keys a job of this project carries ([] for anything else)."""
    if job is None:
        return []
    try:
        args = job.args
    except Exception:  # not a JSON payload: not ours
        return []
    if isinstance(args, list | tuple) and len(args) == 2 and isinstance(args[1], list):
        return [k for k in args[1] if is_line_key(k)]
    return []


@_redis_refusals
def status(conn: Redis, keys: Keys, batch_id: str) -> dict:
    """The batch status object of FORMATS.md. Raises BatchError for an unknown batch,
    CorruptBatch for damaged state."""
    meta = _meta(conn, keys, batch_id)
    now = time.time()
    total = conn.zcard(keys.order(batch_id))
    completed, failed = int(meta.get("completed", 0)), int(meta.get("failed", 0))
    jobs = running_jobs(conn, keys, batch_id, models_of(meta))
    running = sum(j.lines for j in jobs)
    done = completed + failed
    running = min(running, max(0, total - done))
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
            "cached_prompt_tokens": int(meta.get("cached_prompt_tokens", 0)),
        },
        "speculative_decoding": store.spec_summary(meta),
        "throughput_tokens_per_second": round(throughput, 2),
        "eta_seconds": eta,
        "workers": _workers(conn, keys, batch_id, jobs, now, watch=not finished),
        "audit": audit_summary(meta),
    }


def audit_summary(meta: dict[str, str]) -> dict[str, int]:
    """{"checked", "mismatches"}: requests re-run target-only by audit mode, and how
    many of them came out different from the speculative output."""
    return {
        "checked": int(meta.get(AUDIT_CHECKED, 0)),
        "mismatches": int(meta.get(AUDIT_MISMATCHES, 0)),
    }


def _workers(
    conn: Redis, keys: Keys, batch_id: str, jobs: list[RunningJob], now: float, watch: bool
) -> list[dict]:
    """Per worker of the batch (it stored lines, or holds running ones): its counters,
    running lines, when it was last heard from, and whether it has gone quiet: not
    heard from for longer than the heartbeat TTL (SPEC_HEARTBEAT_TTL_S) without having
    stopped cleanly, while it holds running lines or the batch is unfinished (`watch`)."""
    key = keys.batch_workers(batch_id)
    by_name: dict[str, dict[str, int]] = {}
    for raw_field, value in conn.hgetall(key).items():
        field = _text(raw_field)
        counter, sep, name = field.partition(":")
        if not sep:
            raise CorruptBatch(f"key {key} field {field}: expected <counter>:<worker>")
        by_name.setdefault(name, {})[counter] = _integer(key, field, _text(value))
    holding: dict[str, int] = {}
    for job in jobs:
        if job.worker:
            holding[job.worker] = holding.get(job.worker, 0) + job.lines
            by_name.setdefault(job.worker, {})
    names = sorted(by_name)
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hmget(keys.worker(name), "model", "last_seen", "started_at", "stopped_at")
        facts = pipe.execute()
    ttl = config.heartbeat_ttl_s()
    out = []
    for name, (model, seen, since, stopped) in zip(names, facts, strict=True):
        c = by_name[name]
        busy = c.get("busy_ms", 0) / 1000
        last_seen = _seen(keys.worker(name), seen or since)
        running = holding.get(name, 0)
        quiet = (
            last_seen is not None
            and stopped is None
            and (running > 0 or watch)
            and now - last_seen > ttl
        )
        out.append(
            {
                "name": name,
                "model": _text(model) if model else None,
                "completed": c.get("completed", 0),
                "failed": c.get("failed", 0),
                "running": running,
                "tokens_per_second": round(c.get("completion_tokens", 0) / busy, 2)
                if busy
                else 0.0,
                "last_seen": round(last_seen, 3) if last_seen is not None else None,
                "stopped": stopped is not None,
                "quiet": quiet,
            }
        )
    return out


def _seen(key: str, value) -> float | None:
    if value is None:
        return None
    return _timestamp(key, "last_seen", _text(value))


def stored_lines(
    conn: Redis, keys: Keys, batch_id: str, order: Literal["input", "completion"] = "input"
) -> Iterator[tuple[Literal["result", "error", "pending"], str, str | None]]:
    """Every line of the batch as spec-collect writes it, in `order`, read CHUNK_LINES at
    a time: (kind, JSON line, problem). A line without a result or error line yet is
    ("pending", "", None); a stored line that is damaged comes as ("error", its
    `internal_error` line, where: key, field and what is wrong)."""
    for line in store.read_lines(conn, keys, batch_id, order):
        if line.kind == "pending":
            yield "pending", "", None
            continue
        problem = _problem(line)
        if problem:
            where = f"key {line.hash_key} field {line.key}: {problem}"
            yield "error", _corrupt_line(conn, keys, batch_id, line.key, where), where
            continue
        yield line.kind, line.text, None


@_redis_refusals
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
    files beside the targets, renamed over them once both are written; a symlink is
    written through). Returns counts {"results", "errors", "pending"}.

    A stored line that is not a JSON object is written as an `internal_error` error
    line instead, and CorruptLines is raised once the files are written. With delete,
    every line must be final (nothing queued or running) and written, else BatchError
    before anything is written; the batch's keys are removed after the files are.
    Raises OutputError when a file cannot be written (then no file was changed).
    """
    meta = _meta(conn, keys, batch_id)
    targets = check_outputs(out_path, errors_path)
    if delete:
        _check_final(conn, keys, batch_id)
    counts = {"results": 0, "errors": 0, "pending": 0}
    corrupt, first_corrupt = 0, ""
    with _Outputs(targets) as files:
        err_role = "--errors" if errors_path else "-o"
        for kind, raw, problem in stored_lines(conn, keys, batch_id, order):
            if kind == "pending":
                counts["pending"] += 1
                continue
            if problem:
                first_corrupt = first_corrupt or problem
                corrupt += 1
            if kind == "result":
                files.write("-o", raw)
                counts["results"] += 1
            else:
                files.write(err_role, raw)
                counts["errors"] += 1
    if corrupt:
        raise CorruptLines(
            f"{corrupt} stored line(s) of batch {batch_id} are not valid JSON "
            f"(first: {first_corrupt}); wrote them as internal_error error lines"
            + ("; the batch was not deleted" if delete else ""),
            {**counts, "corrupt": corrupt},
        )
    if delete:
        if counts["pending"]:
            raise BatchError(
                f"batch {batch_id}: {counts['pending']} line(s) have no result or error line "
                "yet: the files were written, the batch was not deleted"
            )
        _delete(conn, keys, batch_id, models_of(meta), int(meta.get(JOBS_FIELD, 0)))
    return counts


def _check_final(conn: Redis, keys: Keys, batch_id: str) -> None:
    """Raises BatchError unless every line of the batch is final: a result or error line
    for each, nothing queued or running, no spec-submit still enqueueing."""
    state = status(conn, keys, batch_id)
    c = state["request_counts"]
    waiting = [f"{c[k]} {k}" for k in ("running", "queued") if c[k]]
    if conn.exists(keys.submitting(batch_id)):
        waiting.append("a spec-submit still enqueueing")
    if waiting or state["status"] not in TERMINAL:
        what = "cancelled but not finished" if state["status"] == "cancelled" else "not finished"
        detail = f" ({', '.join(waiting)})" if waiting else ""
        raise BatchError(f"batch {batch_id} is {what}{detail}: collect without --delete, or wait")


def _problem(line: store.StoredLine) -> str | None:
    """Why a stored line cannot be written as a JSONL line (damaged compressed data, text
    that is not JSON, JSON that is not an object), else None."""
    if line.damage is not None:
        return f"not a valid stored line ({line.damage})"
    try:
        value = json.loads(line.text)
    except (ValueError, RecursionError) as exc:
        return f"not valid JSON ({type(exc).__name__}: {exc})"
    if not isinstance(value, dict):
        return f"not a JSON object (a {type(value).__name__})"
    return None


def _corrupt_line(conn: Redis, keys: Keys, batch_id: str, line_key: str, where: str) -> str:
    """The internal_error error line written in place of a damaged stored line."""
    line = store.line_number(conn, keys, batch_id, line_key)
    custom_id = custom_id_of(line_key)
    message = f"the stored line is damaged ({where}): run the line again in a new batch"
    return dumps(error_line(batch_id, line, custom_id, "internal_error", message))


def check_outputs(out_path: str, errors_path: str | None) -> dict[str, tuple[str, str]]:
    """{option: (path as given, real path to replace)} for -o and --errors. Raises
    OutputError when either cannot be written or both name one file (call it before
    waiting for a batch, to fail at once)."""
    targets = {"-o": (out_path, _target("-o", out_path))}
    if errors_path:
        targets["--errors"] = (errors_path, _target("--errors", errors_path))
        real_out, real_errors = targets["-o"][1], targets["--errors"][1]
        same = real_out == real_errors
        try:
            same = same or os.path.samefile(real_out, real_errors)
        except OSError:
            pass  # one of them does not exist yet: different files
        if same:
            raise OutputError(
                f"-o {out_path} and --errors {errors_path} are the same file: give --errors "
                "another file, or leave it out to write error lines into -o"
            )
    return targets


def _target(option: str, path: str) -> str:
    """The file that writing `path` replaces (a symlink's target, so the link stays)."""
    real = os.path.realpath(path)
    directory = os.path.dirname(real)
    if not os.path.isdir(directory):
        raise OutputError(f"{option} {path}: directory {directory} does not exist")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return real
    except OSError as exc:
        raise OutputError(f"{option} {path}: {exc.strerror}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{option} {path}: is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{option} {path}: not a regular file")
    if not st.st_mode & 0o222 or not os.access(real, os.W_OK):
        raise OutputError(f"{option} {path}: the file is read-only")
    return real


class _Outputs:
    """Lines to temporary files beside their targets; every target is replaced only once
    all files are written and synced. On any failure the temporary files are removed
    and the targets are left as they were."""

    def __init__(self, targets: dict[str, tuple[str, str]]):
        self.targets = targets
        self._files: dict[str, tuple[str, object]] = {}  # option -> (temporary path, file)

    def __enter__(self):
        try:
            for option, (shown, real) in self.targets.items():
                self._files[option] = self._open(option, shown, real)
        except BaseException:
            self._discard()
            raise
        return self

    def _open(self, option: str, shown: str, real: str):
        directory = os.path.dirname(real)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".spec-collect-", dir=directory)
        except OSError as exc:
            raise OutputError(
                f"{option} {shown}: cannot create a file in {directory}: {exc.strerror}"
            ) from exc
        try:
            mode = os.stat(real).st_mode & 0o7777
        except OSError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        return tmp, os.fdopen(fd, "wb")

    def write(self, option: str, line: bytes | str) -> None:
        data = line if isinstance(line, bytes) else line.encode()
        try:
            self._files[option][1].write(data + b"\n")
        except OSError as exc:
            raise self._failed(option, exc) from exc

    def _failed(self, option: str, exc: OSError) -> OutputError:
        return OutputError(
            f"{option} {self.targets[option][0]}: cannot write: {exc.strerror}; "
            "the file was left as it was"
        )

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._discard()
            return
        try:
            for option, (_, f) in self._files.items():
                try:
                    f.flush()
                    os.fsync(f.fileno())
                    f.close()
                except OSError as error:
                    raise self._failed(option, error) from error
            for option, (tmp, _) in self._files.items():
                try:
                    os.replace(tmp, self.targets[option][1])
                except OSError as error:
                    raise self._failed(option, error) from error
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        for tmp, f in self._files.values():
            try:
                f.close()
            except OSError:
                pass  # a full disk may refuse the last flush too: the file goes anyway
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _delete(conn: Redis, keys: Keys, batch_id: str, models: list[str], jobs: int) -> None:
    """Remove every key of the batch and its RQ jobs (numbers 1..jobs). UNLINK: Redis
    frees a big hash in the background instead of stalling every client."""
    step = config.CHUNK_LINES
    for first in range(1, jobs + 1, step):
        with conn.pipeline(transaction=False) as pipe:
            for number in range(first, min(first + step, jobs + 1)):
                job = job_id(batch_id, number)
                pipe.unlink(keys.rq_job(job))
                for alias in models:
                    pipe.zrem(keys.rq_failed(alias), job)
            pipe.execute()
    with conn.pipeline() as pipe:
        pipe.unlink(*keys.batch_keys(batch_id))
        pipe.zrem(keys.batches, batch_id)
        pipe.execute()


@_redis_refusals
def retry(conn: Redis, keys: Keys, batch_id: str) -> int:
    """Queue again every line that ended in an error line and has a request (lines
    rejected at submit time have none: fix and re-submit those). Returns the count."""
    ttl = int(_meta(conn, keys, batch_id).get("result_ttl", 0))  # raises for an unknown batch
    failed = [_text(k) for k in conn.hkeys(keys.errors(batch_id))]
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


@_redis_refusals
def _request(hash_key: str, field: str, record: bytes):
    """A stored request record as a JobLine. Raises CorruptBatch naming key and field."""
    from jobstore.jobfile import JobLine

    try:
        return JobLine.from_record(json.loads(record))
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptBatch(
            f"key {hash_key} field {field}: not a request record ({type(exc).__name__}: {exc})"
        ) from exc


@_redis_refusals
def cancel(conn: Redis, keys: Keys, batch_id: str) -> int:
    """Mark the batch cancelled and take its waiting jobs out of the queues; each of
    their lines gets a `cancelled` error line. Lines already running finish; the lines
    of a running job that have not started are cancelled by its worker. Returns how
    many lines were cancelled here."""
    meta = _meta(conn, keys, batch_id)
    conn.hset(keys.batch(batch_id), "cancelled", f"{time.time():.3f}")
    removed = 0
    for alias in models_of(meta):
        queue = Queue(keys.queue_name(alias), connection=conn, serializer=JSONSerializer)
        for removed_id in store.remove_queued(conn, queue.key, batch_id):
            line_keys = _job_lines(_fetch(conn, removed_id))
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
