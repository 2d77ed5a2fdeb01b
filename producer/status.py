"""`spec-status`: the batch status object of FORMATS.md, from the batch's counters,
RQ's started jobs (running lines) and the workers' heartbeats (quiet workers)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from redis import Redis
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from contract.limits import TERMINAL_STATUSES
from contract.stats import tokens_per_second
from jobstore import config, store
from jobstore.keys import AUDIT_CHECKED, AUDIT_MISMATCHES, Keys, is_job_of
from producer.errors import CorruptBatch, first_line, redis_refusals
from producer.meta import integer, job_lines, models_of, read_meta, text, timestamp

TERMINAL = TERMINAL_STATUSES


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
            raise CorruptBatch(f"key {registry.key}: {first_line(exc)}") from exc
        ids += [j for j in found if is_job_of(batch_id, j)]
    if not ids:
        return []
    jobs = _fetch_jobs(conn, ids)
    running = []
    with conn.pipeline(transaction=False) as pipe:
        for job_id_, job in zip(ids, jobs, strict=True):
            line_keys = job_lines(job)
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


@redis_refusals
def status(conn: Redis, keys: Keys, batch_id: str) -> dict:
    """The batch status object of FORMATS.md. Raises BatchError for an unknown batch,
    CorruptBatch for damaged state."""
    meta = read_meta(conn, keys, batch_id)
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
        # Choices of the completed lines (a line of n > 1 choices counts n).
        "choices": {"completed": completed + int(meta.get(store.EXTRA_CHOICES_FIELD, 0))},
        "usage": {
            "prompt_tokens": int(meta.get("prompt_tokens", 0)),
            "completion_tokens": completion_tokens,
            "cached_prompt_tokens": int(meta.get("cached_prompt_tokens", 0)),
        },
        "speculative_decoding": store.spec_summary(meta),
        "throughput_tokens_per_second": tokens_per_second(completion_tokens, elapsed * 1000),
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
        field = text(raw_field)
        counter, sep, name = field.partition(":")
        if not sep:
            raise CorruptBatch(f"key {key} field {field}: expected <counter>:<worker>")
        by_name.setdefault(name, {})[counter] = integer(key, field, text(value))
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
                "model": text(model) if model else None,
                "completed": c.get("completed", 0),
                "failed": c.get("failed", 0),
                "running": running,
                "tokens_per_second": tokens_per_second(
                    c.get("completion_tokens", 0), c.get("busy_ms", 0)
                ),
                "last_seen": round(last_seen, 3) if last_seen is not None else None,
                "stopped": stopped is not None,
                "quiet": quiet,
            }
        )
    return out


def _seen(key: str, value) -> float | None:
    if value is None:
        return None
    return timestamp(key, "last_seen", text(value))
